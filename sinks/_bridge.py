"""What a restarted sinks app applies while Spark starts.

Starting the JVM and a Spark session is most of a restart (5-10 s on two cores). The changes written while the
app was down need none of it: for each partition sink whose store opens without Spark (search, cache), a
thread reads what its topics hold past the last batch its checkpoint committed — up to
``sinks._ranges.DRIVER_RECORDS`` offsets per partition — and applies it with the driver's fold and the sink's
writer (sinks._write.fold_and_write) while the session starts.

The checkpoint is only read: the query's first batches read the same records again, and the stores' position
guard makes their writes change nothing. Poison records and refusals are left to those batches, which write
the dead letters. A store of a generation nobody serves yet, or a checkpoint with no committed batch, is left
to the query as well.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sinks._api import PartitionSink, Rebuildable
from sinks._progress import TopicEnds, checkpoint_location, checkpoint_offsets
from sinks._ranges import DRIVER_RECORDS, RangeReader
from sinks._reader import Decoder
from sinks._taskfold import TopicFold, framed_ids
from sinks._write import tally, written_on_driver

if TYPE_CHECKING:
    from sinks._config import SinkSettings

log = logging.getLogger(__name__)


def backlog_ranges(
    done: dict[tuple[str, int], int], ends: dict[tuple[str, int], tuple[int, int]], most: int
) -> dict[tuple[str, int], tuple[int, int]]:
    """Per partition the checkpoint names, [its committed offset, up to ``most`` further) within the partition's
    (low, high) watermarks; partitions with nothing new are left out."""
    ranges = {}
    for tp, (low, high) in ends.items():
        start = done.get(tp)
        if start is not None and high > max(start, low):
            begin = max(start, low)
            ranges[tp] = (begin, min(high, begin + most))
    return ranges


def apply_backlog(settings: SinkSettings, name: str, sink: Any) -> tuple[int, int]:
    """Applies the records past ``sink``'s committed batch (see the module); (records read, records of tables
    written)."""
    generation = sink.current_generation() if isinstance(sink, Rebuildable) else 1
    if generation is None:
        return 0, 0
    done = checkpoint_offsets(checkpoint_location(settings.state(), name, generation))
    if done is None:
        return 0, 0
    ends = TopicEnds(settings)
    try:
        ranges = backlog_ranges(done, ends.read(), DRIVER_RECORDS)
    finally:
        ends.close()
    reader = RangeReader(settings, name)
    try:
        records = reader.read(ranges)
    finally:
        reader.close()
    if not records:
        return 0, 0
    decoder = Decoder(settings)
    folds = [TopicFold(decoder.schemas(topic)) for topic in sorted(framed_ids(records))]
    return len(records), tally(written_on_driver(sink, folds, records, settings, (-1, generation))).records


class Bridge(threading.Thread):
    """:func:`apply_backlog` for one sink, on a thread of its own while Spark starts; a failure is only logged
    (the query's batches apply the same records). The sink's query starts only after it has ended: a batch
    writing beside it could have its delete of a key undone by the bridge's older upsert of it (a cache key
    deleted leaves no position to compare)."""

    def __init__(self, settings: SinkSettings, name: str, opened: Callable[[], Any]) -> None:
        super().__init__(name=f"pgcdc-bridge-{name}", daemon=True)
        self.settings, self.sink_name, self._opened = settings, name, opened

    def run(self) -> None:
        started = time.monotonic()
        sink = None
        try:
            sink = self._opened()
            if not isinstance(sink, PartitionSink):
                return
            read, applied = apply_backlog(self.settings, self.sink_name, sink)
            if read:
                log.info(
                    "sink %s: applied %d record(s) written while it was down, before Spark started (%.2fs)",
                    self.sink_name,
                    applied,
                    time.monotonic() - started,
                )
        except Exception as exc:
            log.info("sink %s: nothing applied before Spark started (%s)", self.sink_name, exc)
        finally:
            if sink is not None:
                sink.close()
