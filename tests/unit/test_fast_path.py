"""The row encoders (C and Python, TableCodec.encoder) + envelope_bytes write exactly the general path's bytes.

The general path — decode into TupleData, ``row()`` into a dict, ``key_of``, ``envelope`` — is the oracle: it is
itself checked against fastavro (test_fast_encoding.py, test_types_properties.py). Here random tuples in
pgoutput's wire form (binary, text, null and unchanged-TOAST columns) go through both and must agree byte for
byte; malformed tuples must raise (the capture then lets the general path report them), never encode.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcdc_dev.codecs import make_codec

from cdc._chunks import packed_keys, parse_binary_copy, rows_and_last
from cdc._encoder import KeyMissingError, packed_rows
from cdc.encoding import Position, Stamp, TableCodec
from decoders import Insert, PgOutputDecoder, TupleData
from schemas import PgType
from tests.unit.test_types_numeric import numeric_send

PG_EPOCH_US = 946_684_800_000_000


def _text(value: str) -> tuple[bytes, bytes]:
    return value.encode(), value.encode()


# name, type, typmod, strategy of (text form, binary form) pairs
COLUMNS: list[tuple[str, PgType, int, Any]] = [
    (
        "id",
        PgType(20, "int8"),
        -1,
        st.integers(-(2**63), 2**63 - 1).map(lambda v: (str(v).encode(), struct.pack(">q", v))),
    ),
    (
        "i2",
        PgType(21, "int2"),
        -1,
        st.integers(-(2**15), 2**15 - 1).map(lambda v: (str(v).encode(), struct.pack(">h", v))),
    ),
    (
        "i4",
        PgType(23, "int4"),
        -1,
        st.integers(-(2**31), 2**31 - 1).map(lambda v: (str(v).encode(), struct.pack(">i", v))),
    ),
    ("oid", PgType(26, "oid"), -1, st.integers(0, 2**32 - 1).map(lambda v: (str(v).encode(), struct.pack(">I", v)))),
    (
        "name",
        PgType(25, "text"),
        -1,
        st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00")).map(_text),
    ),
    ("vc", PgType(1043, "varchar"), 14, st.text(max_size=10, alphabet="abcé✓").map(_text)),
    ("ok", PgType(16, "bool"), -1, st.booleans().map(lambda v: (b"t" if v else b"f", b"\x01" if v else b"\x00"))),
    (
        "f8",
        PgType(701, "float8"),
        -1,
        st.floats(allow_nan=False).map(lambda v: (repr(v).encode(), struct.pack(">d", v))),
    ),
    (
        "amount",
        PgType(1700, "numeric"),
        (12 << 16 | 2) + 4,
        st.decimals(min_value=-(10**9), max_value=10**9, places=2).map(
            lambda v: (str(v).encode(), numeric_send(str(v)))
        ),
    ),
    (
        "doc",
        PgType(3802, "jsonb"),
        -1,
        st.sampled_from(['{"a": 1}', "[]", '"é"', "null"]).map(lambda v: (v.encode(), b"\x01" + v.encode())),
    ),
    (
        "at",
        PgType(1184, "timestamptz"),
        -1,
        st.integers(-(10**15), 10**15).map(lambda v: (None, struct.pack(">q", v))),
    ),
    # The C encoder's other fast cases, and the values it hands back to the converters: ±infinity, NaN,
    # numerics too wide for 63 bits, another jsonb version, odd lengths.
    (
        "local",
        PgType(1114, "timestamp"),
        -1,
        st.sampled_from([-(2**63), 2**63 - 1, 2**63 - 2, 0]).map(lambda v: (None, struct.pack(">q", v)))
        | st.integers(-(10**15), 10**15).map(lambda v: (None, struct.pack(">q", v))),
    ),
    (
        "day",
        PgType(1082, "date"),
        -1,
        st.sampled_from([-(2**31), 2**31 - 1]).map(lambda v: (None, struct.pack(">i", v)))
        | st.integers(-(10**6), 10**6).map(lambda v: (None, struct.pack(">i", v))),
    ),
    (
        "f4",
        PgType(700, "float4"),
        -1,
        st.floats(width=32).map(lambda v: (None, struct.pack(">f", v)))
        | st.binary(min_size=4, max_size=4).map(lambda v: (None, v)),
    ),
    ("f8nan", PgType(701, "float8"), -1, st.binary(min_size=8, max_size=8).map(lambda v: (None, v))),
    ("u", PgType(2950, "uuid"), -1, st.binary(min_size=16, max_size=16).map(lambda v: (None, v))),
    ("blob", PgType(17, "bytea"), -1, st.binary(max_size=40).map(lambda v: (None, v))),
    (
        "wide",
        PgType(1700, "numeric"),
        (38 << 16 | 6) + 4,
        st.decimals(min_value=-(10**31), max_value=10**31, places=6).map(
            lambda v: (str(v).encode(), numeric_send(str(v)))
        )
        | st.just((b"NaN", numeric_send("NaN")))
        | st.integers(-(2**63), 2**63).map(lambda v: (f"{v}.000001".encode(), numeric_send(f"{v}.000001"))),
    ),
    (
        "tags",
        PgType(3802, "jsonb"),
        -1,
        st.sampled_from([b"\x01[1]", b"\x01", b"\x02[1]"]).map(lambda v: (None, v)),
    ),
    ("flag", PgType(16, "bool"), -1, st.binary(max_size=2).map(lambda v: (None, v))),
]
KEY = ["id", "name"]


def _codec() -> TableCodec:
    return make_codec(
        [(name, pgtype, typmod) for name, pgtype, typmod, _ in COLUMNS],
        topic="p.public.t",
        key=KEY,
        register=lambda _subject, _schema: 9,
    )


CODEC = _codec()
# The same codec with the Python encoder (cdc._encoder.PythonRowEncoder) instead of the C one.
PY_CODEC = _codec()
PY_CODEC.use_python()
KEY_INDEXES = [i for i, c in enumerate(COLUMNS) if c[0] in KEY]


def _tuple(values: list[tuple[bytes | None, bytes]], kinds: list[str]) -> bytes:
    out = struct.pack(">H", len(values))
    for (text, binary), kind in zip(values, kinds, strict=True):
        if kind == "b":
            out += b"b" + struct.pack(">I", len(binary)) + binary
        elif kind == "t":
            assert text is not None
            out += b"t" + struct.pack(">I", len(text)) + text
        else:
            out += kind.encode()
    return out


@st.composite
def tuples(draw: st.DrawFn, *, key_present: bool = True) -> tuple[bytes, list[str]]:
    values = [draw(strategy) for *_, strategy in COLUMNS]
    kinds = []
    for i, (text, _) in enumerate(values):
        choices = ["b"] + (["t"] if text is not None else [])
        if i not in KEY_INDEXES or not key_present:
            choices += ["n", "u"]
        kinds.append(draw(st.sampled_from(choices)))
    return _tuple(values, kinds), kinds


def _insert(frame: bytes) -> Insert:
    msg = PgOutputDecoder(2).decode(b"I" + struct.pack(">I", 1) + b"N" + frame)
    assert isinstance(msg, Insert)
    return msg


def _general(frame: bytes) -> tuple[bytes, bytes | None, list[str]]:
    """What decode + row + write_row + key_of give for an Insert of this tuple."""
    msg = _insert(frame)
    row, unchanged = CODEC.row(msg.new)
    record = CODEC.encode_row(row)
    try:
        key: bytes | None = CODEC.key_of(row)
    except KeyMissingError:
        key = None
    return record, key, unchanged


def test_the_c_encoder_is_built() -> None:
    """./dev installs the package with its C extension: if the build failed, say so rather than test only the
    Python encoder (which is what runs without a compiler)."""
    if os.environ.get("CDC_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("CDC_PURE_PYTHON is set: the capture runs the Python encoder")
    assert CODEC.native_plan is not None, "cdc._native is not built: reinstall with a C compiler (./dev rebuilds it)"


ENCODERS = pytest.mark.parametrize("codec", [CODEC, PY_CODEC], ids=["c", "python"])


@ENCODERS
@settings(max_examples=300, deadline=None)
@given(tuples())
def test_encode_tuple_equals_the_general_path(codec: TableCodec, example: tuple[bytes, list[str]]) -> None:
    frame, _ = example
    try:
        expected = _general(frame)
    except Exception:  # a value the converters refuse (an out-of-range timestamp…): the fast path must refuse it
        with pytest.raises(Exception):  # noqa: B017, PT011 - which one does not matter, see test_malformed…
            codec.encoder.encode(b"xx" + frame, 2)
        return
    record, key, unchanged, end = codec.encoder.encode(b"xx" + frame, 2)
    assert end == len(frame) + 2
    assert (record, key, unchanged) == expected


@pytest.mark.parametrize("length", [0, 1, 7, 31, 32, 33, 63, 64, 65, 100])
def test_text_is_checked_as_utf8_at_every_position(length: int) -> None:
    """The C encoder's UTF-8 check reads ASCII 32 bytes at a time: a non-ASCII byte anywhere, at either side
    of a step, must reach CPython's decoder — refused when invalid, written as the general path writes it when
    valid."""
    if CODEC.native_plan is None:
        pytest.skip("the C encoder's UTF-8 scan: cdc._native is not in use (test_the_c_encoder_is_built says why)")

    def frame(name: bytes) -> bytes:
        # the key (id, name) and nulls elsewhere
        given = {"id": struct.pack(">q", 1), "name": name}
        values: list[tuple[bytes | None, bytes]] = [(None, given.get(c[0], b"")) for c in COLUMNS]
        return _tuple(values, ["b" if c[0] in given else "n" for c in COLUMNS])

    for at in range(length):
        ascii_value = bytearray(b"x" * length)
        ascii_value[at] = 0xFF  # never valid in UTF-8
        with pytest.raises(UnicodeDecodeError):
            CODEC.encoder.encode(frame(bytes(ascii_value)), 0)
        valid = bytes(ascii_value[:at]) + "é".encode() + bytes(ascii_value[at + 1 :])
        record, key, unchanged, _ = CODEC.encoder.encode(frame(valid), 0)
        assert (record, key, unchanged) == _general(frame(valid))
    plain = frame(b"x" * length)
    assert CODEC.encoder.encode(plain, 0)[:3] == _general(plain)


@ENCODERS
@settings(max_examples=100, deadline=None)
@given(tuples(key_present=False))
def test_a_missing_key_column_gives_no_key(codec: TableCodec, example: tuple[bytes, list[str]]) -> None:
    frame, kinds = example
    try:
        expected = _general(frame)[1]
    except Exception:
        return
    _, key, _, _ = codec.encoder.encode(frame, 0)
    assert (key is None) == any(kinds[i] in "nu" for i in KEY_INDEXES)
    assert key == expected


@ENCODERS
@settings(max_examples=100, deadline=None)
@given(tuples(), st.data())
def test_envelope_bytes_equals_envelope(
    codec: TableCodec, example: tuple[bytes, list[str]], data: st.DataObject
) -> None:
    frame, _ = example
    try:
        row, _ = codec.row(_insert(frame).new)
    except Exception:
        return
    record, _, unchanged, _ = codec.encoder.encode(frame, 0)
    op = data.draw(st.sampled_from("cud"))
    pos = Position(data.draw(st.integers(0, 2**63 - 1)), data.draw(st.integers(0, 2**63 - 1)), 1_700_000_000_000_000, 7)
    tx = data.draw(st.none() | st.just(("7:100", 3, 2)))
    before, after = (row, None) if op == "d" else (row if op == "u" else None, row)
    rec_before, rec_after = (record, None) if op == "d" else (record if op == "u" else None, record)
    expected = codec.envelope(op, Stamp(pos, 5, tx), before, after, unchanged)
    got = codec.envelope_bytes(op, Stamp(pos, 5, tx), rec_before, rec_after, unchanged)
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(tuples(), st.data())
@ENCODERS
def test_malformed_tuples_raise(codec: TableCodec, example: tuple[bytes, list[str]], data: st.DataObject) -> None:
    """Cut short, or with a foreign value kind: an exception, never bytes (the capture falls back on it)."""
    frame, _ = example
    cut = frame[: data.draw(st.integers(0, len(frame) - 1))]
    foreign = frame[:2] + b"x" + frame[3:]
    for bad in (cut, foreign):
        try:
            codec.encoder.encode(bad, 0)
        except Exception:  # noqa: S112 - any exception will do: the general path says which
            continue
        pytest.fail(f"encode_tuple accepted the malformed tuple {bad!r}")


def test_the_python_encoder_says_what_is_wrong() -> None:
    """What the C encoder refuses goes to the Python one, whose error is the capture's message: it names the
    column of a value no converter takes, and the key columns a row lacks."""
    known = {"id": struct.pack(">q", 1), "name": b"ok"}

    def frame(**values: bytes | None) -> bytes:
        given = {**known, **values}
        cols: list[tuple[bytes | None, bytes]] = [(None, given.get(c[0]) or b"") for c in COLUMNS]
        return _tuple(cols, ["b" if given.get(c[0]) is not None else "n" for c in COLUMNS])

    encoder = PY_CODEC.python_encoder
    with pytest.raises(ValueError, match=r"column 'name': .*utf-8"):
        encoder.encode(frame(name=b"\xff"), 0)
    with pytest.raises(KeyMissingError, match=r"public.t arrived without key column\(s\) \['id'\]"):
        encoder.encode_keyed(frame(id=None), 0)
    assert encoder.encode(frame(id=None), 0)[1] is None
    row = struct.pack(">h", len(COLUMNS)) + b"".join(
        struct.pack(">i", len(known[c[0]])) + known[c[0]] if c[0] == "name" else struct.pack(">i", -1) for c in COLUMNS
    )
    copy = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0) + row + struct.pack(">h", -1)
    with pytest.raises(
        KeyMissingError, match=r"public.t arrived without key column\(s\) \['id'\]: key columns must be NOT NULL"
    ):
        encoder.encode_copy_packed(copy, b"b" * len(COLUMNS))


@ENCODERS
def test_a_tuple_of_another_width_is_refused(codec: TableCodec) -> None:
    frame = _tuple([(b"1", struct.pack(">q", 1))], ["b"])
    with pytest.raises(ValueError, match="column count"):
        codec.encoder.encode(frame, 0)


# Columns whose strategies give no text form.
TEXTLESS = {"at", "local", "day", "f4", "f8nan", "u", "blob", "tags", "flag"}


@st.composite
def copy_chunks(draw: st.DrawFn) -> tuple[bytes, bytes, list[bytes]]:
    """A binary COPY chunk of random rows (each with one extra text field, like the snapshot's resume key),
    the per-column modes (b: send format, t: text), and the extra fields."""
    modes = bytes(draw(st.sampled_from(b"bt" if COLUMNS[i][0] not in TEXTLESS else b"b")) for i in range(len(COLUMNS)))
    out = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
    extras = []
    for n in range(draw(st.integers(0, 5))):
        values = [draw(strategy) for *_, strategy in COLUMNS]
        out += struct.pack(">h", len(COLUMNS) + 1)
        for i, ((text, binary), mode) in enumerate(zip(values, modes, strict=True)):
            if i not in KEY_INDEXES and draw(st.booleans()):
                out += struct.pack(">i", -1)
            else:
                value = binary if mode == ord("b") else text
                assert value is not None
                out += struct.pack(">i", len(value)) + value
        extra = f"key-{n}".encode()
        extras.append(extra)
        out += struct.pack(">i", len(extra)) + extra
    return out + struct.pack(">h", -1), modes, extras


@settings(max_examples=200, deadline=None)
@given(copy_chunks())
@ENCODERS
def test_copy_rows_encode_as_the_general_path(codec: TableCodec, chunk: tuple[bytes, bytes, list[bytes]]) -> None:
    data, modes, extras = chunk
    expected = []
    try:
        for raw in parse_binary_copy(data):
            values = raw[: len(COLUMNS)]
            kinds = bytes(ord("n") if v is None else m for v, m in zip(values, modes, strict=True))
            row, _ = CODEC.row(TupleData(kinds, tuple(values)))
            expected.append((CODEC.key_of(row), CODEC.encode_row(row)))
    except Exception:  # a value the converters refuse: so must the snapshot's encoder
        with pytest.raises(Exception):  # noqa: B017, PT011
            codec.encoder.encode_copy_packed(data, modes)
        return
    packed, rows = codec.encoder.encode_copy_packed(data, modes)
    assert (rows, _unpacked(packed)) == (len(expected), expected)
    keys, records = packed_rows(packed)
    assert list(zip(keys, records or [], strict=True)) == expected
    assert packed_keys(packed) == keys
    rows, last = rows_and_last(data)  # what the next chunk's query is made from
    assert (rows, None if last is None else last[len(COLUMNS) :]) == (len(expected), extras[-1:] or None)


def _unpacked(packed: bytes) -> list[tuple[bytes, bytes]]:
    """TuplePlan.encode_copy_packed's rows as (key, record) pairs: per row the record's and the key's lengths
    (big-endian uint32), the record, the key."""
    out, at = [], 0
    while at < len(packed):
        reclen, keylen = struct.unpack_from(">II", packed, at)
        at += 8
        out.append((packed[at + reclen : at + reclen + keylen], packed[at : at + reclen]))
        at += reclen + keylen
    assert at == len(packed)
    return out


def _numeric_codec(typmod: int) -> tuple[TableCodec, TableCodec]:
    columns = [("id", PgType(20, "int8"), -1), ("n", PgType(1700, "numeric"), typmod)]
    made = [make_codec(columns, topic="p.public.n", key=["id"], register=lambda _s, _d: 9) for _ in range(2)]
    made[1].use_python()
    return made[0], made[1]


def test_numeric_digits_above_9999_encode_as_the_python_path() -> None:
    """No numeric PostgreSQL writes, but the converter reads it: the C encoder must hand it over, not wrap
    its 64-bit accumulator (found in review: it wrote 4 where the converter gives 1844674407370959)."""
    c_codec, py_codec = _numeric_codec((18 << 16) + 4)
    value = bytes.fromhex("000500030000000007341a5802e103b9ffff")
    frame = _tuple([(b"1", struct.pack(">q", 1)), (b"", value)], ["b", "b"])
    assert c_codec.encoder.encode(frame, 0) == py_codec.encoder.encode(frame, 0)


def test_the_c_encoder_refuses_impossible_calls() -> None:
    """Checks that keep the C code's unchecked reads in bounds: a position past the end, a short transaction
    block, a plan whose parts disagree."""
    from cdc import _native  # type: ignore[attr-defined]

    if CODEC.native_plan is None:
        pytest.skip("cdc._native is not built (test_the_c_encoder_is_built says why)")
    with pytest.raises(ValueError, match="truncated"):
        CODEC.native_plan.encode(b"\x00\x01n", 2**63 - 1)
    with pytest.raises(ValueError, match="transaction"):
        _native.envelope(b"F", None, None, b"", 1, 2, b"", b"", ("x",), b"", None)
    with pytest.raises(ValueError, match="key column index"):
        _native.TuplePlan([(0, 0)], (bytes.decode,), (bytes,), (print,), ("a",), (5,), b"K")
    with pytest.raises(ValueError, match="per column"):
        _native.TuplePlan([(0, 0)] * 3, (), (), (), (), (), b"K")


@settings(max_examples=100, deadline=None)
@given(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**15), 2**15 - 1),
    st.integers(-(2**31), 2**31 - 1),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")),
    st.uuids(),
)
def test_snapshot_resume_keys_print_as_postgresql_does(i8: int, i2: int, i4: int, text: str, uuid_value: Any) -> None:
    """The snapshot resumes after the last row's key values, printed (for these types, instead of a ``key::text``
    column per row): str() of the value the column's converter gives must be PostgreSQL's text form of it."""
    columns = [
        ("a", PgType(20, "int8"), -1),
        ("b", PgType(21, "int2"), -1),
        ("c", PgType(23, "int4"), -1),
        ("d", PgType(25, "text"), -1),
        ("e", PgType(1043, "varchar"), -1),
        ("f", PgType(2950, "uuid"), -1),
    ]
    codec = make_codec(columns, topic="p.public.k", key=[c[0] for c in columns], register=lambda _s, _d: 4)
    raw = [struct.pack(">q", i8), struct.pack(">h", i2), struct.pack(">i", i4), text.encode(), text.encode()]
    printed = [str(codec.binary_value(i, r)) for i, r in enumerate([*raw, uuid_value.bytes])]
    assert printed == [str(i8), str(i2), str(i4), text, text, str(uuid_value)]


@settings(max_examples=200, deadline=None)
@given(copy_chunks())
def test_copy_rows_and_last_reads_what_the_python_parser_reads(chunk: tuple[bytes, bytes, list[bytes]]) -> None:
    """The snapshot's read-ahead counts a chunk's rows and takes its last row's fields in C: as parse_binary_copy."""
    if CODEC.native_plan is None:
        pytest.skip("cdc._native is not built (test_the_c_encoder_is_built says why)")
    from cdc import _native  # type: ignore[attr-defined]

    data, _, _ = chunk
    rows = parse_binary_copy(data)
    assert _native.copy_rows_and_last(data) == (len(rows), rows[-1] if rows else None)


def test_cut_copy_output_is_refused_not_read_past() -> None:
    """Every prefix of a COPY output is refused with ValueError by the C readers (no read past the end), and so
    is every prefix of packed rows cut inside a row."""
    if CODEC.native_plan is None:
        pytest.skip("cdc._native is not built (test_the_c_encoder_is_built says why)")
    from cdc import _native  # type: ignore[attr-defined]

    modes = b"b" * len(COLUMNS)
    known = {"id": struct.pack(">q", 7), "i2": struct.pack(">h", 2), "name": b"hello"}
    row = struct.pack(">h", len(COLUMNS) + 1)
    for name, *_ in COLUMNS:  # the key columns and a text one set, the others NULL
        row += struct.pack(">i", len(known[name])) + known[name] if name in known else struct.pack(">i", -1)
    row += struct.pack(">i", 3) + b"key"
    data = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0) + row + row + struct.pack(">h", -1)
    assert _native.copy_rows_and_last(data)[0] == 2
    for cut in range(len(data)):
        with pytest.raises(ValueError):  # noqa: PT011 - any of the readers' messages
            _native.copy_rows_and_last(data[:cut])
        with pytest.raises(ValueError):  # noqa: PT011
            CODEC.native_plan.encode_copy_packed(data[:cut], modes)
    packed, _ = CODEC.native_plan.encode_copy_packed(data, modes)
    first_row_ends = len(packed) // 2  # two identical rows
    for cut in range(1, len(packed)):
        if cut == first_row_ends:
            assert len(_native.packed_rows(packed[:cut])[0]) == 1
            continue
        with pytest.raises(ValueError, match="truncated packed rows"):
            _native.packed_rows(packed[:cut])
