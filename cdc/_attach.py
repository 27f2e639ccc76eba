"""What attaching to the source gives every phase of a capture (snapshot, stream): the checked source, its
types, the Kafka topics and schema registry, the committed state's store, and each table's codec.

The phases take these as arguments instead of reaching into the coordinator (cdc/_capture.py), so the imports
run one way: the coordinator imports the phases, never the reverse."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc import __version__
from cdc._catalog import TypeResolver, qualified_name
from cdc._config import Settings
from cdc._deadletter import CaptureDeadLetters, server_printer
from cdc._events import ColumnSpec, SourceInfo, TableCodec, table_shape
from cdc._kafka import OffsetStore, Registry, Topics
from cdc._metrics import CaptureMetrics
from cdc._source import AttachReport, check_and_prepare, connect
from cdc.errors import StreamError
from decoders import Relation


@dataclass(frozen=True)
class CaptureContext:
    """What every part of one capture shares: its settings, the stop request, its metrics."""

    settings: Settings
    stop: threading.Event
    metrics: CaptureMetrics


class TextModeNeededError(Exception):
    """A relation arrived with a column we can only read in text form."""


class TableCodecs:
    """Builds a table version's codec: its topic made, its schemas registered, its key checked."""

    def __init__(
        self,
        ctx: CaptureContext,
        report: AttachReport,
        *,
        types: TypeResolver,
        topics: Topics,
        registry: Registry,
        source_info: SourceInfo,
    ) -> None:
        self._ctx = ctx
        self._report = report
        self._types = types
        self._topics = topics
        self._registry = registry
        self.source_info = source_info

    def for_table(
        self, schema: str, table: str, columns: Sequence[ColumnSpec], key_flags: Sequence[bool]
    ) -> TableCodec:
        """Build (and register schemas for) the codec of one version of a table; callers cache it."""
        settings = self._ctx.settings
        qualified = qualified_name(schema, table)
        key = self._report.key_columns.get(qualified) or tuple(
            c.name for c, is_key in zip(columns, key_flags, strict=True) if is_key
        )
        if not key:
            raise StreamError(
                f"table {qualified} has no key columns in the stream; give it a primary key or set "
                f"source.key_columns for it"
            )
        topic = settings.topic_for(schema, table)
        self._topics.ensure(topic)
        self._ctx.metrics.tables[topic] = f"{schema}.{table}"
        return TableCodec(
            table_shape(settings, self._types, schema, table, columns=columns, key=key),
            source=self.source_info,
            register=lambda subject, sch: self._registry.register(subject, sch, table=qualified),
        )

    def for_relation(self, rel: Relation, *, binary: bool) -> TableCodec:
        """The codec of the table version a Relation message describes; with ``binary`` (the stream is in
        binary mode), TextModeNeededError when a column has no binary reader."""
        cols = [ColumnSpec(c.name, c.type_oid, c.type_modifier) for c in rel.columns]
        codec = self.for_table(rel.namespace, rel.name, cols, [c.is_key for c in rel.columns])
        if binary and not all(codec.binary_capable):
            raise TextModeNeededError(f"table {rel.namespace}.{rel.name} has a column without a binary reader")
        return codec


@dataclass
class Attached:
    """The source checked and ready (slot and publication in place), and the clients the phases share."""

    sql: psycopg.Connection[Any]
    report: AttachReport
    types: TypeResolver
    topics: Topics
    registry: Registry
    codecs: TableCodecs
    offsets: OffsetStore
    dead_letters: CaptureDeadLetters  # what becomes of a row no encoder takes (capture.on_unencodable)


@contextlib.contextmanager
def attach(ctx: CaptureContext) -> Iterator[Attached]:
    """Checks the source and prepares it (publication), connects to Kafka and the registry, makes the offsets
    topic; the SQL connection is closed on the way out."""
    s = ctx.settings
    sql = connect(s)
    try:
        report = check_and_prepare(sql, s, dry_run=False, allow_active_slot=True)
        types = TypeResolver(sql)
        kafka = s.kafka.client_conf()
        topics = Topics(kafka, partitions=s.kafka.partitions, replication_factor=s.kafka.replication_factor)
        registry = Registry(s.registry.client_conf())
        topics.ensure(s.offsets_topic, partitions=1)
        offsets = OffsetStore(kafka, s.offsets_topic, s.source.slot)
        source_info = SourceInfo(__version__, s.kafka.topic_prefix, sql.info.dbname)
        codecs = TableCodecs(ctx, report, types=types, topics=topics, registry=registry, source_info=source_info)
        dead = CaptureDeadLetters(s.capture.on_unencodable, s.kafka.topic_prefix, server_printer(sql), topics.ensure)
        yield Attached(sql, report, types, topics, registry, codecs, offsets, dead)
    finally:
        sql.close()


__all__ = ["Attached", "CaptureContext", "TableCodecs", "TextModeNeededError", "attach"]
