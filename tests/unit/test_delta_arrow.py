"""sinks._delta_arrow: raw Avro values to the Arrow types Spark's from_avro gives the same schema."""

from __future__ import annotations

from decimal import Context, Decimal

import pyarrow as pa
import pytest

from sinks._delta_arrow import NotInArrowError, arrow_field, beyond_python, rows_table, spark_type
from sinks._values import Names


def _one(avro: object, value: object) -> pa.Array:
    arrow, convert = arrow_field(avro, Names())
    return rows_table({"c": (arrow, [convert(value)])}).column("c")


@pytest.mark.parametrize(
    ("avro", "raw", "arrow", "value"),
    [
        ({"type": "int", "logicalType": "date"}, 19_000, pa.date32(), 19_000),
        ({"type": "long", "logicalType": "timestamp-micros"}, 5, pa.timestamp("us", tz="UTC"), 5),
        ({"type": "long", "logicalType": "local-timestamp-micros"}, 5, pa.timestamp("us"), 5),
        ({"type": "long", "logicalType": "time-micros"}, 7, pa.int64(), 7),  # times of day stay µs
        ({"type": "string", "logicalType": "uuid"}, "u", pa.string(), "u"),
        ({"type": "enum", "name": "E", "symbols": ["a"]}, "a", pa.string(), "a"),
        ("float", 1.5, pa.float32(), 1.5),
        (
            {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
            (-12345).to_bytes(3, "big", signed=True),
            pa.decimal128(12, 2),
            Decimal("-123.45"),
        ),
        (["null", "long"], None, pa.int64(), None),
        (
            ["null", "long", "string"],
            "NaN",
            pa.struct([("member0", pa.int64()), ("member1", pa.string())]),
            {"member0": None, "member1": "NaN"},
        ),
        ({"type": "array", "items": "int"}, [1, 2], pa.list_(pa.field("element", pa.int32())), [1, 2]),
        ({"type": "map", "values": "long"}, {"k": 1}, pa.map_(pa.string(), pa.int64()), [("k", 1)]),
        (
            {"type": "record", "name": "R", "fields": [{"name": "a", "type": ["null", "boolean"]}]},
            {"a": True},
            pa.struct([("a", pa.bool_())]),
            {"a": True},
        ),
    ],
)  # fmt: skip
def test_each_avro_type_becomes_the_arrow_type_spark_gives_it(
    avro: object, raw: object, arrow: pa.DataType, value: object
) -> None:
    column = _one(avro, raw)
    assert column.type == arrow
    got = column.to_pylist()[0]
    if isinstance(value, int) and (pa.types.is_date32(arrow) or pa.types.is_timestamp(arrow)):
        got = column.cast(pa.int64() if pa.types.is_timestamp(arrow) else pa.int32()).to_pylist()[0]
    assert got == value


def test_a_boolean_is_not_taken_for_an_integer_branch() -> None:
    assert _one(["null", "long", "boolean"], True).to_pylist() == [{"member0": None, "member1": True}]


def test_a_decimal_wider_than_spark_holds_is_left_to_spark() -> None:
    with pytest.raises(NotInArrowError, match="precision 40"):
        arrow_field({"type": "bytes", "logicalType": "decimal", "precision": 40, "scale": 0}, Names())


@pytest.mark.parametrize(
    ("arrow", "values", "beyond"),
    [
        (pa.date32(), [0, 2_932_896], False),  # 9999-12-31
        (pa.date32(), [2**31 - 1], True),  # PostgreSQL's infinity
        (pa.date32(), [-719_163], True),  # 1 BC
        (pa.timestamp("us", tz="UTC"), [-(2**63)], True),
        (pa.timestamp("us"), [0, None], False),
        (pa.int64(), [2**63 - 1], False),
    ],
)
def test_dates_and_timestamps_beyond_years_1_to_9999_are_found(
    arrow: pa.DataType, values: list[int], beyond: bool
) -> None:
    assert beyond_python(pa.array(values, arrow)) is beyond


@pytest.mark.parametrize("unscaled", [10**38 - 1, -(10**38 - 1), 10**29 + 7, 0])
def test_a_decimal_keeps_every_digit_of_its_precision(unscaled: int) -> None:
    """Python's Decimal context rounds to 28 digits; a numeric(38, 10) value must not lose its last ten."""
    avro = {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 10}
    column = _one(avro, unscaled.to_bytes(17, "big", signed=True))
    assert column.type == pa.decimal128(38, 10)
    assert column.to_pylist() == [Decimal(unscaled).scaleb(-10, Context(prec=38))]
    assert column.to_pylist()[0].as_tuple().digits == Decimal(unscaled).as_tuple().digits


@pytest.mark.parametrize(
    ("arrow", "ddl"),
    [
        (pa.int32(), "int"),
        (pa.timestamp("us", tz="UTC"), "timestamp"),
        (pa.timestamp("us"), "timestamp_ntz"),
        (pa.decimal128(38, 10), "decimal(38, 10)"),
        (pa.map_(pa.string(), pa.date32()), "map<string, date>"),
        (pa.list_(pa.field("element", pa.binary())), "array<binary>"),
        (pa.struct([("a b", pa.float32()), ("c`", pa.null())]), "struct<`a b`: float, `c```: void>"),
    ],
)
def test_each_arrow_type_has_its_spark_type(arrow: pa.DataType, ddl: str) -> None:
    assert spark_type(arrow) == ddl


def test_an_arrow_type_spark_has_no_type_for_is_refused() -> None:
    with pytest.raises(NotInArrowError, match="uint8"):
        spark_type(pa.uint8())
