"""Arrays, composites, ranges, multiranges, hstore, geometric and text-search types, from hand-made values.

The binary encoders here follow the send functions (array_send, record_send, range_send…); the text
inputs are what the output functions print, quoting included.
"""

from __future__ import annotations

import struct
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest

from schemas import FormatError, PgType, avro_mapping, dedupe_named_types
from tests.unit.test_types import (
    INT32_MAX,
    INT64_MAX,
    PG_EPOCH_US,
    array_of,
    as_dict,
    avro_bytes,
    avro_read,
    check,
    numeric_typmod,
    pg,
)
from tests.unit.test_types_numeric import numeric_send

INT4, TEXT = pg("int4", 23), pg("text", 25)


def i4(value: int) -> bytes:
    return struct.pack(">i", value)


def array_send(
    elements: list[bytes | None], dims: list[int], lower_bounds: list[int] | None = None, oid: int = 23
) -> bytes:
    lower_bounds = lower_bounds or [1] * len(dims)
    out = struct.pack(">iiI", len(dims), int(None in elements), oid)
    for dim, lower in zip(dims, lower_bounds, strict=True):
        out += struct.pack(">ii", dim, lower)
    for element in elements:
        out += struct.pack(">i", -1) if element is None else struct.pack(">i", len(element)) + element
    return out


def record_send(fields: list[tuple[int, bytes | None]]) -> bytes:
    out = struct.pack(">i", len(fields))
    for oid, value in fields:
        out += struct.pack(">Ii", oid, -1) if value is None else struct.pack(">Ii", oid, len(value)) + value
    return out


def range_send(
    lower: bytes | None, upper: bytes | None, lower_inc: bool = True, upper_inc: bool = False, empty: bool = False
) -> bytes:
    if empty:
        return b"\x01"
    flags = (0x02 if lower_inc and lower is not None else 0) | (0x04 if upper_inc and upper is not None else 0)
    flags |= (0x08 if lower is None else 0) | (0x10 if upper is None else 0)
    out = bytes([flags])
    for bound in (lower, upper):
        if bound is not None:
            out += struct.pack(">i", len(bound)) + bound
    return out


def multirange_send(ranges: list[bytes]) -> bytes:
    return struct.pack(">i", len(ranges)) + b"".join(struct.pack(">i", len(r)) + r for r in ranges)


def hstore_send(pairs: dict[str, str | None]) -> bytes:
    out = struct.pack(">i", len(pairs))
    for key, value in pairs.items():
        out += struct.pack(">i", len(key.encode())) + key.encode()
        out += struct.pack(">i", -1) if value is None else struct.pack(">i", len(value.encode())) + value.encode()
    return out


def arr(elements: list[Any], dims: list[int] | None = None, lower_bounds: list[int] | None = None) -> dict[str, Any]:
    if dims is None:
        dims = [len(elements)] if elements else []  # an empty array has no dimensions at all
    return {"elements": elements, "dims": dims, "lower_bounds": lower_bounds or [1] * len(dims)}


# --- arrays ------------------------------------------------------------------------------------------


def test_array_schema_is_a_record_of_elements_dims_and_lower_bounds() -> None:
    schema = avro_mapping(array_of(INT4)).schema
    assert schema == {
        "type": "record",
        "name": "pg_catalog._int4",
        "fields": [
            {"name": "elements", "type": {"type": "array", "items": ["null", "int"]}},
            {"name": "dims", "type": {"type": "array", "items": "int"}},
            {"name": "lower_bounds", "type": {"type": "array", "items": "int"}},
        ],
    }


@pytest.mark.parametrize(
    ("text", "elements", "dims", "lower_bounds"),
    [
        ("{}", [], [], []),
        ("{1}", [1], [1], [1]),
        ("{1,NULL,-3}", [1, None, -3], [3], [1]),
        ("{{1,2},{3,4}}", [1, 2, 3, 4], [2, 2], [1, 1]),
        ("{{{1},{2}},{{3},{4}}}", [1, 2, 3, 4], [2, 2, 1], [1, 1, 1]),
        ("[0:1]={1,2}", [1, 2], [2], [0]),
        ("[-3:-2][2:3]={{1,2},{3,NULL}}", [1, 2, 3, None], [2, 2], [-3, 2]),
    ],
)
def test_int_arrays_any_shape(text: str, elements: list[int | None], dims: list[int], lower_bounds: list[int]) -> None:
    binary = array_send([None if e is None else i4(e) for e in elements], dims, lower_bounds)
    check(array_of(INT4), text, binary, arr(elements, dims, lower_bounds))


def test_text_array_quoting() -> None:
    values = ["", "NULL", None, "a,b", 'q"uote', "back\\slash", " sp ", "{}", "ü", "null", "a\tb", "x"]
    text = '{"","NULL",NULL,"a,b","q\\"uote","back\\\\slash"," sp ","{}",ü,"null","a\tb",x}'
    binary = array_send([None if v is None else v.encode() for v in values], [len(values)], oid=25)
    check(array_of(TEXT), text, binary, arr(values))


def test_text_array_nested_with_quotes() -> None:
    text = '{{"a}",b},{"{c","d\\\\"}}'
    check(array_of(TEXT), text, None, arr(["a}", "b", "{c", "d\\"], [2, 2]))


def test_box_array_uses_semicolons() -> None:
    box = pg("box", 603)
    text = "{(3,4),(1,2);(1,1),(0,0)}"
    boxes = [struct.pack(">4d", 3, 4, 1, 2), struct.pack(">4d", 1, 1, 0, 0)]
    expected = arr(
        [
            {"high": {"x": 3.0, "y": 4.0}, "low": {"x": 1.0, "y": 2.0}},
            {"high": {"x": 1.0, "y": 1.0}, "low": {"x": 0.0, "y": 0.0}},
        ]
    )
    check(array_of(box, ";"), text, array_send(list(boxes), [2], oid=603), expected)


def test_numeric_array_keeps_the_element_typmod() -> None:
    typmod = numeric_typmod(10, 2)
    text = "{1.50,NaN,NULL}"
    binary = array_send([numeric_send("1.50"), numeric_send("NaN"), None], [3], oid=1700)
    check(array_of(pg("numeric")), text, binary, arr([Decimal("1.50"), "NaN", None]), typmod=typmod)


def test_timestamp_and_date_arrays_with_infinity() -> None:
    tstz = pg("timestamptz", 1184)
    text = '{"2020-01-01 00:00:00+00",infinity,-infinity}'
    micros = 1_577_836_800_000_000
    binary = array_send(
        [struct.pack(">q", micros - PG_EPOCH_US), struct.pack(">q", INT64_MAX), struct.pack(">q", -(2**63))], [3]
    )
    check(array_of(tstz), text, binary, arr([micros, INT64_MAX, -(2**63)]))
    check(array_of(pg("date")), "{2020-02-29,infinity}", None, arr([date(2020, 2, 29), INT32_MAX]))


def test_array_of_composites_and_of_domains() -> None:
    pair = PgType(9, "pair", "public", "composite", fields=(("a", INT4, -1), ("b", TEXT, -1)))
    text = '{"(1,x)","(2,\\"a b\\")",NULL,"(,)"}'
    binary = array_send(
        [
            record_send([(23, i4(1)), (25, b"x")]),
            record_send([(23, i4(2)), (25, b"a b")]),
            None,
            record_send([(23, None), (25, None)]),
        ],
        [4],
        oid=9,
    )
    expected = arr([{"a": 1, "b": "x"}, {"a": 2, "b": "a b"}, None, {"a": None, "b": None}])
    check(array_of(pair), text, binary, expected)
    positive = PgType(10, "positive", "public", "domain", base=INT4)
    check(array_of(positive), "{1,2}", array_send([i4(1), i4(2)], [2]), arr([1, 2]))


@pytest.mark.parametrize("text", ["1,2", "{1,2", "{{1,2},{3}}", "{1,{2}}x", "[0:1]1,2"])
def test_malformed_arrays_are_refused(text: str) -> None:
    with pytest.raises((FormatError, ValueError)):
        avro_mapping(array_of(INT4)).from_text(text.encode())


# --- composites --------------------------------------------------------------------------------------

MOOD = PgType(20, "mood", "public", "enum", labels=("sad", "happy"))
INNER = PgType(21, "inner", "public", "composite", fields=(("n", INT4, -1), ("s", TEXT, -1)))
OUTER = PgType(
    22,
    "outer",
    "public",
    "composite",
    fields=(
        ("id", INT4, -1),
        ("first name", TEXT, -1),
        ("price", pg("numeric", 1700), numeric_typmod(5, 2)),
        ("inner", INNER, -1),
        ("tags", array_of(TEXT), -1),
        ("at", pg("timestamptz", 1184), -1),
        ("mood", MOOD, -1),
    ),
)


def test_composite_schema() -> None:
    schema = avro_mapping(OUTER).schema
    assert isinstance(schema, dict)
    assert schema["name"] == "public.outer"
    names = [f["name"] for f in schema["fields"]]
    assert names[0] == "id"
    assert names[1].startswith("first_name_")
    assert names[2:] == ["price", "inner", "tags", "at", "mood"]
    assert all(f["type"][0] == "null" and f["default"] is None for f in schema["fields"])
    assert schema["fields"][2]["type"][1]["logicalType"] == "decimal"  # flattened union: null, decimal, string
    assert schema["fields"][2]["type"][2] == "string"


def test_composite_text_and_binary() -> None:
    first = next(f["name"] for f in as_dict(avro_mapping(OUTER).schema)["fields"] if f["name"].startswith("first"))
    text = '(1,"Ada ""the"" \\\\ Countess",1.50,"(2,""x, y"")","{a,""b c""}","2020-01-01 00:00:00+00",happy)'
    binary = record_send(
        [
            (23, i4(1)),
            (25, b'Ada "the" \\ Countess'),
            (1700, numeric_send("1.50")),
            (21, record_send([(23, i4(2)), (25, b"x, y")])),
            (1009, array_send([b"a", b"b c"], [2], oid=25)),
            (1184, struct.pack(">q", 1_577_836_800_000_000 - PG_EPOCH_US)),
            (20, b"happy"),
        ]
    )
    expected = {
        "id": 1,
        first: 'Ada "the" \\ Countess',
        "price": Decimal("1.50"),
        "inner": {"n": 2, "s": "x, y"},
        "tags": arr(["a", "b c"]),
        "at": datetime(2020, 1, 1, tzinfo=UTC),
        "mood": "happy",
    }
    check(OUTER, text, binary, expected)


def test_composite_nulls_and_empty_strings() -> None:
    assert avro_mapping(INNER).from_text(b"(,)") == {"n": None, "s": None}
    assert avro_mapping(INNER).from_text(b'(,"")') == {"n": None, "s": ""}
    binary = record_send([(23, None), (25, b"")])
    check(INNER, '(,"")', binary, {"n": None, "s": ""})


def test_composite_attribute_count_mismatch_is_an_error() -> None:
    mapping = avro_mapping(INNER)
    with pytest.raises(FormatError, match=r"public\.inner"):
        mapping.from_text(b"(1,x,3)")
    assert mapping.from_binary is not None
    with pytest.raises(FormatError, match=r"public\.inner"):
        mapping.from_binary(record_send([(23, i4(1))]))


def test_composite_with_a_text_only_attribute_is_text_only() -> None:
    with_regclass = PgType(23, "t", "public", "composite", fields=(("r", pg("regclass"), -1),))
    assert avro_mapping(with_regclass).from_binary is None
    assert avro_mapping(with_regclass).from_text(b"(pg_class)") == {"r": "pg_class"}


# --- ranges and multiranges --------------------------------------------------------------------------


def _range(lower: Any, upper: Any, lower_inc: bool = True, upper_inc: bool = False) -> dict[str, Any]:
    return {"lower": lower, "upper": upper, "lower_inclusive": lower_inc, "upper_inclusive": upper_inc, "empty": False}


EMPTY = {"lower": None, "upper": None, "lower_inclusive": False, "upper_inclusive": False, "empty": True}
INT4RANGE = PgType(3904, "int4range", kind="range", element=INT4)


@pytest.mark.parametrize(
    ("text", "binary", "expected"),
    [
        ("empty", range_send(None, None, empty=True), EMPTY),
        ("[1,5)", range_send(i4(1), i4(5)), _range(1, 5)),
        ("(,5)", range_send(None, i4(5)), _range(None, 5, False)),
        ("[1,)", range_send(i4(1), None), _range(1, None)),
        ("(,)", range_send(None, None), _range(None, None, False)),
    ],
)
def test_int4range(text: str, binary: bytes, expected: dict[str, Any]) -> None:
    schema = avro_mapping(INT4RANGE).schema
    assert as_dict(schema)["name"] == "pg_catalog.int4range"
    check(INT4RANGE, text, binary, expected)


def test_range_bounds_with_quotes_and_infinity() -> None:
    tstzrange = PgType(3910, "tstzrange", kind="range", element=pg("timestamptz", 1184))
    text = '["2020-01-01 00:00:00+00",infinity]'
    binary = range_send(
        struct.pack(">q", 1_577_836_800_000_000 - PG_EPOCH_US), struct.pack(">q", INT64_MAX), True, True
    )
    check(tstzrange, text, binary, _range(datetime(2020, 1, 1, tzinfo=UTC), INT64_MAX, True, True))
    textrange = PgType(50, "textrange", "public", "range", element=TEXT)
    text = '["a,b","q""uote\\\\")'
    check(textrange, text, range_send(b"a,b", b'q"uote\\'), _range("a,b", 'q"uote\\'))
    check(textrange, '["",x)', range_send(b"", b"x"), _range("", "x"))


def test_numrange_bounds_are_exact_text() -> None:
    numrange = PgType(3906, "numrange", kind="range", element=pg("numeric", 1700))
    check(
        numrange,
        "[1.5,2.50]",
        range_send(numeric_send("1.5"), numeric_send("2.50"), True, True),
        _range("1.5", "2.50", True, True),
    )


def test_multiranges() -> None:
    multi = PgType(4451, "int4multirange", kind="multirange", element=INT4)
    schema = avro_mapping(multi).schema
    assert schema == {"type": "array", "items": avro_mapping(INT4RANGE).schema}
    check(multi, "{}", multirange_send([]), [])
    binary = multirange_send([range_send(i4(1), i4(3)), range_send(i4(5), i4(7))])
    check(multi, "{[1,3),[5,7)}", binary, [_range(1, 3), _range(5, 7)])
    check(
        multi,
        "{(,5),[10,)}",
        multirange_send([range_send(None, i4(5)), range_send(i4(10), None)]),
        [_range(None, 5, False), _range(10, None)],
    )


def test_multirange_record_names() -> None:
    # A user multirange PgType names only the subtype: its range record gets a name of its own.
    custom = PgType(60, "floatmultirange", "public", "multirange", element=pg("float8"))
    assert as_dict(avro_mapping(custom).schema)["items"]["name"] == "public.floatmultirange_range"
    given_range = PgType(
        61,
        "floatmultirange",
        "public",
        "multirange",
        element=PgType(62, "floatrange", "public", "range", element=pg("float8")),
    )
    assert as_dict(avro_mapping(given_range).schema)["items"]["name"] == "public.floatrange"


def test_a_table_with_a_range_and_its_multirange_dedupes() -> None:
    multi = PgType(4451, "int4multirange", kind="multirange", element=INT4)
    schemas = dedupe_named_types([avro_mapping(INT4RANGE).schema, avro_mapping(multi).schema])
    assert schemas[1] == {"type": "array", "items": "pg_catalog.int4range"}


# --- hstore ------------------------------------------------------------------------------------------

HSTORE = PgType(70000, "hstore", "public")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("", {}),
        ('"a"=>"1", "b"=>NULL', {"a": "1", "b": None}),
        ('"k e y"=>"v\\"al\\\\", "ü"=>""', {"k e y": 'v"al\\', "ü": ""}),
        ('"NULL"=>"NULL"', {"NULL": "NULL"}),
    ],
)
def test_hstore(text: str, value: dict[str, str | None]) -> None:
    assert avro_mapping(HSTORE).schema == {"type": "map", "values": ["null", "string"]}
    check(HSTORE, text, hstore_send(value), value)


# --- geometric ---------------------------------------------------------------------------------------


def _pt(x: float, y: float) -> dict[str, float]:
    return {"x": float(x), "y": float(y)}


@pytest.mark.parametrize(
    ("name", "text", "binary", "expected"),
    [
        ("point", "(1.5,2e+20)", struct.pack(">2d", 1.5, 2e20), _pt(1.5, 2e20)),
        ("point", "(NaN,-Infinity)", struct.pack(">2d", float("nan"), float("-inf")), _pt(float("nan"), float("-inf"))),
        ("line", "{1,2,-3}", struct.pack(">3d", 1, 2, -3), {"a": 1.0, "b": 2.0, "c": -3.0}),
        ("lseg", "[(1,2),(3,4)]", struct.pack(">4d", 1, 2, 3, 4), {"start": _pt(1, 2), "end": _pt(3, 4)}),
        ("box", "(3,4),(1,2)", struct.pack(">4d", 3, 4, 1, 2), {"high": _pt(3, 4), "low": _pt(1, 2)}),
        (
            "path",
            "((1,2),(3,4))",
            b"\x01" + struct.pack(">i4d", 2, 1, 2, 3, 4),
            {"closed": True, "points": [_pt(1, 2), _pt(3, 4)]},
        ),
        (
            "path",
            "[(0,0),(1e+300,-1e-300)]",
            b"\x00" + struct.pack(">i4d", 2, 0, 0, 1e300, -1e-300),
            {"closed": False, "points": [_pt(0, 0), _pt(1e300, -1e-300)]},
        ),
        ("polygon", "((0,0),(1,1))", struct.pack(">i4d", 2, 0, 0, 1, 1), {"points": [_pt(0, 0), _pt(1, 1)]}),
        ("circle", "<(1,2),3>", struct.pack(">3d", 1, 2, 3), {"center": _pt(1, 2), "radius": 3.0}),
    ],
)
def test_geometric(name: str, text: str, binary: bytes, expected: dict[str, Any]) -> None:
    check(pg(name), text, binary, expected)


def test_geometric_records_share_the_point_record() -> None:
    box = avro_mapping(pg("box")).schema
    assert as_dict(box)["fields"][1]["type"] == "pg_catalog.point"
    value = {"high": _pt(3, 4), "low": _pt(1, 2)}
    assert avro_read(box, avro_bytes(box, value)) == value


# --- text search -------------------------------------------------------------------------------------


def _tsvector_send(entries: list[tuple[str, list[int]]]) -> bytes:
    out = struct.pack(">i", len(entries))
    for lexeme, positions in entries:
        out += lexeme.encode() + b"\0" + struct.pack(f">H{len(positions)}H", len(positions), *positions)
    return out


def test_tsvector() -> None:
    entries = [("a", [1 | 3 << 14, 2]), ("b", []), ("c", [3 | 2 << 14, 4 | 1 << 14, 5]), ("it's \\", [16383])]
    text = "'a':1A,2 'b' 'c':3B,4C,5 'it''s \\\\':16383"
    check(pg("tsvector"), text, _tsvector_send(entries), text)
    check(pg("tsvector"), "", _tsvector_send([]), "")


def _val(operand: str, weight: int = 0, prefix: bool = False) -> bytes:
    return bytes([1, weight, int(prefix)]) + operand.encode() + b"\0"


def _op(operator: int, distance: int | None = None) -> bytes:
    return bytes([2, operator]) + (struct.pack(">h", distance) if distance is not None else b"")


AND, OR, NOT, PHRASE = 2, 3, 1, 4


@pytest.mark.parametrize(
    ("items", "text"),
    [
        ([], ""),
        ([_val("a")], "'a'"),
        ([_op(AND), _val("b"), _val("a")], "'a' & 'b'"),
        # 'it''s' & !( 'b' | 'c' ) <-> 'd':*AB <3> 'e', as PostgreSQL 15 stores and prints it
        (
            [
                _op(AND),
                _op(PHRASE, 3),
                _val("e"),
                _op(PHRASE, 1),
                _val("d", 0b1100, True),
                _op(NOT),
                _op(OR),
                _val("c"),
                _val("b"),
                _val("it's"),
            ],
            "'it''s' & !( 'b' | 'c' ) <-> 'd':*AB <3> 'e'",
        ),
        ([_op(OR), _op(AND), _val("c"), _val("b"), _val("a")], "'a' | 'b' & 'c'"),
        ([_op(AND), _op(OR), _val("c"), _val("b"), _val("a")], "'a' & ( 'b' | 'c' )"),
        ([_op(PHRASE, 1), _op(PHRASE, 1), _val("c"), _val("b"), _val("a")], "'a' <-> ( 'b' <-> 'c' )"),
        ([_op(NOT), _op(NOT), _val("a", 1)], "!!'a':D"),
    ],
)
def test_tsquery(items: list[bytes], text: str) -> None:
    binary = struct.pack(">i", len(items)) + b"".join(items)
    check(pg("tsquery"), text, binary, text)
