"""The source as the events describe it: every row of the captured tables, as the capture would encode it.

``cdc verify`` compares a derived store with this. Rows are read in one REPEATABLE READ snapshot with binary
COPY and converted by the same type mappings the capture uses, so a value is compared in exactly the form
its events carry (raw Avro values by field name), never through a second, hand-written conversion.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg import sql

from cdc._catalog import TypeResolver
from cdc._config import Settings, load_settings
from cdc._snapshot import parse_binary_copy
from cdc._source import check_and_prepare, connect
from schemas import avro_mapping
from schemas._envelope import ColumnShape, avro_namespace, envelope_schema, field_names


@dataclass(frozen=True)
class SourceTable:
    """One captured table: where its events go and what its rows look like in Avro."""

    schema: str
    table: str
    topic: str
    key_fields: tuple[str, ...]  # Avro field names of the key columns, in key order
    row_schema: dict[str, Any]  # the Avro ``Value`` record (named types defined once)
    _settings: Settings
    _select: sql.Composed
    _converters: tuple[Any, ...]

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every row now in the table: raw Avro values by field name (what the Avro writer takes)."""
        names = [f["name"] for f in self.row_schema["fields"]]
        with connect(self._settings, autocommit=False) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            data = bytearray()
            with conn.cursor() as cur, cur.copy(self._select) as copy:
                for block in copy:
                    data += block
        for raw in parse_binary_copy(data):
            yield {
                name: None if value is None else conv(value)
                for name, value, conv in zip(names, raw, self._converters, strict=True)
            }


def source_tables(config: Path | Settings | None) -> list[SourceTable]:
    """The captured tables of the configuration (``source.tables`` or the publication's), described now."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    out: list[SourceTable] = []
    with connect(settings) as conn:
        report = check_and_prepare(conn, settings, dry_run=True, allow_active_slot=True)
        types = TypeResolver(conn)
        for info in report.tables:
            shapes: list[ColumnShape] = []
            converters: list[Any] = []
            columns: list[sql.Composable] = []
            for col in info.columns:
                pgtype = types.resolve(col.type_oid)
                mapping = avro_mapping(pgtype, col.typmod)
                shapes.append(ColumnShape(col.name, pgtype, col.typmod, mapping.schema))
                if mapping.from_binary is not None:
                    converters.append(mapping.from_binary)
                    columns.append(sql.Identifier(col.name))
                else:
                    converters.append(mapping.from_text)
                    columns.append(sql.SQL("{}::text").format(sql.Identifier(col.name)))
            names = field_names(shapes)
            keys = report.key_columns[info.qualified]
            key_fields = tuple(names[[c.name for c in info.columns].index(k)] for k in keys)
            envelope = envelope_schema(avro_namespace(settings.kafka.topic_prefix, info.schema, info.name), shapes)
            row_schema = envelope["fields"][0]["type"][1]
            select = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT (FORMAT binary)").format(
                sql.SQL(", ").join(columns), info.ident()
            )
            out.append(
                SourceTable(
                    schema=info.schema,
                    table=info.name,
                    topic=settings.topic_for(info.schema, info.name),
                    key_fields=key_fields,
                    row_schema=row_schema,
                    _settings=settings,
                    _select=select,
                    _converters=tuple(converters),
                )
            )
    return out
