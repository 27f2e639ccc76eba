"""How far each sink has come, read without Spark: its checkpoint's offsets against the topics' ends, its
status file, its lag (`cdc status`, the dashboard, `cdc sinks wait`-style tools and benchmarks)."""

from __future__ import annotations

from sinks._progress import (
    SinkProgress,
    TopicEnds,
    batch_offsets,
    checkpoint_location,
    checkpoint_offsets,
    reached,
    sink_progress,
    sinks_present,
)

__all__ = [
    "SinkProgress",
    "TopicEnds",
    "batch_offsets",
    "checkpoint_location",
    "checkpoint_offsets",
    "reached",
    "sink_progress",
    "sinks_present",
]
