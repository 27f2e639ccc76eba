"""The pgoutput decoder on bytes captured from a real PostgreSQL (tests/data/pgoutput/captured.json).

tests/integration/test_pgoutput_capture.py makes the writes described here on a live server, decodes the
replication stream with the same checks, and (with ``PGCDC_RECAPTURE=1``) saves the frames it received.
The checks below say what the server must have sent for those writes; they hold for the live stream and
for the saved one alike. LSNs, xids, OIDs and times vary between captures, so they are checked for
consistency (a Commit matches its Begin, a column's type is the Type message's OID), not for value.

Large frames (the 20 kB TOAST insert, the bulk of each streamed transaction) are not saved: each run of
them is replaced by ``{"omitted": kind, "count": n}`` and replays as an :class:`Omitted` placeholder, so
the message sequence stays exact.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from decoders import (
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
    Update,
    XLogData,
    parse_copy_data,
)

DATA_FILE = Path(__file__).resolve().parents[1] / "data" / "pgoutput" / "captured.json"

# -- what the capture writes -------------------------------------------------------------------------

NOTE = "héllo wörld"
CREATED = "2024-11-22 10:15:00.123456+00"  # the walsender runs with TimeZone=UTC, DateStyle ISO
BIG_ROWS = 500  # rows per bulk transaction: ~100 kB in the reorder buffer, over logical_decoding_work_mem=64kB
BIN_AT = datetime(2024, 11, 22, 10, 15, tzinfo=UTC)
ORIGIN_LSN = 0xABCDEF


def big_text() -> str:
    """20 kB of hex that pglz cannot shrink, so PostgreSQL stores it out of line (TOAST)."""
    return "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(320))


def names(suffix: str) -> dict[str, str]:
    """Every object a capture creates, by role."""
    return {
        "items": f"pgcdc_items_{suffix}",
        "full": f"pgcdc_full_{suffix}",
        "parent": f"pgcdc_parent_{suffix}",
        "child": f"pgcdc_child_{suffix}",
        "mood": f"pgcdc_mood_{suffix}",
        "bin": f"pgcdc_bin_{suffix}",
        "tp": f"pgcdc_tp_{suffix}",
        "origin": f"pgcdc_origin_{suffix}",
        "prefix": f"pgcdc.cap.{suffix}",
        "gid_commit": f"pgcdc_gid_commit_{suffix}",
        "gid_rollback": f"pgcdc_gid_rollback_{suffix}",
        "gid_stream": f"pgcdc_gid_stream_{suffix}",
    }


# -- replaying saved frames --------------------------------------------------------------------------


@dataclass(frozen=True)
class Omitted:
    """A run of ``count`` messages of one kind that the capture did not save (too large or too many)."""

    kind: str
    count: int


Captured = Message | Omitted

_KIND_CHARS: dict[type, str] = {
    Begin: "B", Commit: "C", Origin: "O", Relation: "R", TypeInfo: "Y", Insert: "I", Update: "U",
    Delete: "D", Truncate: "T", LogicalMessage: "M", StreamStart: "S", StreamStop: "E", StreamCommit: "c",
    StreamAbort: "A", BeginPrepare: "b", Prepare: "P", CommitPrepared: "K", RollbackPrepared: "r",
    StreamPrepare: "p",
}  # fmt: skip


def kind_of(msg: Captured) -> str:
    return msg.kind if isinstance(msg, Omitted) else _KIND_CHARS[type(msg)]


def shape(msgs: list[Captured]) -> str:
    """The message kinds in order, one letter each (as on the wire); an omitted run counts its length."""
    return "".join(m.kind * m.count if isinstance(m, Omitted) else kind_of(m) for m in msgs)


def load_scenarios() -> dict[str, Any]:
    scenarios: dict[str, Any] = json.loads(DATA_FILE.read_text())["scenarios"]
    return scenarios


def replay(scenario: dict[str, Any]) -> tuple[list[Captured], list[XLogData | Keepalive]]:
    """Parse and decode a saved scenario's frames in order, as the capture service would."""
    decoder = PgOutputDecoder(**scenario["decoder"])
    msgs: list[Captured] = []
    frames: list[XLogData | Keepalive] = []
    for entry in scenario["frames"]:
        if isinstance(entry, dict):
            msgs.append(Omitted(entry["omitted"], entry["count"]))
            continue
        frame = parse_copy_data(bytes.fromhex(entry))
        frames.append(frame)
        if isinstance(frame, XLogData):
            msgs.append(decoder.decode(frame.payload))
    return msgs, frames


# -- checks shared with the live capture -------------------------------------------------------------


T = TypeVar("T")


def _get(msgs: list[Captured], index: int, cls: type[T]) -> T:
    msg = msgs[index]
    assert isinstance(msg, cls), (index, msg)
    return msg


def _check_time(us: int, now_us: int | None) -> None:
    """A server time converted to Unix µs: close to now when live; after 2024 and not in the future saved."""
    if now_us is not None:
        assert abs(us - now_us) < 3_600_000_000, (us, now_us)
    else:
        assert 1_704_067_200_000_000 < us < datetime.now(UTC).timestamp() * 1e6 + 86_400e6, us


def _check_transactions(msgs: list[Captured], now_us: int | None) -> None:
    """Each Begin is closed by a Commit for the same commit LSN and time."""
    begin: Begin | None = None
    for msg in msgs:
        if isinstance(msg, Begin):
            assert begin is None, "Begin inside a transaction"
            begin = msg
            _check_time(msg.commit_time_us, now_us)
        elif isinstance(msg, Commit):
            assert begin is not None, "Commit without Begin"
            assert (msg.flags, msg.commit_lsn, msg.commit_time_us) == (
                0,
                begin.final_lsn,
                begin.commit_time_us,
            )
            assert msg.end_lsn > msg.commit_lsn
            begin = None
    assert begin is None


def _stream_blocks(msgs: list[Captured]) -> dict[int, list[Captured]]:
    """Top-level xid -> every message streamed for it, across its blocks; checks the segment flags.

    Inside a block each change carries the xid of the (sub)transaction that made it, which is the
    top-level xid of the Stream Start or one of its subtransactions' xids (what Stream Abort's subxid
    refers to); it is never absent.
    """
    blocks: dict[int, list[Captured]] = {}
    xid: int | None = None
    for msg in msgs:
        if isinstance(msg, StreamStart):
            assert xid is None
            xid = msg.xid
            assert msg.first_segment == (xid not in blocks), msg
            blocks.setdefault(xid, [])
        elif isinstance(msg, StreamStop):
            assert xid is not None
            xid = None
        elif xid is not None:
            if not isinstance(msg, Omitted | Origin):
                assert isinstance(getattr(msg, "xid", None), int), f"{msg!r} inside the block of xid {xid}"
            blocks[xid].append(msg)
    assert xid is None
    return blocks


def _xids(msgs: list[Captured]) -> set[int]:
    return {m.xid for m in msgs if isinstance(m, Relation | Insert | LogicalMessage) and m.xid is not None}


def _count(msgs: list[Captured], kind: str) -> int:
    return shape(msgs).count(kind)


def _tuple(kinds: str, *values: bytes | str | None) -> TupleData:
    return TupleData(kinds.encode(), tuple(v.encode() if isinstance(v, str) else v for v in values))


def check_v1_text(msgs: list[Captured], suffix: str, *, now_us: int | None = None) -> None:
    """Protocol 1, text values: every row change kind, TOAST, REPLICA IDENTITY FULL, TRUNCATE, Origin."""
    n = names(suffix)
    transactions = ["BYRIC", "BIC", "BUC", "BUC", "BDC", "BRIC", "BUC", "BDC", "BRRTC", "BRTC", "BOIC"]
    assert shape(msgs) == "".join(transactions)
    _check_transactions(msgs, now_us)
    assert not any(getattr(m, "xid", None) is not None for m in msgs if not isinstance(m, Begin))

    mood = _get(msgs, 1, TypeInfo)
    assert (mood.xid, mood.namespace, mood.name) == (None, "public", n["mood"])
    items = _get(msgs, 2, Relation)
    assert (items.xid, items.namespace, items.name, items.replica_identity) == (
        None,
        "public",
        n["items"],
        "d",
    )
    assert items.columns == (
        Column(1, "id", 23, -1),
        Column(0, "note", 25, -1),
        Column(0, "qty", 23, -1),
        Column(0, "price", 1700, (10 << 16 | 2) + 4),  # numeric(10,2)
        Column(0, "mood", mood.oid, -1),
        Column(0, "created", 1184, -1),
        Column(0, "blob", 25, -1),
    )
    assert [c.is_key for c in items.columns] == [True] + [False] * 6
    rid = items.relid

    row1 = _tuple("ttntttn", "1", NOTE, None, "12.50", "happy", CREATED, None)
    assert _get(msgs, 3, Insert) == Insert(None, rid, row1)
    if not isinstance(msgs[6], Omitted):  # the TOAST row is too large to save
        row2 = _tuple("ttttttt", "2", "toast", "7", "0.10", "sad", "2000-01-01 00:00:00+00", big_text())
        assert _get(msgs, 6, Insert) == Insert(None, rid, row2)
    # qty changed, the out-of-line blob did not: it is not sent again ('u'); key unchanged: no old tuple.
    row2_after = _tuple("ttttttu", "2", "toast", "8", "0.10", "sad", "2000-01-01 00:00:00+00", None)
    assert _get(msgs, 9, Update) == Update(None, rid, None, None, row2_after)
    # the key changed: the old key follows ('K'), the other columns of the old key tuple are null.
    old_key = _tuple("tnnnnnn", "1", None, None, None, None, None, None)
    row3 = _tuple("ttntttn", "3", NOTE, None, "12.50", "happy", CREATED, None)
    assert _get(msgs, 12, Update) == Update(None, rid, old_key, "K", row3)
    assert _get(msgs, 15, Delete) == Delete(None, rid, _tuple("tnnnnnn", "3", *[None] * 6), "K")

    full = _get(msgs, 18, Relation)
    assert (full.name, full.replica_identity) == (n["full"], "f")
    assert full.columns == (Column(1, "id", 23, -1), Column(1, "note", 25, -1))  # FULL: every column is key
    assert _get(msgs, 19, Insert) == Insert(None, full.relid, _tuple("tt", "1", "a"))
    update = Update(None, full.relid, _tuple("tt", "1", "a"), "O", _tuple("tt", "1", "b"))
    assert _get(msgs, 22, Update) == update
    assert _get(msgs, 25, Delete) == Delete(None, full.relid, _tuple("tt", "1", "b"), "O")

    # TRUNCATE parent RESTART IDENTITY CASCADE: the child is truncated too, both in one message.
    truncated = [_get(msgs, 28, Relation), _get(msgs, 29, Relation)]
    assert {r.name for r in truncated} == {n["parent"], n["child"]}
    truncate = _get(msgs, 30, Truncate)
    assert sorted(truncate.relids) == sorted(r.relid for r in truncated)
    assert (truncate.xid, truncate.cascade, truncate.restart_identity) == (None, True, True)
    # TRUNCATE gives the table a new relfilenode; the relcache invalidation makes pgoutput resend it.
    assert _get(msgs, 33, Relation) == full
    assert _get(msgs, 34, Truncate) == Truncate(None, (full.relid,), False, False)

    assert _get(msgs, 37, Origin) == Origin(ORIGIN_LSN, n["origin"])
    row10 = _tuple("ttnnnnn", "10", "from elsewhere", None, None, None, None, None)
    assert _get(msgs, 38, Insert) == Insert(None, rid, row10)


def check_v2_binary_streaming(msgs: list[Captured], suffix: str, *, now_us: int | None = None) -> None:
    """Protocol 2, binary values, logical messages, and three streamed transactions.

    A bulk insert committed (Stream Commit), one rolled back (Stream Abort, subxid = xid), and one whose
    savepoint was rolled back after streaming began (Stream Abort for the subtransaction, then Commit).
    """
    n = names(suffix)
    streamed = r"(?:S[RIM]+E)+"
    match = re.fullmatch(f"(BRIMC)(M)({streamed})(c)({streamed})(A)({streamed})(A)({streamed})(c)", shape(msgs))
    assert match, shape(msgs)
    _check_transactions(msgs, now_us)

    rel = _get(msgs, 1, Relation)
    assert (rel.xid, rel.name, rel.replica_identity) == (None, n["bin"], "d")
    assert [(c.name, c.type_oid, c.is_key) for c in rel.columns] == [
        ("id", 23, True), ("note", 25, False), ("amount", 20, False), ("at", 1184, False),
        ("flag", 16, False), ("payload", 25, False),
    ]  # fmt: skip
    at_pg_us = int(BIN_AT.timestamp() * 1_000_000) - 946_684_800_000_000
    binary_row = TupleData(
        b"bbbbbn",
        (
            struct.pack(">i", 1),
            b"binary",
            struct.pack(">q", 9_000_000_000),
            struct.pack(">q", at_pg_us),
            b"\x01",
            None,
        ),
    )
    assert _get(msgs, 2, Insert) == Insert(None, rel.relid, binary_row)
    inside = _get(msgs, 3, LogicalMessage)
    assert (inside.xid, inside.transactional, inside.prefix, inside.content) == (
        None,
        True,
        n["prefix"],
        b"inside",
    )
    outside = _get(msgs, 5, LogicalMessage)
    assert (outside.xid, outside.transactional, outside.prefix) == (None, False, n["prefix"])
    assert outside.content == b"\x00\x01\xff"
    assert outside.lsn > inside.lsn

    blocks = _stream_blocks(msgs)
    assert len(blocks) == 3, blocks.keys()
    ends = [m for m in msgs if isinstance(m, StreamCommit | StreamAbort)]
    assert [type(m) for m in ends] == [StreamCommit, StreamAbort, StreamAbort, StreamCommit]
    committed, aborted, sub_aborted, sub_committed = ends
    assert isinstance(committed, StreamCommit)
    assert isinstance(sub_committed, StreamCommit)
    assert isinstance(aborted, StreamAbort)
    assert isinstance(sub_aborted, StreamAbort)
    for commit in (committed, sub_committed):
        assert commit.flags == 0
        assert commit.end_lsn > commit.commit_lsn
        _check_time(commit.commit_time_us, now_us)
    assert aborted.xid == aborted.subxid  # the whole transaction rolled back
    assert (aborted.abort_lsn, aborted.abort_time_us) == (None, None)  # protocol 2: not sent
    assert sub_aborted.xid == sub_committed.xid != sub_aborted.subxid  # only its savepoint rolled back
    assert len({committed.xid, aborted.xid, sub_committed.xid}) == 3

    first = blocks[committed.xid]
    assert _xids(first) == {committed.xid}  # no subtransactions: every change carries the top-level xid
    assert _count(first, "I") == BIG_ROWS
    assert kind_of(first[0]) == "R"
    streamed_rel = _get(first, 0, Relation)  # schema is sent again inside each streamed transaction
    assert (streamed_rel.xid, streamed_rel.relid, streamed_rel.columns) == (
        committed.xid,
        rel.relid,
        rel.columns,
    )
    [message] = [m for m in first if isinstance(m, LogicalMessage)]
    assert (message.xid, message.transactional, message.prefix, message.content) == (
        committed.xid,
        True,
        n["prefix"],
        b"in stream",
    )
    sample = next(m for m in first if isinstance(m, Insert))
    assert sample.new.kinds == b"bbnnnb"
    assert sample.new.values[:2] == (struct.pack(">i", 1000), b"bulk")
    assert _xids(blocks[aborted.xid]) == {aborted.xid}
    assert 0 < _count(blocks[aborted.xid], "I") <= BIG_ROWS

    # 10 rows, part of the rolled-back savepoint's rows (those streamed before its abort), BIG_ROWS more.
    last = blocks[sub_committed.xid]
    assert 10 + BIG_ROWS < _count(last, "I") <= 10 + 2 * BIG_ROWS
    # Rows carry the xid of the subtransaction that wrote them: the first 10 the top-level one, the
    # savepoint's (ids 4000+) its subxid, which is how a receiver knows what Stream Abort discards; after
    # ROLLBACK TO SAVEPOINT the savepoint is re-established, so the last rows (5000+) have a third xid.
    by_range: dict[int, set[int | None]] = {}
    for insert in (m for m in last if isinstance(m, Insert)):
        (row_id,) = struct.unpack(">i", insert.new.values[0] or b"")
        by_range.setdefault(row_id // 1000, set()).add(insert.xid)
    assert by_range.get(3, {sub_committed.xid}) == {sub_committed.xid}
    assert by_range.get(4, {sub_aborted.subxid}) == {sub_aborted.subxid}
    resumed = by_range.get(5, set())
    assert len(resumed) <= 1
    assert not resumed & {sub_committed.xid, sub_aborted.subxid}
    assert _xids(last) <= {sub_committed.xid, sub_aborted.subxid, *resumed}
    if not any(isinstance(m, Omitted) for m in last):  # live: every row is there
        assert set(by_range) == {3, 4, 5}
        assert len(resumed) == 1


def check_v3_two_phase(msgs: list[Captured], suffix: str, *, now_us: int | None = None) -> None:
    """Protocol 3 with two_phase and streaming: prepared transactions committed, rolled back, streamed."""
    n = names(suffix)
    match = re.fullmatch(r"(bRIP)(K)(bIP)(r)((?:S[RI]+E)+)(p)(K)", shape(msgs))
    assert match, shape(msgs)
    begin = _get(msgs, 0, BeginPrepare)
    rel = _get(msgs, 1, Relation)
    assert (rel.name, rel.xid) == (n["tp"], None)
    assert _get(msgs, 2, Insert) == Insert(None, rel.relid, _tuple("tt", "1", "prepared"))
    prepare = _get(msgs, 3, Prepare)
    assert begin.gid == prepare.gid == n["gid_commit"]
    assert (prepare.flags, prepare.prepare_lsn, prepare.end_lsn, prepare.xid) == (
        0,
        begin.prepare_lsn,
        begin.end_lsn,
        begin.xid,
    )
    assert prepare.prepare_time_us == begin.prepare_time_us
    _check_time(prepare.prepare_time_us, now_us)
    commit = _get(msgs, 4, CommitPrepared)
    assert (commit.flags, commit.xid, commit.gid) == (0, begin.xid, n["gid_commit"])
    assert commit.commit_lsn >= prepare.end_lsn
    _check_time(commit.commit_time_us, now_us)

    begin2 = _get(msgs, 5, BeginPrepare)
    assert begin2.gid == n["gid_rollback"]
    assert _get(msgs, 6, Insert) == Insert(None, rel.relid, _tuple("tt", "2", "rolled back"))
    prepare2 = _get(msgs, 7, Prepare)
    rollback = _get(msgs, 8, RollbackPrepared)
    assert (rollback.flags, rollback.xid, rollback.gid) == (0, begin2.xid, n["gid_rollback"])
    assert (rollback.prepare_end_lsn, rollback.prepare_time_us) == (
        prepare2.end_lsn,
        prepare2.prepare_time_us,
    )
    assert rollback.rollback_end_lsn > rollback.prepare_end_lsn
    _check_time(rollback.rollback_time_us, now_us)

    stream_prepare = next(m for m in msgs if isinstance(m, StreamPrepare))
    assert (stream_prepare.flags, stream_prepare.gid) == (0, n["gid_stream"])
    blocks = _stream_blocks(msgs)
    assert list(blocks) == [stream_prepare.xid]
    assert _count(blocks[stream_prepare.xid], "I") == BIG_ROWS
    last = _get(msgs, len(msgs) - 1, CommitPrepared)
    assert (last.xid, last.gid) == (stream_prepare.xid, n["gid_stream"])


CHECKS = {
    "v1_text": check_v1_text,
    "v2_binary_streaming": check_v2_binary_streaming,
    "v3_two_phase": check_v3_two_phase,
}


def check_frames(frames: list[XLogData | Keepalive], *, now_us: int | None = None) -> None:
    """The replication framing around the messages: send times in the Unix epoch, consistent LSNs."""
    assert any(isinstance(f, XLogData) for f in frames)
    for frame in frames:
        _check_time(frame.send_time_us, now_us)
        if isinstance(frame, XLogData):
            # A logical walsender writes the LSN of the record being decoded as both start and end
            # (0 for messages tied to no record, such as Relation).
            assert frame.start_lsn == frame.end_lsn, frame


# -- the unit tests: replay the saved captures ----------------------------------------------------------

SCENARIOS = load_scenarios() if DATA_FILE.exists() else {}


def test_captured_file_has_every_scenario() -> None:
    assert set(SCENARIOS) >= {"v1_text", "v2_binary_streaming"}, "run the capture with PGCDC_RECAPTURE=1"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_captured_scenario_decodes_to_what_was_written(name: str) -> None:
    scenario = SCENARIOS[name]
    msgs, frames = replay(scenario)
    CHECKS[name](msgs, scenario["suffix"])
    check_frames(frames)


def test_captured_vectors_cover_every_message_kind_the_server_sent() -> None:
    seen = set()
    for scenario in SCENARIOS.values():
        msgs, _ = replay(scenario)
        seen |= {kind_of(m) for m in msgs if not isinstance(m, Omitted)}
    captured_kinds = set("BCORYIUDTMSEcA")
    if "v3_two_phase" in SCENARIOS:
        captured_kinds |= set("bPKrp")
    assert seen >= captured_kinds, sorted(captured_kinds - seen)


def test_captured_keepalive_and_xlogdata_framing() -> None:
    kinds = {type(f) for scenario in SCENARIOS.values() for f in replay(scenario)[1]}
    assert XLogData in kinds
    keepalives = [f for scenario in SCENARIOS.values() for f in replay(scenario)[1] if isinstance(f, Keepalive)]
    assert keepalives, "the capture saves the server's keepalives too"


def test_a_check_fails_on_a_wrong_value() -> None:
    """The shared checks can fail: flip one captured value and the scenario is rejected."""
    scenario = SCENARIOS["v1_text"]
    msgs, _ = replay(scenario)
    insert = msgs[3]
    assert isinstance(insert, Insert)
    msgs[3] = Insert(None, insert.relid, TupleData(insert.new.kinds, (b"2", *insert.new.values[1:])))
    with pytest.raises(AssertionError):
        check_v1_text(msgs, scenario["suffix"])


def test_a_decoder_with_the_wrong_options_rejects_a_streamed_capture() -> None:
    """Decoding a streamed capture as if streaming were off must fail loudly, not misread the xids."""
    scenario = dict(SCENARIOS["v2_binary_streaming"], decoder={"protocol_version": 2})
    with pytest.raises(DecodeError, match="streaming was not enabled"):
        replay(scenario)
