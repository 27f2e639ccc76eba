"""PostgreSQL types to Avro: schemas, converters from hand-made wire values, and fastavro's view of them.

The helpers at the top (``avro_check``, ``same``, ``to_avro``) are shared with the other type tests and
the integration type zoo: every converted value must be written by fastavro under the mapped schema, read
back as the intended logical value, and — where a high-level Python object exists — encode to exactly the
bytes fastavro produces from that object.
"""

from __future__ import annotations

import io
import math
import struct
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from fastavro.logical_writers import LOGICAL_WRITERS

from schemas import (
    TEXT_OUTPUT_SETTINGS,
    AvroMapping,
    FormatError,
    PgType,
    UnsupportedTypeError,
    ValueOutOfRangeError,
    avro_mapping,
    dedupe_named_types,
    nullable,
)

INT64_MAX, INT64_MIN, INT32_MAX, INT32_MIN = 2**63 - 1, -(2**63), 2**31 - 1, -(2**31)
PG_EPOCH_US = 946_684_800_000_000
PG_EPOCH_DAYS = 10_957


def as_dict(schema: Any) -> dict[str, Any]:
    """A schema that must be a complex type (record, array, map), for indexing it in tests."""
    assert isinstance(schema, dict), schema
    return schema


def pg(name: str, oid: int = 0, **kw: Any) -> PgType:
    """A pg_catalog type (or any, with namespace=…)."""
    return PgType(oid, name, **kw)


def array_of(element: PgType, delimiter: str = ",") -> PgType:
    return PgType(0, "_" + element.name, element.namespace, "array", element=element, delimiter=delimiter)


def numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


# --- comparing and writing values --------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equality that is strict about types (True is not 1), treats NaN as equal and tells -0.0 from 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def strip_logical(schema: Any) -> Any:
    """The schema with logical types removed: what fastavro then reads is the raw Avro value."""
    if isinstance(schema, list):
        return [strip_logical(s) for s in schema]
    if isinstance(schema, dict):
        return {k: strip_logical(v) for k, v in schema.items() if k not in ("logicalType", "precision", "scale")}
    return schema


def to_avro(value: Any, schema: Any, names: dict[str, Any] | None = None) -> Any:
    """An expected value with high-level leaves (Decimal, datetime, UUID…) converted by fastavro's own
    logical writers to the Avro-ready primitive it would write.
    """
    names = {} if names is None else names
    if isinstance(schema, str):
        return to_avro(value, names[schema], names) if schema in names else value
    if isinstance(schema, list):
        if value is None:
            return None
        branches = [b for b in schema if b != "null"]
        if isinstance(value, Decimal) or len(branches) == 1:
            return to_avro(value, branches[0], names)
        return value  # numeric(p,s)'s "NaN" string branch
    kind = schema["type"]
    if kind == "record":
        names[schema["name"]] = schema
        return {f["name"]: to_avro(value[f["name"]], f["type"], names) for f in schema["fields"]}
    if kind == "array":
        return [to_avro(v, schema["items"], names) for v in value]
    if kind == "map":
        return {k: to_avro(v, schema["values"], names) for k, v in value.items()}
    logical = schema.get("logicalType")
    if logical and not isinstance(value, (int, bytes, str)) and value is not None:
        return LOGICAL_WRITERS[f"{kind}-{logical}"](value, schema)
    return value


def _row_schema(schema: Any) -> dict[str, Any]:
    return {
        "type": "record",
        "name": "pgcdc_test.Row",
        "fields": [{"name": "v", "type": nullable(schema)}],
    }


def avro_bytes(schema: Any, value: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(_row_schema(schema)), {"v": value})
    return out.getvalue()


def avro_read(schema: Any, data: bytes, raw: bool = False) -> Any:
    writer = _row_schema(strip_logical(schema) if raw else schema)
    row: Any = fastavro.schemaless_reader(io.BytesIO(data), fastavro.parse_schema(writer))
    return row["v"]


def avro_check(mapping: AvroMapping, value: Any, expected: Any = None) -> None:
    """fastavro writes ``value`` under the mapping's schema and reads it back unchanged; when ``expected``
    has high-level leaves, it encodes to the same bytes, and — when every logical value in it is one
    Python can hold — fastavro reads exactly it back.
    """
    data = avro_bytes(mapping.schema, value)
    assert same(avro_read(mapping.schema, data, raw=True), value)
    if expected is not None:
        assert avro_bytes(mapping.schema, expected) == data
        if _fully_logical(expected, mapping.schema, {}):
            assert same(avro_read(mapping.schema, data), expected)


def _fully_logical(value: Any, schema: Any, names: dict[str, Any]) -> bool:
    """Whether every value under a logical type is a high-level object (no raw int/bytes such as ±infinity
    sentinels or dates beyond Python's years 1..9999), so that fastavro's logical read can be compared.
    """
    if value is None:
        return True
    if isinstance(schema, str):
        return _fully_logical(value, names[schema], names) if schema in names else True
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        if isinstance(value, str) and "string" in branches:
            return True
        return _fully_logical(value, branches[0], names)
    kind = schema["type"]
    if kind == "record":
        names[schema["name"]] = schema
        return all(_fully_logical(value[f["name"]], f["type"], names) for f in schema["fields"])
    if kind == "array":
        return all(_fully_logical(v, schema["items"], names) for v in value)
    if kind == "map":
        return all(_fully_logical(v, schema["values"], names) for v in value.values())
    if "logicalType" in schema and schema["logicalType"] != "uuid":
        return not isinstance(value, (int, bytes))
    return True


def convert(mapping: AvroMapping, text: bytes | str, binary: bytes | None) -> Any:
    """Both converters on one value's two formats: they must agree. Returns the value."""
    value = mapping.from_text(text.encode() if isinstance(text, str) else text)
    if binary is not None:
        assert mapping.from_binary is not None
        from_binary = mapping.from_binary(binary)
        assert same(from_binary, value), (from_binary, value)
    return value


def check(pgtype: PgType, text: str, binary: bytes | None, expected: Any, typmod: int = -1) -> Any:
    """The full contract for one value: both formats agree, equal ``expected`` (high-level leaves allowed),
    and fastavro writes and reads it.
    """
    mapping = avro_mapping(pgtype, typmod)
    value = convert(mapping, text, binary)
    want = to_avro(expected, mapping.schema)
    assert same(value, want), (value, want)
    high_level = expected if _has_high_level(expected) else None
    avro_check(mapping, value, high_level)
    return value


def _has_high_level(value: Any) -> bool:
    if isinstance(value, (Decimal, datetime, date, time, uuid.UUID)):
        return True
    if isinstance(value, dict):
        return any(_has_high_level(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_high_level(v) for v in value)
    return False


# --- the API -----------------------------------------------------------------------------------------


def test_public_names() -> None:
    import schemas

    for name in (
        "AvroMapping",
        "avro_mapping",
        "UnsupportedTypeError",
        "ValueOutOfRangeError",
        "dedupe_named_types",
        "nullable",
        "TEXT_OUTPUT_SETTINGS",
    ):
        assert name in schemas.__all__
    assert issubclass(UnsupportedTypeError, ValueError)
    assert issubclass(ValueOutOfRangeError, ValueError)
    assert issubclass(FormatError, ValueError)


def test_mapping_is_frozen() -> None:
    mapping = avro_mapping(pg("int4"), -1)
    with pytest.raises(AttributeError):
        mapping.schema = "long"  # type: ignore[misc]


def test_text_output_settings_name_what_the_parsers_need() -> None:
    assert TEXT_OUTPUT_SETTINGS["DateStyle"].startswith("ISO")
    assert TEXT_OUTPUT_SETTINGS["IntervalStyle"] == "postgres"
    assert int(TEXT_OUTPUT_SETTINGS["extra_float_digits"]) >= 1


def test_nullable_flattens_unions() -> None:
    assert nullable("int") == ["null", "int"]
    assert nullable(["bytes", "string"]) == ["null", "bytes", "string"]
    assert nullable(["null", "string"]) == ["null", "string"]


# --- booleans, integers, OIDs ------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "binary", "expected"), [("t", b"\x01", True), ("f", b"\x00", False)])
def test_bool(text: str, binary: bytes, expected: bool) -> None:
    assert avro_mapping(pg("bool")).schema == "boolean"
    check(pg("bool"), text, binary, expected)


@pytest.mark.parametrize(
    ("name", "fmt", "schema", "values"),
    [
        ("int2", ">h", "int", [0, 1, -1, 32767, -32768]),
        ("int4", ">i", "int", [0, 42, INT32_MAX, INT32_MIN]),
        ("int8", ">q", "long", [0, INT64_MAX, INT64_MIN]),
        ("oid", ">I", "long", [0, 2**32 - 1]),
        ("xid", ">I", "long", [3, 2**32 - 1]),
        ("cid", ">I", "long", [0, 2**32 - 1]),
    ],
)
def test_integers(name: str, fmt: str, schema: str, values: list[int]) -> None:
    assert avro_mapping(pg(name)).schema == schema
    for value in values:
        check(pg(name), str(value), struct.pack(fmt, value), value)


@pytest.mark.parametrize(
    ("text", "expected"), [("0", 0), (str(2**63 - 1), INT64_MAX), (str(2**64 - 1), -1), (str(2**63), INT64_MIN)]
)
def test_xid8_keeps_all_64_bits_in_a_long(text: str, expected: int) -> None:
    check(pg("xid8"), text, struct.pack(">Q", int(text)), expected)


@pytest.mark.parametrize(
    ("text", "value"), [("0/0", 0), ("16/B374D848", 0x16_B374D848), ("FFFFFFFF/FFFFFFFF", 2**64 - 1)]
)
def test_pg_lsn(text: str, value: int) -> None:
    expected = value - 2**64 if value >= 2**63 else value
    check(pg("pg_lsn"), text, struct.pack(">Q", value), expected)


# --- floats ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["0", "-0", "NaN", "Infinity", "-Infinity", "3.4028235e+38", "1e-45", "0.1", "1.1754944e-38", "16777217"]
)
def test_float4_text_is_rounded_to_the_float4_binary_reads(text: str) -> None:
    binary = struct.pack(">f", float(text))
    expected = struct.unpack(">f", binary)[0]
    value = check(pg("float4"), text, binary, expected)
    assert avro_mapping(pg("float4")).schema == "float"
    assert struct.pack(">f", value) == binary


@pytest.mark.parametrize(
    "text", ["0", "-0", "NaN", "Infinity", "-Infinity", "1.7976931348623157e+308", "5e-324", "0.1", "1e+15"]
)
def test_float8(text: str) -> None:
    check(pg("float8"), text, struct.pack(">d", float(text)), float(text))


# --- money -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cents"),
    [
        ("$0.00", 0),
        ("$1,234.56", 123456),
        ("-$0.05", -5),
        ("($12.00)", -1200),  # locales that put negatives in parentheses
        ("1.234,56 €", 123456),  # and use other separators
        ("-$92,233,720,368,547,758.08", INT64_MIN),
        ("$92,233,720,368,547,758.07", INT64_MAX),
        ("¥1,234", 1234),  # a locale with no fraction digits stores whole yen
    ],
)
def test_money_is_its_stored_integer_whatever_the_locale(text: str, cents: int) -> None:
    assert avro_mapping(pg("money")).schema == "long"
    check(pg("money"), text, struct.pack(">q", cents), cents)


# --- strings -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["text", "varchar", "bpchar", "name", "json", "xml", "refcursor"])
@pytest.mark.parametrize("text", ["", "héllo 😀", 'q"uote\\back', "NULL", "a\nb", "ab   "])
def test_text_types(name: str, text: str) -> None:
    assert avro_mapping(pg(name)).schema == "string"
    check(pg(name), text, text.encode(), text)


def test_enum_is_a_string() -> None:
    mood = PgType(1, "mood", "public", "enum", labels=("sad", "happy"))
    assert avro_mapping(mood).schema == "string"
    check(mood, "happy", b"happy", "happy")


@pytest.mark.parametrize(("binary", "text"), [(b"a", "a"), (b"\x00", ""), (b"\\", "\\"), (b"\xc3", "\\303")])
def test_char_prints_as_charout_does(binary: bytes, text: str) -> None:
    check(pg("char"), text, binary, text)


def test_jsonb_and_jsonpath_binary_carry_a_version_byte() -> None:
    for name in ("jsonb", "jsonpath"):
        check(pg(name), '{"a": 1}', b'\x01{"a": 1}', '{"a": 1}')
        mapping = avro_mapping(pg(name))
        assert mapping.from_binary is not None
        with pytest.raises(FormatError):
            mapping.from_binary(b'\x02{"a": 1}')


def test_uuid() -> None:
    value = uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")
    assert avro_mapping(pg("uuid")).schema == {"type": "string", "logicalType": "uuid"}
    check(pg("uuid"), str(value), value.bytes, value)


@pytest.mark.parametrize(
    ("text", "value"),
    [("\\x", b""), ("\\x00ff10", b"\x00\xff\x10"), ("abc\\\\\\000\\377", b"abc\\\x00\xff")],
)
def test_bytea_hex_and_escape_formats(text: str, value: bytes) -> None:
    assert avro_mapping(pg("bytea")).schema == "bytes"
    check(pg("bytea"), text, value, value)


# --- bit strings -------------------------------------------------------------------------------------


def _bits_send(bits: str) -> bytes:
    padded = bits.ljust(-(-len(bits) // 8) * 8, "0")
    body = int(padded, 2).to_bytes(len(padded) // 8, "big") if bits else b""
    return struct.pack(">i", len(bits)) + body


@pytest.mark.parametrize("bits", ["", "1", "0", "10110", "00000000", "101010101", "1" * 70])
def test_bit_strings_are_their_text(bits: str) -> None:
    check(pg("varbit"), bits, _bits_send(bits), bits)
    if bits:
        check(pg("bit"), bits, _bits_send(bits), bits, typmod=len(bits) if len(bits) > 1 else 2)


def test_bit1_is_a_boolean() -> None:
    assert avro_mapping(pg("bit"), 1).schema == "boolean"
    check(pg("bit"), "1", _bits_send("1"), True, typmod=1)
    check(pg("bit"), "0", _bits_send("0"), False, typmod=1)


# --- network types -----------------------------------------------------------------------------------


def _inet_send(family: int, bits: int, is_cidr: bool, addr: bytes) -> bytes:
    return bytes([family, bits, int(is_cidr), len(addr)]) + addr


@pytest.mark.parametrize(
    ("name", "text", "binary"),
    [
        ("inet", "192.168.0.1", _inet_send(2, 32, False, bytes([192, 168, 0, 1]))),
        ("inet", "192.168.0.1/24", _inet_send(2, 24, False, bytes([192, 168, 0, 1]))),
        ("cidr", "10.0.0.0/8", _inet_send(2, 8, True, bytes([10, 0, 0, 0]))),
        ("cidr", "10.0.0.1/32", _inet_send(2, 32, True, bytes([10, 0, 0, 1]))),
        ("inet", "::1", _inet_send(3, 128, False, bytes(15) + b"\x01")),
        ("inet", "::", _inet_send(3, 128, False, bytes(16))),
        ("inet", "::ffff:1.2.3.4", _inet_send(3, 128, False, bytes(10) + b"\xff\xff\x01\x02\x03\x04")),
        ("inet", "::1.2.3.4", _inet_send(3, 128, False, bytes(12) + b"\x01\x02\x03\x04")),
        ("inet", "1:0:2:3:4:5:6:7", _inet_send(3, 128, False, bytes.fromhex("00010000000200030004000500060007"))),
        ("inet", "1::", _inet_send(3, 128, False, b"\x00\x01" + bytes(14))),
        ("inet", "fe80::1:0:0:1/64", _inet_send(3, 64, False, bytes.fromhex("fe800000000000000001000000000001"))),
        ("cidr", "2001:db8::/32", _inet_send(3, 32, True, bytes.fromhex("20010db8") + bytes(12))),
    ],
)
def test_inet_binary_prints_as_postgresql_does(name: str, text: str, binary: bytes) -> None:
    check(pg(name), text, binary, text)


def test_macaddr() -> None:
    check(pg("macaddr"), "08:00:2b:01:02:03", bytes.fromhex("08002b010203"), "08:00:2b:01:02:03")
    check(pg("macaddr8"), "08:00:2b:01:02:03:04:05", bytes.fromhex("08002b0102030405"), "08:00:2b:01:02:03:04:05")


# --- system types ------------------------------------------------------------------------------------


def test_tid_snapshot_vectors() -> None:
    check(pg("tid"), "(4294967295,65535)", struct.pack(">IH", 2**32 - 1, 65535), "(4294967295,65535)")
    snapshot = struct.pack(">iqqqqq", 3, 10, 20, 10, 14, 15)
    check(pg("pg_snapshot"), "10:20:10,14,15", snapshot, "10:20:10,14,15")
    check(pg("txid_snapshot"), "10:20:", struct.pack(">iqq", 0, 10, 20), "10:20:")
    int2vector = struct.pack(">iiIii", 1, 0, 21, 2, 0) + struct.pack(">ih", 2, 1) + struct.pack(">ih", 2, -3)
    check(pg("int2vector"), "1 -3", int2vector, "1 -3")
    oidvector = struct.pack(">iiIii", 1, 0, 26, 1, 0) + struct.pack(">iI", 4, 2**32 - 1)
    check(pg("oidvector"), "4294967295", oidvector, "4294967295")


@pytest.mark.parametrize("name", ["regclass", "regtype", "regproc", "regrole", "aclitem"])
def test_name_printing_oid_types_are_text_only(name: str) -> None:
    mapping = avro_mapping(pg(name))
    assert mapping.schema == "string"
    assert mapping.from_binary is None
    assert mapping.from_text(b"pg_catalog.pg_class") == "pg_catalog.pg_class"


def test_unknown_types_fall_back_to_their_text() -> None:
    for pgtype in (PgType(99999, "cube", "public"), PgType(2276, "any", kind="pseudo")):
        mapping = avro_mapping(pgtype)
        assert mapping.schema == "string"
        assert mapping.from_binary is None
        assert mapping.from_text(b"(1, 2)") == "(1, 2)"


def test_extension_types_by_name_in_any_schema() -> None:
    assert avro_mapping(PgType(1, "citext", "ext")).from_text(b"MiXeD") == "MiXeD"
    ltree = avro_mapping(PgType(2, "ltree", "ext"))
    assert ltree.from_binary is not None
    assert ltree.from_binary(b"\x01a.b.c") == ltree.from_text(b"a.b.c") == "a.b.c"


def test_catalog_types_with_an_element_type_are_not_taken_for_arrays() -> None:
    # The array category and a typelem do not make int2vector an array: it prints "1 2 3".
    as_array = PgType(22, "int2vector", kind="array", element=pg("int2"))
    assert avro_mapping(as_array).from_text(b"1 2 3") == "1 2 3"
    point = PgType(600, "point", kind="array", element=pg("float8"))
    assert avro_mapping(point).from_text(b"(1,2)") == {"x": 1.0, "y": 2.0}


def test_missing_pgtype_parts_name_the_type_and_the_fix() -> None:
    with pytest.raises(UnsupportedTypeError, match=r"public\._broken.*PgType\.element"):
        avro_mapping(PgType(1, "_broken", "public", "array"))
    with pytest.raises(UnsupportedTypeError, match=r"public\.d.*PgType\.base"):
        avro_mapping(PgType(1, "d", "public", "domain"))


# --- Avro names --------------------------------------------------------------------------------------


def test_record_names_come_from_qualified_type_names_sanitised() -> None:
    def name_of(namespace: str, name: str) -> str:
        comp = PgType(1, name, namespace, "composite", fields=(("a", pg("int4"), -1),))
        schema = avro_mapping(comp).schema
        assert isinstance(schema, dict)
        return str(schema["name"])

    assert name_of("public", "Address") == "public.Address"
    odd = name_of("my schema", "2nd-type")
    assert odd.startswith("my_schema_")
    assert ".2nd" not in odd
    assert odd.split(".")[1].startswith("_2nd_type_")
    # Names that sanitise alike stay apart; the same name always gets the same Avro name.
    assert name_of("public", "a b") != name_of("public", "a_b") == "public.a_b"
    assert name_of("public", "a b") == name_of("public", "a b")
    assert name_of("public", "int") != "public.int"  # a primitive's name cannot name a record


def test_dedupe_defines_each_named_type_once_and_refers_to_it_after() -> None:
    interval = avro_mapping(pg("interval")).schema
    timetz = avro_mapping(pg("timetz")).schema
    first, second, third = dedupe_named_types([interval, timetz, interval])
    assert first == interval
    assert second == timetz
    assert third == "pg_catalog.interval"
    row = {
        "type": "record",
        "name": "t.Row",
        "fields": [{"name": f"c{i}", "type": s} for i, s in enumerate((first, second, third))],
    }
    fastavro.parse_schema(row)


def test_dedupe_rejects_two_different_types_under_one_name() -> None:
    a = {"type": "record", "name": "x.T", "fields": [{"name": "a", "type": "int"}]}
    b = {"type": "record", "name": "x.T", "fields": [{"name": "a", "type": "long"}]}
    with pytest.raises(ValueError, match=r"x\.T"):
        dedupe_named_types([a, b])


def test_dedupe_compares_definitions_whether_nested_types_are_inline_or_referenced() -> None:
    point = avro_mapping(pg("point")).schema
    box = avro_mapping(pg("box")).schema  # defines point inline, then refers to it
    out = dedupe_named_types([point, box, box])
    assert as_dict(out[1])["fields"][0]["type"] == "pg_catalog.point"
    assert out[2] == "pg_catalog.box"


def test_a_composite_used_twice_in_one_column_is_defined_once() -> None:
    inner = PgType(10, "inner", "public", "composite", fields=(("n", pg("int4"), -1),))
    outer = PgType(11, "outer", "public", "composite", fields=(("a", inner, -1), ("b", inner, -1)))
    mapping = avro_mapping(outer)
    assert isinstance(mapping.schema, dict)
    fields = mapping.schema["fields"]
    assert fields[0]["type"][1]["name"] == "public.inner"
    assert fields[1]["type"] == ["null", "public.inner"]
    value = check(outer, '("(1)","(2)")', None, {"a": {"n": 1}, "b": {"n": 2}})
    assert value == {"a": {"n": 1}, "b": {"n": 2}}


def test_arrays_whose_typmod_changes_the_element_schema_get_distinct_names() -> None:
    numeric_array = array_of(pg("numeric"))
    a = avro_mapping(numeric_array, numeric_typmod(10, 2)).schema
    b = avro_mapping(numeric_array, numeric_typmod(12, 4)).schema
    c = avro_mapping(numeric_array, -1).schema
    varchar = avro_mapping(array_of(pg("varchar")), 14).schema
    names = {as_dict(s)["name"] for s in (a, b, c)}
    assert names == {"pg_catalog._numeric_10_2", "pg_catalog._numeric_12_4", "pg_catalog._numeric"}
    assert as_dict(varchar)["name"] == "pg_catalog._varchar"
    dedupe_named_types([a, b, c, a])  # no clash


# --- dates and times ---------------------------------------------------------------------------------


def _date_send(d: date) -> bytes:
    return struct.pack(">i", (d - date(2000, 1, 1)).days)


@pytest.mark.parametrize("d", [date(2020, 2, 29), date(1970, 1, 1), date(1, 1, 1), date(9999, 12, 31)])
def test_date(d: date) -> None:
    assert avro_mapping(pg("date")).schema == {"type": "int", "logicalType": "date"}
    check(pg("date"), d.isoformat(), _date_send(d), d)


@pytest.mark.parametrize(
    ("text", "pg_days", "expected"),
    [
        ("infinity", INT32_MAX, INT32_MAX),
        ("-infinity", INT32_MIN, INT32_MIN),
        ("4714-11-24 BC", -2451545, -2440588),  # Julian day 0, PostgreSQL's first date
        ("0001-12-31 BC", -730120, -719163),  # year 0: the day before 0001-01-01
        ("5874897-12-31", 2145031948, 2145042905),  # PostgreSQL's last date
        ("10000-01-01", 2921940, 2932897),
    ],
)
def test_dates_beyond_python(text: str, pg_days: int, expected: int) -> None:
    check(pg("date"), text, struct.pack(">i", pg_days), expected)


def _us(dt: datetime) -> int:
    epoch = datetime(1970, 1, 1, tzinfo=UTC) if dt.tzinfo else datetime(1970, 1, 1)
    return (dt - epoch) // timedelta(microseconds=1)


@pytest.mark.parametrize(
    ("text", "dt"),
    [
        ("2020-01-02 03:04:05.123456+00", datetime(2020, 1, 2, 3, 4, 5, 123456, UTC)),
        ("2020-01-02 03:04:05.12+05:30", datetime(2020, 1, 1, 21, 34, 5, 120000, UTC)),
        ("1900-01-01 00:00:00+00:19:32", datetime(1899, 12, 31, 23, 40, 28, tzinfo=UTC)),
        ("1969-12-31 23:59:59.999999-03:30", datetime(1970, 1, 1, 3, 29, 59, 999999, UTC)),
        ("0001-01-01 00:00:00+00", datetime(1, 1, 1, tzinfo=UTC)),
        ("9999-12-31 23:59:59.999999+00", datetime(9999, 12, 31, 23, 59, 59, 999999, UTC)),
    ],
)
def test_timestamptz(text: str, dt: datetime) -> None:
    assert avro_mapping(pg("timestamptz")).schema == {"type": "long", "logicalType": "timestamp-micros"}
    check(pg("timestamptz"), text, struct.pack(">q", _us(dt) - PG_EPOCH_US), dt)


@pytest.mark.parametrize(
    "dt",
    [datetime(2020, 1, 2, 3, 4, 5, 123456), datetime(1, 1, 1), datetime(1969, 12, 31, 23, 59, 59, 1)],
)
def test_timestamp_is_local_timestamp_micros(dt: datetime) -> None:
    assert avro_mapping(pg("timestamp")).schema == {"type": "long", "logicalType": "local-timestamp-micros"}
    text = dt.isoformat(sep=" ").rstrip("0") if dt.microsecond else dt.isoformat(sep=" ")
    check(pg("timestamp"), text, struct.pack(">q", _us(dt) - PG_EPOCH_US), dt)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("infinity", INT64_MAX),
        ("-infinity", INT64_MIN),
        ("4714-11-24 00:00:00+00 BC", -210866803200000000),  # PostgreSQL's first timestamp
        ("0001-12-31 23:59:59.5+00 BC", _us(datetime(1, 1, 1, tzinfo=UTC)) - 500000),  # year 0
        ("10000-01-01 00:00:00+00", 253402300800000000),
        ("294247-01-10 04:00:54.775806+00", INT64_MAX - 1),  # the last microsecond an int64 holds
    ],
)
def test_timestamps_beyond_python(text: str, expected: int) -> None:
    pg_us = expected if expected in (INT64_MAX, INT64_MIN) else expected - PG_EPOCH_US
    check(pg("timestamptz"), text, struct.pack(">q", pg_us), expected)
    check(pg("timestamp"), text.replace("+00", ""), struct.pack(">q", pg_us), expected)


@pytest.mark.parametrize(
    ("text", "pg_us"),
    [
        # +infinity's own int64 once shifted to 1970, and PostgreSQL's very last microsecond (294276 AD).
        ("294247-01-10 04:00:54.775807+00", INT64_MAX - PG_EPOCH_US),
        ("294276-12-31 23:59:59.999999+00", 9223371331199999999),
    ],
)
def test_timestamps_past_int64_micros_since_1970_are_refused(text: str, pg_us: int) -> None:
    for name in ("timestamptz", "timestamp"):
        mapping = avro_mapping(pg(name))
        assert mapping.from_binary is not None
        with pytest.raises(ValueOutOfRangeError, match="timestamp"):
            mapping.from_text(text.replace("+00", "" if name == "timestamp" else "+00").encode())
        with pytest.raises(ValueOutOfRangeError, match="timestamp"):
            mapping.from_binary(struct.pack(">q", pg_us))


@pytest.mark.parametrize(
    ("text", "micros"),
    [("00:00:00", 0), ("23:59:59.999999", 86_399_999_999), ("24:00:00", 86_400_000_000), ("12:34:56.7", None)],
)
def test_time(text: str, micros: int | None) -> None:
    assert avro_mapping(pg("time")).schema == {"type": "long", "logicalType": "time-micros"}
    expected: Any = micros
    if micros is None:
        expected = time.fromisoformat(text)
        micros = (12 * 3600 + 34 * 60 + 56) * 1_000_000 + 700_000
    check(pg("time"), text, struct.pack(">q", micros), expected)


@pytest.mark.parametrize(
    ("text", "micros", "offset"),
    [
        ("12:34:56.789+05:30", 45_296_789_000, 19800),
        ("00:00:00+15:59", 0, 15 * 3600 + 59 * 60),
        ("24:00:00-15:59", 86_400_000_000, -(15 * 3600 + 59 * 60)),
        ("12:00:00+00:53:28", 43_200_000_000, 53 * 60 + 28),
        ("12:00:00-00", 43_200_000_000, 0),
    ],
)
def test_timetz_keeps_the_offset(text: str, micros: int, offset: int) -> None:
    binary = struct.pack(">qi", micros, -offset)  # PostgreSQL counts the zone west of UTC
    check(pg("timetz"), text, binary, {"time": micros, "offset_seconds": offset})


@pytest.mark.parametrize(
    ("text", "months", "days", "micros"),
    [
        ("00:00:00", 0, 0, 0),
        ("1 year 2 mons 3 days 04:05:06.789", 14, 3, 14_706_789_000),
        ("-1 years -2 mons +3 days -04:05:06.789", -14, 3, -14_706_789_000),
        ("1 mon", 1, 0, 0),
        ("-1 days +01:00:00", 0, -1, 3_600_000_000),
        ("1 day -00:00:00.000001", 0, 1, -1),
        ("178000000 years", 2_136_000_000, 0, 0),
        ("2562047788:00:54.775807", 0, 0, INT64_MAX),
        ("-2562047788:00:54.775808", 0, 0, INT64_MIN),
        ("-2147483648 days", 0, INT32_MIN, 0),
    ],
)
def test_interval_keeps_months_days_and_micros_apart(text: str, months: int, days: int, micros: int) -> None:
    binary = struct.pack(">qii", micros, days, months)
    check(pg("interval"), text, binary, {"months": months, "days": days, "micros": micros})


@pytest.mark.parametrize("text", ["@ 1 year", "P1Y2M", "1-2", "1 fortnight"])
def test_interval_in_another_style_is_refused(text: str) -> None:
    with pytest.raises(FormatError, match="IntervalStyle"):
        avro_mapping(pg("interval")).from_text(text.encode())


@pytest.mark.parametrize("text", ["01/02/2020", "Thu Jan 02 2020"])
def test_dates_in_another_style_are_refused(text: str) -> None:
    with pytest.raises(FormatError, match="DateStyle"):
        avro_mapping(pg("date")).from_text(text.encode())
    with pytest.raises(FormatError, match="DateStyle"):
        avro_mapping(pg("timestamp")).from_text(f"{text} 00:00:00".encode())


def test_fastavro_reads_timestamps_as_aware_and_naive_datetimes() -> None:
    aware = avro_read(avro_mapping(pg("timestamptz")).schema, avro_bytes(avro_mapping(pg("timestamptz")).schema, 0))
    naive = avro_read(avro_mapping(pg("timestamp")).schema, avro_bytes(avro_mapping(pg("timestamp")).schema, 0))
    assert aware == datetime(1970, 1, 1, tzinfo=UTC)
    assert aware.utcoffset() == timedelta(0)
    assert naive == datetime(1970, 1, 1)
    assert naive.tzinfo is None


def test_a_returned_schema_can_be_annotated_without_touching_other_mappings() -> None:
    first = avro_mapping(pg("date")).schema
    assert isinstance(first, dict)
    first["connect.name"] = "changed"
    assert avro_mapping(pg("date")).schema == {"type": "int", "logicalType": "date"}
