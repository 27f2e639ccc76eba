"""The source as the events describe it: every row of the captured tables, as the capture would encode it.

``cdc verify`` compares a derived store with this. Rows are read with binary COPY, in key order and in chunks
(``ORDER BY key LIMIT n``, each chunk after the last one's key), so memory holds one chunk whatever the table's
size; they are converted by the capture's own codec (``build_codec`` → ``TableCodec.row``, as the snapshot
does), so a value is compared in exactly the form its events carry (raw Avro values by field name).

A table can be read in key ranges by parallel tasks (verify's Spark tasks) that all see one snapshot: the driver
exports it (:func:`exported_snapshot`, held open while the tasks run) and picks the ranges from a sample of the
keys (:meth:`SourceTable.ranges`); each task imports the snapshot and reads its range. A :class:`SourceTable`
pickles: it carries its columns' resolved types, so a task needs no catalog look-up to build the codec.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from cdc._catalog import TypeResolver
from cdc._chunks import encode_chunk, parse_binary_copy, rows_and_last
from cdc._config import Settings, load_settings
from cdc._encoder import packed_rows
from cdc._events import ColumnSpec, SourceInfo, TableCodec, table_shape
from cdc._source import check_and_prepare, connect
from cdc._standby import source_connections
from cdc._version import __version__
from decoders import TupleData
from schemas import PgType

_B, _T, _N = ord("b"), ord("t"), ord("n")
_SAMPLE_KEYS = 100_000  # keys sampled to split a table into ranges: enough for even ranges, small in memory


@dataclass(frozen=True)
class KeyRange:
    """The rows whose key is after ``after`` and at most ``upto`` (the key columns as PostgreSQL prints them;
    None: unbounded on that side)."""

    after: tuple[str, ...] | None = None
    upto: tuple[str, ...] | None = None


@contextmanager
def exported_snapshot(settings: Settings) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    """A REPEATABLE READ transaction whose snapshot other sessions can import (``rows(snapshot=…)``); it must
    stay open until they have started, so the caller reads within the ``with``."""
    with connect(settings) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")  # autocommit: BEGIN opens it
        row = conn.execute("SELECT pg_export_snapshot()").fetchone()
        assert row is not None
        yield conn, str(row[0])


@dataclass(frozen=True)
class UnencodableRow:
    """A source row with a value Avro cannot hold, so no event (docs/types.md, capture.on_unencodable)."""

    key_text: dict[str, str | None]  # its key columns as PostgreSQL prints them
    key: dict[str, Any] | None  # its key's Avro values by field name; None when the key itself cannot be encoded
    error: str


@dataclass(frozen=True)
class _KnownTypes:
    """The columns' types as the driver resolved them (cdc._events.TypeSource), for a task with no catalog."""

    types: dict[int, PgType]

    def resolve(self, oid: int) -> PgType:
        return self.types[oid]


@dataclass(frozen=True)
class SourceTable:
    """One captured table: where its events go, what its rows look like in Avro, how to read them."""

    schema: str
    table: str
    topic: str
    key_fields: tuple[str, ...]  # Avro field names of the key columns, in key order
    row_schema: dict[str, Any]  # the Avro ``Value`` record (named types defined once)
    _settings: Settings
    _source: SourceInfo
    _columns: tuple[ColumnSpec, ...]
    _types: tuple[PgType, ...]  # each column's, resolved when the table was described
    _keys: tuple[str, ...]  # the key columns' names, in key order
    _key_types: tuple[str, ...]  # format_type of each key column
    _oid: int
    _row_filter: str | None = None  # the publication's: rows outside it have no events

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"

    def rows(
        self,
        chunk_rows: int = 20_000,
        unencodable: Callable[[UnencodableRow], None] | None = None,
        *,
        snapshot: str | None = None,
        within: KeyRange = KeyRange(),
    ) -> Iterator[dict[str, Any]]:
        """The table's rows in key order, ``within`` a key range: raw Avro values by field name (what the Avro
        writer takes). Every chunk reads one snapshot: a new one, or ``snapshot`` (from :func:`exported_snapshot`).

        A row with a value Avro cannot hold (docs/types.md) has no event: it goes to ``unencodable`` instead (the
        capture dead-letters or stops on it, capture.on_unencodable); without ``unencodable`` it raises."""
        codec = self._codec()
        kinds = bytes(_B if b else _T for b in codec.binary_capable)
        width = len(kinds)
        for data in self._copies(codec, chunk_rows, snapshot, within):
            for raw in parse_binary_copy(data):
                # Exactly as the snapshot converts a row (binary COPY, text for types without a binary reader).
                try:
                    row = _row(codec, raw[:width], kinds)
                except ValueError as exc:
                    if unencodable is None:
                        raise
                    unencodable(_unencodable(codec, raw, kinds, exc))
                    continue
                yield row

    def records(
        self, chunk_rows: int = 20_000, *, snapshot: str | None = None, within: KeyRange = KeyRange()
    ) -> Iterator[tuple[list[bytes], list[UnencodableRow]]]:
        """:meth:`rows` a chunk at a time as the capture's encoder writes them (in C where it is built): each row
        as the Value record's Avro bytes, with the chunk's rows that have no event. No row becomes a Python
        object: a reader that decodes Avro itself (Spark's ``from_avro``) takes these."""
        codec = self._codec()
        kinds = bytes(_B if b else _T for b in codec.binary_capable)
        for data in self._copies(codec, chunk_rows, snapshot, within):
            _, packed, refused = encode_chunk(codec, self.qualified, data, kinds)
            records = packed_rows(packed)[1]
            assert records is not None
            yield records, [_unencodable(codec, r.fields, kinds, r.error) for r in refused]

    def _copies(self, codec: TableCodec, chunk_rows: int, snapshot: str | None, within: KeyRange) -> Iterator[bytes]:
        """Binary COPY outputs of ``chunk_rows`` rows ``within`` the range, in key order, each chunk after the last
        one's key, all in one snapshot."""
        width = len(codec.binary_capable)
        select = self._select(codec)
        with connect(self._settings) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")  # every chunk sees one snapshot
            if snapshot is not None:
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            after = within.after
            while True:
                buf = bytearray()
                with conn.cursor() as cur, cur.copy(self._chunk(select, after, within.upto, chunk_rows)) as copy:
                    for block in copy:
                        buf += block
                data = bytes(buf)
                count, last = rows_and_last(data)
                yield data
                if count < chunk_rows or last is None:
                    return
                after = tuple((v or b"").decode() for v in last[width:])

    def snapshot(self) -> AbstractContextManager[tuple[psycopg.Connection[Any], str]]:
        """A snapshot to read the table in parallel (:func:`exported_snapshot`), from the table's database."""
        return exported_snapshot(self._settings)

    def ranges(self, conn: psycopg.Connection[Any], parts: int, *, min_rows: int = 1) -> list[KeyRange]:
        """Up to ``parts`` key ranges that cover the table with about as many rows each (and about ``min_rows``
        at least), as ``conn``'s snapshot sees it: split at keys of a sample (every key of a small table)."""
        found = conn.execute(
            "SELECT reltuples, pg_total_relation_size(oid) FROM pg_class WHERE oid = %s", (self._oid,)
        ).fetchone()
        assert found is not None
        # reltuples is -1 until the table was first vacuumed or analysed: then guess ~100 bytes per row
        estimate = float(found[0]) if found[0] >= 0 else float(found[1]) / 100
        parts = min(parts, max(1, int(estimate // max(1, min_rows))))
        if parts <= 1:
            return [KeyRange()]
        sample: sql.Composable = sql.SQL("")
        if estimate > _SAMPLE_KEYS:  # SYSTEM picks whole pages: cheap, and even enough for split points
            sample = sql.SQL("TABLESAMPLE SYSTEM ({})").format(sql.Literal(100.0 * _SAMPLE_KEYS / estimate))
        query = sql.SQL("SELECT {} FROM {} AS src {} ORDER BY {}").format(
            sql.SQL(", ").join(sql.SQL("src.{}::text").format(sql.Identifier(k)) for k in self._keys),
            self._ident(),
            sample,
            self._key(),
        )
        keys = [tuple(str(v) for v in row) for row in conn.execute(query).fetchall()]
        cuts = sorted({keys[len(keys) * i // parts] for i in range(1, parts)} if len(keys) >= parts else set())
        bounds: list[tuple[str, ...] | None] = [None, *cuts, None]
        return [KeyRange(after, upto) for after, upto in itertools.pairwise(bounds)]

    def _codec(self) -> TableCodec:
        types = _KnownTypes({c.type_oid: t for c, t in zip(self._columns, self._types, strict=True)})
        shape = table_shape(self._settings, types, self.schema, self.table, columns=self._columns, key=self._keys)
        return TableCodec(shape, source=self._source, register=lambda *_: 0)  # verify registers nothing

    def _select(self, codec: TableCodec) -> sql.Composable:
        """The table's columns (as text where the codec has no binary reader), then its key columns as text
        (where a chunk ends), aliased so that no output name shadows a column."""
        select: list[sql.Composable] = [
            sql.SQL("src.{}").format(sql.Identifier(c.name))
            if binary
            else sql.SQL("src.{}::text").format(sql.Identifier(c.name))
            for c, binary in zip(self._columns, codec.binary_capable, strict=True)
        ]
        select += [
            sql.SQL("src.{}::text AS {}").format(sql.Identifier(k), sql.Identifier(f"__pgcdc_key_{i}"))
            for i, k in enumerate(self._keys)
        ]
        return sql.SQL(", ").join(select)

    def _ident(self) -> sql.Composable:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.table))

    def _key(self) -> sql.Composable:
        """The key columns, qualified so that ORDER BY sorts by the column, not an output name."""
        return sql.SQL(", ").join(sql.SQL("src.{}").format(sql.Identifier(k)) for k in self._keys)

    def _key_value(self, texts: tuple[str, ...]) -> sql.Composable:
        # Literals, not %s: quoted identifiers may hold a "%s" (see cdc._chunks).
        return sql.SQL(", ").join(
            sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t)) for v, t in zip(texts, self._key_types, strict=True)
        )

    def _chunk(
        self, select: sql.Composable, after: tuple[str, ...] | None, upto: tuple[str, ...] | None, limit: int
    ) -> sql.Composed:
        bounds: list[sql.Composable] = []
        if after is not None:
            bounds.append(sql.SQL("({}) > ({})").format(self._key(), self._key_value(after)))
        if upto is not None:
            bounds.append(sql.SQL("({}) <= ({})").format(self._key(), self._key_value(upto)))
        bounds += [sql.SQL("({})").format(sql.SQL(self._row_filter))] if self._row_filter is not None else []
        where = sql.SQL("WHERE ") + sql.SQL(" AND ").join(bounds) if bounds else sql.SQL("")
        return sql.SQL("COPY (SELECT {} FROM {} AS src {} ORDER BY {} LIMIT {}) TO STDOUT (FORMAT binary)").format(
            select, self._ident(), where, self._key(), sql.Literal(limit)
        )


def _row(codec: TableCodec, values: list[bytes | None], kinds: bytes) -> dict[str, Any]:
    tup = TupleData(bytes(_N if v is None else k for v, k in zip(values, kinds, strict=True)), tuple(values))
    return codec.row(tup)[0]


def _unencodable(codec: TableCodec, raw: list[bytes | None], kinds: bytes, exc: ValueError) -> UnencodableRow:
    """What verify says of a row that has no event: its key as PostgreSQL prints it (selected as text after the
    columns), and its key's Avro values when they can be encoded (the store may hold an older version)."""
    width = len(kinds)
    names = [codec.columns[i].name for i in codec.key_indexes]
    text = {n: None if v is None else v.decode() for n, v in zip(names, raw[width:], strict=True)}
    keys_only = [v if i in codec.key_indexes else None for i, v in enumerate(raw[:width])]
    try:
        row = _row(codec, keys_only, kinds)
        key: dict[str, Any] | None = {f: row[f] for f in codec.key_field_names}
    except ValueError:
        key = None
    return UnencodableRow(text, key, str(exc) or type(exc).__name__)


def source_tables(config: Path | Settings | None) -> list[SourceTable]:
    """The captured tables of the configuration (``source.tables`` or the publication's), described now."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    out: list[SourceTable] = []
    with source_connections(settings) as (conn, primary):  # a standby's publication is read on its primary
        report = check_and_prepare(
            conn, settings, dry_run=True, allow_active_slot=True, writer=primary, as_published=True
        )
        types = TypeResolver(conn)
        source = SourceInfo(__version__, settings.kafka.topic_prefix, conn.info.dbname)
        for info in report.tables:
            columns = tuple(ColumnSpec(c.name, c.type_oid, c.typmod, c.attnum) for c in info.columns)
            keys = report.key_columns[info.qualified]
            # Nothing is registered: verify only needs the schemas and the converters.
            shape = table_shape(settings, types, info.schema, info.name, columns=columns, key=keys)
            codec = TableCodec(shape, source=source, register=lambda *_: 0)
            key_types = tuple(
                str(row[0])
                for k in keys
                for row in conn.execute(
                    "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s AND attname = %s",
                    (info.oid, k),
                ).fetchall()
            )
            out.append(
                SourceTable(
                    schema=info.schema,
                    table=info.name,
                    topic=codec.topic,
                    key_fields=codec.key_field_names,
                    row_schema=codec.value_schema["fields"][0]["type"][1],
                    _settings=settings,
                    _source=source,
                    _columns=columns,
                    _types=tuple(types.resolve(c.type_oid) for c in columns),
                    _keys=tuple(keys),
                    _key_types=key_types,
                    _oid=info.oid,
                    _row_filter=info.row_filter,
                )
            )
    return out
