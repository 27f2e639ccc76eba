"""Derived views kept in sync from the compacted change topics by Spark Structured Streaming.

The public face for sink authors (docs/sinks.md, "Write a sink"): :class:`PartitionSink` and
:class:`PartitionWriter` (rows written inside Spark's executor tasks: :class:`TableInfo`, :class:`Change`,
:class:`Rejected`), :class:`Sink` for sinks that write Spark frames (:class:`Batch`, :class:`TableChanges`),
:class:`BaseSink`, :class:`SinkContext`, and :class:`Rebuildable` for stores that can be rebuilt and verified
(read back in parallel tasks through :class:`ReadsInParts` or :class:`ReadsFrame`, and read again when
:class:`ChangesUnderRead` says the store changed under a read).
pyspark is imported lazily (only inside functions that need it), so listing sinks stays cheap; the capture
service's internals are never imported.
"""

from __future__ import annotations

from sinks._api import (
    BaseSink,
    Batch,
    Change,
    ChangesUnderRead,
    DropsGeneration,
    FrameRows,
    PartitionSink,
    PartitionWriter,
    ReadsFields,
    ReadsFrame,
    ReadsInParts,
    Rebuildable,
    Rejected,
    Sink,
    SinkContext,
    StorePart,
    TableChanges,
    TableInfo,
    TableRef,
    key_id,
)
from sinks.errors import SinkError, SinkTerminalError, SinkTransientError

__all__ = [
    "BaseSink",
    "Batch",
    "Change",
    "ChangesUnderRead",
    "DropsGeneration",
    "FrameRows",
    "PartitionSink",
    "PartitionWriter",
    "ReadsFields",
    "ReadsFrame",
    "ReadsInParts",
    "Rebuildable",
    "Rejected",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkTerminalError",
    "SinkTransientError",
    "StorePart",
    "TableChanges",
    "TableInfo",
    "TableRef",
    "key_id",
]
