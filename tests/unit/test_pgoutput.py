"""The pgoutput decoder against the documented layouts: hand-built vectors, malformed input, round trips.

Vectors here are written out field by field from PostgreSQL's "Logical Replication Message Formats" and
"Streaming Replication Protocol" pages (and proto.c), not produced by the decoder's own code. The
property tests use a separate encoder written from the same pages. Bytes captured from a real server
are replayed in test_pgoutput_captured.py.
"""

from __future__ import annotations

import pickle
import struct
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import decoders
from decoders import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    Keepalive,
    LogicalMessage,
    Message,
    Origin,
    PgOutputDecoder,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    TypeInfo,
    Unchanged,
    Update,
    XLogData,
    format_lsn,
    parse_copy_data,
    parse_lsn,
    standby_status,
)

PG_EPOCH_US = 946_684_800 * 1_000_000  # 2000-01-01 in Unix epoch microseconds


def u8(v: int) -> bytes:
    return struct.pack(">B", v)


def u16(v: int) -> bytes:
    return struct.pack(">H", v)


def u32(v: int) -> bytes:
    return struct.pack(">I", v)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def ts(unix_us: int) -> bytes:
    """A TimestampTz on the wire: microseconds since 2000-01-01."""
    return struct.pack(">q", unix_us - PG_EPOCH_US)


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


# ---------------------------------------------------------------------------------------------------
# A test-side encoder, straight from the documented layouts. The round-trip properties below check the
# decoder against it; it is deliberately written differently (no shared tables or structs).


def encode_tuple(t: TupleData) -> bytes:
    out = [u16(len(t.values))]
    for kind, value in zip(t.kinds, t.values, strict=True):
        out.append(bytes([kind]))
        if kind in b"tb":
            assert value is not None
            out.append(i32(len(value)) + value)
    return b"".join(out)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else u32(xid)


def _ns(namespace: str) -> bytes:
    return cstr("" if namespace == "pg_catalog" else namespace)


def encode(m: Message, *, parallel: bool = False) -> bytes:
    match m:
        case Begin():
            return b"B" + u64(m.final_lsn) + ts(m.commit_time_us) + u32(m.xid)
        case Commit():
            return b"C" + u8(m.flags) + u64(m.commit_lsn) + u64(m.end_lsn) + ts(m.commit_time_us)
        case Origin():
            return b"O" + u64(m.commit_lsn) + cstr(m.name)
        case Relation():
            cols = b"".join(u8(c.flags) + cstr(c.name) + u32(c.type_oid) + i32(c.type_modifier) for c in m.columns)
            return (
                b"R"
                + _xid(m.xid)
                + u32(m.relid)
                + _ns(m.namespace)
                + cstr(m.name)
                + m.replica_identity.encode()
                + u16(len(m.columns))
                + cols
            )
        case TypeInfo():
            return b"Y" + _xid(m.xid) + u32(m.oid) + _ns(m.namespace) + cstr(m.name)
        case Insert():
            return b"I" + _xid(m.xid) + u32(m.relid) + b"N" + encode_tuple(m.new)
        case Update():
            old = b"" if m.old is None else (m.old_kind or "").encode() + encode_tuple(m.old)
            return b"U" + _xid(m.xid) + u32(m.relid) + old + b"N" + encode_tuple(m.new)
        case Delete():
            return b"D" + _xid(m.xid) + u32(m.relid) + m.old_kind.encode() + encode_tuple(m.old)
        case Truncate():
            options = (1 if m.cascade else 0) | (2 if m.restart_identity else 0)
            relids = b"".join(u32(r) for r in m.relids)
            return b"T" + _xid(m.xid) + u32(len(m.relids)) + u8(options) + relids
        case LogicalMessage():
            return (
                b"M"
                + _xid(m.xid)
                + u8(1 if m.transactional else 0)
                + u64(m.lsn)
                + cstr(m.prefix)
                + i32(len(m.content))
                + m.content
            )
        case StreamStart():
            return b"S" + u32(m.xid) + u8(1 if m.first_segment else 0)
        case StreamStop():
            return b"E"
        case StreamCommit():
            return b"c" + u32(m.xid) + u8(m.flags) + u64(m.commit_lsn) + u64(m.end_lsn) + ts(m.commit_time_us)
        case StreamAbort():
            body = b"A" + u32(m.xid) + u32(m.subxid)
            if parallel:
                assert m.abort_lsn is not None
                assert m.abort_time_us is not None
                body += u64(m.abort_lsn) + ts(m.abort_time_us)
            return body
        case BeginPrepare():
            return b"b" + u64(m.prepare_lsn) + u64(m.end_lsn) + ts(m.prepare_time_us) + u32(m.xid) + cstr(m.gid)
        case Prepare() | StreamPrepare():
            kind = b"P" if isinstance(m, Prepare) else b"p"
            return (
                kind
                + u8(m.flags)
                + u64(m.prepare_lsn)
                + u64(m.end_lsn)
                + ts(m.prepare_time_us)
                + u32(m.xid)
                + cstr(m.gid)
            )
        case CommitPrepared():
            return (
                b"K"
                + u8(m.flags)
                + u64(m.commit_lsn)
                + u64(m.end_lsn)
                + ts(m.commit_time_us)
                + u32(m.xid)
                + cstr(m.gid)
            )
        case RollbackPrepared():
            return (
                b"r"
                + u8(m.flags)
                + u64(m.prepare_end_lsn)
                + u64(m.rollback_end_lsn)
                + ts(m.prepare_time_us)
                + ts(m.rollback_time_us)
                + u32(m.xid)
                + cstr(m.gid)
            )
    raise AssertionError(f"no encoder for {m!r}")


# ---------------------------------------------------------------------------------------------------
# The public surface


def test_public_surface_is_explicit() -> None:
    assert sorted(decoders.__all__) == sorted(
        [
            "UNCHANGED", "Begin", "BeginPrepare", "Column", "Commit", "CommitPrepared", "DecodeError",
            "Delete", "Insert", "Keepalive", "LogicalMessage", "Message", "Origin", "PgOutputDecoder",
            "Prepare", "Relation", "RollbackPrepared", "StreamAbort", "StreamCommit", "StreamPrepare",
            "StreamStart", "StreamStop", "Truncate", "TupleData", "TypeInfo", "Unchanged", "Update",
            "XLOG_HEADER", "XLOG_PAYLOAD_AT", "XLogData", "fill_unchanged_from_old", "format_lsn", "parse_copy_data",
            "parse_lsn",
            "standby_status",
        ]
    )  # fmt: skip
    for name in decoders.__all__:
        assert getattr(decoders, name) is not None, name


def test_decoders_does_not_import_a_driver_or_anything_downstream() -> None:
    """psycopg too: decoders works on bytes, whoever owns the connection moves them."""
    import subprocess
    import sys

    code = (
        "import sys, decoders\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'psycopg', 'cdc', 'schemas', 'sinks', 'confluent_kafka', 'fastavro', 'pyspark'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_messages_are_frozen_and_slotted() -> None:
    msg = Insert(None, 1, TupleData(b"t", (b"1",)))
    with pytest.raises(AttributeError):
        msg.relid = 2  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    assert hash(Begin(1, 2, 3)) == hash(Begin(1, 2, 3))


def test_unchanged_is_a_singleton_that_survives_pickling() -> None:
    assert Unchanged() is UNCHANGED
    assert pickle.loads(pickle.dumps(UNCHANGED)) is UNCHANGED  # noqa: S301 (our own bytes)
    assert repr(UNCHANGED) == "UNCHANGED"


def test_column_is_key_reads_flag_bit_zero() -> None:
    assert Column(1, "id", 23, -1).is_key
    assert not Column(0, "note", 25, -1).is_key
    assert Column(3, "x", 23, -1).is_key  # other bits are not ours to refuse


# ---------------------------------------------------------------------------------------------------
# LSN helpers


@pytest.mark.parametrize(
    ("lsn", "text"),
    [
        (0, "0/0"),
        (0x16_B374D848, "16/B374D848"),
        (0x1_00000000, "1/0"),
        (0xFFFFFFFF, "0/FFFFFFFF"),
        ((1 << 64) - 1, "FFFFFFFF/FFFFFFFF"),
    ],
)
def test_lsn_round_trip(lsn: int, text: str) -> None:
    assert format_lsn(lsn) == text
    assert parse_lsn(text) == lsn
    assert parse_lsn(text.lower()) == lsn


@pytest.mark.parametrize(
    "text",
    ["", "16", "16/", "/1", "16/B374D848/1", "G/0", "123456789/0", " 1/0", "1/0 ", "0x1/0", "+1/0", "1_0/0"],
)
def test_parse_lsn_refuses_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn(text)


@pytest.mark.parametrize("lsn", [-1, 1 << 64])
def test_format_lsn_refuses_out_of_range(lsn: int) -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        format_lsn(lsn)


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_lsn_helpers_are_inverse(lsn: int) -> None:
    assert parse_lsn(format_lsn(lsn)) == lsn


# ---------------------------------------------------------------------------------------------------
# Replication framing: XLogData, keepalive, standby status


def test_parse_xlogdata() -> None:
    send_unix = 1_700_000_000_123_456
    frame = b"w" + u64(0x16_B374D848) + u64(0x16_B374D900) + ts(send_unix) + b"E"
    msg = parse_copy_data(frame)
    assert isinstance(msg, XLogData)
    assert (msg.start_lsn, msg.end_lsn, msg.send_time_us) == (0x16_B374D848, 0x16_B374D900, send_unix)
    assert isinstance(msg.payload, memoryview)
    assert bytes(msg.payload) == b"E"
    assert parse_copy_data(memoryview(frame)) == msg


def test_parse_keepalive() -> None:
    send_unix = 1_700_000_000_000_001
    msg = parse_copy_data(b"k" + u64(0x2_00000010) + ts(send_unix) + b"\x01")
    assert msg == Keepalive(0x2_00000010, send_unix, True)
    assert parse_copy_data(b"k" + u64(5) + ts(send_unix) + b"\x00") == Keepalive(5, send_unix, False)


@pytest.mark.parametrize(
    ("frame", "match", "offset", "kind"),
    [
        (b"", "empty replication message", 0, None),
        (b"r" + bytes(33), "unknown replication message type 'r'", 0, "r"),
        (b"w" + bytes(23), "XLogData truncated: 24 bytes", 24, "w"),
        (b"k" + bytes(16), "keepalive message must be 18 bytes, got 17", 17, "k"),
        (b"k" + bytes(18), "keepalive message must be 18 bytes, got 19", 18, "k"),
    ],
)
def test_parse_copy_data_refuses_malformed(frame: bytes, match: str, offset: int, kind: str | None) -> None:
    with pytest.raises(DecodeError, match=match) as exc:
        parse_copy_data(frame)
    assert (exc.value.offset, exc.value.kind) == (offset, kind)


def test_standby_status_layout() -> None:
    # Byte1('r'), Int64 write, Int64 flush, Int64 apply, Int64 clock (µs since 2000-01-01), Byte1 reply.
    now_unix = PG_EPOCH_US + 1_000_000  # one second after PostgreSQL's epoch
    msg = standby_status(0x10, 0x20, 0x30, now_unix, reply_requested=True)
    assert msg == bytes.fromhex(
        "72" "0000000000000010" "0000000000000020" "0000000000000030" "00000000000f4240" "01"
    )  # fmt: skip
    assert standby_status(1, 1, 1, now_unix)[-1:] == b"\x00"


def test_standby_status_converts_the_clock_by_subtracting_the_epoch_offset() -> None:
    now_unix = int(time.time() * 1_000_000)
    (pg_time,) = struct.unpack_from(">q", standby_status(0, 0, 0, now_unix), 25)
    assert pg_time == now_unix - 946_684_800_000_000
    # a clock before 2000-01-01 is negative on the wire, not an error
    (early,) = struct.unpack_from(">q", standby_status(0, 0, 0, 0), 25)
    assert early == -946_684_800_000_000


@pytest.mark.parametrize(("write", "now"), [(-1, 0), (1 << 64, 0), (0, 1 << 70)])
def test_standby_status_refuses_out_of_range(write: int, now: int) -> None:
    with pytest.raises(ValueError, match="standby status"):
        standby_status(write, 0, 0, now)


# ---------------------------------------------------------------------------------------------------
# Decoder construction


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "must be 1, 2, 3 or 4"),
        ((5,), {}, "must be 1, 2, 3 or 4"),
        (("2",), {}, "must be 1, 2, 3 or 4"),
        ((1,), {"streaming": True}, "streaming needs pgoutput protocol_version 2"),
        ((3,), {"streaming": True, "parallel": True}, "parallel streaming needs"),
        ((4,), {"parallel": True}, "parallel streaming needs"),
    ],
)
def test_decoder_refuses_impossible_options(args: tuple[Any, ...], kwargs: dict[str, bool], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PgOutputDecoder(*args, **kwargs)


def test_decoder_defaults_to_protocol_1() -> None:
    d = PgOutputDecoder()
    assert (d.protocol_version, d.streaming, d.parallel, d.in_stream) == (1, False, False, False)


# ---------------------------------------------------------------------------------------------------
# Hand-built vectors, one per message kind, written field by field from the documentation.

T0 = 1_732_233_600_000_000  # 2024-11-22T00:00:00Z, Unix µs
T1 = T0 + 1_500_000


def test_begin_and_commit() -> None:
    d = PgOutputDecoder()
    assert d.decode(b"B" + u64(0x1_6B3748) + ts(T0) + u32(740)) == Begin(0x1_6B3748, T0, 740)
    commit = b"C" + b"\x00" + u64(0x1_6B3748) + u64(0x1_6B3778) + ts(T1)
    assert d.decode(commit) == Commit(0, 0x1_6B3748, 0x1_6B3778, T1)


def test_begin_commit_time_uses_the_postgres_epoch_on_the_wire() -> None:
    """Zero on the wire is 2000-01-01, not 1970-01-01."""
    msg = PgOutputDecoder().decode(b"B" + u64(1) + bytes(8) + u32(1))
    assert isinstance(msg, Begin)
    assert msg.commit_time_us == 946_684_800_000_000


def test_origin() -> None:
    d = PgOutputDecoder()
    assert d.decode(b"O" + u64(0x1234) + b"pg_16399\0") == Origin(0x1234, "pg_16399")


def test_relation_with_key_columns_and_pg_catalog_abbreviation() -> None:
    payload = (
        b"R"
        + u32(16390)
        + b"public\0"
        + b"orders\0"
        + b"d"
        + u16(3)
        + b"\x01" + b"id\0" + u32(23) + i32(-1)
        + b"\x00" + b"note\0" + u32(1043) + i32(68)  # varchar(64): typmod is length + 4
        + b"\x00" + b"amount\0" + u32(1700) + i32((10 << 16) + 2 + 4)
    )  # fmt: skip
    msg = PgOutputDecoder().decode(payload)
    assert msg == Relation(
        None,
        16390,
        "public",
        "orders",
        "d",
        (Column(1, "id", 23, -1), Column(0, "note", 1043, 68), Column(0, "amount", 1700, 655366)),
    )
    assert isinstance(msg, Relation)
    assert [c.is_key for c in msg.columns] == [True, False, False]
    # An empty namespace stands for pg_catalog ("to save space", proto.c).
    empty_ns = b"R" + u32(1) + b"\0" + b"t\0" + b"n" + u16(0)
    assert PgOutputDecoder().decode(empty_ns) == Relation(None, 1, "pg_catalog", "t", "n", ())


def test_type() -> None:
    msg = PgOutputDecoder().decode(b"Y" + u32(16401) + b"public\0" + b"mood\0")
    assert msg == TypeInfo(None, 16401, "public", "mood")


def test_insert_with_every_value_kind() -> None:
    payload = (
        b"I" + u32(16390) + b"N" + u16(4)
        + b"t" + i32(2) + b"42"
        + b"n"
        + b"u"
        + b"b" + i32(4) + b"\x00\x00\x00\x2a"
    )  # fmt: skip
    msg = PgOutputDecoder().decode(payload)
    assert msg == Insert(None, 16390, TupleData(b"tnub", (b"42", None, None, b"\x00\x00\x00\x2a")))
    assert isinstance(msg, Insert)
    assert all(type(v) is bytes for v in msg.new.values if v is not None)


def test_insert_with_empty_value_and_no_columns() -> None:
    d = PgOutputDecoder()
    assert d.decode(b"I" + u32(7) + b"N" + u16(1) + b"t" + i32(0)) == Insert(None, 7, TupleData(b"t", (b"",)))
    assert d.decode(b"I" + u32(7) + b"N" + u16(0)) == Insert(None, 7, TupleData(b"", ()))


@pytest.mark.parametrize(("marker", "kind"), [(b"K", "K"), (b"O", "O")])
def test_update_with_old_key_or_old_row(marker: bytes, kind: str) -> None:
    old = u16(2) + b"t" + i32(1) + b"1" + b"n"
    new = u16(2) + b"t" + i32(1) + b"2" + b"t" + i32(1) + b"x"
    msg = PgOutputDecoder().decode(b"U" + u32(5) + marker + old + b"N" + new)
    assert msg == Update(None, 5, TupleData(b"tn", (b"1", None)), kind, TupleData(b"tt", (b"2", b"x")))


def test_update_without_old_tuple() -> None:
    msg = PgOutputDecoder().decode(b"U" + u32(5) + b"N" + u16(1) + b"u")
    assert msg == Update(None, 5, None, None, TupleData(b"u", (None,)))


@pytest.mark.parametrize(("marker", "kind"), [(b"K", "K"), (b"O", "O")])
def test_delete(marker: bytes, kind: str) -> None:
    msg = PgOutputDecoder().decode(b"D" + u32(5) + marker + u16(1) + b"t" + i32(1) + b"9")
    assert msg == Delete(None, 5, TupleData(b"t", (b"9",)), kind)


@pytest.mark.parametrize(
    ("options", "cascade", "restart"),
    [(0, False, False), (1, True, False), (2, False, True), (3, True, True)],
)
def test_truncate_option_bits(options: int, cascade: bool, restart: bool) -> None:
    msg = PgOutputDecoder().decode(b"T" + u32(2) + u8(options) + u32(16390) + u32(16395))
    assert msg == Truncate(None, (16390, 16395), cascade, restart)


@pytest.mark.parametrize(("flags", "transactional"), [(0, False), (1, True)])
def test_logical_message(flags: int, transactional: bool) -> None:
    content = b"\x00binary\xffcontent"
    payload = b"M" + u8(flags) + u64(0x3_0000_0028) + b"pgcdc.heartbeat\0" + i32(len(content)) + content
    msg = PgOutputDecoder(2).decode(payload)
    assert msg == LogicalMessage(None, transactional, 0x3_0000_0028, "pgcdc.heartbeat", content)


def _in_stream(d: PgOutputDecoder) -> bool:
    return d.in_stream  # a call, so that mypy does not narrow the property across decode() calls


def test_streamed_transaction_carries_xid_only_inside_the_block() -> None:
    d = PgOutputDecoder(2, streaming=True)
    xid = 771
    row = u16(1) + b"t" + i32(1) + b"1"
    assert d.decode(b"S" + u32(xid) + b"\x01") == StreamStart(xid, True)
    assert _in_stream(d)
    stream = [
        (b"R" + u32(xid) + u32(16390) + b"public\0t\0d" + u16(1) + b"\x01id\0" + u32(23) + i32(-1),
         Relation(xid, 16390, "public", "t", "d", (Column(1, "id", 23, -1),))),
        (b"Y" + u32(xid) + u32(16401) + b"public\0mood\0", TypeInfo(xid, 16401, "public", "mood")),
        (b"I" + u32(xid) + u32(16390) + b"N" + row, Insert(xid, 16390, TupleData(b"t", (b"1",)))),
        (b"U" + u32(xid) + u32(16390) + b"N" + row, Update(xid, 16390, None, None, TupleData(b"t", (b"1",)))),
        (b"D" + u32(xid) + u32(16390) + b"K" + row, Delete(xid, 16390, TupleData(b"t", (b"1",)), "K")),
        (b"T" + u32(xid) + u32(1) + b"\x00" + u32(16390), Truncate(xid, (16390,), False, False)),
        (b"M" + u32(xid) + b"\x01" + u64(9) + b"p\0" + i32(1) + b"x",
         LogicalMessage(xid, True, 9, "p", b"x")),
        (b"O" + u64(0) + b"remote\0", Origin(0, "remote")),  # Origin never carries the xid
    ]  # fmt: skip
    for payload, expected in stream:
        assert d.decode(payload) == expected
    assert d.decode(b"E") == StreamStop()
    assert not _in_stream(d)
    # The same Insert outside the block has no xid: the first four bytes are the relation id again.
    assert d.decode(b"I" + u32(16390) + b"N" + row) == Insert(None, 16390, TupleData(b"t", (b"1",)))
    assert d.decode(b"S" + u32(xid) + b"\x00") == StreamStart(xid, False)
    assert d.decode(b"E") == StreamStop()
    commit = b"c" + u32(xid) + b"\x00" + u64(0x50) + u64(0x78) + ts(T1)
    assert d.decode(commit) == StreamCommit(xid, 0, 0x50, 0x78, T1)


def test_stream_abort_without_abort_info_before_protocol_4_parallel() -> None:
    for d in (PgOutputDecoder(2, streaming=True), PgOutputDecoder(4, streaming=True)):
        assert d.decode(b"A" + u32(771) + u32(772)) == StreamAbort(771, 772, None, None)


def test_stream_abort_with_abort_lsn_and_time_in_protocol_4_parallel() -> None:
    d = PgOutputDecoder(4, streaming=True, parallel=True)
    msg = d.decode(b"A" + u32(771) + u32(771) + u64(0x1_0000_0A00) + ts(T1))
    assert msg == StreamAbort(771, 771, 0x1_0000_0A00, T1)


def test_two_phase_messages() -> None:
    d = PgOutputDecoder(3)
    gid = b"pg_gid_16400_742\0"
    assert d.decode(b"b" + u64(0x100) + u64(0x180) + ts(T0) + u32(742) + gid) == BeginPrepare(
        0x100, 0x180, T0, 742, "pg_gid_16400_742"
    )
    assert d.decode(b"P" + b"\x00" + u64(0x100) + u64(0x180) + ts(T0) + u32(742) + gid) == Prepare(
        0, 0x100, 0x180, T0, 742, "pg_gid_16400_742"
    )
    assert d.decode(b"K" + b"\x00" + u64(0x200) + u64(0x228) + ts(T1) + u32(742) + gid) == CommitPrepared(
        0, 0x200, 0x228, T1, 742, "pg_gid_16400_742"
    )
    rollback = b"r" + b"\x00" + u64(0x180) + u64(0x300) + ts(T0) + ts(T1) + u32(743) + gid
    assert d.decode(rollback) == RollbackPrepared(0, 0x180, 0x300, T0, T1, 743, "pg_gid_16400_742")


def test_stream_prepare() -> None:
    d = PgOutputDecoder(3, streaming=True)
    payload = b"p" + b"\x00" + u64(0x100) + u64(0x180) + ts(T0) + u32(742) + b"big one\0"
    assert d.decode(payload) == StreamPrepare(0, 0x100, 0x180, T0, 742, "big one")


def test_decode_accepts_memoryview_and_bytearray() -> None:
    payload = b"I" + u32(1) + b"N" + u16(1) + b"t" + i32(3) + b"abc"
    expected = PgOutputDecoder().decode(payload)
    assert PgOutputDecoder().decode(memoryview(payload)) == expected
    assert PgOutputDecoder().decode(memoryview(b"xx" + payload)[2:]) == expected
    assert PgOutputDecoder().decode(bytearray(payload)) == expected  # type: ignore[arg-type]


def test_decode_through_xlogdata_framing() -> None:
    payload = b"I" + u32(1) + b"N" + u16(1) + b"t" + i32(3) + b"abc"
    frame = parse_copy_data(b"w" + u64(1) + u64(2) + ts(T0) + payload)
    assert isinstance(frame, XLogData)
    assert PgOutputDecoder().decode(frame.payload) == Insert(None, 1, TupleData(b"t", (b"abc",)))


# ---------------------------------------------------------------------------------------------------
# Malformed input: DecodeError, with where and what

ROW = u16(1) + b"t" + i32(1) + b"1"


@pytest.mark.parametrize(
    ("payload", "options", "match", "offset", "kind"),
    [
        (b"", {}, "empty pgoutput message", 0, None),
        (b"Z" + bytes(8), {}, "unknown pgoutput message type 'Z'", 0, "Z"),
        (b"\xff", {}, r"unknown pgoutput message type '\xff' \(0xff\)", 0, "\xff"),
        (b"B" + bytes(19), {}, "Begin message truncated: 20 bytes, its fields need 21", 20, "B"),
        (b"B" + bytes(21), {}, "Begin message: 1 unexpected bytes after its last field", 21, "B"),
        (b"C" + bytes(24), {}, "Commit message truncated", 25, "C"),
        (b"I" + u32(1) + b"N" + u16(2) + b"t" + i32(1) + b"1", {}, "Insert message truncated", 14, "I"),
        (b"I" + u32(1) + b"N" + u16(1) + b"t" + i32(5) + b"1", {}, "column 0 says 5 bytes follow, only 1", 9, "I"),
        (b"I" + u32(1) + b"N" + u16(1) + b"t" + i32(-1), {}, "column 0 says 4294967295 bytes follow", 9, "I"),
        (b"I" + u32(1) + b"N" + u16(2) + b"n" + b"x", {}, "column 1 has unknown value kind 0x78", 9, "I"),
        (b"I" + u32(1) + b"X" + ROW, {}, "Insert message: expected 'N' \\(new tuple\\), got 0x58", 5, "I"),
        (b"I" + u32(1) + b"N" + ROW + b"\0", {}, "Insert message: 1 unexpected bytes", 14, "I"),
        (b"I" + u32(1), {}, "Insert message truncated", 5, "I"),
        (b"U" + u32(1) + b"K" + ROW + b"K" + ROW, {}, "expected 'N' \\(new tuple\\), got 0x4b", 14, "U"),
        (b"U" + u32(1) + b"Q" + ROW, {}, "expected 'K' \\(old key\\), 'O' \\(old tuple\\) or 'N'", 5, "U"),
        (b"D" + u32(1) + b"N" + ROW, {}, "Delete message: expected 'K' \\(old key\\) or 'O'", 5, "D"),
        (b"T" + u32(3) + b"\0" + u32(1), {}, "3 relation ids need 12 bytes, 4 follow", 6, "T"),
        (b"T" + u32(0xFFFFFFFF) + b"\0", {}, "4294967295 relation ids need", 6, "T"),
        (b"R" + u32(1) + b"public", {}, "Relation message: the namespace has no terminating NUL", 5, "R"),
        (b"R" + u32(1) + b"public\0t\0x" + u16(0), {}, "unknown replica identity 0x78", 14, "R"),
        (b"R" + u32(1) + b"public\0t\0d" + u16(1) + b"\x01id\0" + u32(23), {}, "Relation message trunc", 25, "R"),
        (b"R" + u32(1) + b"p\xffblic\0t\0d" + u16(0), {}, "the namespace is not valid UTF-8", 6, "R"),
        (b"O" + u64(1) + b"name", {}, "Origin message: the origin name has no terminating NUL", 9, "O"),
        (b"M" + b"\x01" + u64(1) + b"p\0" + i32(5) + b"abc", {}, "length says 5 bytes, 3 follow", 12, "M"),
        (b"M" + b"\x01" + u64(1) + b"p\0" + i32(1) + b"abc", {}, "length says 1 bytes, 3 follow", 12, "M"),
        (b"S" + u32(1) + b"\x01", {}, "unexpected Stream Start message: streaming was not enabled", 0, "S"),
        (b"E", {"protocol_version": 2}, "unexpected Stream Stop message: streaming was not enabled", 0, "E"),
        (b"E", {"protocol_version": 2, "streaming": True}, "Stream Stop outside a streamed block", 0, "E"),
        (b"A" + u32(1) + u32(1), {"protocol_version": 4, "streaming": True, "parallel": True},
         "Stream Abort message truncated: 9 bytes, its fields need 25", 9, "A"),
        (b"A" + u32(1) + u32(1) + bytes(16), {"protocol_version": 4, "streaming": True},
         "Stream Abort message: 16 unexpected bytes .* match the START_REPLICATION options", 9, "A"),
        (b"b" + bytes(28) + b"gid\0", {"protocol_version": 2},
         "unexpected Begin Prepare message: two-phase messages need protocol_version 3", 0, "b"),
        (b"p" + bytes(29) + b"gid\0", {"protocol_version": 3}, "unexpected Stream Prepare message: stream", 0, "p"),
        (b"K" + bytes(29) + b"gid", {"protocol_version": 3}, "the gid has no terminating NUL", 30, "K"),
        (b"r" + bytes(20), {"protocol_version": 3}, "Rollback Prepared message truncated", 21, "r"),
    ],
)  # fmt: skip
def test_malformed_payloads_raise_decode_error(
    payload: bytes, options: dict[str, Any], match: str, offset: int, kind: str | None
) -> None:
    with pytest.raises(DecodeError, match=match) as exc:
        PgOutputDecoder(**options).decode(payload)
    assert (exc.value.offset, exc.value.kind) == (offset, kind)
    assert f"at offset {offset}" in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_stream_block_rules() -> None:
    d = PgOutputDecoder(3, streaming=True)
    d.decode(b"S" + u32(9) + b"\x01")
    with pytest.raises(DecodeError, match="Stream Start inside a streamed block"):
        d.decode(b"S" + u32(9) + b"\x00")
    with pytest.raises(DecodeError, match="Stream Commit inside a streamed block"):
        d.decode(b"c" + u32(9) + bytes(25))
    with pytest.raises(DecodeError, match="Stream Abort inside a streamed block"):
        d.decode(b"A" + u32(9) + u32(9))
    with pytest.raises(DecodeError, match="Stream Prepare inside a streamed block"):
        d.decode(b"p" + bytes(29) + b"g\0")
    assert d.in_stream  # refused messages leave the state alone
    assert d.decode(b"E") == StreamStop()


def test_a_refused_stream_start_does_not_enter_the_block() -> None:
    d = PgOutputDecoder(2, streaming=True)
    with pytest.raises(DecodeError, match="truncated"):
        d.decode(b"S" + u32(9))
    assert not d.in_stream


def test_decode_error_survives_pickling() -> None:
    with pytest.raises(DecodeError) as exc:
        PgOutputDecoder().decode(b"I" + u32(1))
    copy = pickle.loads(pickle.dumps(exc.value))  # noqa: S301 (our own bytes)
    assert (str(copy), copy.offset, copy.kind) == (str(exc.value), exc.value.offset, exc.value.kind)


# ---------------------------------------------------------------------------------------------------
# Property-based: decode(encode(m)) == m for every kind, and no exception but DecodeError on any input

u32s = st.integers(min_value=0, max_value=0xFFFFFFFF)
u64s = st.integers(min_value=0, max_value=(1 << 64) - 1)
times = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1).map(lambda pg: pg + PG_EPOCH_US)
flags8 = st.integers(min_value=0, max_value=255)
# PostgreSQL names are valid UTF-8: no NUL, and no lone surrogates (which UTF-8 cannot encode).
names = st.text(st.characters(exclude_characters="\0", exclude_categories=["Cs"]), max_size=12)
namespaces = st.one_of(st.just("pg_catalog"), names.filter(bool))
tuples = st.lists(
    st.one_of(
        st.sampled_from([(ord("n"), None), (ord("u"), None)]),
        st.tuples(st.sampled_from([ord("t"), ord("b")]), st.binary(max_size=40)),
    ),
    max_size=8,
).map(lambda cols: TupleData(bytes(k for k, _ in cols), tuple(v for _, v in cols)))
columns = st.builds(Column, flags8, names, u32s, st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1))


def _change_messages(xid: st.SearchStrategy[int | None]) -> st.SearchStrategy[Message]:
    """The messages that carry the xid inside a streamed block, plus Origin."""
    old_kinds = st.sampled_from(["K", "O"])
    return st.one_of(
        st.builds(
            Relation,
            xid,
            u32s,
            namespaces,
            names,
            st.sampled_from("dnfi"),
            st.lists(columns, max_size=5).map(tuple),
        ),
        st.builds(TypeInfo, xid, u32s, namespaces, names),
        st.builds(Insert, xid, u32s, tuples),
        st.builds(Update, xid, u32s, st.none(), st.none(), tuples),
        st.builds(Update, xid, u32s, tuples, old_kinds, tuples),
        st.builds(Delete, xid, u32s, tuples, old_kinds),
        st.builds(Truncate, xid, st.lists(u32s, max_size=6).map(tuple), st.booleans(), st.booleans()),
        st.builds(LogicalMessage, xid, st.booleans(), u64s, names, st.binary(max_size=40)),
        st.builds(Origin, u64s, names),
    )


def _control_messages(parallel: bool) -> st.SearchStrategy[Message]:
    """The messages sent outside streamed blocks (besides the changes of ordinary transactions)."""
    abort = (
        st.builds(StreamAbort, u32s, u32s, u64s, times)
        if parallel
        else st.builds(StreamAbort, u32s, u32s, st.none(), st.none())
    )
    return st.one_of(
        st.builds(Begin, u64s, times, u32s),
        st.builds(Commit, flags8, u64s, u64s, times),
        st.builds(StreamStart, u32s, st.booleans()),
        st.builds(StreamCommit, u32s, flags8, u64s, u64s, times),
        abort,
        st.builds(BeginPrepare, u64s, u64s, times, u32s, names),
        st.builds(Prepare, flags8, u64s, u64s, times, u32s, names),
        st.builds(CommitPrepared, flags8, u64s, u64s, times, u32s, names),
        st.builds(RollbackPrepared, flags8, u64s, u64s, times, times, u32s, names),
        st.builds(StreamPrepare, flags8, u64s, u64s, times, u32s, names),
    )


@st.composite
def situations(draw: st.DrawFn) -> tuple[bool, bool, Message]:
    """(parallel, in_stream, message): a message as a protocol 4 streaming walsender could send it."""
    parallel = draw(st.booleans())
    in_stream = draw(st.booleans())
    if in_stream:
        msg = draw(st.one_of(_change_messages(u32s), st.just(StreamStop())))
    else:
        msg = draw(st.one_of(_change_messages(st.none()), _control_messages(parallel)))
    return parallel, in_stream, msg


def _decoder_in(parallel: bool, in_stream: bool) -> PgOutputDecoder:
    d = PgOutputDecoder(4, streaming=True, parallel=parallel)
    if in_stream:
        d.decode(b"S" + u32(1) + b"\x01")
    return d


@given(situations())
def test_decode_inverts_encode(situation: tuple[bool, bool, Message]) -> None:
    parallel, in_stream, msg = situation
    payload = encode(msg, parallel=parallel)
    d = _decoder_in(parallel, in_stream)
    assert d.decode(payload) == msg
    assert _decoder_in(parallel, in_stream).decode(memoryview(payload)) == msg
    if isinstance(msg, StreamStart):
        assert d.in_stream
    elif isinstance(msg, StreamStop):
        assert not d.in_stream
    else:
        assert d.in_stream == in_stream


@given(_change_messages(st.none()).filter(lambda m: not isinstance(m, LogicalMessage)))
def test_protocol_1_decodes_the_same_layouts(msg: Message) -> None:
    assert PgOutputDecoder(1).decode(encode(msg)) == msg


@given(situations(), st.data())
def test_every_truncation_and_every_extension_is_refused(situation: tuple[bool, bool, Message], data: Any) -> None:
    """Each message's length is fully determined by its fields, so a prefix or a suffix never decodes."""
    parallel, in_stream, msg = situation
    payload = encode(msg, parallel=parallel)
    cut = data.draw(st.integers(min_value=0, max_value=len(payload) - 1), label="cut")
    with pytest.raises(DecodeError):
        _decoder_in(parallel, in_stream).decode(payload[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=8), label="extra")
    with pytest.raises(DecodeError):
        _decoder_in(parallel, in_stream).decode(payload + extra)


def _decode_or_decode_error(d: PgOutputDecoder, payload: bytes) -> None:
    """Either a message or a DecodeError pointing inside the payload; any other exception fails."""
    try:
        d.decode(payload)
    except DecodeError as exc:
        offset = exc.offset
    else:
        return
    assert 0 <= offset <= len(payload)


_CONFIGS = [
    {"protocol_version": 1},
    {"protocol_version": 2, "streaming": True},
    {"protocol_version": 3},
    {"protocol_version": 4, "streaming": True, "parallel": True},
]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(_CONFIGS),
    enter_stream=st.booleans(),
    payload=st.one_of(
        st.binary(max_size=64),
        st.tuples(st.sampled_from(b"BCORYIUDTMSEcAbPKrp"), st.binary(max_size=64)).map(
            lambda kb: bytes([kb[0]]) + kb[1]
        ),
    ),
)
def test_arbitrary_bytes_raise_only_decode_error(config: dict[str, Any], enter_stream: bool, payload: bytes) -> None:
    d = PgOutputDecoder(**config)
    if enter_stream and d.streaming:
        d.decode(b"S" + u32(1) + b"\x01")
    _decode_or_decode_error(d, payload)


@settings(max_examples=300)
@given(situations(), st.data())
def test_corrupted_messages_raise_only_decode_error(situation: tuple[bool, bool, Message], data: Any) -> None:
    parallel, in_stream, msg = situation
    payload = bytearray(encode(msg, parallel=parallel))
    for _ in range(data.draw(st.integers(min_value=1, max_value=3), label="flips")):
        where = data.draw(st.integers(min_value=0, max_value=len(payload) - 1), label="where")
        payload[where] = data.draw(st.integers(min_value=0, max_value=255), label="byte")
    _decode_or_decode_error(_decoder_in(parallel, in_stream), bytes(payload))


@given(st.binary(max_size=40))
def test_parse_copy_data_on_arbitrary_bytes(buf: bytes) -> None:
    try:
        msg = parse_copy_data(buf)
    except DecodeError:
        return
    assert isinstance(msg, XLogData | Keepalive)


# ---------------------------------------------------------------------------------------------------
# A figure, not a gate: how fast an Insert of five text columns decodes here.


def test_print_insert_decode_speed() -> None:
    values = [b"42", b"a short note", b"2024-11-22 10:15:00.123456+00", b'{"k": [1, 2, 3]}', b"1234.5678"]
    payload = b"I" + u32(16390) + b"N" + u16(5) + b"".join(b"t" + i32(len(v)) + v for v in values)
    frame = b"w" + u64(1) + u64(2) + ts(T0) + payload
    d = PgOutputDecoder()
    assert d.decode(payload) == Insert(None, 16390, TupleData(b"ttttt", tuple(values)))
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        d.decode(payload)
    decode_only = n / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(n):
        xlog = parse_copy_data(frame)
        assert isinstance(xlog, XLogData)
        d.decode(xlog.payload)
    framed = n / (time.perf_counter() - start)
    print(f"\npgoutput Insert, 5 text columns: {decode_only:,.0f}/s decode, {framed:,.0f}/s with XLogData framing")
