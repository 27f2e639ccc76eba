"""What attaching to the source gives every phase of a capture (snapshot, stream): the checked source, its
types, the Kafka topics and schema registry, the committed state's store, and each table's codec.

The phases take these as arguments instead of reaching into the coordinator (cdc/_capture.py), so the imports
run one way: the coordinator imports the phases, never the reverse."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from cdc import __version__
from cdc._catalog import TypeResolver, qualified_name
from cdc._config import Settings
from cdc._deadletter import CaptureDeadLetters, server_printer
from cdc._events import ColumnSpec, SourceInfo, TableCodec, TableShape, table_shape
from cdc._generations import (
    Generations,
    KeyChangeError,
    Known,
    ScaleChangeError,
    TypeChange,
    changed_columns,
    known_columns,
    registered_columns,
    rewritten,
    scale_changes,
)
from cdc._kafka import OffsetStore, Registry, SchemaRefusedError, Topics
from cdc._metrics import CaptureMetrics
from cdc._source import AttachReport, check_and_prepare
from cdc._standby import source_connections, wait_replayed
from cdc.errors import StreamError
from decoders import Relation
from pgcdc_common.topics import generation_topic, split_table_name
from schemas import ColumnHistory

log = logging.getLogger(__name__)


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
        self._histories: dict[str, ColumnHistory] = {}  # by topic; learnt from the registry on first use
        self._keys: dict[str, Mapping[str, Any] | None] = {}  # by topic: the key subject's latest schema
        self._known: dict[str, Known] = {}  # by table: its columns' types as last written
        self._values: dict[str, Mapping[str, Any]] = {}  # by topic: its value schema as last written
        self.generations = Generations(ctx.settings)  # bound to the committed state once it is read
        self._lock = threading.Lock()  # the stream and the snapshot's or backfill's threads build codecs
        self._relations: dict[int, list[tuple[str, int, int | None]]] = {}  # the stream's last Relation of each

    def for_table(
        self, schema: str, table: str, columns: Sequence[ColumnSpec], key_flags: Sequence[bool], relid: int
    ) -> TableCodec:
        """Build (and register schemas for) the codec of one version of a table (``relid``: its oid); callers
        cache it. A schema its topic cannot take moves the table to its next topic generation, or stops the
        capture, as capture.on_type_change says (cdc/_generations.py)."""
        settings = self._ctx.settings
        qualified = qualified_name(schema, table)
        key = self._key(qualified, columns, key_flags)
        if not key:
            raise StreamError(
                f"table {qualified} has no key columns in the stream; give it a primary key or set "
                f"source.key_columns for it"
            )
        shape = table_shape(settings, self._types, schema, table, columns=columns, key=key)
        with self._lock:
            generation = self.generations.of(qualified)
            try:
                return self._built(shape, qualified, generation_topic(shape.topic, generation), relid)
            except SchemaRefusedError as refused:
                change = self._change(shape, qualified, generation, refused)
            if settings.capture.on_type_change == "stop":
                raise self.generations.stop_error(change)
            topic = self.generations.move(change)
            codec = self._built(shape, qualified, topic, relid)
            log.warning(
                "%s, which subject %r cannot take (%s): the table's changes go to topic %s from now on, and "
                "backfill %s.g%d reads the whole table into it while the other tables go on; %s keeps what was "
                "written before",
                change.what(),
                change.subject,
                change.reason,
                topic,
                qualified,
                change.generation + 1,
                generation_topic(shape.topic, change.generation),
            )
            return codec

    def _key(self, qualified: str, columns: Sequence[ColumnSpec], key_flags: Sequence[bool]) -> tuple[str, ...]:
        """The table's key columns: those found when the capture started (its primary key or replica identity
        index, or source.key_columns), or, once such a column was renamed, the Relation's key columns (the same
        key under its new names; a change of the topic's key, cdc/_generations.py)."""
        found = self._report.key_columns.get(qualified)
        names = {c.name for c in columns}
        if found and set(found) <= names:
            return found
        flagged = tuple(c.name for c, is_key in zip(columns, key_flags, strict=True) if is_key)
        if found and qualified in {qualified_name(*split_table_name(t)) for t in self._ctx.settings.source.key_columns}:
            missing = [c for c in found if c not in names]
            raise StreamError(
                f"table {qualified}: source.key_columns names {missing}, which are not columns of the table any "
                "more (renamed?): set source.key_columns for it to the columns' names now and run again"
            )
        if found:
            self._report.key_columns[qualified] = flagged  # backfills and verify read the key by its new names
        return flagged

    def topic_of(self, schema: str, table: str) -> str:
        """The topic the table's events go to now (its generation's)."""
        base = self._ctx.settings.topic_for(schema, table)
        return generation_topic(base, self.generations.of(qualified_name(schema, table)))

    def _built(self, shape: TableShape, qualified: str, topic: str, relid: int) -> TableCodec:
        """The codec of ``shape`` writing to ``topic``, its schemas registered there; SchemaRefusedError when
        the topic's subjects cannot take them."""
        self._topics.ensure(topic)
        self._ctx.metrics.tables[topic] = qualified
        history = self._histories.get(topic)
        if history is None or history.relid != relid:  # first seen, or dropped and made again
            history = self._histories[topic] = ColumnHistory(relid)
            if (registered := self._registry.latest(f"{topic}-value")) is not None:
                history.learn(registered)
                self._known.setdefault(qualified, registered_columns(registered))
                self._values.setdefault(topic, registered)
        if topic not in self._keys:
            self._keys[topic] = self._registry.latest(f"{topic}-key")
        pinned = self._keys[topic]
        shape = replace(shape, topic=topic, columns=history.identify(shape.columns), relid=relid, registered_key=pinned)

        latest = self._values.get(topic)

        def register(subject: str, schema: dict[str, Any]) -> int:
            if subject == f"{topic}-key" and pinned is not None and schema != pinned:
                # A key column's new type, a key column renamed, another primary key: every key's bytes change.
                raise KeyChangeError(qualified, subject, _field_names(pinned), _field_names(schema))
            if subject == f"{topic}-value" and latest is not None and (scaled := scale_changes(latest, schema)):
                raise ScaleChangeError(qualified, subject, scaled)
            return self._registry.register(subject, schema, table=qualified)

        codec = TableCodec(shape, source=self.source_info, register=register)
        self._keys[topic], self._values[topic] = codec.key_schema, codec.value_schema
        before, self._known[qualified] = self._known.get(qualified), known_columns(codec.columns)
        if before is not None and (columns := rewritten(before, self._known[qualified])):
            self._refill(qualified, columns)
        return codec

    def _refill(self, qualified: str, columns: list[str]) -> None:
        """A type change that writes the columns' values in another form: the table is read again into its
        topic, so that every store holds each row in the new form (cdc/_generations.py)."""
        backfill = self.generations.refill(qualified, columns)
        if backfill is not None:
            log.info(
                "table %s: column(s) %s are written in another form since their type changed: backfill %s reads "
                "the table again so that every store gets its rows in the new form",
                qualified,
                ", ".join(columns),
                backfill,
            )

    def _change(self, shape: TableShape, qualified: str, generation: int, refused: SchemaRefusedError) -> TypeChange:
        return TypeChange(
            table=qualified,
            base=shape.topic,
            generation=generation,
            columns=changed_columns(self._known.get(qualified, {}), known_columns(shape.columns)),
            subject=refused.subject,
            reason=refused.reason,
        )

    def for_relation(self, rel: Relation, *, binary: bool) -> TableCodec:
        """The codec of the table version a Relation message describes; with ``binary`` (the stream is in
        binary mode), TextModeNeededError when a column has no binary reader."""
        columns = [(c.name, c.type_oid) for c in rel.columns]
        numbers = relation_attnums(columns, self._types.column_numbers(rel.relid), self._relations.get(rel.relid))
        cols = [ColumnSpec(c.name, c.type_oid, c.type_modifier, n) for c, n in zip(rel.columns, numbers, strict=True)]
        codec = self.for_table(rel.namespace, rel.name, cols, [c.is_key for c in rel.columns], rel.relid)
        # The numbers the codec settled on (a column the catalogs no longer name keeps the number its name had
        # in the table's schemas): the table's next Relation is told apart against them.
        self._relations[rel.relid] = [(c.name, c.pgtype.oid, c.attnum) for c in codec.columns]
        if binary and not all(codec.binary_capable):
            raise TextModeNeededError(f"table {rel.namespace}.{rel.name} has a column without a binary reader")
        return codec


def _field_names(schema: Mapping[str, Any]) -> list[Any]:
    return [f.get("name") for f in schema.get("fields", ()) if isinstance(f, dict)]


def relation_attnums(
    columns: Sequence[tuple[str, int]],
    now: Mapping[str, tuple[int, int]],
    previous: Sequence[tuple[str, int, int | None]] | None,
) -> list[int | None]:
    """The attnums of a Relation message's columns ((name, type oid), in the message's order, which is attnum
    order), from the catalogs as they are ``now`` (live columns' (attnum, type oid) by name) and the table's
    ``previous`` Relation in this stream with the attnums found for it.

    A column found by name with the same type takes the catalog's number. The stream may be behind a later
    ALTER, so a column not found there (renamed again since) takes the number of the previous Relation's column
    at the same place when both messages have as many columns, the types agree and that column still lives:
    a live column was not dropped in between, so the one at its place is it, renamed. Numbers that are not in
    increasing order betray a guess gone wrong: then none is given (the columns carry no identity, as before
    pgcdc knew them)."""
    numbers: list[int | None] = []
    for name, type_oid in columns:
        found = now.get(name)
        numbers.append(found[0] if found is not None and found[1] == type_oid else None)
    alive = {attnum for attnum, _ in now.values()}
    if previous is not None and len(previous) == len(columns):
        for i, ((_, type_oid), (_, was_type, was)) in enumerate(zip(columns, previous, strict=True)):
            if numbers[i] is None and was is not None and was_type == type_oid and was in alive and was not in numbers:
                numbers[i] = was
    known = [n for n in numbers if n is not None]
    return numbers if known == sorted(set(known)) else [None] * len(columns)


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
    primary: psycopg.Connection[Any] | None = None  # when ``sql`` is a standby: its primary (cdc._standby)

    @property
    def writer(self) -> psycopg.Connection[Any]:
        """Where the capture writes (heartbeats, the signal table): the primary when it reads a standby."""
        return self.primary if self.primary is not None else self.sql


@contextlib.contextmanager
def attach(ctx: CaptureContext) -> Iterator[Attached]:
    """Checks the source and prepares it (publication), connects to Kafka and the registry, makes the offsets
    topic; the SQL connection is closed on the way out."""
    s = ctx.settings
    with source_connections(s) as (sql, primary):
        report = check_and_prepare(sql, s, dry_run=False, allow_active_slot=True, writer=primary)
        if primary is not None:
            wait_replayed(sql, primary)  # the publication as the primary has it, before the standby decodes
        types = TypeResolver(sql)
        kafka = s.kafka.client_conf()
        topics = Topics(kafka, partitions=s.kafka.partitions, replication_factor=s.kafka.replication_factor)
        registry = Registry(s.registry.client_conf())
        topics.ensure(s.offsets_topic, partitions=1)
        offsets = OffsetStore(kafka, s.offsets_topic, s.source.slot)
        source_info = SourceInfo(__version__, s.kafka.topic_prefix, sql.info.dbname)
        codecs = TableCodecs(ctx, report, types=types, topics=topics, registry=registry, source_info=source_info)
        dead = CaptureDeadLetters(s.capture.on_unencodable, s.kafka.topic_prefix, server_printer(sql), topics.ensure)
        yield Attached(sql, report, types, topics, registry, codecs, offsets, dead, primary)


__all__ = ["Attached", "CaptureContext", "TableCodecs", "TextModeNeededError", "attach", "relation_attnums"]
