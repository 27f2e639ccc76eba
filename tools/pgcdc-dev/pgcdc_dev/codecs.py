"""A TableCodec from column types, and the capture's ChangeWriter around such codecs, without a database: what
the unit tests and bench/hotpath_micro.py encode with."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cdc.config import load_settings
from cdc.encoding import (
    CaptureContext,
    CaptureDeadLetters,
    ChangeWriter,
    CommitPolicy,
    KafkaBatchWriter,
    Policy,
    SourceInfo,
    TableCodec,
    TableShape,
    hex_values,
)
from cdc.kafka import OffsetStore
from cdc.metrics import CaptureMetrics
from schemas import ColumnShape, PgType, avro_mapping


def change_writer(producer: Any, *, in_batch: bool = False, on_unencodable: Policy = "stop") -> ChangeWriter:
    """The capture's ChangeWriter writing through a batch writer on ``producer`` (a TransactionalProducer, or
    anything with its produce methods), with no source behind it: the caller gives it the codecs of its
    relations (``changes._codecs[relid] = make_codec(...)``). ``in_batch``: a Kafka transaction is taken as open,
    so ``producer`` needs no begin()."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "cdc.toml"
        config.write_text('[source]\ndsn = "postgresql://u@localhost/db"\ntables = ["public.t"]\n')
        settings = load_settings(config)
    ctx = CaptureContext(settings, threading.Event(), CaptureMetrics())
    offsets = OffsetStore({}, "unused.offsets", "unused")
    writer = KafkaBatchWriter(producer, offsets, ctx.metrics, CommitPolicy(max_events=1 << 62))
    writer.in_batch = in_batch
    # No source: codecs are given; a dead letter's binary values print as hex.
    dead = CaptureDeadLetters(on_unencodable, "p", hex_values, lambda _topic: 1)
    return ChangeWriter(ctx, SimpleNamespace(dead_letters=dead), writer)  # type: ignore[arg-type]


def make_codec(
    columns: Iterable[tuple[str, PgType, int]],
    *,
    topic: str,
    key: Sequence[str] = ("id",),
    source: SourceInfo | None = None,
    register: Callable[[str, dict[str, Any]], int] = lambda _subject, _schema: 1,
    registered_key: dict[str, Any] | None = None,
) -> TableCodec:
    """``columns``: (name, type, typmod); ``topic``: "<prefix>.<schema>.<table>" (also the Avro namespace);
    ``registered_key``: the key subject's latest schema (TableShape.registered_key). The Python encoders alone:
    the codec's ``use_python()``."""
    shapes, mappings = [], []
    for name, pgtype, typmod in columns:
        mapping = avro_mapping(pgtype, typmod)
        mappings.append(mapping)
        shapes.append(ColumnShape(name, pgtype, typmod, mapping.schema))
    prefix, schema, table = topic.split(".")
    shape = TableShape(schema, table, topic, topic, shapes, mappings, list(key), registered_key=registered_key)
    return TableCodec(shape, source=source or SourceInfo("1.0", prefix, "db"), register=register)
