"""The committed state: every shape format 1 took is read and written back with the same keys and meanings
(plus ``version``), so a capture resumes from it without a re-snapshot; a newer format or a damaged record is
refused with the reason."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc._offsets import (
    PLAIN_STATE_VERSION,
    STATE_VERSION,
    BackfillProgress,
    CaptureState,
    OffsetsStateError,
    RangeProgress,
    SnapshotState,
    TableProgress,
)
from cdc.errors import StreamError
from cdc.kafka import OffsetStore

_DONE = {"done": True}

# Format 1, as the release before format 2 committed it, one fixture per situation it could stop in.
V1: dict[str, dict[str, Any]] = {
    "streaming, no snapshot": {"lsn": 23861472},
    "streaming after a snapshot": {
        "lsn": 40000000,
        "snapshot": {"status": "done", "consistent_lsn": 23861472, "tables": {"public.a": _DONE, "public.b": _DONE}},
    },
    "mid-snapshot in key ranges": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {
                "public.a": _DONE,
                "public.b": {
                    "since": {"0": 0, "1": 0},
                    "ranges": [
                        {"after": ["1000"], "upto": ["2000"], "done": False},
                        {"after": ["2000"], "upto": ["3000"], "done": True},
                        {"after": None, "upto": None, "done": False},
                    ],
                },
            },
        },
    },
    "mid-snapshot in block ranges": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {
                "public.big": {
                    "since": {"0": 0},
                    "ranges": [
                        {"after": None, "upto": None, "done": True, "blocks": [0, 4096], "filenode": 16384},
                        {"after": None, "upto": None, "done": False, "blocks": [4096, None], "filenode": 16384},
                    ],
                }
            },
        },
    },
    "during the gap deletes": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {
                "public.b": {
                    "since": {"0": 812},
                    "ranges": [{"after": ["a", "2026-01-01 00:00:00+00"], "upto": None, "done": True}],
                }
            },
        },
    },
    "one range per table, with start offsets": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {"public.b": {"after": ["42"], "done": False, "since": {"0": 3}}},
        },
    },
    "one range per table, without start offsets": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {"public.b": {"after": ["42"], "done": False}},
        },
    },
    "snapshot just begun": {
        "lsn": 23861472,
        "snapshot": {"status": "running", "consistent_lsn": 23861472, "tables": {"public.a": {}}},
    },
    "no table begun yet": {"lsn": 5, "snapshot": {"status": "running", "consistent_lsn": 5, "tables": {}}},
    "start offsets on several partitions": {
        "lsn": 23861472,
        "snapshot": {
            "status": "running",
            "consistent_lsn": 23861472,
            "tables": {"public.b": {"since": {"0": 10, "1": 12, "2": 0}, "ranges": []}},
        },
    },
}


@pytest.mark.parametrize("name", list(V1))
def test_format_1_reads_and_writes_back_with_the_same_keys(name: str) -> None:
    v1 = V1[name]
    state = CaptureState.from_json(copy.deepcopy(v1))
    assert state.to_json() == {**v1, "version": PLAIN_STATE_VERSION}
    # What the offsets topic holds: a reader of format 1 finds every key it knows, with the same value.
    assert json.loads(json.dumps(state.to_json())) == {**v1, "version": PLAIN_STATE_VERSION}


def test_mid_snapshot_state_says_where_to_resume() -> None:
    state = CaptureState.from_json(V1["mid-snapshot in key ranges"])
    snap = state.snapshot
    assert snap is not None
    assert state.snapshot_running
    assert snap.table_done("public.a")
    assert not snap.table_done("public.b")
    assert not snap.table_done("public.c")
    b = snap.tables["public.b"]
    assert b.since == {0: 0, 1: 0}
    assert b.ranges is not None
    assert [(r.after, r.upto, r.done) for r in b.ranges] == [
        (["1000"], ["2000"], False),
        (["2000"], ["3000"], True),
        (None, None, False),
    ]
    blocks = CaptureState.from_json(V1["mid-snapshot in block ranges"]).snapshot
    assert blocks is not None
    ranges = blocks.tables["public.big"].ranges
    assert ranges is not None
    assert [(r.blocks, r.filenode) for r in ranges] == [([0, 4096], 16384), ([4096, None], 16384)]
    legacy = CaptureState.from_json(V1["one range per table, without start offsets"]).snapshot
    assert legacy is not None
    assert legacy.tables["public.b"] == TableProgress(legacy_after=["42"])


def test_a_table_done_keeps_nothing_else() -> None:
    progress = TableProgress(ranges=[RangeProgress(after=["1"], done=True)], since={0: 4})
    progress.done = True
    assert progress.to_json() == {"done": True}


def test_the_first_state_of_a_snapshot() -> None:
    state = CaptureState(lsn=7, snapshot=SnapshotState.started(7))
    state.snapshot.table("public.a")  # type: ignore[union-attr]
    assert state.to_json() == {
        "version": PLAIN_STATE_VERSION,
        "lsn": 7,
        "snapshot": {"status": "running", "consistent_lsn": 7, "tables": {"public.a": {}}},
    }


def test_a_tables_topic_generation_is_kept_in_format_4_and_only_then() -> None:
    state = CaptureState(lsn=7, generations={"public.items": 2})
    assert state.to_json() == {"version": STATE_VERSION, "lsn": 7, "generations": {"public.items": 2}}
    assert CaptureState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert CaptureState(lsn=7).to_json() == {"version": PLAIN_STATE_VERSION, "lsn": 7}  # older releases read it
    with pytest.raises(OffsetsStateError, match="topic generations are not table names and numbers from 2"):
        CaptureState.from_json({"version": 4, "lsn": 1, "generations": {"public.items": 1}})


def test_a_newer_format_is_refused_with_the_way_out() -> None:
    with pytest.raises(OffsetsStateError, match=r"format 5; this release of pgcdc reads formats 1 to 4") as info:
        CaptureState.from_json({"version": 5, "lsn": 1})
    assert isinstance(info.value, StreamError)
    assert info.value.exit_code == 7
    assert "upgrade" in str(info.value)


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ([1, 2], "the offsets record is not a JSON object"),
        ({"lsn": "0/16B3748"}, "lsn is not a non-negative integer"),
        ({"lsn": -1}, "lsn is not a non-negative integer"),
        ({"lsn": 1, "snapshot": {"status": "paused", "consistent_lsn": 1}}, "neither running nor done"),
        ({"lsn": 1, "snapshot": {"status": "running", "consistent_lsn": None}}, "consistent_lsn is not an LSN"),
        ({"lsn": 1, "snapshot": {"status": "running", "consistent_lsn": 1, "tables": {"t": {"done": 1}}}}, "done"),
        (
            {"lsn": 1, "snapshot": {"status": "running", "consistent_lsn": 1, "tables": {"t": {"since": {"x": 1}}}}},
            "start offsets",
        ),
        (
            {"lsn": 1, "snapshot": {"status": "running", "consistent_lsn": 1, "tables": {"t": {"after": [1]}}}},
            "after is not a key",
        ),
        (
            {
                "lsn": 1,
                "snapshot": {
                    "status": "running",
                    "consistent_lsn": 1,
                    "tables": {"t": {"ranges": [{"blocks": [0], "done": False}]}},
                },
            },
            "blocks",
        ),
        ({"version": True, "lsn": 1}, "format True"),
    ],
)
def test_a_damaged_record_is_refused_with_what_is_wrong(record: Any, says: str) -> None:
    with pytest.raises(OffsetsStateError, match=says):
        CaptureState.from_json(record)


_keys = st.one_of(st.none(), st.lists(st.text(max_size=8), min_size=1, max_size=3))
_offsets = st.integers(min_value=0, max_value=2**62)
_ranges = st.builds(
    RangeProgress,
    after=_keys,
    upto=_keys,
    done=st.booleans(),
    blocks=st.one_of(st.none(), st.lists(st.one_of(st.none(), _offsets), min_size=2, max_size=2)),
    filenode=st.one_of(st.none(), _offsets),
)
_tables = st.builds(
    TableProgress,
    done=st.just(False),
    ranges=st.one_of(st.none(), st.lists(_ranges, max_size=4)),
    since=st.one_of(st.none(), st.dictionaries(st.integers(0, 64), _offsets, max_size=4)),
    legacy_after=st.one_of(st.none(), st.lists(st.text(max_size=8), min_size=1, max_size=3)),
)
_states = st.builds(
    CaptureState,
    lsn=st.one_of(st.none(), _offsets),
    snapshot=st.one_of(
        st.none(),
        st.builds(
            SnapshotState,
            status=st.sampled_from(["running", "done"]),
            consistent_lsn=_offsets,
            tables=st.dictionaries(st.text(min_size=1, max_size=12), st.one_of(_tables, st.just(TableProgress(True)))),
        ),
    ),
)


@given(_states)
def test_every_state_survives_its_record(state: CaptureState) -> None:
    for progress in state.snapshot.tables.values() if state.snapshot else []:
        for r in progress.ranges or []:
            if r.blocks is None:
                r.filenode = None  # a key range has no file: not written, so not read back
    assert CaptureState.from_json(json.loads(json.dumps(state.to_json()))) == state


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b'{"version": 5, "lsn": 1}', "slot 'slot_a' in topic 'p.offsets': the offsets record has format 5"),
        (b"{not json", "cannot be resumed: .*produce a corrected record under the same key, or run `cdc detach`"),
        (b'{"lsn": "x"}', "lsn is not a non-negative integer: 'x'. Nothing was read from the slot"),
    ],
)
def test_the_store_names_the_record_and_the_way_on(value: bytes, says: str) -> None:
    store = OffsetStore({}, "p.offsets", "slot_a")
    with pytest.raises(OffsetsStateError, match=says) as info:
        store._decode(value)
    assert info.value.exit_code == 7


def test_the_store_writes_what_it_reads() -> None:
    store = OffsetStore({}, "p.offsets", "slot_a")
    state = CaptureState.from_json(V1["mid-snapshot in key ranges"])
    assert store._decode(store.encode(state)) == state


def test_format_3_keeps_the_known_tables_the_backfills_and_the_last_signal() -> None:
    raw = {
        "version": 3,
        "lsn": 9,
        "tables": ["public.a", "public.b"],
        "signal": 12,
        "signal_offsets": {"0": 4},
        "backfills": [
            {
                "id": "12",
                "table": "public.a",
                "status": "running",
                "rows": 10,
                "chunks": 1,
                "reason": "requested",
                "where": "x > 1",
                "after": ["10"],
            },
            {"id": "added-1", "table": "public.b", "status": "queued", "rows": 0, "chunks": 0, "reason": "added"},
            {
                "id": "13",
                "table": "public.a",
                "status": "done",
                "rows": 3,
                "chunks": 1,
                "reason": "keys",
                "keys": 13,  # the signal whose row lists them
                "deleted": 1,
                "after": ["4"],
            },
        ],
    }
    state = CaptureState.from_json(raw)
    assert state.tables == ["public.a", "public.b"]
    assert state.signal == 12
    assert state.signal_offsets == {0: 4}
    assert [(b.id, b.status, b.where, b.after, b.rows) for b in state.backfills] == [
        ("12", "running", "x > 1", ["10"], 10),
        ("added-1", "queued", None, None, 0),
        ("13", "done", None, ["4"], 3),
    ]
    assert (state.backfills[2].keys, state.backfills[2].deleted) == (13, 1)
    assert state.to_json() == raw


def test_a_format_2_state_has_no_known_tables_and_no_backfills() -> None:
    state = CaptureState.from_json({"version": 2, "lsn": 9, "snapshot": {"status": "done", "consistent_lsn": 7}})
    assert state.tables is None
    assert state.backfills == []
    assert state.signal == 0


def test_only_the_last_finished_backfills_are_kept() -> None:
    state = CaptureState(lsn=1, backfills=[BackfillProgress(str(i), "public.a", "done") for i in range(30)])
    state.backfills.append(BackfillProgress("running", "public.a", "running"))
    state.forget_finished()
    assert [b.id for b in state.backfills] == [*(str(i) for i in range(10, 30)), "running"]


@pytest.mark.parametrize(
    ("backfill", "says"),
    [
        ({"id": "1", "table": "public.a", "status": "sleeping"}, "a backfill's status is not one of"),
        ({"id": 1, "table": "public.a", "status": "done"}, "a backfill's id is not a string"),
        ({"id": "1", "table": "public.a", "status": "done", "rows": -1}, "rows is not a non-negative integer"),
    ],
)
def test_a_damaged_backfill_is_named(backfill: dict[str, object], says: str) -> None:
    with pytest.raises(OffsetsStateError, match=says):
        CaptureState.from_json({"version": 3, "lsn": 1, "backfills": [backfill]})
