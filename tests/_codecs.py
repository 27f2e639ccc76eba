"""A TableCodec from column types, without a database: what the unit tests and bench/hotpath_micro.py encode with."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cdc._events import SourceInfo, TableCodec
from schemas import ColumnShape, PgType, avro_mapping


def make_codec(
    columns: Iterable[tuple[str, PgType, int]],
    *,
    topic: str,
    key: Sequence[str] = ("id",),
    source: SourceInfo | None = None,
    register: Callable[[str, dict[str, Any]], int] = lambda _subject, _schema: 1,
) -> TableCodec:
    """``columns``: (name, type, typmod); ``topic``: "<prefix>.<schema>.<table>" (also the Avro namespace)."""
    shapes, mappings = [], []
    for name, pgtype, typmod in columns:
        mapping = avro_mapping(pgtype, typmod)
        mappings.append(mapping)
        shapes.append(ColumnShape(name, pgtype, typmod, mapping.schema))
    prefix, schema, table = topic.split(".")
    return TableCodec(
        schema=schema,
        table=table,
        topic=topic,
        namespace=topic,
        columns=shapes,
        mappings=mappings,
        key_columns=list(key),
        source=source or SourceInfo("1.0", prefix, "db"),
        register=register,
    )
