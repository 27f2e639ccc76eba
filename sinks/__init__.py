"""Derived views kept in sync from the compacted change topics by Spark Structured Streaming.

The public face for sink authors (docs/sinks.md, "Write a sink"): :class:`Sink` (the Protocol),
:class:`BaseSink`, what ``write`` receives (:class:`Batch`, :class:`TableChanges`, :class:`Change`,
:class:`Rejected`), :class:`SinkContext`, and :class:`Rebuildable` for stores that can be rebuilt and verified.
pyspark is imported lazily (only inside functions that need it), so listing sinks stays cheap; the capture
service's internals are never imported.
"""

from __future__ import annotations

from sinks._api import BaseSink, Batch, Change, Rebuildable, Rejected, Sink, SinkContext, TableChanges, TableRef, key_id
from sinks.errors import SinkError, SinkTerminalError, SinkTransientError

__all__ = [
    "BaseSink",
    "Batch",
    "Change",
    "Rebuildable",
    "Rejected",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkTerminalError",
    "SinkTransientError",
    "TableChanges",
    "TableRef",
    "key_id",
]
