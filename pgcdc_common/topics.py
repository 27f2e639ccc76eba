"""Table names and topic names: the naming rule the capture writes by and the sinks read by.

One rule on both sides (docs/events.md): a topic is ``<prefix>.<schema>.<table>``, where characters Kafka
refuses, and dots inside a part, become ``_``; tables are written ``schema.table`` with quotes around parts
that hold dots or quotes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping


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


def superseded(topics: Iterable[str], prefix: str, chosen: Mapping[str, int] | None = None) -> set[str]:
    """The change topics (under ``prefix``) of a table that are not the generation it is read from: its newest
    among ``topics`` (nothing is written to the earlier ones any more), or, given ``chosen`` (a store
    generation's choice per table's first topic: sinks._served), the chosen one; a table not in ``chosen`` is
    read from its first generation, one whose chosen topic is not among ``topics`` from its newest."""
    found = [(t, *split_generation(t, prefix)) for t in topics]
    present: dict[str, set[int]] = {}
    for _topic, base, generation in found:
        present.setdefault(base, set()).add(generation)
    read = {}
    for base, generations in present.items():
        wanted = max(generations) if chosen is None else chosen.get(base, 1)
        read[base] = wanted if wanted in generations else max(generations)
    return {topic for topic, base, generation in found if generation != read[base]}


def newest_generations(topics: Iterable[str], prefix: str) -> dict[str, int]:
    """Per table's first topic, its newest generation among ``topics``."""
    newest: dict[str, int] = {}
    for topic in topics:
        base, generation = split_generation(topic, prefix)
        newest[base] = max(newest.get(base, 0), generation)
    return newest


def split_table_name(name: str) -> tuple[str, str]:
    """'schema.table' -> (schema, table); a quoted part may contain dots: '"my.schema"."t"'. ValueError if not."""
    parts = re.findall(r'"((?:[^"]|"")*)"|([^."]+)', name)
    rebuilt = [quoted.replace('""', '"') if quoted else plain for quoted, plain in parts]
    if len(rebuilt) != 2 or not all(rebuilt):
        raise ValueError(f"table {name!r} must be written 'schema.table' (quote parts with dots in them)")
    return rebuilt[0], rebuilt[1]
