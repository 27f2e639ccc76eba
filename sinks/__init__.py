"""Derived views kept in sync from the compacted change topics by Spark Structured Streaming.

Imports pyspark lazily (only inside functions that need it) so that listing sinks stays cheap, and never
imports the capture service's internals.
"""
