"""pgcdc's capture service: PostgreSQL logical replication to Avro events on compacted Kafka topics.

The public surface is kept small and explicit; implementation lives in private modules.
"""

from __future__ import annotations

from cdc._expected import KeyRange, SourceTable, source_tables
from cdc._repair import report_keys, request_keys, wait_for_backfills
from cdc._version import __version__
from cdc.errors import CDCError, TerminalError, TransientError

__all__ = [
    "CDCError",
    "KeyRange",
    "SourceTable",
    "TerminalError",
    "TransientError",
    "__version__",
    "report_keys",
    "request_keys",
    "source_tables",
    "wait_for_backfills",
]
