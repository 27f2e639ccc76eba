"""pgcdc's capture service: PostgreSQL logical replication to Avro events on compacted Kafka topics.

The public surface is kept small and explicit; implementation lives in private modules.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from cdc._expected import SourceTable, source_tables
from cdc.errors import CDCError, TerminalError, TransientError

try:
    __version__ = version("pgcdc")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["CDCError", "SourceTable", "TerminalError", "TransientError", "__version__", "source_tables"]
