"""Table names and topic names: the naming rule the capture writes by and the sinks read by.

One rule on both sides (docs/events.md): a topic is ``<prefix>.<schema>.<table>``, where characters Kafka
refuses, and dots inside a part, become ``_``; tables are written ``schema.table`` with quotes around parts
that hold dots or quotes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def topic_part(name: str) -> str:
    """One part of a topic name: characters Kafka refuses, and dots, become '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "_"


def topic_name(prefix: str, schema: str, table: str) -> str:
    return f"{prefix}.{topic_part(schema)}.{topic_part(table)}"


GENERATION = r"(?:\.g[0-9]+)?"  # a table's later topic generation (docs/events.md, Type changes), as a pattern
_GENERATION = re.compile(r"g[0-9]+")


def generation_topic(base: str, generation: int) -> str:
    """The topic of a table's ``generation``: its plain topic for the first, ``<topic>.g<n>`` after."""
    return base if generation <= 1 else f"{base}.g{generation}"


def split_generation(topic: str, prefix: str) -> tuple[str, int]:
    """(the table's first topic, the generation) of a change topic under ``prefix`` (which may hold dots); the
    schema and table parts never do, so a third part ``g<n>`` after the prefix can only be a generation."""
    parts = topic[len(prefix) + 1 :].split(".") if topic.startswith(prefix + ".") else []
    if len(parts) != 3 or _GENERATION.fullmatch(parts[2]) is None:
        return topic, 1
    return topic[: -len(parts[2]) - 1], int(parts[2][1:])


def superseded(topics: Iterable[str], prefix: str) -> set[str]:
    """The change topics (under ``prefix``) of a table that has a later generation among ``topics``: nothing is
    written to them any more, and the table is read from its newest generation alone."""
    newest: dict[str, int] = {}
    found = [(t, *split_generation(t, prefix)) for t in topics]
    for _topic, base, generation in found:
        newest[base] = max(newest.get(base, 0), generation)
    return {topic for topic, base, generation in found if generation < newest[base]}


def split_table_name(name: str) -> tuple[str, str]:
    """'schema.table' -> (schema, table); a quoted part may contain dots: '"my.schema"."t"'. ValueError if not."""
    parts = re.findall(r'"((?:[^"]|"")*)"|([^."]+)', name)
    rebuilt = [quoted.replace('""', '"') if quoted else plain for quoted, plain in parts]
    if len(rebuilt) != 2 or not all(rebuilt):
        raise ValueError(f"table {name!r} must be written 'schema.table' (quote parts with dots in them)")
    return rebuilt[0], rebuilt[1]
