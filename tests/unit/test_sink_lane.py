"""The lane's bookkeeping (sinks._lane): which part of a batch is left to the query, and where it reads from."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from sinks._feed import LaneFeed, Reader
from sinks._lane import Lane
from sinks.config import SinkSettings

A, B = ("t", 0), ("t", 1)


class _Feed(LaneFeed):
    """The process's reader, without its thread: records what the lanes ask for."""

    def __init__(self) -> None:
        super().__init__(SinkSettings(), lambda _records: [])
        self.assigned: list[dict[tuple[str, int], int]] = []

    def want(self, lane: Reader, starts: Mapping[tuple[str, int], int]) -> None:
        self.assigned.append(dict(starts))
        self._cursors[lane] = dict(starts)


def _lane(feed: LaneFeed | None = None) -> Lane:
    return Lane(SinkSettings(), "cache", 1, feed=feed or _Feed(), opened=lambda: None, folds=lambda _records: [])


def test_a_batch_keeps_only_what_the_lane_has_not_applied() -> None:
    lane = _lane()
    lane._applied = {A: 10, B: 3}
    assert lane._left({A: (5, 10), B: (0, 8)}) == {B: (3, 8)}
    assert lane._left({A: (5, 12)}) == {A: (10, 12)}
    assert lane._left({("u", 0): (0, 4)}) == {("u", 0): (0, 4)}  # a partition it does not read


def test_it_reads_from_the_query_s_end_and_skips_ahead_only_where_it_is_behind() -> None:
    consumer = _Feed()
    lane = _lane(consumer)
    positions: dict[tuple[str, int], int] = {}
    assert not lane._resume(positions)  # nothing to read from yet
    lane._follow = {A: 10, B: 4}
    assert lane._resume(positions)
    assert consumer.assigned == [{A: 10, B: 4}]
    assert positions == {A: 10, B: 4}
    assert lane._left({A: (0, 10), B: (0, 4)}) == {}  # the query applied everything before its end
    positions[A] = 15  # the lane read ahead; the query's next batch ends behind it
    lane._follow = {A: 12, B: 4}
    assert lane._resume(positions)
    assert len(consumer.assigned) == 1  # nothing to skip
    lane._follow = {A: 12, B: 9}  # the query is ahead on B: read from there, A where the lane is
    assert lane._resume(positions)
    assert consumer.assigned[-1] == {A: 15, B: 9}


def test_after_a_refusal_it_waits_for_a_batch_past_it() -> None:
    consumer = _Feed()
    lane = _lane(consumer)
    lane._blocked = {A: 20}
    positions: dict[tuple[str, int], int] = {}
    lane._follow = {A: 18}
    assert not lane._resume(positions)
    assert consumer.assigned == []
    lane._follow = {A: 21}
    assert lane._resume(positions)
    assert consumer.assigned == [{A: 21}]
    assert lane._blocked == {}


def test_a_batch_waits_for_the_lane_only_while_it_reads_and_moves() -> None:
    lane = _lane()
    lane._applied = {A: 10}
    lane._reading = frozenset({A})
    assert lane.wait_for({A: (5, 10)}) == {}
    assert lane.wait_for({B: (0, 3)}) == {B: (0, 3)}  # a partition it does not read: the batch's, at once
    assert lane.wait_for({A: (5, 12)}, patience_s=0.2) == {A: (10, 12)}  # no progress: the batch's


def test_a_lane_far_behind_leaves_the_rest_to_the_batch_at_once() -> None:
    lane = _lane()
    lane._applied = {A: 10}
    lane._reading = frozenset({A})
    assert lane.wait_for({A: (10, 5_000)}, most=4_000, patience_s=60) == {A: (10, 5_000)}


def test_a_lane_too_slow_to_finish_soon_leaves_the_rest_to_the_batch() -> None:
    lane = _lane()
    lane._applied = {A: 10}
    lane._reading = frozenset({A})
    stop = threading.Event()

    def crawl() -> None:  # 10 offsets every 50 ms: the 3,000 of the range would take 15 s
        while not stop.wait(0.05):
            with lane._progress:
                lane._applied[A] += 10
                lane._progress.notify_all()

    thread = threading.Thread(target=crawl)
    thread.start()
    try:  # no patience or time limit comes into it: only the pace sends the rest to the batch
        left = lane.wait_for({A: (10, 3_010)}, patience_s=60, finish_s=1.0, limit_s=60)
    finally:
        stop.set()
        thread.join()
    assert left[A][1] == 3_010
    assert 10 < left[A][0] < 3_010  # the lane moved, and what it applied is not the batch's
    assert lane._paused


def test_a_batch_waits_out_a_lane_some_seconds_behind_that_moves() -> None:
    """The defaults: a lane 9,000 offsets behind (4.5 s of a 2,000 changes/s load) applying a chunk at a time
    is left to finish; the batch takes nothing and the lane is not paused."""
    lane = _lane()
    lane._applied = {A: 0}
    lane._reading = frozenset({A})
    stop = threading.Event()

    def chunks() -> None:
        while not stop.wait(0.05) and lane._applied[A] < 9_000:
            with lane._progress:
                lane._applied[A] += 1_000
                lane._progress.notify_all()

    thread = threading.Thread(target=chunks)
    thread.start()
    try:
        left = lane.wait_for({A: (0, 9_000)})
    finally:
        stop.set()
        thread.join()
    assert left == {}
    assert not lane._paused


def test_a_batch_that_writes_holds_the_lane_until_it_has_ended() -> None:
    consumer = _Feed()
    lane = _lane(consumer)
    lane._applied = {A: 10}
    lane._reading = frozenset({A})
    assert lane.wait_for({A: (10, 9_000)}, most=4_000) == {A: (10, 9_000)}
    assert lane._paused
    lane._follow = {A: 20}
    lane._turn(None, {A: 10})  # paused: takes nothing, asks for nothing
    assert lane._follow == {A: 20}
    assert consumer.assigned == []
    lane._halt.set()  # no thread: follow() only records the batch's end and releases the lane
    lane.follow({A: 9_000})
    assert not lane._paused
