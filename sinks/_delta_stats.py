"""Which columns of a warehouse table Delta gathers statistics for, so that every Delta reader can open it.

Delta stores each file's minimum and maximum of a column as JSON text, a date as its ISO text
(``"+5881580-07-11"`` for PostgreSQL's ``infinity``). delta-rs's Python reader (``to_pyarrow_table``,
``to_pandas``, every reader built on its pyarrow dataset) turns a date's statistics into Python ``date``
objects, which stop at years 1..9999: a date statistic outside them fails the whole table, not the row
(``Invalid isoformat string`` for years 0 and before or 10000 and after, a Rust panic for ±infinity).
Timestamps' statistics have no such limit there, nor do nested fields' (the reader does not parse them).

So the sink drops a date column from the table's statistics once the column holds such a value: before the
batch that writes it, ``delta.dataSkippingStatsColumns`` lists the columns Delta gathers minimum and maximum
for by default (numbers, strings, dates and timestamps among the first 32 leaf columns, struct fields by
path) less that column. delta-rs reads only the listed columns' statistics, so files written before the
change no longer count either. The cost: no data skipping on that column (a filter on it reads every file),
and no null counts for the unlisted booleans and binaries among the first 32 (``IS NULL`` on them reads every
file too). Other tables keep Delta's default. The check is one aggregate over the batch's changes, for
tables whose statistics still cover a date column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

STATS_COLUMNS = "delta.dataSkippingStatsColumns"
DEFAULT_INDEXED_LEAVES = 32  # delta.dataSkippingNumIndexedCols's default
FIRST_DAY, LAST_DAY = "0001-01-01", "9999-12-31"  # what Python's date holds


Path = tuple[str, ...]  # a column, or a field inside struct columns


def default_columns(schema: StructType) -> list[Path]:
    """The leaf columns Delta gathers minimum and maximum for by default: those within the first 32 leaves
    whose type Delta can compare (numbers, strings, dates, timestamps; a listed column must be one)."""
    out: list[Path] = []
    for path, data_type in _leaves(schema, ())[:DEFAULT_INDEXED_LEAVES]:
        if _comparable(data_type):
            out.append(path)
    return out


def _leaves(schema: StructType, prefix: Path) -> list[tuple[Path, DataType]]:
    from pyspark.sql.types import StructType

    out: list[tuple[Path, DataType]] = []
    for field in schema.fields:
        if isinstance(field.dataType, StructType):
            out.extend(_leaves(field.dataType, (*prefix, field.name)))
        else:
            out.append(((*prefix, field.name), field.dataType))
    return out


def _comparable(data_type: DataType) -> bool:
    from pyspark.sql.types import DateType, NumericType, StringType, TimestampNTZType, TimestampType

    return isinstance(data_type, NumericType | DateType | TimestampType | TimestampNTZType | StringType)


def format_columns(columns: Sequence[Path]) -> str:
    return ",".join(".".join(quoted(part) for part in path) for path in columns)


def parse_columns(value: str) -> list[Path]:
    """The columns of a ``delta.dataSkippingStatsColumns`` value: ``a,`b`.`c``` → [("a",), ("b", "c")]."""
    out: list[Path] = []
    parts: list[str] = []
    name, quoted, i = "", False, 0
    while i < len(value):
        ch = value[i]
        if quoted:
            if ch == "`" and value[i + 1 : i + 2] == "`":
                name, i = name + "`", i + 1
            elif ch == "`":
                quoted = False
            else:
                name += ch
        elif ch == "`":
            quoted = True
        elif ch in ".,":
            parts.append(name.strip())
            name = ""
            if ch == ",":
                out.append(tuple(parts))
                parts = []
        else:
            name += ch
        i += 1
    parts.append(name.strip())
    if any(parts):
        out.append(tuple(parts))
    return [p for p in out if all(p)]


class BatchDates:
    """Which date columns of a batch's changes hold a value before year 1 or after 9999: one aggregate over
    the columns asked about first, remembered for the batch's other writes (table and history)."""

    def __init__(self, frame: Callable[[], DataFrame]) -> None:
        self._frame = frame  # built on the first question: most tables have no date to ask about
        self._known: dict[str, bool] = {}

    def beyond_python(self, columns: Sequence[str]) -> set[str]:
        from pyspark.sql import functions as F

        ask = [c for c in columns if c not in self._known]
        if ask:
            low, high = F.expr(f"DATE'{FIRST_DAY}'"), F.expr(f"DATE'{LAST_DAY}'")
            row = (
                self._frame()
                .select(
                    *[
                        F.max(F.when((F.col(quoted(c)) < low) | (F.col(quoted(c)) > high), 1)).alias(f"c{i}")
                        for i, c in enumerate(ask)
                    ]
                )
                .first()
            )
            self._known.update({c: row is not None and row[f"c{i}"] is not None for i, c in enumerate(ask)})
        return {c for c in columns if self._known[c]}


class StatsColumns:
    """The statistics columns of the warehouse's tables, as this sink last set them (it alone writes them).

    ``guard`` is called before each write of a table; it returns the writer options that create a table with
    the right list, or sets the list on an existing table itself.
    """

    def __init__(self) -> None:
        self._listed: dict[str, list[Path] | None] = {}  # path -> delta.dataSkippingStatsColumns (None: unset)

    def guard(
        self, spark: SparkSession, path: str, schema: StructType, dates: BatchDates, *, new: bool
    ) -> dict[str, str]:
        """Keep the batch's dates beyond years 1..9999 out of the statistics of the table at ``path``.

        ``schema``: the table's columns (when ``new``, those this write creates it with).
        """
        from pyspark.sql.types import DateType

        listed = None if new else self._listed_columns(spark, path)
        columns = listed if listed is not None else default_columns(schema)
        types = {f.name: f.dataType for f in schema.fields}
        top = [c[0] for c in columns if len(c) == 1 and isinstance(types.get(c[0]), DateType)]
        beyond = dates.beyond_python(top)
        kept = [c for c in columns if not (len(c) == 1 and c[0] in beyond)]
        if new:  # a rebuild may create a table again at a path seen before: nothing is kept from then
            self._listed[path] = kept if beyond else None
            return {STATS_COLUMNS: format_columns(kept)} if beyond else {}
        if beyond:
            self._listed[path] = kept
            value = sql_string(format_columns(kept))
            spark.sql(f"ALTER TABLE delta.{quoted(path)} SET TBLPROPERTIES ({sql_string(STATS_COLUMNS)} = {value})")
        return {}

    def forget(self, path: str) -> None:
        """The table at ``path`` was created by another writer (delta-rs): its list is read again when needed."""
        self._listed.pop(path, None)

    def _listed_columns(self, spark: SparkSession, path: str) -> list[Path] | None:
        if path not in self._listed:
            from delta.tables import DeltaTable

            detail = DeltaTable.forPath(spark, path).detail().first()
            value = None if detail is None else (detail["properties"] or {}).get(STATS_COLUMNS)
            self._listed[path] = None if value is None else parse_columns(value)
        return self._listed[path]


def quoted(name: str) -> str:
    """A Spark SQL identifier: a column or a ``delta.`<path>``` table."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(text: str) -> str:
    """A Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def has_dates(schema: StructType) -> bool:
    """Whether a frame has a top-level date column: a write without one cannot need the guard."""
    from pyspark.sql.types import DateType

    return any(isinstance(f.dataType, DateType) for f in schema.fields)
