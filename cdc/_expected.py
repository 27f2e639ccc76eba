"""The source as the events describe it: every row of the captured tables, as the capture would encode it.

``cdc verify`` compares a derived store with this. Rows are read in one REPEATABLE READ snapshot with binary
COPY, in key order and in chunks (``ORDER BY key LIMIT n``, each chunk after the last one's key), so memory
holds one chunk whatever the table's size; they are converted by the capture's own codec (``build_codec`` →
``TableCodec.row``, as the snapshot does), so a value is compared in exactly the form its events carry (raw
Avro values by field name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg import sql

from cdc._catalog import TypeResolver
from cdc._config import Settings, load_settings
from cdc._events import ColumnSpec, SourceInfo, TableCodec, table_shape
from cdc._snapshot import parse_binary_copy
from cdc._source import check_and_prepare, connect
from cdc._version import __version__
from decoders import TupleData

_B, _T, _N = ord("b"), ord("t"), ord("n")


@dataclass(frozen=True)
class UnencodableRow:
    """A source row with a value Avro cannot hold, so no event (docs/types.md, capture.on_unencodable)."""

    key_text: dict[str, str | None]  # its key columns as PostgreSQL prints them
    key: dict[str, Any] | None  # its key's Avro values by field name; None when the key itself cannot be encoded
    error: str


@dataclass(frozen=True)
class SourceTable:
    """One captured table: where its events go and what its rows look like in Avro."""

    schema: str
    table: str
    topic: str
    key_fields: tuple[str, ...]  # Avro field names of the key columns, in key order
    row_schema: dict[str, Any]  # the Avro ``Value`` record (named types defined once)
    _settings: Settings
    _codec: TableCodec
    _select: list[sql.Composable]  # the table's columns, then its key columns as text (where a chunk ends)
    _ident: sql.Composable
    _key: sql.Composable  # the key columns, for ORDER BY and the row comparison
    _key_types: tuple[str, ...]  # format_type of each key column

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"

    def rows(
        self, chunk_rows: int = 20_000, unencodable: Callable[[UnencodableRow], None] | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every row now in the table, in key order: raw Avro values by field name (what the Avro writer takes).

        A row with a value Avro cannot hold (docs/types.md) has no event: it goes to ``unencodable`` instead (the
        capture dead-letters or stops on it, capture.on_unencodable); without ``unencodable`` it raises."""
        kinds = bytes(_B if b else _T for b in self._codec.binary_capable)
        width = len(kinds)
        with connect(self._settings, autocommit=False) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")  # every chunk sees one snapshot
            after: list[str] | None = None
            while True:
                data = bytearray()
                with conn.cursor() as cur, cur.copy(self._chunk(after, chunk_rows)) as copy:
                    for block in copy:
                        data += block
                chunk = parse_binary_copy(data)
                for raw in chunk:
                    # Exactly as the snapshot converts a row (binary COPY, text for types without a binary reader).
                    try:
                        row = self._row(raw[:width], kinds)
                    except ValueError as exc:
                        if unencodable is None:
                            raise
                        unencodable(self._unencodable(raw, kinds, exc))
                        continue
                    yield row
                if len(chunk) < chunk_rows:
                    return
                after = [(v or b"").decode() for v in chunk[-1][width:]]

    def _row(self, values: list[bytes | None], kinds: bytes) -> dict[str, Any]:
        tup = TupleData(bytes(_N if v is None else k for v, k in zip(values, kinds, strict=True)), tuple(values))
        return self._codec.row(tup)[0]

    def _unencodable(self, raw: list[bytes | None], kinds: bytes, exc: ValueError) -> UnencodableRow:
        """What verify says of a row that has no event: its key as PostgreSQL prints it (selected as text after
        the columns), and its key's Avro values when they can be encoded (the store may hold an older version)."""
        width = len(kinds)
        names = [self._codec.columns[i].name for i in self._codec.key_indexes]
        text = {n: None if v is None else v.decode() for n, v in zip(names, raw[width:], strict=True)}
        keys_only = [v if i in self._codec.key_indexes else None for i, v in enumerate(raw[:width])]
        try:
            row = self._row(keys_only, kinds)
            key: dict[str, Any] | None = {f: row[f] for f in self.key_fields}
        except ValueError:
            key = None
        return UnencodableRow(text, key, str(exc) or type(exc).__name__)

    def _chunk(self, after: list[str] | None, limit: int) -> sql.Composed:
        where: sql.Composable = sql.SQL("")
        if after is not None:  # literals, not %s: quoted identifiers may hold a "%s" (see cdc._snapshot)
            last = sql.SQL(", ").join(
                sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t))
                for v, t in zip(after, self._key_types, strict=True)
            )
            where = sql.SQL("WHERE ({}) > ({})").format(self._key, last)
        return sql.SQL("COPY (SELECT {} FROM {} AS src {} ORDER BY {} LIMIT {}) TO STDOUT (FORMAT binary)").format(
            sql.SQL(", ").join(self._select), self._ident, where, self._key, sql.Literal(limit)
        )


def source_tables(config: Path | Settings | None) -> list[SourceTable]:
    """The captured tables of the configuration (``source.tables`` or the publication's), described now."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    out: list[SourceTable] = []
    with connect(settings) as conn:
        report = check_and_prepare(conn, settings, dry_run=True, allow_active_slot=True)
        types = TypeResolver(conn)
        source = SourceInfo(__version__, settings.kafka.topic_prefix, conn.info.dbname)
        for info in report.tables:
            columns = [ColumnSpec(c.name, c.type_oid, c.typmod) for c in info.columns]
            keys = report.key_columns[info.qualified]
            # Nothing is registered: verify only needs the schemas and the converters.
            shape = table_shape(settings, types, info.schema, info.name, columns=columns, key=keys)
            codec = TableCodec(shape, source=source, register=lambda *_: 0)
            select: list[sql.Composable] = [
                sql.SQL("src.{}").format(sql.Identifier(c.name))
                if binary
                else sql.SQL("src.{}::text").format(sql.Identifier(c.name))
                for c, binary in zip(info.columns, codec.binary_capable, strict=True)
            ]
            # Aliased, so that no output name shadows a column; ORDER BY qualified, so it sorts by the column.
            select += [
                sql.SQL("src.{}::text AS {}").format(sql.Identifier(k), sql.Identifier(f"__pgcdc_key_{i}"))
                for i, k in enumerate(keys)
            ]
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
                    _codec=codec,
                    _select=select,
                    _ident=info.ident(),
                    _key=sql.SQL(", ").join(sql.SQL("src.{}").format(sql.Identifier(k)) for k in keys),
                    _key_types=key_types,
                )
            )
    return out
