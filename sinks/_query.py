"""One sink's streaming query for one generation (:class:`SinkQuery`), and the sizing of its batches.

Each query has its own checkpoint, ``<state_dir>/<sink>/g<N>/checkpoint``: a generation's store and its
checkpoint belong together, so a rebuilt generation is continued exactly where its rebuild stopped. A
running query checks the served generation before each batch; when a rebuild has swapped a new one in, the
query stops (:data:`GENERATION_CHANGED`) and the supervisor (sinks._supervisor) starts the new generation's
query from that generation's checkpoint. Each batch takes the cheapest path its size allows: the driver's (no
Spark job), one task, or many (:func:`batch_starts`, :func:`offsets_moved` and :func:`_tasks` size it). A sink
is opened here too (:func:`opened`), for every module that runs one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from sinks._api import PartitionSink, Rebuildable, SinkContext, WritesFolded
from sinks._feed import LaneFeed
from sinks._fold import DRIVER_FOLD_RECORDS, ONE_TASK_RECORDS, TopicFold
from sinks._frames import in_frames
from sinks._frames import rehearse as rehearse_frames
from sinks._lane import Lane
from sinks._metrics import SinkMetrics, query_name
from sinks._plugins import load
from sinks._progress import REBUILD_FILE, STATUS_FILE, batch_offsets, checkpoint_location, topic_names
from sinks._ranges import DRIVER_RECORDS, RangeReader, Ranges, batch_ranges, size_of
from sinks._reader import Decoder, RegistryFolds, open_stream, tail_ranges, tail_records
from sinks._served import ServedTopics, served_topics
from sinks._spark import PARALLELISM_KEYS
from sinks._status import Status, short
from sinks._warehouse_live import NotOnDriverError
from sinks._write import (
    Outcome,
    folded_on_driver,
    in_tasks,
    on_driver,
    rehearse_on_driver,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

# What a served query stops with when a rebuild has swapped in a new generation: the supervisor switches.
GENERATION_CHANGED = "pgcdc: served generation changed"
BUILT_IN = ("search", "cache", "warehouse", "sql")
_LANE_SINKS = ("search", "cache")  # built-ins that write without Spark (sinks._lane)


def opened(name: str, settings: SinkSettings, generation: int, spark: SparkSession) -> Any:
    sink = load(name)
    options: dict[str, Any] = getattr(settings.sinks, name).model_dump() if name in BUILT_IN else {}
    options = settings.sinks.plugins.get(name, options)
    sink.open(SinkContext(name, settings, options, generation, spark))
    return sink


def opened_without_spark(name: str, settings: SinkSettings) -> Any:
    """A built-in sink opened before (or without) a Spark session: they touch Spark only to write frames."""
    assert name in BUILT_IN, name
    return opened(name, settings, 0, None)  # type: ignore[arg-type]


QueryRole = Literal["serve", "rebuild", "fixed"]
"""What a query is for. ``serve``: the app's query of the served generation, which follows a rebuild's swap;
``rebuild``: a rebuild's query of a generation nobody serves yet, beside a running app it must not disturb (its
own status file, a rebuild's larger batches, never a swap); ``fixed``: one generation as it is (the benchmarks'
replays)."""


class SinkQuery:
    """One sink's streaming query for one generation."""

    def __init__(
        self,
        name: str,
        settings: SinkSettings,
        spark: SparkSession,
        generation: int,
        *,
        role: QueryRole = "serve",
        sink: Any | None = None,
    ) -> None:
        self.name, self.settings, self.generation = name, settings, generation
        self.feed: LaneFeed | None = None  # the process's lane reader (sinks._feed); without it, no lane
        self.spark = spark.newSession()  # own SQL conf per sink, one SparkContext
        for key in PARALLELISM_KEYS:  # fitted at run time (sinks._spark), which a new session does not inherit
            if (value := spark.conf.get(key, None)) is not None:
                self.spark.conf.set(key, value)
        if sink is None:
            self.sink = opened(name, settings, generation, self.spark)
        else:  # an instance made elsewhere (benchmarks: a reference sink that is not installed)
            self.sink = sink
            sink.open(SinkContext(name, settings, {}, generation, self.spark))
        self.decoder = Decoder(settings)
        self.shuffle_partitions = int(self.spark.conf.get("spark.sql.shuffle.partitions") or 200)
        self.rebuild = role == "rebuild"
        self.follow_swaps = role == "serve" and isinstance(self.sink, Rebuildable)
        base = settings.state / name
        self.checkpoint = checkpoint_location(settings.state, name, generation)
        self.checkpoint.make_dirs()
        self.served = (  # a store with generations reads one topic generation per table: sinks._served
            served_topics(settings, name, generation, lambda: topic_names(settings))
            if isinstance(self.sink, Rebuildable)
            else ServedTopics(settings.kafka.topic_prefix, None)
        )
        self._skipped: set[str] = set()  # the last batch's topics of generations this one does not read
        self.status = Status.load(base / (REBUILD_FILE if self.rebuild else STATUS_FILE))
        self.status.update(generation=generation)
        self.metrics: SinkMetrics | None = None
        self.query: StreamingQuery | None = None
        self._ends: dict[int, dict[tuple[str, int], int]] = {}  # the last batch's end offsets, by its id
        self._reader: RangeReader | None = None  # made at the first batch the driver reads itself
        self.folds = RegistryFolds(self.decoder)  # each topic's fold, for the driver's batches
        self._observed = -1  # the last batch whose Spark phases the metrics have
        self._lane: Lane | None = None  # search's and cache's, from their first batch on
        self._lane_lock = threading.Lock()
        self._lane_records = 0  # applied by the lane since the last batch

    def start(self, metrics: SinkMetrics | None = None) -> StreamingQuery:
        """Starts the query; ``metrics``: the app's, which each batch reports to."""
        self.metrics = metrics
        # A rebuild's batches follow one another at once: nobody reads its generation until the swap.
        interval = 0.0 if self.rebuild else self.settings.sinks.trigger_for(self.name)
        if self._lane_on():  # the lane applies changes as they arrive; a batch only confirms them (sinks._lane)
            interval = max(interval, self.settings.sinks.lane_trigger_interval_s)
        writer = (
            open_stream(self.spark, self.settings, rebuild=self.rebuild, served=self.served)
            .writeStream.queryName(query_name(self.name, self.generation))
            .option("checkpointLocation", self.checkpoint.uri)
            .foreachBatch(self._batch)
        )
        writer = writer.trigger(processingTime=f"{interval} seconds") if interval else writer
        # Each query's jobs in a scheduler pool of its own (spark.scheduler.mode FAIR): a long warehouse
        # MERGE no longer holds every core while a cache batch of one row waits behind it. The query's
        # thread inherits the property from the thread that starts it.
        context = self.spark.sparkContext
        pool = context.getLocalProperty("spark.scheduler.pool")
        context.setLocalProperty("spark.scheduler.pool", f"pgcdc-{self.name}")
        try:
            self.query = writer.start()
        finally:
            context.setLocalProperty("spark.scheduler.pool", pool)  # type: ignore[arg-type]
        log.info("sink %s: generation %d streaming (checkpoint %s)", self.name, self.generation, self.checkpoint)
        return self.query

    def warm(self) -> None:
        """A live batch's path once over the last records of each topic, writing nothing: for a partition sink
        the driver's (sinks._write.rehearse_on_driver: milliseconds, no Spark job), for a sink that folds its
        small batches on the driver (the warehouse) that fold, for another frame sink the fold in a task up to
        its frames, in the sink's scheduler pool (sinks._frames.rehearse). A failure here is only logged: the first
        batch meets it again."""
        started = time.monotonic()
        context = self.spark.sparkContext
        pool = context.getLocalProperty("spark.scheduler.pool")
        context.setLocalProperty("spark.scheduler.pool", f"pgcdc-{self.name}")
        try:
            if _on_driver(self.sink):  # its live batches are folded on the driver
                records = self._range_reader().read(tail_ranges(self.settings, _WARM_RECORDS))
                for fold in self._folds(records):
                    fold.fold([r for r in records if r["topic"] == fold.schemas.topic])
            elif isinstance(self.sink, PartitionSink):  # its live batches are applied by the driver (sinks._ranges)
                records = self._range_reader().read(tail_ranges(self.settings, _WARM_RECORDS))
                # The batches' own schema look-up: what it asks the registry for is kept for them.
                rehearse_on_driver(self.sink, self._folds(records), records, self.settings, self.generation)
            else:
                tail = tail_records(self.spark, self.settings, _WARM_RECORDS)
                if tail is None:
                    return
                raw, topics = tail
                rehearse_frames([TopicFold(self.decoder.schemas(topic)) for topic in sorted(topics)], raw)
            log.info("sink %s: warmed up in %.1fs", self.name, time.monotonic() - started)
        except Exception as exc:
            log.info("sink %s: warm-up skipped (%s)", self.name, short(exc))
        finally:
            context.setLocalProperty("spark.scheduler.pool", pool)  # type: ignore[arg-type]

    def _batch(self, raw: Any, batch_id: int) -> None:
        if self.follow_swaps and self.sink.current_generation() != self.generation:
            raise RuntimeError(GENERATION_CHANGED)
        started = time.monotonic()
        offsets = self._offsets(batch_id)
        if offsets is None:  # the checkpoint does not say (not written by Spark as expected): ask the data
            moved = {r["topic"]: _UNKNOWN for r in raw.select("topic").distinct().collect()}
            ranges = None
        else:
            moved, ranges = offsets_moved(*offsets), batch_ranges(*offsets)
        # A table is read from one topic generation (sinks._served): another one's records are not this
        # generation's, and its schemas may not be the store's.
        self._skipped = self.served.superseded({tp[0] for tp in offsets[1]} if offsets else moved)
        if self._skipped:
            if self._skipped & set(moved):
                raw = raw.where(~raw["topic"].isin(sorted(self._skipped)))
            moved = {t: n for t, n in moved.items() if t not in self._skipped}
            ranges = None if ranges is None else {tp: r for tp, r in ranges.items() if tp[0] not in self._skipped}
        topics = set(moved)
        records = sum(moved.values())
        batch = (batch_id, self.generation)
        if self._lane is not None and ranges is not None:
            left = self._lane.wait_for(ranges)  # the lane is paused when something is left, until the batch ends
            if not left:  # the lane has applied all of it
                self._done(batch_id, Outcome(0, 0, self._lane.newest_ts_ms), started, started)
                self._follow_lane(batch_id)
                return
            if size_of(left) <= DRIVER_RECORDS:  # else the batch's paths take the whole range
                ranges, records = left, size_of(left)
        elif self._lane is not None:  # ranges unknown: the lane waits for a batch whose end is known
            self._lane.pause()
        if (
            ranges is not None
            and records <= DRIVER_FOLD_RECORDS
            and self._whole_on_driver(batch_id, ranges, raw, started)
        ):
            return
        if isinstance(self.sink, PartitionSink) and ranges is not None and records <= DRIVER_RECORDS:
            read = self._range_reader().read(ranges)  # no Spark job: see sinks._ranges
            folds = self._folds(read)
            planned = time.monotonic()
            outcome = on_driver(self.sink, folds, read, raw, self.settings, batch=batch)
        else:
            folds = [TopicFold(self.decoder.schemas(topic)) for topic in sorted(topics)]
            planned = time.monotonic()
            tasks = _tasks(records, ranges, self.shuffle_partitions)
            apply = in_tasks if isinstance(self.sink, PartitionSink) else in_frames
            outcome = apply(self.sink, folds, raw, self.settings, batch, tasks=tasks)
        self._done(batch_id, outcome, started, planned)
        self._follow_lane(batch_id)

    def _whole_on_driver(self, batch_id: int, ranges: Ranges, raw: Any, started: float) -> bool:
        """A sink that writes whole tables on the driver (the warehouse, by delta-rs) takes a batch of up to one
        task's worth there: its store's write costs milliseconds where a Spark MERGE costs seconds. False when
        the batch goes the Spark path (the sink says why)."""
        if not _on_driver(self.sink):
            return False
        read = self._range_reader().read(ranges)
        folds = self._folds(read)
        planned = time.monotonic()
        try:
            outcome = folded_on_driver(self.sink, folds, read, raw, self.settings, batch=(batch_id, self.generation))
        except NotOnDriverError as exc:
            log.info("sink %s: batch %d goes Spark's path: %s", self.name, batch_id, exc)
            return False
        self._done(batch_id, outcome, started, planned)
        return True

    def _follow_lane(self, batch_id: int) -> None:
        """After a committed batch of a served search or cache: its lane goes on from the batch's end (started
        at the first; see sinks._lane)."""
        ends = self._ends.get(batch_id)
        if ends is None or not self._lane_on():
            return
        ends = {tp: offset for tp, offset in ends.items() if tp[0] not in self._skipped}
        if self._lane is None:
            assert self.feed is not None  # _lane_on
            lane = Lane(
                self.settings, self.name, self.generation, feed=self.feed, opened=self._lane_sink, folds=self._folds
            )
            lane.on_applied = self._lane_applied
            self._lane = lane
        self._lane.follow(ends)

    def _lane_on(self) -> bool:
        return self.feed is not None and not self.rebuild and self.settings.sinks.lane and self.name in _LANE_SINKS

    def _lane_applied(self, records: int) -> None:
        """On the lane's thread: its records count in the next batch's figures (status, metrics) as well, and
        where it has applied to is in the status file at once (within the flusher's half second), which
        `cdc status` and the lag metrics read beside the checkpoint (sinks._progress.lane_offsets)."""
        with self._lane_lock:
            self._lane_records += records
        if self._lane is not None:
            applied = sorted(self._lane.applied().items())
            self.status.stage(
                lane_generation=self.generation, lane_applied=[[t, p, offset] for (t, p), offset in applied]
            )
        if self.metrics is not None:
            self.metrics.lane_records.labels(self.name).inc(records)

    def _lane_sink(self) -> Any:
        """The lane's own instance of the sink, writing this query's generation."""
        return opened(self.name, self.settings, self.generation, None)  # type: ignore[arg-type]  # no Spark needed

    def _folds(self, records: list[dict[str, Any]]) -> list[TopicFold]:
        return self.folds(records)

    def _range_reader(self) -> RangeReader:
        if self._reader is None:
            self._reader = RangeReader(self.settings, self.name)
        return self._reader

    def _done(self, batch_id: int, outcome: Outcome, started: float, planned: float) -> None:
        ended = time.monotonic()
        with self._lane_lock:  # what the lane applied since the last batch is this one's as well
            outcome.records, self._lane_records = outcome.records + self._lane_records, 0
        self._report(batch_id, outcome, ended - started, planned - started)
        if self.metrics is not None:
            self.metrics.phase_seconds.labels(self.name, "pgcdc_plan").observe(planned - started)
            self.metrics.phase_seconds.labels(self.name, "pgcdc_write").observe(ended - planned)

    def _offsets(self, batch_id: int) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]] | None:
        """Where batch ``batch_id`` starts and ends in each partition, from its checkpoint (Spark writes
        ``offsets/N`` before running N; N-1's is remembered from the batch before; see :func:`batch_starts`);
        None if unknown."""
        try:
            end = batch_offsets(self.checkpoint, batch_id)
            before = self._ends.get(batch_id - 1)
            if before is None and batch_id > 0:
                before = batch_offsets(self.checkpoint, batch_id - 1)
        except (OSError, ValueError, AttributeError):
            return None
        if end is None:
            return None
        self._ends = {batch_id: end}
        return batch_starts(batch_id, before, end), end

    def _report(self, batch_id: int, outcome: Outcome, elapsed: float, planning: float) -> None:
        totals = self.status.data
        applied_ms = time.time() * 1000
        newest = outcome.newest_ts_ms
        self.status.stage(
            batches=totals.get("batches", 0) + 1,
            records=totals.get("records", 0) + outcome.records,
            dead_letters=totals.get("dead_letters", 0) + outcome.dead_letters,
            last_batch_id=batch_id,
            last_batch_s=round(elapsed, 3),
            last_applied_ms=int(applied_ms),
            last_source_ts_ms=max(newest or 0, totals.get("last_source_ts_ms") or 0) or None,
        )
        if self.metrics is not None:
            self.metrics.batch_seconds.labels(self.name).observe(elapsed)
            self.metrics.records.labels(self.name).inc(outcome.records)
            self.metrics.dead_letters.labels(self.name).inc(outcome.dead_letters)
            if newest is not None:
                self.metrics.batch_latency.labels(self.name).set(max(0.0, (applied_ms - newest) / 1000))
        log.info(
            "sink %s: batch %d: %d record(s) in %.2fs (planned in %.2fs), %d dead letter(s)",
            self.name,
            batch_id,
            outcome.records,
            elapsed,
            planning,
            outcome.dead_letters,
        )

    def behind(self, topics: Iterable[str]) -> dict[str, tuple[int, int]]:
        """The tables this served generation reads from an older topic generation than their newest among
        ``topics`` (sinks._moves); none for a query of another role, or of a sink without generations."""
        return self.served.behind(topics) if self.follow_swaps else {}

    def caught_up(self) -> bool:
        """True once a batch has read everything that was available when it started."""
        progress = self.query.lastProgress if self.query else None
        if not progress or not progress.get("sources"):
            return False
        source = progress["sources"][0]
        return bool(source.get("endOffset")) and source.get("endOffset") == source.get("latestOffset")

    def observe_progress(self) -> None:
        """Spark's phases of the query's last batch into the metrics, once per batch. Read here, on the
        supervisor's thread, rather than by a StreamingQueryListener: PySpark hands a listener each batch's
        progress converted field by field over py4j (dozens of round trips, and an exception converted at the
        end of every map), which under load took a fifth of the driver's Python time from the batches."""
        progress = self.query.lastProgress if self.metrics is not None and self.query is not None else None
        if progress is None or progress.batchId == self._observed or "addBatch" not in progress.durationMs:
            return  # seen, or a trigger that found nothing to do (its progress keeps the next batch's id)
        self._observed = progress.batchId
        assert self.metrics is not None
        self.metrics.observe_phases(self.name, dict(progress.durationMs))

    def stop(self) -> None:
        if self.query is not None and self.query.isActive:
            self.query.stop()
        if self._lane is not None:
            self._lane.stop()
        self.status.flush()
        if self._reader is not None:
            self._reader.close()
        self.sink.close()


_WARM_RECORDS = 3  # per partition: enough for every stage of a batch to run
_UNKNOWN = 1 << 40  # offsets of a topic whose start is not known (see batch_starts)
_ROWS_PER_SHUFFLE = ONE_TASK_RECORDS  # records per shuffle partition of a batch's fold


def _on_driver(sink: Any) -> bool:
    return isinstance(sink, WritesFolded) and sink.folds_on_driver


def batch_starts(
    batch_id: int, before: dict[tuple[str, int], int] | None, end: dict[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """Where batch ``batch_id`` starts in each partition of ``end``, given where the batch before it ended
    (``before``; None when the checkpoint no longer says).

    The first batch of a checkpoint, and a partition new to the query, start at the partition's beginning:
    the Spark source reads them from the earliest offset (a record compacted away is simply not there, as for
    the driver's reader). Knowing so, a first start's batch is sized like any other and, when small, applied
    by the driver without a Spark job. A later batch whose predecessor is unknown starts nowhere known (empty):
    its own rows decide."""
    if before is None and batch_id > 0:
        return {}
    return {tp: (before or {}).get(tp, 0) for tp in end}


def offsets_moved(start: dict[tuple[str, int], int], end: dict[tuple[str, int], int]) -> dict[str, int]:
    """Per topic, how many offsets lie between two batches' end offsets (a partition absent from ``start``:
    read from its beginning, so the count is unknown and taken as large)."""
    moved: dict[str, int] = {}
    for (topic, partition), offset in end.items():
        before = start.get((topic, partition))
        if before != offset:
            moved[topic] = moved.get(topic, 0) + (_UNKNOWN if before is None else offset - before)
    return moved


def _tasks(offsets: int, ranges: Ranges | None, most: int) -> int:
    """How sinks._write.in_tasks spreads a partition sink's batch: 1 (one task) up to ONE_TASK_RECORDS; else
    :func:`_wanted` tasks by a shuffle when the batch's Kafka partitions are fewer, or 0 (a task each)."""
    if offsets <= ONE_TASK_RECORDS:
        return 1
    wanted = _wanted(offsets, most)
    return wanted if ranges is None or len(ranges) < wanted else 0


def _wanted(offsets: int, most: int) -> int:
    """Tasks for a batch of ``offsets``: one per ~25,000 records, up to ``most``."""
    return max(1, min(most, -(-offsets // _ROWS_PER_SHUFFLE)))
