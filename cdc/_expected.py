"""The source as the events describe it: every row of the captured tables, as the capture would encode it.

``cdc verify`` compares a derived store with this. Rows are read in one REPEATABLE READ snapshot with binary
COPY and converted by the capture's own codec (``build_codec`` → ``TableCodec.row``, as the snapshot does), so
a value is compared in exactly the form its events carry (raw Avro values by field name).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg import sql

from cdc._catalog import TypeResolver
from cdc._config import Settings, load_settings
from cdc._events import ColumnSpec, SourceInfo, TableCodec, build_codec
from cdc._snapshot import parse_binary_copy
from cdc._source import check_and_prepare, connect
from cdc._version import __version__
from decoders import TupleData

_B, _T, _N = ord("b"), ord("t"), ord("n")


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
    _select: sql.Composed

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every row now in the table: raw Avro values by field name (what the Avro writer takes)."""
        with connect(self._settings, autocommit=False) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            data = bytearray()
            with conn.cursor() as cur, cur.copy(self._select) as copy:
                for block in copy:
                    data += block
        kinds = bytes(_B if b else _T for b in self._codec.binary_capable)
        for raw in parse_binary_copy(data):
            # Exactly as the snapshot converts a row (binary COPY, text for types without a binary reader).
            row, _ = self._codec.row(
                TupleData(bytes(_N if v is None else k for v, k in zip(raw, kinds, strict=True)), tuple(raw))
            )
            yield row


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
            codec = build_codec(
                settings, types, info.schema, info.name, columns, key_columns=keys, source=source, register=lambda *_: 0
            )
            select = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT (FORMAT binary)").format(
                sql.SQL(", ").join(
                    sql.Identifier(c.name) if binary else sql.SQL("{}::text").format(sql.Identifier(c.name))
                    for c, binary in zip(info.columns, codec.binary_capable, strict=True)
                ),
                info.ident(),
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
                )
            )
    return out
