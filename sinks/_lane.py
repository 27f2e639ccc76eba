"""Applying a partition sink's changes as they arrive, ahead of Spark's micro-batches.

Spark's query owns a sink's progress: its checkpoint says which offsets are applied, and after a crash its
batches apply them again. But every micro-batch costs Spark ~0.2 s of its own (the offset and commit files,
planning) before the batch's few milliseconds of work, and waits for CPU behind the other queries, so a change
waits for the batch in progress and then its own: most of search's and cache's freshness.

The lane is a thread per served search or cache query. From where the query's last batch ended it takes the
same partitions' records from the process's one reader (sinks._feed: read_committed, as the query reads them,
read and folded once for every lane) and applies them at once with the sink's writer, the path of a small
batch. It keeps in memory how far its writes have completed; a query batch waits while the lane applies its
ranges and applies only what is left (nothing, as a rule), with the lane paused: the two never write a
partition at the same time (see :meth:`Lane.wait_for`), and each change is written about once.

It never commits anything and never writes a dead letter. A chunk with a record the sink refuses (poison, a
refused write) is not counted as applied: the lane stops, the query's batch applies that range and writes the
dead letter, and the lane goes on from the end of a batch past it. Any failure (a store or Kafka unreachable,
a lane the reader dropped because its store stalled) stops it the same way, and the query's batches carry on as
they would without it. A crash loses only its position in memory: the restarted query applies again from its
checkpoint, to no effect where the lane had written (the stores' position guard: a replayed change never moves
a row backwards).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sinks._feed import CHUNK, Chunk, LaneFeed
from sinks._fold import TopicFold
from sinks._ranges import Ranges, size_of
from sinks._write import prepared_written, tally, written_on_driver
from sinks.errors import SinkTransientError

if TYPE_CHECKING:
    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

Offsets = Mapping[tuple[str, int], int]  # (topic, partition) -> an offset
_POLL_S = 0.2  # the wait for a chunk; it returns as soon as one arrives


class Lane:
    """One sink's lane (see the module). The query's thread calls :meth:`wait_for` (or :meth:`pause`) before
    a batch writes and :meth:`follow` after it; the lane's own thread does the rest."""

    def __init__(
        self,
        settings: SinkSettings,
        name: str,
        generation: int,
        *,
        feed: LaneFeed,
        opened: Callable[[], Any],
        folds: Callable[[list[dict[str, Any]]], list[TopicFold]],
    ) -> None:
        """``feed``: the process's reader; ``opened``: the lane's own instance of the sink; ``folds``: each
        topic's fold for some records (the query's, which keeps the registry's schemas), for a chunk the lane
        takes only part of."""
        self.settings, self.name, self.generation = settings, name, generation
        self._feed, self._opened, self._folds = feed, opened, folds
        self._inbox: queue.Queue[Chunk] = queue.Queue()
        self._inbox_records = 0  # records offered and not yet taken off the inbox (under _lock)
        self._took_at = time.monotonic()  # when the lane last took a chunk (or its inbox last became non-empty)
        self._dropped = threading.Event()  # set by the feed
        self.on_applied: Callable[[int], None] = lambda _records: None  # told how many records each chunk applied
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # notified when the lane applied or stopped reading
        self._reading: frozenset[tuple[str, int]] = frozenset()  # the partitions it is reading now
        self._applied: dict[tuple[str, int], int] = {}  # per partition: everything before it is in the store
        self._newest_ts_ms: int | None = None  # the newest source commit time among what the lane applied
        self._follow: dict[tuple[str, int], int] | None = None  # the query's last batch's ends, not yet taken
        self._blocked: dict[tuple[str, int], int] = {}  # after a refusal: the ends the query must pass first
        self._paused = False  # a batch writes what the lane had not applied: the lane waits for its end
        self._busy = False  # the lane's thread is reading or writing a chunk
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the query's side ------------------------------------------------------------------------------

    def follow(self, ends: Offsets) -> None:
        """The query's batch that ended at ``ends`` is committed: the lane starts there, or skips to there if
        it is behind; the first call starts its thread."""
        with self._progress:
            self._follow = dict(ends)
            self._paused = False
            self._progress.notify_all()
        if (self._thread is None or not self._thread.is_alive()) and not self._halt.is_set():
            self._thread = threading.Thread(target=self._run, name=f"pgcdc-lane-{self.name}", daemon=True)
            self._thread.start()

    def wait_for(
        self,
        ranges: Ranges,
        *,
        most: int = 50 * CHUNK,
        patience_s: float = 2.0,
        finish_s: float = 20.0,
        limit_s: float = 30.0,
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """The part of a batch's ``ranges`` the lane has not applied, once it has applied what it will: nothing,
        as a rule (the batch then only commits). At once, all that is left when that is over ``most`` offsets
        (a backlog: the batch takes it, on the executors) or when the lane is not reading one of its partitions
        (new to it, after a refusal or a failure). Else the batch waits while the lane's pace, measured since
        the wait began, would finish the rest within ``finish_s``; after ``patience_s`` without progress, a pace
        too slow, or ``limit_s`` in all, the rest is the batch's.

        A lane a load has put some seconds behind is still the cheapest way through: its changes were decoded
        and folded once for every lane of the process (sinks._feed) and it pays no Spark job, where a batch handed
        the rest pauses the lane and decodes the same changes again in its tasks. On a busy machine that hand-off
        took more CPU than the lane it relieved, and the sinks never caught up again; so a batch waits out a lane
        that is moving, and takes over only from one that stalls or could not finish in ``finish_s``.

        When something is left the lane is paused first, its chunk in flight written, until :meth:`follow`
        says the batch has ended: the batch and the lane never write one partition at once. (A change the lane
        wrote past a batch's range while the batch wrote an older one of the same key could stand: a delete
        before the batch's upsert of the key, or an unchanged TOAST value taken from a row older than the
        batch's.)"""
        with self._progress:
            began = since = time.monotonic()
            first = last = size_of(self._left(ranges))
            while True:
                left = self._left(ranges)
                if not left:
                    return left
                now, size = time.monotonic(), size_of(left)
                if size != last:
                    last, since = size, now
                if self._paused or not self._reading.issuperset(left) or size > most:
                    return self._pause_locked(ranges)
                if (
                    now - since > patience_s
                    or now - began > limit_s
                    or self._too_slow(first, size, now - began, finish_s)
                ):
                    return self._pause_locked(ranges)
                self._progress.wait(0.1)

    @staticmethod
    def _too_slow(first: int, left: int, waited_s: float, finish_s: float) -> bool:
        """Whether the pace since the wait began (judged after half of ``finish_s``) would not apply the
        ``left`` offsets within ``finish_s`` more."""
        if waited_s < finish_s / 2:
            return False
        pace = (first - left) / waited_s
        return pace <= 0 or left / pace > finish_s

    def pause(self) -> None:
        """Holds the lane until :meth:`follow` (a batch the lane cannot measure writes meanwhile)."""
        with self._progress:
            self._pause_locked({})

    def _pause_locked(self, ranges: Ranges) -> dict[tuple[str, int], tuple[int, int]]:
        self._paused = True
        while self._busy:  # the chunk in flight lands first; the writers' own timeouts bound it
            self._progress.wait(0.1)
        return self._left(ranges)

    def _left(self, ranges: Ranges) -> dict[tuple[str, int], tuple[int, int]]:
        out = {}
        for tp, (start, end) in ranges.items():
            begin = max(start, self._applied.get(tp, start))
            if begin < end:
                out[tp] = (begin, end)
        return out

    def applied(self) -> dict[tuple[str, int], int]:
        """Per partition, the offset before which everything is in the store, as far as the lane knows."""
        with self._lock:
            return dict(self._applied)

    @property
    def newest_ts_ms(self) -> int | None:
        return self._newest_ts_ms

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(30)

    # --- the feed's side -----------------------------------------------------------------------------

    def offer(self, chunk: Chunk) -> None:
        """Queues ``chunk`` for the lane's thread."""
        with self._lock:
            if not self._inbox_records:
                self._took_at = time.monotonic()  # idle from here, if it takes nothing
            self._inbox_records += len(chunk.records)
        self._inbox.put(chunk)

    def backlog(self) -> tuple[int, float]:
        with self._lock:
            return self._inbox_records, time.monotonic() - self._took_at

    def dropped(self) -> None:
        self._dropped.set()

    # --- the lane's thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        sink = None
        positions: dict[tuple[str, int], int] = {}  # per partition read: the next offset to apply
        said = None
        try:
            sink = self._opened()
            while not self._halt.is_set():
                try:
                    self._turn(sink, positions)
                    said = None
                except Exception as exc:  # the batches apply what the lane has not; it goes on after the next
                    if str(exc) != said:
                        log.warning("sink %s: the lane stopped until the next batch (%s)", self.name, exc)
                    said = str(exc)
                    self._stop_reading(positions)
                    self._halt.wait(1.0)
        except Exception as exc:
            log.warning("sink %s: no lane: changes wait for the query's batches (%s)", self.name, exc)
        finally:
            self._stop_reading(positions)
            if sink is not None:
                sink.close()

    def _turn(self, sink: Any, positions: dict[tuple[str, int], int]) -> None:
        """Applies the next chunk, or waits a moment for one (while paused: for the batch's end)."""
        with self._progress:
            if self._paused:
                self._progress.wait(_POLL_S)
                return
            self._busy = True
        try:
            self._step(sink, positions)
        finally:
            with self._progress:
                self._busy = False
                self._progress.notify_all()

    def _step(self, sink: Any, positions: dict[tuple[str, int], int]) -> None:
        if self._dropped.is_set() and positions:
            raise SinkTransientError("its store took no changes for a while, or the sinks' reader stopped")
        if not self._resume(positions):
            self._halt.wait(_POLL_S)
            return
        try:
            chunk = self._inbox.get(timeout=_POLL_S)
        except queue.Empty:
            return
        with self._lock:
            self._inbox_records -= len(chunk.records)
            self._took_at = time.monotonic()
        if self._halt.is_set():
            return
        mine = [tp for tp in chunk.ends if tp in positions and positions[tp] < chunk.ends[tp]]
        if not mine:
            return
        if any(chunk.starts[tp] > positions[tp] for tp in mine):
            raise SinkTransientError("the sinks' reader skipped offsets it needs")
        count = self._apply(sink, chunk, positions, mine)
        if count is None:  # stopped: the query applies the chunk (and writes its dead letters)
            self._stop_reading(positions)
            return
        for tp in mine:
            positions[tp] = chunk.ends[tp]
        with self._progress:
            self._applied.update(positions)
            self._progress.notify_all()
        self.on_applied(count)

    def _resume(self, positions: dict[tuple[str, int], int]) -> bool:
        """Takes the query's latest ends: reads from there where the lane is behind them or not reading yet.
        False while there is nothing to read from."""
        with self._lock:
            follow, self._follow = self._follow, None
        if follow is not None and self._blocked:
            if any(follow.get(tp, 0) < end for tp, end in self._blocked.items()):
                return bool(positions)
            self._blocked = {}
        if follow is not None and any(positions.get(tp, -1) < end for tp, end in follow.items()):
            starts = {tp: max(end, positions.get(tp, end)) for tp, end in follow.items()}
            self._dropped.clear()
            self._feed.want(self, starts)
            with self._lock:
                for tp, start in starts.items():
                    self._applied[tp] = max(self._applied.get(tp, start), start)
            self._read_from(positions, starts)
        return bool(positions)

    def _stop_reading(self, positions: dict[tuple[str, int], int]) -> None:
        """The feed stops feeding the lane, and what it had queued goes: the query's batches apply it, and the
        lane reads again from the end of one."""
        self._feed.forget(self)
        self._read_from(positions, {})
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            self._inbox_records = 0

    def _read_from(self, positions: dict[tuple[str, int], int], starts: Mapping[tuple[str, int], int]) -> None:
        """The partitions the lane reads become ``starts``' (none: it stopped); a waiting batch hears of it."""
        positions.clear()
        positions.update(starts)
        with self._progress:
            self._reading = frozenset(starts)
            self._progress.notify_all()

    def _apply(
        self, sink: Any, chunk: Chunk, positions: Mapping[tuple[str, int], int], mine: list[tuple[str, int]]
    ) -> int | None:
        """Writes the part of ``chunk`` at or after ``positions`` in ``mine``: the feed's prepared changes where
        the lane takes all of a topic's records, else its own fold of its part. The records applied; None if the
        sink refused one (the lane stops until the query's batches are past them)."""
        topics = {t for t, _ in mine}
        whole = {  # topics of which the lane takes every record of the chunk
            t
            for t in topics
            if all(tp in positions and positions[tp] == start for tp, start in chunk.starts.items() if tp[0] == t)
        }
        part = [
            r
            for r in chunk.records
            if r["topic"] in topics - whole and r["offset"] >= positions.get((r["topic"], r["partition"]), 1 << 62)
        ]
        batch = (-1, self.generation)
        prepared = [chunk.prepared[t] for t in sorted(whole) if t in chunk.prepared]
        rows = prepared_written(sink, prepared, self.settings, batch)
        if part:
            rows += written_on_driver(sink, self._folds(part), part, self.settings, batch)
        if any(r["kind"] == "rejected" for r in rows):
            self._blocked = {tp: chunk.ends[tp] for tp in mine}
            log.info("sink %s: a refused change: its batch applies it and writes the dead letter", self.name)
            return None
        out = tally(rows)
        if out.newest_ts_ms is not None:
            self._newest_ts_ms = max(self._newest_ts_ms or 0, out.newest_ts_ms)
        return out.records
