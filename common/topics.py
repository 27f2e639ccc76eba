"""Table names and topic names: the naming rule the capture writes by and the sinks read by.

One rule on both sides (docs/events.md): a topic is ``<prefix>.<schema>.<table>``, where characters Kafka
refuses, and dots inside a part, become ``_``; tables are written ``schema.table`` with quotes around parts
that hold dots or quotes.
"""

from __future__ import annotations

import re


def topic_part(name: str) -> str:
    """One part of a topic name: characters Kafka refuses, and dots, become '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "_"


def topic_name(prefix: str, schema: str, table: str) -> str:
    return f"{prefix}.{topic_part(schema)}.{topic_part(table)}"


def split_table_name(name: str) -> tuple[str, str]:
    """'schema.table' -> (schema, table); a quoted part may contain dots: '"my.schema"."t"'. ValueError if not."""
    parts = re.findall(r'"((?:[^"]|"")*)"|([^."]+)', name)
    rebuilt = [quoted.replace('""', '"') if quoted else plain for quoted, plain in parts]
    if len(rebuilt) != 2 or not all(rebuilt):
        raise ValueError(f"table {name!r} must be written 'schema.table' (quote parts with dots in them)")
    return rebuilt[0], rebuilt[1]
