"""Which columns keep Delta statistics (sinks._delta_stats): Delta's default window and the list's text form."""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
)

from sinks._delta_stats import default_columns, format_columns, parse_columns


def _struct(n: int, prefix: str = "f") -> StructType:
    return StructType([StructField(f"{prefix}{i}", IntegerType()) for i in range(n)])


def test_the_default_columns_are_the_comparable_leaves_among_the_first_32() -> None:
    narrow = StructType(
        [
            StructField("id", LongType()),
            StructField("d", DateType()),
            StructField(
                "n", StructType([StructField("member0", DecimalType(12, 2)), StructField("member1", StringType())])
            ),
            StructField("b", BooleanType()),  # Delta refuses to list booleans, binaries, arrays and maps
            StructField("x", BinaryType()),
            StructField("a", ArrayType(IntegerType())),
            StructField("t", TimestampNTZType()),
        ]
    )
    assert default_columns(narrow) == [("id",), ("d",), ("n", "member0"), ("n", "member1"), ("t",)]
    wide = StructType([StructField(f"c{i}", StringType()) for i in range(40)])
    assert default_columns(wide) == [(f"c{i}",) for i in range(32)]
    # Leaves are counted inside structs: a struct straddling the 32nd leaf is cut there.
    straddling = StructType(
        [StructField("s", _struct(30)), StructField("t", _struct(5, "g")), StructField("d", DateType())]
    )
    assert default_columns(straddling) == [*[("s", f"f{i}") for i in range(30)], ("t", "g0"), ("t", "g1")]


def test_the_list_reads_back_as_written_whatever_the_names() -> None:
    paths = [("id",), ("Order",), ("n", "member0"), ("we`ird", "x")]
    text = format_columns(paths)
    assert text == "`id`,`Order`,`n`.`member0`,`we``ird`.`x`"
    assert parse_columns(text) == paths
    assert parse_columns("id, n.member0 ,x") == [("id",), ("n", "member0"), ("x",)]  # as set by hand
    assert parse_columns("") == []
