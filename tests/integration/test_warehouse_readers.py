"""Delta readers that are not Spark read the warehouse exactly.

The type zoo (test_types_zoo) is captured, written by the warehouse sink (Spark, Delta Lake), and read back
with delta-rs (the ``deltalake`` package, no JVM): every value of every column, in the table and in its
history, must be PostgreSQL's. Two delta-rs paths read it: ``to_pyarrow_table()`` (delta-rs resolves the log,
pyarrow decodes the Parquet files) and delta-rs's own query engine (DataFusion decodes them).

Spark writes its TIMESTAMP (timestamptz here; timestamp_ntz is always int64 µs) as Parquet INT96 unless
told otherwise: nanoseconds within a day plus a Julian day number. Both readers turn that into int64
nanoseconds, which overflows for PostgreSQL's ±infinity (int64 max/min µs) and for any year outside
1677..2262: pyarrow refuses the file ("would lose data"), DataFusion silently returns a wrapped instant
(infinity as 1969-12-31 23:59:59.999999, -infinity as 1970-01-01, year 9999 as 1816). The sinks therefore
write TIMESTAMP_MICROS (sinks._spark), which every reader decodes as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import polars as pl
import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import TableNotFoundError
from psycopg import sql

from sinks._delta_stats import parse_columns
from sinks._values import Names, doc_converter
from tests.integration._capture_helpers import wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, cdc_here
from tests.integration.test_capture_zoo import SourceColumn, Types, insert_rows, source_columns, types_table
from tests.integration.test_capture_zoo import zoo_table as zoo_table  # noqa: PLC0414 - the fixture, for pytest
from tests.integration.test_types_zoo import TEXT, ZOO, Zoo, us
from tests.integration.test_types_zoo import zoo as zoo  # noqa: PLC0414 - the fixture, re-exported for pytest
from tests.unit.test_types import same

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.timeout(1200), SPARK_WORKER]


def _pyarrow(path: Path) -> pa.Table:
    return DeltaTable(str(path)).to_pyarrow_table()


def _datafusion(path: Path) -> pa.Table:
    result = QueryBuilder().register("t", DeltaTable(str(path))).execute("SELECT * FROM t").read_all()
    return pa.table(result)


def _polars(path: Path) -> pa.Table:
    return pl.read_delta(str(path)).to_arrow()


READERS: dict[str, Callable[[Path], pa.Table]] = {"pyarrow": _pyarrow, "datafusion": _datafusion, "polars": _polars}

# The zoo's top-level scalar types as the first columns of a narrow table: Delta gathers statistics (min, max)
# for the first 32 leaf columns only, and the zoo's date column is beyond them. Here every edge value lands in
# a file's statistics, which delta-rs's pyarrow reader parses (sinks._delta_stats).
EDGE_TYPES = ("date", "timestamp", "timestamptz", "numeric(38,10)", "numeric(12,2)", "numeric", "real", "bytea")
EDGES = [entry for t in EDGE_TYPES for entry in ZOO if entry[0] == t]

# The Arrow type delta-rs gives each of these zoo columns, and how PostgreSQL's value maps onto it (checked
# value by value against ZOO's hand-written expectations in _arrow_value):
# - timestamptz: µs since 1970-01-01 UTC; timestamp: the wall clock as µs since 1970-01-01. PostgreSQL's
#   infinity and -infinity are int64 max and min (9223372036854775807, -9223372036854775808), as in the Avro
#   events; years outside 1..9999 (4714 BC, 294247) are plain µs counts too.
# - date: days since 1970-01-01; infinity and -infinity are int32 max and min (2147483647, -2147483648).
# - numeric without a scale: PostgreSQL's text, exact (1000 digits, NaN, ±Infinity); numeric(p,s): the union
#   of decimal(p,s) and the text of NaN.
# - bytea: the bytes; jsonb: PostgreSQL's normalised text; real/double: the IEEE value, NaN, ±inf and -0.0 kept.
EXACT_TYPES = {
    "boolean": pa.bool_(),
    "real": pa.float32(),
    "double precision": pa.float64(),
    "numeric": pa.string(),
    "numeric(12,2)": pa.struct([("member0", pa.decimal128(12, 2)), ("member1", pa.string())]),
    "numeric(38,10)": pa.struct([("member0", pa.decimal128(38, 10)), ("member1", pa.string())]),
    "text": pa.string(),
    "bytea": pa.binary(),
    "jsonb": pa.string(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
}


def test_delta_rs_and_polars_read_every_zoo_value_exactly_and_verify_finds_no_drift(
    *,
    zoo: Zoo,
    zoo_table: tuple[str, int],
    pg_dsn: str,
    stack: Stack,
    spark: SparkSession,
    unique: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    table, rows = zoo_table
    caplog.set_level(logging.INFO, logger="sinks._verify")
    insert_rows(zoo, table, 1, rows)
    with types_table(zoo, f"edges_{unique}", EDGES) as (edges, edge_rows):
        insert_rows(zoo, edges, 1, edge_rows, EDGES)
        tables = {f"{zoo.schema}.{table}": (rows, ZOO), f"{zoo.schema}.{edges}": (edge_rows, EDGES)}
        with _warehouse_sink(tables, pg_dsn=pg_dsn, stack=stack, spark=spark, unique=unique, workdir=tmp_path) as (
            current,
            cfg,
        ):
            # `cdc verify` reads the warehouse with Spark and compares every value with PostgreSQL's.
            result = cdc_here("verify", "warehouse", "--config", str(cfg))
            assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
            assert "no drift" in result.stdout, result.stdout
            for name in tables:  # every type, the hstore map included, is compared without per-row Python
                assert f"verify: {name} compared in the JVM" in caplog.text, caplog.text
            paths = sorted(p for p in current.iterdir() if (p / "_delta_log").is_dir())
        assert [p.name for p in paths] == sorted(n + h for n in tables for h in ("", ".history"))
        stats = _statistics_columns(current / f"{zoo.schema}.{edges}")
        assert stats is not None, "the edge table's dates beyond years 1..9999 are still in its statistics"
        assert ("c0",) not in stats, stats  # the date column, and only it
        assert {("id",), ("c1",), ("c2",), ("c3", "member0")} <= set(stats), stats
        _check_ways_around(current / f"{zoo.schema}.{edges}", source_columns(zoo, edges, EDGES)[0])
        for path in paths:
            name = path.name.removesuffix(".history")
            rows, types = tables[name]
            columns = source_columns(zoo, name.split(".")[1], types)
            for reader_name, read in READERS.items():
                where = f"{reader_name} reading {path.name}"
                frame = read(path)
                _check_exact_types(frame, columns, where)
                got = _rows_by_id(frame)
                assert sorted(got) == sorted(columns[0].texts), where  # every row, once
                _check_hand_written(got, columns, types, where)
                check_every_column(got, columns, where, spark_values=True)


def _check_ways_around(path: Path, dates: SourceColumn) -> None:
    """Dates Python's ``date`` cannot hold (docs/types.md, "What each reader sees"): pandas keeps them with
    Arrow's types, polars as its Date, both exact as day numbers."""
    assert dates.column_type == "date"
    want = sorted(v for v in dates.values().values() if v is not None)  # days since 1970, ±infinity as int32 max/min
    with pytest.raises((ValueError, OverflowError)):
        DeltaTable(str(path)).to_pandas()  # numpy's default conversion builds Python dates
    frame = DeltaTable(str(path)).to_pandas(types_mapper=pd.ArrowDtype)
    assert sorted(v for v in pa.array(frame["c0"]).cast(pa.int32()).to_pylist() if v is not None) == want
    days = pl.read_delta(str(path)).select(pl.col("c0").cast(pl.Int32))["c0"].to_list()
    assert sorted(v for v in days if v is not None) == want


def _statistics_columns(path: Path) -> list[tuple[str, ...]] | None:
    value = DeltaTable(str(path)).metadata().configuration.get("delta.dataSkippingStatsColumns")
    return None if value is None else parse_columns(value)


@contextlib.contextmanager
def _warehouse_sink(
    tables: dict[str, tuple[int, Any]], *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, workdir: Path
) -> Iterator[tuple[Path, Path]]:
    """`cdc run` and `cdc sinks run warehouse` until each table and its history hold its number of rows
    (counted by delta-rs on the id column alone, which any timestamp encoding leaves readable); yields the
    served copy and the configuration file."""
    cfg = stack.config(pg_dsn, list(tables), prefix=f"w{unique}", unique=unique, workdir=workdir)
    capture = cfg.start(workdir)
    sinks = InProcessSinks(spark, workdir / "cdc.toml", workdir / "sinks.log", ["warehouse"])
    current = workdir / "warehouse" / "current"
    try:
        capture.wait_streaming(180)
        sinks.start()
        for table, (rows, _) in tables.items():
            for path in (current / table, current / f"{table}.history"):
                wait_for(lambda p=path, n=rows: _row_count(p) == n, 600, f"{rows} rows in {path.name}", sinks)
        yield current, workdir / "cdc.toml"
    finally:
        if sinks.alive():
            sinks.stop()
        capture.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (f"s_{unique}",))
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(f"p_{unique}")))


def _row_count(path: Path) -> int:
    try:
        return int(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).num_rows)
    except TableNotFoundError:  # not there yet, or its first commit not written yet
        return 0


def _retyped(arrow: pa.DataType, leaf: Callable[[pa.DataType], pa.DataType]) -> pa.DataType:
    """``arrow`` with ``leaf`` applied to every type inside its structs, maps and lists."""
    if pa.types.is_struct(arrow):
        fields = [arrow.field(i) for i in range(arrow.num_fields)]
        return pa.struct([f.with_type(_retyped(f.type, leaf)) for f in fields])
    if pa.types.is_map(arrow):
        return pa.map_(arrow.key_field, arrow.item_field.with_type(_retyped(arrow.item_type, leaf)))
    if pa.types.is_list(arrow):
        return pa.list_(arrow.value_field.with_type(_retyped(arrow.value_type, leaf)))
    if pa.types.is_large_list(arrow):
        return pa.large_list(arrow.value_field.with_type(_retyped(arrow.value_type, leaf)))
    return leaf(arrow)


def _integral(arrow: pa.DataType) -> pa.DataType:
    """Timestamps as int64 and dates as int32: the same numbers, which Python's datetime and date cannot all
    hold (pyarrow's to_pylist raises OverflowError for infinity, year 294247, 4714 BC…)."""
    if pa.types.is_timestamp(arrow):
        return pa.int64()
    return pa.int32() if pa.types.is_date32(arrow) else arrow


def _plain(arrow: pa.DataType) -> pa.DataType:
    """Views and large layouts as the plain one: DataFusion hands out string_view and binary_view, polars
    large_string and large_binary, pyarrow string and binary; an in-memory layout, the same values."""
    if pa.types.is_string_view(arrow) or pa.types.is_large_string(arrow):
        return pa.string()
    return pa.binary() if pa.types.is_binary_view(arrow) or pa.types.is_large_binary(arrow) else arrow


def _rows_by_id(frame: pa.Table) -> dict[int, dict[str, Any]]:
    schema = pa.schema([f.with_type(_retyped(f.type, _integral)) for f in frame.schema])
    return {row["id"]: row for row in frame.cast(schema).to_pylist()}


def _check_exact_types(frame: pa.Table, columns: list[SourceColumn], where: str) -> None:
    for i, column in enumerate(columns):
        if column.column_type in EXACT_TYPES:
            got = _retyped(frame.schema.field(f"c{i}").type, _plain)
            assert got == EXACT_TYPES[column.column_type], f"{where}: {column.column_type} is {got}"


def _arrow_value(column_type: str, expected: Any, text: bytes | None) -> Any:
    """ZOO's expectation for a case, as it reads from Arrow after _integral (see EXACT_TYPES)."""
    if expected is TEXT:
        assert text is not None
        return text.decode()
    if isinstance(expected, datetime):  # before date: a datetime is a date
        return us(expected)
    if isinstance(expected, date):
        return (expected - date(1970, 1, 1)).days
    if column_type in ("numeric(12,2)", "numeric(38,10)"):
        return (
            {"member0": expected, "member1": None}
            if isinstance(expected, Decimal)
            else {"member0": None, "member1": expected}
        )
    return expected


def _check_hand_written(got: dict[int, dict[str, Any]], columns: list[SourceColumn], types: Types, where: str) -> None:
    """The EXACT_TYPES columns against the hand-written expectations: row j (id j + 1) holds each type's j-th
    case."""
    mismatches = []
    for i, (column, (column_type, cases)) in enumerate(zip(columns, types, strict=True)):
        if column_type not in EXACT_TYPES:
            continue
        for j, (expression, expected) in enumerate(cases):
            want = _arrow_value(column_type, expected, column.texts[j + 1])
            value = got[j + 1][f"c{i}"]
            if not same(value, want):
                mismatches.append(f"{column_type} {expression}: got {value!r}, expected {want!r}")
    assert not mismatches, f"{where}: {len(mismatches)} mismatches:\n" + "\n".join(mismatches)


def check_every_column(
    got: dict[int, dict[str, Any]], columns: list[SourceColumn], where: str, *, spark_values: bool
) -> None:
    """Every zoo column in document form (sinks._values, what `cdc verify` compares) against PostgreSQL's value:
    ``spark_values``, the store's values as Spark reads them (unions as member structs, dates and timestamps as
    numbers), converted to document form first; else the store holds the document form itself."""
    mismatches = []
    for i, column in enumerate(columns):
        from_source = doc_converter(column.mapping.schema, Names(), spark=False)
        from_store = doc_converter(column.mapping.schema, Names(), spark=True) if spark_values else None
        for row_id, value in column.values().items():
            stored, expected = got[row_id].get(f"c{i}"), from_source(value)
            if from_store is not None:
                stored = from_store(stored)
            if not same(stored, expected):
                mismatches.append(f"row {row_id} {column.column_type}: got {stored!r}, expected {expected!r}")
    assert not mismatches, f"{where}: {len(mismatches)} mismatches:\n" + "\n".join(mismatches[:20])
