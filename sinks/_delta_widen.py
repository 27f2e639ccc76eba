"""A column widened at the source, and the warehouse's Delta tables.

After ``ALTER TABLE … ALTER COLUMN … TYPE bigint`` (a wider ``numeric``, ``real`` → ``double precision``,
``timestamp`` → ``timestamptz``) the events carry the column in its new type, and a Delta column of the old
type cannot take its values (Delta refuses an ``int`` column a ``bigint`` value, rather than truncate it). The
warehouse then rewrites the table once with the column in its new type, as one new Delta version (readers of
an older version still see the old type), before it merges the batch: :func:`widened` says which columns,
:func:`rewrite` does it through Spark, so that it runs on the executors and wherever the table is stored.
Delta's own type widening (a table feature) would avoid the rewrite, but delta-rs, which writes the live
batches and which readers outside Spark use, does not take tables that have it.

Types are compared in Spark's DDL (``int``, ``decimal(10,2)``, ``timestamp_ntz``), which both Spark's schemas
(``DataType.simpleString``) and sinks._delta_arrow.spark_type give.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from sinks._delta_stats import quoted

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_INTEGERS = ("tinyint", "smallint", "int", "bigint")
_PAIRS = {("float", "double"), ("timestamp_ntz", "timestamp")}
_DECIMAL = re.compile(r"decimal\((\d+),(\d+)\)")


def widens(old: str, new: str) -> bool:
    """Whether a column of type ``old`` moved to ``new`` holds every value it held, unchanged (a ``timestamp_ntz``
    read as UTC); a struct (a ``numeric(p,s)``'s decimal-or-NaN union) when a member widens and none narrows."""
    old, new = _plain(old), _plain(new)
    if old.startswith("struct<") and new.startswith("struct<"):
        return _struct_widens(_members(old), _members(new))
    if old in _INTEGERS and new in _INTEGERS:
        return _INTEGERS.index(new) > _INTEGERS.index(old)
    if (old, new) in _PAIRS:
        return True
    before, now = _DECIMAL.fullmatch(old), _DECIMAL.fullmatch(new)
    if before is None or now is None:
        return False
    (p, s), (q, t) = (int(x) for x in before.groups()), (int(x) for x in now.groups())
    return (q, t) != (p, s) and t >= s and q - t >= p - s


def _struct_widens(before: list[tuple[str, str]], now: list[tuple[str, str]]) -> bool:
    if [n for n, _ in before] != [n for n, _ in now]:
        return False
    pairs = [(b, n) for (_, b), (_, n) in zip(before, now, strict=True)]
    return all(b == n or widens(b, n) for b, n in pairs) and any(b != n for b, n in pairs)


def _plain(ddl: str) -> str:
    """A Spark DDL type without spaces or quotes around names: Spark's simpleString and spark_type alike."""
    return ddl.replace(" ", "").replace("`", "").lower()


def _members(struct: str) -> list[tuple[str, str]]:
    """The (name, type) of a plain ``struct<a:int,b:struct<…>>``'s members."""
    inner, out, depth, start = struct[len("struct<") : -1], [], 0, 0
    for i, ch in enumerate(inner + ","):
        depth += (ch in "<(") - (ch in ">)")
        if ch == "," and depth == 0:
            name, _, typ = inner[start:i].partition(":")
            out.append((name, typ))
            start = i + 1
    return out


def widened(table: Iterable[tuple[str, str]], batch: Mapping[str, str]) -> dict[str, str]:
    """The table's columns whose type the batch widens: column -> its new type. ``table``: the Delta table's
    (column, type); ``batch``: the batch's types by column (Delta's column names ignore case)."""
    by_name = {name.lower(): typ for name, typ in batch.items()}
    return {name: by_name[name.lower()] for name, typ in table if widens(typ, by_name.get(name.lower(), typ))}


def rewrite(spark: SparkSession, path: str, columns: Mapping[str, str]) -> None:
    """The Delta table at ``path`` written anew with ``columns`` cast to their new types (a timestamp_ntz as UTC:
    the sinks' sessions run in UTC), as one new version that replaces its schema."""
    from pyspark.sql import functions as F

    frame = spark.read.format("delta").load(path)
    cast = {name.lower(): typ for name, typ in columns.items()}
    projected = [
        F.col(quoted(c)).cast(cast[c.lower()]).alias(c) if c.lower() in cast else F.col(quoted(c))
        for c in frame.columns
    ]
    frame.select(*projected).write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)
