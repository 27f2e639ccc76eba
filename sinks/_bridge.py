"""What a sinks app applies while Spark starts.

Starting the JVM and a Spark session, then a query's first batch, is most of a start: 5-10 s for a restart on
two cores, 20-40 s for a first start (no class archive yet, the stores' indices and tables created). The
changes in the topics need none of it: for each built-in sink whose store opens without Spark (search, cache,
sql, and the warehouse where it merges on the driver: a local directory), a thread reads what its topics hold
past the last batch its checkpoint committed (from each partition's start on a first start) and applies it
with the driver's fold and the sink's own driver path (sinks._write.written_on_driver, or folded_written for
the warehouse's delta-rs, which leaves the history's events to the batches), in steps of up to
``sinks._ranges.DRIVER_RECORDS`` offsets per partition, and goes on with what arrives until the sink's query
is ready to start (:meth:`Bridge.finish`). A first start shows the snapshot in the stores within seconds, and
the changes after it as they come.

The checkpoint is only read: the query's first batches read the same records again, and the stores' position
guard makes their writes change nothing. Poison records and refusals are left to those batches, which write
the dead letters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sinks._api import PartitionSink, Rebuildable, WritesFolded
from sinks._fold import TopicFold, framed_ids
from sinks._progress import TopicEnds, checkpoint_location, checkpoint_offsets, topic_names
from sinks._ranges import DRIVER_RECORDS, RangeReader
from sinks._reader import Decoder
from sinks._served import served_topics
from sinks._write import folded_written, tally, written_on_driver

if TYPE_CHECKING:
    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

# The wait before looking at the topics' ends again once everything in them is applied: doubled while they stay
# still, up to 2 s: an idle bridge then asks the broker for every partition's ends once every 2 s beside Spark's
# start, whose JVM launch and py4j calls share the driver's cores and GIL with it.
_IDLE_S = 0.2
_IDLE_MAX_S = 2.0


def bridged(sink: Any) -> bool:
    """Whether a bridge can apply ``sink``'s backlog: its writes need no Spark."""
    return isinstance(sink, PartitionSink) or (isinstance(sink, WritesFolded) and sink.folds_on_driver)


def served_generation(sink: Any) -> int:
    """The served generation; a sink's first run creates and serves generation 1."""
    if not isinstance(sink, Rebuildable):
        return 1
    current = sink.current_generation()
    if current is None:
        current = 1
        sink.prepare_generation(current)
    # swap is idempotent: serving the served generation again completes a swap a crash interrupted (e.g.
    # OpenSearch aliases behind the recorded generation).
    sink.swap(current)
    return current


def backlog_ranges(
    done: dict[tuple[str, int], int], ends: dict[tuple[str, int], tuple[int, int]], most: int
) -> dict[tuple[str, int], tuple[int, int]]:
    """Per partition, [where it was applied to, up to ``most`` further) within its (low, high) watermarks: a
    partition absent from ``done`` is read from its start, as the query reads a partition new to it."""
    ranges = {}
    for tp, (low, high) in ends.items():
        begin = max(done.get(tp, low), low)
        if high > begin:
            ranges[tp] = (begin, min(high, begin + most))
    return ranges


class _Backlog:
    """One sink's position in its topics and the step that applies the next records past it."""

    def __init__(self, settings: SinkSettings, name: str, sink: Any, generation: int) -> None:
        self.sink, self.settings, self.generation = sink, settings, generation
        done = checkpoint_offsets(checkpoint_location(settings.state, name, generation))
        self.position: dict[tuple[str, int], int] = dict(done or {})  # none committed: every partition's start
        served = served_topics(settings, name, generation, lambda: topic_names(settings))
        self._ends = TopicEnds(settings, served=served)  # the generations its query reads: sinks._served
        self._reader = RangeReader(settings, name)
        self._decoder = Decoder(settings)
        self.read = self.applied = 0

    def step(self) -> bool:
        """Applies up to DRIVER_RECORDS offsets per partition past the position; whether there were any."""
        ranges = backlog_ranges(self.position, self._ends.read(), DRIVER_RECORDS)
        if not ranges:
            return False
        records = self._reader.read(ranges)
        if records:
            folds = [TopicFold(self._decoder.schemas(topic)) for topic in sorted(framed_ids(records))]
            batch = (-1, self.generation)
            if isinstance(self.sink, PartitionSink):
                rows = written_on_driver(self.sink, folds, records, self.settings, batch)
            else:
                rows = folded_written(self.sink, folds, records, self.settings, batch, history=False)
            self.applied += tally(rows).records
            self.read += len(records)
        self.position.update({tp: end for tp, (_, end) in ranges.items()})
        return True

    def close(self) -> None:
        self._ends.close()
        self._reader.close()


class Bridge(threading.Thread):
    """The backlog of one sink (see the module), on a thread of its own while Spark starts, until
    :meth:`finish`; a failure is only logged (the query's batches apply the same records). The sink's query
    starts only after it has ended: a batch writing beside it could have its delete of a key undone by the
    bridge's older upsert of it (a cache key deleted leaves no position to compare)."""

    def __init__(self, settings: SinkSettings, name: str, opened: Callable[[], Any]) -> None:
        super().__init__(name=f"pgcdc-bridge-{name}", daemon=True)
        self.settings, self.sink_name, self._opened = settings, name, opened
        # Set once the served generation is settled (created on a first start): the query's start waits for it,
        # so the two never create the same store at once.
        self.settled = threading.Event()
        self._finish = threading.Event()

    def finish(self) -> None:
        """Ends the bridge after its current step (the query is about to start, or the app stops)."""
        self._finish.set()

    def run(self) -> None:
        started = time.monotonic()
        sink = backlog = None
        told = False
        try:
            sink = self._opened()
            if not bridged(sink):
                return
            backlog = _Backlog(self.settings, self.sink_name, sink, served_generation(sink))
            self.settled.set()
            idle = _IDLE_S
            while not self._finish.is_set():
                if not backlog.step():
                    self._finish.wait(idle)
                    idle = min(idle * 2, _IDLE_MAX_S)
                    continue
                idle = _IDLE_S
                if backlog.applied and not told:
                    told = True
                    log.info(
                        "sink %s: applied %d record(s) before its query started, the first after %.2fs",
                        self.sink_name,
                        backlog.applied,
                        time.monotonic() - started,
                    )
        except Exception as exc:
            log.info("sink %s: the bridge before Spark stopped (%s); the query applies the rest", self.sink_name, exc)
        finally:
            self.settled.set()
            if backlog is not None:
                backlog.close()
                if backlog.read:
                    log.info(
                        "sink %s: the bridge applied %d record(s) in all before its query started (%.2fs)",
                        self.sink_name,
                        backlog.applied,
                        time.monotonic() - started,
                    )
            if sink is not None:
                sink.close()
