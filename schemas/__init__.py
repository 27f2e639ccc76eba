"""Avro schemas for change events: relation metadata to key and envelope schemas.

Knows nothing of the network; registering schemas is the capture service's job.
"""
