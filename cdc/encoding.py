"""The capture's event encoding outside a running capture: a table's codec (its Avro schemas and the event
envelope), the change writer that turns decoded rows into events, the batch writer that produces them in
Kafka transactions, and the dead-letter policy for rows that cannot be encoded. Benchmarks and codec
comparisons drive these directly, without a replication stream."""

from __future__ import annotations

from cdc._attach import CaptureContext
from cdc._batch import CommitPolicy, KafkaBatchWriter
from cdc._changes import ChangeWriter
from cdc._deadletter import CaptureDeadLetters, Policy, hex_values
from cdc._events import Position, SourceInfo, Stamp, TableCodec, TableShape

__all__ = [
    "CaptureContext",
    "CaptureDeadLetters",
    "ChangeWriter",
    "CommitPolicy",
    "KafkaBatchWriter",
    "Policy",
    "Position",
    "SourceInfo",
    "Stamp",
    "TableCodec",
    "TableShape",
    "hex_values",
]
