"""The lanes' one reader (sinks._feed): a chunk is folded once and offered to every lane reading it; each lane
writes only what lies at or after its own position; the feed waits for a full lane that moves, and drops one
whose store stalls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

import sinks._feed
from sinks import Change, Rejected, TableInfo
from sinks._feed import STALL_S, Chunk, LaneFeed
from sinks._fold import TopicFold
from sinks._lane import Lane
from sinks._write import prepare
from sinks.config import SinkSettings
from sinks.errors import SinkTransientError
from tests.unit.test_shared_decoding import TOPIC, _record, _schemas

P0 = (TOPIC, 0)
FOLDS = [TopicFold(_schemas())]


class _Writer:
    """A sink's writer that keeps what it is given."""

    def __init__(self) -> None:
        self.written: list[Change] = []

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        self.written.extend(changes)
        return ()


class _Sink:
    def __init__(self) -> None:
        self.writer = _Writer()

    def prepare(self, tables: list[TableInfo]) -> None:
        pass

    def partition_writer(self) -> _Writer:
        return self.writer


def _chunk(start: int, end: int) -> Chunk:
    records = [_record(_schemas(), offset, f"v{offset}") for offset in range(start, end)]
    return Chunk({P0: start}, {P0: end}, records, prepare(FOLDS, records))


def _lane(feed: LaneFeed) -> Lane:
    return Lane(SinkSettings(), "cache", 1, feed=feed, opened=_Sink, folds=lambda _records: FOLDS)


def test_a_chunk_is_folded_once_and_each_lane_writes_the_same_changes() -> None:
    feed = LaneFeed(SinkSettings(), lambda _records: FOLDS)
    search, cache = _lane(feed), _lane(feed)
    feed._cursors = {search: {P0: 10}, cache: {P0: 10}}
    assert feed._wanted() == {P0: 10}
    feed._offer(_chunk(10, 13))
    assert feed._cursors == {search: {P0: 13}, cache: {P0: 13}}
    sinks = {search: _Sink(), cache: _Sink()}
    for lane, sink in sinks.items():
        lane._step(sink, {P0: 10})
    first, second = (sink.writer.written for sink in sinks.values())
    assert [c.row for c in first] == [{"id": 7, "name": "v12"}]  # one key: its last change
    assert first[0] is second[0]  # the very same change: decoded, folded and converted once
    assert search.applied() == cache.applied() == {P0: 13}


def test_a_lane_takes_only_what_lies_past_its_position() -> None:
    feed = LaneFeed(SinkSettings(), lambda _records: FOLDS)
    lane, sink = _lane(feed), _Sink()
    positions = {P0: 12}  # the query's batch applied up to 12; the chunk starts at 10
    feed._cursors = {lane: dict(positions)}
    feed._offer(_chunk(10, 15))
    lane._step(sink, positions)
    assert [c.offset for c in sink.writer.written] == [14]  # folded from 12 on, by the lane itself
    assert positions == {P0: 15}
    lane.offer(_chunk(16, 17))  # the reader skipped offset 15: the lane cannot go on
    with pytest.raises(SinkTransientError, match="skipped"):
        lane._step(sink, positions)


def test_the_feed_waits_for_a_full_lane_that_moves_and_drops_one_that_stalls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = LaneFeed(SinkSettings(), lambda _records: FOLDS)
    slow, other = _lane(feed), _lane(feed)
    feed._cursors = {slow: {P0: 0}, other: {P0: 0}}
    slow.offer(_chunk(0, 1))
    monkeypatch.setattr(sinks._feed, "INBOX_RECORDS", 1)  # one record queued fills it
    assert not feed._room()  # full, and it took its last chunk a moment ago: the feed waits
    assert set(feed._cursors) == {slow, other}
    slow._took_at -= STALL_S + 1  # nothing taken for longer than the feed waits
    assert feed._room()
    assert list(feed._cursors) == [other]  # the other lane goes on
    assert slow._dropped.is_set()
    positions = {P0: 0}
    with pytest.raises(SinkTransientError, match="took no changes"):
        slow._step(_Sink(), positions)
    slow._stop_reading(positions)  # what it had queued goes: its batches apply it
    assert slow._inbox.empty()
    assert slow.backlog()[0] == 0
    assert positions == {}


def test_a_lane_s_new_start_is_read_again_from_there() -> None:
    """A lane that stopped asks again from its batch's end, behind where the reader is: the reader's next read
    starts there (the earliest offset any lane needs)."""
    feed = LaneFeed(SinkSettings(), lambda _records: FOLDS)
    ahead, behind = _lane(feed), _lane(feed)
    feed._halt.set()  # no thread: only the bookkeeping is under test
    feed._cursors = {ahead: {P0: 50}}
    feed.want(behind, {P0: 20})
    assert feed._wanted() == {P0: 20}
    feed._offer(_chunk(20, 30))
    assert feed._cursors == {ahead: {P0: 50}, behind: {P0: 30}}  # the lane ahead is not offered what it passed
    assert ahead._inbox.empty()
