"""Which type changes keep every value (sinks._delta_widen, the SQL sink's migration), and which change the
form the capture writes values in (cdc._generations.rewritten)."""

from __future__ import annotations

import pytest
from pgcdc_dev.codecs import make_codec

from cdc._generations import known_columns, rewritten
from schemas import PgType
from sinks._delta_widen import widened, widens
from sinks._sql import plan_migration
from sinks._sqltypes import ColumnKind


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("int", "bigint"),
        ("smallint", "int"),
        ("float", "double"),
        ("timestamp_ntz", "timestamp"),
        ("decimal(10,2)", "decimal(14,2)"),
        ("decimal(10,2)", "decimal(12,4)"),
        ("struct<member0:decimal(10,2),member1:string>", "struct<`member0`: decimal(14, 2), `member1`: string>"),
    ],
)
def test_a_widening_keeps_every_value(old: str, new: str) -> None:
    assert widens(old, new)
    assert not widens(new, old)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("int", "int"),
        ("int", "string"),
        ("bigint", "double"),
        ("decimal(10,2)", "decimal(10,4)"),  # fewer digits before the point
        ("timestamp", "timestamp_ntz"),
        ("struct<member0:decimal(10,2),member1:string>", "struct<member0:decimal(14,2)>"),
        ("struct<a:int,b:int>", "struct<a:bigint,b:string>"),
    ],
)
def test_what_is_not_a_widening(old: str, new: str) -> None:
    assert not widens(old, new)


def test_the_widened_columns_of_a_table_by_name_in_any_case() -> None:
    table = [("ID", "int"), ("qty", "int"), ("name", "string")]
    assert widened(table, {"id": "bigint", "qty": "int", "name": "string", "new": "int"}) == {"ID": "bigint"}


def test_the_sql_sink_keeps_a_widened_column_and_its_values() -> None:
    old = [("id", ColumnKind("int")), ("at", ColumnKind("local_timestamp")), ("v", ColumnKind("text"))]
    new = [("id", ColumnKind("long")), ("at", ColumnKind("timestamp")), ("v", ColumnKind("int"))]
    change = plan_migration(old, new)
    assert [(c, b.kind, n.kind) for c, b, n in change.widened] == [
        ("id", "int", "long"),
        ("at", "local_timestamp", "timestamp"),
    ]
    assert (change.drops, [c for c, _ in change.adds]) == (["v"], ["v"])  # text → int keeps nothing: a new column


def test_only_changes_that_write_values_otherwise_ask_for_the_table_again() -> None:
    int4, int8, numeric = PgType(23, "int4"), PgType(20, "int8"), PgType(1700, "numeric")
    ts, tstz = PgType(1114, "timestamp"), PgType(1184, "timestamptz")

    def known(*types: tuple[PgType, int]) -> dict[str, tuple[str | None, str]]:
        columns = [(f"c{i}", t, m) for i, (t, m) in enumerate(types)]
        return known_columns(make_codec([("id", int4, -1), *columns], topic="p.public.t").columns)

    def typmod(precision: int, scale: int) -> int:
        return ((precision << 16) | scale) + 4

    before = known((int4, -1), (numeric, typmod(10, 2)), (numeric, typmod(10, 2)), (ts, -1))
    after = known((int8, -1), (numeric, typmod(14, 2)), (numeric, typmod(12, 4)), (tstz, -1))
    assert rewritten(before, after) == ["c2", "c3"]  # a decimal's scale, a timestamp's zone
