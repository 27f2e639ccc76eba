"""The hand-written Avro path (schemas.compile_writer, TableCodec.envelope) writes exactly fastavro's bytes."""

from __future__ import annotations

import io
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcdc_dev.codecs import make_codec

from cdc.encoding import Position, SourceInfo, Stamp, TableCodec
from decoders import TupleData
from schemas import PgType, compile_writer

INT4 = PgType(23, "int4")
COLUMNS: list[tuple[str, PgType, int, list[str]]] = [
    ("id", INT4, -1, ["42", "-7", "2147483647"]),
    ("small", PgType(21, "int2"), -1, ["-32768", "0"]),
    ("big", PgType(20, "int8"), -1, ["9223372036854775807", "-9223372036854775808"]),
    ("f4", PgType(700, "float4"), -1, ["1.5", "NaN", "-Infinity"]),
    ("f8", PgType(701, "float8"), -1, ["0.1", "Infinity"]),
    ("price", PgType(1700, "numeric"), (10 << 16 | 2) + 4, ["12.34", "NaN", "-0.01"]),
    ("free", PgType(1700, "numeric"), -1, ["123.456", "1e-20", "Infinity"]),
    ("name", PgType(25, "text"), -1, ["héllo", ""]),
    ("raw", PgType(17, "bytea"), -1, ["\\x00ff10"]),
    ("ok", PgType(16, "bool"), -1, ["t", "f"]),
    ("uid", PgType(2950, "uuid"), -1, ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("doc", PgType(3802, "jsonb"), -1, ['{"a": [1, 2.5, null]}']),
    ("day", PgType(1082, "date"), -1, ["2024-02-29", "infinity", "-infinity"]),
    ("at", PgType(1184, "timestamptz"), -1, ["2024-01-01 00:00:00.000001+00", "infinity"]),
    ("span", PgType(1186, "interval"), -1, ["1 year 2 mons 3 days 04:05:06.789", "-00:00:01"]),
    ("span2", PgType(1186, "interval"), -1, ["00:00:00"]),  # a second use of the same named type
    ("ints", PgType(1007, "_int4", kind="array", element=INT4), -1, ["{1,NULL,3}", "{}"]),
]


def _codec(columns: list[tuple[str, PgType, int, list[str]]]) -> TableCodec:
    return make_codec(
        [(name, pgtype, typmod) for name, pgtype, typmod, _ in columns],
        topic="t.public.zoo",
        source=SourceInfo("9.9.9", "t", "shop"),
        register=lambda _subject, _schema: 7,
    )


def _fastavro(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), record)
    return buf.getvalue()


CODEC = _codec(COLUMNS)
PY_CODEC = _codec(COLUMNS)
PY_CODEC.use_python()  # without the C build: envelope_bytes in Python
ENCODERS = pytest.mark.parametrize("codec", [CODEC, PY_CODEC], ids=["c", "python"])


def _row(variant: int, nulls: frozenset[int] = frozenset()) -> tuple[dict[str, Any], list[str]]:
    kinds = bytearray()
    values: list[bytes | None] = []
    for i, (_, _, _, samples) in enumerate(COLUMNS):
        if i in nulls and i != 0:
            kinds.append(ord("n"))
            values.append(None)
        else:
            kinds.append(ord("t"))
            values.append(samples[variant % len(samples)].encode())
    return CODEC.row(TupleData(bytes(kinds), tuple(values)))


@ENCODERS
@pytest.mark.parametrize("variant", range(3))
def test_envelope_bytes_equal_fastavro(codec: TableCodec, variant: int) -> None:
    after, unchanged = _row(variant)
    before, _ = _row(variant + 1, frozenset({3, 5, 9}))
    pos = Position(commit_lsn=1 << 40, lsn=(1 << 40) - 5, commit_time_us=1_700_000_000_123_456, xid=733)
    for op, b, a, tx in (("c", None, after, None), ("u", before, after, ("733:42", 2, 1)), ("d", before, None, None)):
        fast = codec.envelope(op, Stamp(pos, 1_800_000_000_000_001, tx), b, a, unchanged)
        record = CODEC.envelope_record(op, Stamp(pos, 1_800_000_000_000_001, tx), b, a, unchanged)
        assert fast[:5] == b"\x00\x00\x00\x00\x07"
        assert fast[5:] == _fastavro(CODEC.value_schema, record)
    key = CODEC.key_of(after)
    assert key[5:] == _fastavro(CODEC.key_schema, {"id": after["id"]})


@ENCODERS
@settings(max_examples=200, deadline=None)
@given(
    nulls=st.frozensets(st.integers(1, len(COLUMNS) - 1)),
    variant=st.integers(0, 5),
    lsn=st.integers(0, (1 << 63) - 1),
    xid=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
    snapshot=st.sampled_from(["true", "false", "last"]),
    unchanged=st.lists(st.sampled_from(["name", "doc", "raw"]), max_size=3, unique=True),
)
def test_envelope_bytes_equal_fastavro_property(
    codec: TableCodec,
    *,
    nulls: frozenset[int],
    variant: int,
    lsn: int,
    xid: int | None,
    snapshot: str,
    unchanged: list[str],
) -> None:
    after, _ = _row(variant, nulls)
    pos = Position(commit_lsn=lsn, lsn=max(0, lsn - 3), commit_time_us=lsn // 7, xid=xid, snapshot=snapshot)
    fast = codec.envelope("u", Stamp(pos, lsn // 3), after, after, unchanged)
    record = CODEC.envelope_record("u", Stamp(pos, lsn // 3), after, after, unchanged)
    assert fast[5:] == _fastavro(CODEC.value_schema, record)


@settings(max_examples=300, deadline=None)
@given(
    value=st.one_of(
        st.none(),
        st.integers(-(1 << 63), (1 << 63) - 1),
        st.text(),
        st.binary(),
        st.floats(allow_nan=False),
        st.booleans(),
        st.lists(st.one_of(st.none(), st.integers(-(1 << 31), (1 << 31) - 1))),
        st.dictionaries(st.text(), st.one_of(st.none(), st.text())),
    )
)
def test_compiled_writer_matches_fastavro_for_unions(value: Any) -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {
                "name": "v",
                "type": [
                    "null",
                    "long",
                    "string",
                    "bytes",
                    "double",
                    "boolean",
                    {"type": "array", "items": ["null", "int"]},
                    {"type": "map", "values": ["null", "string"]},
                ],
            }
        ],
    }
    out = bytearray()
    compile_writer(schema)({"v": value}, out)
    assert bytes(out) == _fastavro(schema, {"v": value})
