"""Decoding PostgreSQL's logical replication stream (``pgoutput``) into typed messages and values.

Knows nothing of Kafka or Avro; the capture service (``cdc``) composes it with ``schemas``.
"""
