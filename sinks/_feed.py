"""One reader for every lane of the process: each change is read, decoded and folded once, whatever the sinks.

Search's and cache's lanes (sinks._lane) follow the same topics from about the same offsets: each reading and
folding them on its own decoded every change once per sink, in one interpreter. The feed is a thread with one
Kafka consumer (read_committed, as the queries read) that tails, per partition, from the earliest offset a lane
still needs; it folds what arrives once (sinks._write.prepare: the fold, then the changes in document form) and
offers the chunk to every lane reading one of its partitions. Each lane writes on its own thread, so a slow
store slows only its own lane.

A lane holds at most :data:`INBOX_RECORDS` records it has not written: the feed reads on only once every lane
has room, so under a load the lanes cannot keep up with, they fall behind in Kafka, not in memory, and the
queries' batches wait them out or take the backlog as before (sinks._lane). A lane whose store stalls (a full
inbox it has taken nothing from for :data:`STALL_S`) holds the others back no longer: it is dropped, its query's
next batch applies what it had not (as after any failure of the lane), and it asks again from that batch's end.
When the feed's read fails every lane is dropped the same way.

The feed knows nothing of batches, pauses or refusals: each lane keeps its own position and takes from a chunk
only what lies at or after it (sinks._lane).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sinks._ranges import as_record, driver_consumer
from sinks._write import Prepared, prepare

if TYPE_CHECKING:
    from confluent_kafka import Consumer

    from sinks._config import SinkSettings
    from sinks._fold import TopicFold

log = logging.getLogger(__name__)

Partition = tuple[str, int]  # (topic, partition)
CHUNK = 2_000  # records read at most per chunk: a chunk's latency stays in milliseconds
INBOX_RECORDS = 25 * CHUNK  # records a lane may hold unwritten before the feed waits for it
STALL_S = 5.0  # how long a full lane may take nothing before the feed drops it
_POLL_S = 0.2  # the wait for a first record; it returns as soon as one arrives


@dataclass(frozen=True)
class Chunk:
    """What one read returned: per partition read, the offsets it covers ([start, end): ``end`` may pass a
    transaction's commit marker with no record), the raw records, and each topic's :class:`Prepared`."""

    starts: Mapping[Partition, int]
    ends: Mapping[Partition, int]
    records: list[dict[str, Any]]
    prepared: Mapping[str, Prepared]


class Reader(Protocol):
    """What the feed needs of a lane."""

    def offer(self, chunk: Chunk) -> None:
        """Queues ``chunk`` for the lane to write."""

    def backlog(self) -> tuple[int, float]:
        """The records queued and not yet taken, and the seconds since the lane last took a chunk."""

    def dropped(self) -> None:
        """The feed stopped feeding this lane (its store stalled, or the read failed)."""


class LaneFeed:
    """The process's lane reader (see the module). Lanes ask with :meth:`want` and leave with :meth:`forget`."""

    def __init__(self, settings: SinkSettings, folds: Callable[[list[dict[str, Any]]], list[TopicFold]]) -> None:
        """``folds``: each topic's fold for some records (a query's: the registry's schemas)."""
        self.settings, self._folds = settings, folds
        self._lock = threading.Condition()
        self._cursors: dict[Reader, dict[Partition, int]] = {}  # per lane: the next offset to offer it
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, lane: Reader, starts: Mapping[Partition, int]) -> None:
        """``lane`` reads from ``starts`` on (its partitions, each from that offset) instead of what it read."""
        with self._lock:
            self._cursors[lane] = dict(starts)
            self._lock.notify_all()
            if (self._thread is None or not self._thread.is_alive()) and not self._halt.is_set():
                self._thread = threading.Thread(target=self._run, name="pgcdc-lane-feed", daemon=True)
                self._thread.start()

    def forget(self, lane: Reader) -> None:
        with self._lock:
            self._cursors.pop(lane, None)

    def stop(self) -> None:
        self._halt.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(30)

    # --- the feed's thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        consumer: Consumer | None = None
        positions: dict[Partition, int] = {}  # per partition read: the next offset to read
        said = None
        try:
            consumer = driver_consumer(self.settings, "pgcdc-lanes", linger_ms=self.settings.sinks.lane_linger_ms)
            while not self._halt.is_set():
                try:
                    self._turn(consumer, positions)
                    said = None
                except Exception as exc:  # every lane stops until its next batch; the feed goes on after
                    if str(exc) != said:
                        log.warning("the sinks' lanes stopped until their next batches (%s)", exc)
                    said = str(exc)
                    self._drop_all()
                    positions.clear()
                    consumer.unassign()
                    self._halt.wait(1.0)
        except Exception as exc:
            log.warning("no lanes: changes wait for the queries' batches (%s)", exc)
            self._drop_all()
        finally:
            if consumer is not None:
                consumer.close()

    def _turn(self, consumer: Consumer, positions: dict[Partition, int]) -> None:
        """Reads what has arrived from where the lanes need it, and offers it to them."""
        from confluent_kafka import TopicPartition

        with self._lock:
            wanted = self._wanted() if self._room() else {}
            if not wanted:
                self._lock.wait(_POLL_S)
                return
        if wanted != positions:
            consumer.assign([TopicPartition(t, p, offset) for (t, p), offset in wanted.items()])
            positions.clear()
            positions.update(wanted)
        starts = dict(positions)
        records = self._read(consumer, positions)
        if records is None:
            return
        ends = {tp: end for tp, end in positions.items() if end != starts[tp]}
        chunk = Chunk({tp: starts[tp] for tp in ends}, ends, records, prepare(self._folds(records), records))
        with self._lock:
            self._offer(chunk)

    def _wanted(self) -> dict[Partition, int]:
        """Per partition, the earliest offset a lane still needs."""
        out: dict[Partition, int] = {}
        for cursor in self._cursors.values():
            for tp, offset in cursor.items():
                out[tp] = min(offset, out.get(tp, offset))
        return out

    def _room(self) -> bool:
        """Whether every lane has room for another chunk; a full one that took nothing for STALL_S is dropped."""
        room = True
        for lane in list(self._cursors):
            queued, idle_s = lane.backlog()
            if queued >= INBOX_RECORDS and idle_s > STALL_S:
                log.warning("a sink's lane took no changes for %.0f s: its query's batches take over", idle_s)
                del self._cursors[lane]
                lane.dropped()
            elif queued >= INBOX_RECORDS:
                room = False
        return room

    def _offer(self, chunk: Chunk) -> None:
        for lane, cursor in self._cursors.items():
            mine = [tp for tp in chunk.ends if tp in cursor]
            if not mine or all(cursor[tp] >= chunk.ends[tp] for tp in mine):
                continue
            lane.offer(chunk)
            for tp in mine:
                cursor[tp] = max(cursor[tp], chunk.ends[tp])

    def _drop_all(self) -> None:
        with self._lock:
            lanes, self._cursors = list(self._cursors), {}
        for lane in lanes:
            lane.dropped()

    def _read(self, consumer: Consumer, positions: dict[Partition, int]) -> list[dict[str, Any]] | None:
        """What has arrived, up to a chunk; None if nothing did. ``positions`` move past it (and past a
        transaction's commit marker: the end of the partition says so)."""
        from confluent_kafka import KafkaError, KafkaException

        first = consumer.poll(_POLL_S)
        if first is None:
            return None
        records = []
        for m in [first, *consumer.consume(CHUNK - 1, timeout=0)]:
            tp, error, offset = (m.topic(), m.partition()), m.error(), m.offset()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise KafkaException(error)
            if offset is None or tp not in positions:
                continue
            if error is None:
                records.append(as_record(m))
                positions[tp] = max(positions[tp], offset + 1)
            else:
                positions[tp] = max(positions[tp], offset)
        return records
