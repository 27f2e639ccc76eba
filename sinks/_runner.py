"""Running sinks: one Structured Streaming query per sink, rebuilds beside the served copy, and verify.

Each query has its own checkpoint, ``<state_dir>/<sink>/g<N>/checkpoint``: a generation's store and its
checkpoint belong together, so a rebuilt generation is continued exactly where its rebuild stopped. A
running query checks the served generation before each batch; when a rebuild has swapped a new one in, the
query stops and the runner starts the new generation's query from that generation's checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import queue
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyspark

from common.errors import CDCError
from sinks._api import DropsGeneration, PartitionSink, Rebuildable, SinkContext, WritesFolded
from sinks._bridge import Bridge, served_generation
from sinks._feed import LaneFeed
from sinks._fold import (
    DRIVER_FOLD_RECORDS,
    ONE_TASK_RECORDS,
    TopicFold,
    share_decoding,
)
from sinks._frames import in_frames
from sinks._frames import rehearse as rehearse_frames
from sinks._lane import Lane
from sinks._metrics import SinkMetrics, query_name
from sinks._moves import Mover
from sinks._plugins import load
from sinks._preflight import check_executors, check_master, check_writable, missing_module
from sinks._progress import (
    HEARTBEAT_S,
    REBUILD_FILE,
    STATUS_FILE,
    TopicEnds,
    batch_offsets,
    checkpoint_location,
    checkpoint_offsets,
    reached,
    topic_names,
)
from sinks._ranges import DRIVER_RECORDS, RangeReader, Ranges, batch_ranges, size_of
from sinks._reader import Decoder, RegistryFolds, ensure_dead_letter_topic, open_stream, tail_ranges, tail_records
from sinks._served import ServedTopics, served_topics
from sinks._spark import PARALLELISM_KEYS, build_session, stop_session, submitted_master, under_spark_submit
from sinks._storage import S3_SCHEMES, Location, hadoop_conf
from sinks._verify import Drift, compare
from sinks._warehouse_live import NotOnDriverError
from sinks._write import (
    Outcome,
    folded_on_driver,
    in_tasks,
    on_driver,
    rehearse_on_driver,
)
from sinks.errors import PluginError, SinkConfigError, SinkError, SinkTerminalError, StateDiskFullError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from sinks._config import SinksConfig, SinkSettings

log = logging.getLogger(__name__)

_GENERATION_CHANGED = "pgcdc: served generation changed"
_STATUS_LOCK = threading.Lock()
_HEALTHY_S = 300.0  # a query that ran this long before failing was healthy: its backoff starts over
_NO_SPACE = "No space left on device"  # ENOSPC as the JVM (Spark's checkpoint writes) and the C library say it
_NEARLY_FULL = 64 * 2**20  # free bytes under which an ENOSPC is taken to be the state disk's
_CHECKPOINT_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"
_BUILT_IN = ("search", "cache", "warehouse", "sql")
_CATCH_UP_TIMEOUT_S = 3600.0  # a rebuild that has not read every topic by then fails
_BRIDGE_WAIT_S = 120  # a bridge's store calls time out within this (their clients' own timeouts)
_LANE_SINKS = ("search", "cache")  # built-ins that write without Spark (sinks._lane)


def spark_session(settings: SinkSettings, app: str) -> SparkSession:
    cfg = settings.sinks
    if under_spark_submit():
        check_master(submitted_master(), "spark-submit's --master")
    elif cfg.spark_master:
        check_master(cfg.spark_master, "sinks.spark_master")
    conf = {"spark.sql.session.timeZone": "UTC", **hadoop_conf(cfg.storage), **cfg.spark_conf}
    if cfg.state_dir.partition("://")[0] in S3_SCHEMES and _CHECKPOINT_MANAGER not in conf:
        # Spark's default checkpoint manager commits a file by rename, which S3 does not have (a copy and a
        # delete, not atomic): this one writes each file in one upload that becomes visible whole, or never.
        conf[_CHECKPOINT_MANAGER] = "org.apache.spark.internal.io.cloud.AbortableStreamBasedCheckpointFileManager"
    elif cfg.state_dir.partition("://")[0] in ("file", cfg.state_dir) and _CHECKPOINT_MANAGER not in conf:
        # A local disk: Spark's default (Hadoop's FileContext) takes ~90 ms to write each of a batch's two
        # checkpoint files here, the FileSystem API ~25 ms, with the same write-then-rename (atomic on a local
        # file system). Two of them per batch and sink were a fifth of a live batch's time.
        conf[_CHECKPOINT_MANAGER] = _local_checkpoint_manager(pyspark.__version__)
    session = build_session(
        app,
        list(cfg.spark_jars),
        master=cfg.spark_master,
        conf=conf,
        class_archive=cfg.jvm_class_archive,
        s3=_on_s3(cfg),
    )
    try:
        check_executors(session)
    except BaseException:
        stop_session(session)
        raise
    return session


def _on_s3(cfg: SinksConfig) -> bool:
    """Whether the state or the warehouse is on S3: Spark then needs the S3A connector."""
    return any(path.partition("://")[0] in S3_SCHEMES for path in (cfg.state_dir, cfg.warehouse.path))


def _local_checkpoint_manager(spark_version: str) -> str:
    """Spark's FileSystem-API checkpoint manager: Spark 4.1 moved it into a ``checkpointing`` package."""
    major, minor = (int(part) for part in spark_version.split(".")[:2])
    package = "org.apache.spark.sql.execution.streaming"
    return (
        f"{package}.checkpointing.FileSystemBasedCheckpointFileManager"
        if (major, minor) >= (4, 1)
        else (f"{package}.FileSystemBasedCheckpointFileManager")
    )


def _opened(name: str, settings: SinkSettings, generation: int, spark: SparkSession) -> Any:
    sink = load(name)
    options: dict[str, Any] = getattr(settings.sinks, name).model_dump() if name in _BUILT_IN else {}
    options = settings.sinks.plugins.get(name, options)
    sink.open(SinkContext(name, settings, options, generation, spark))
    return sink


def _opened_without_spark(name: str, settings: SinkSettings) -> Any:
    """A built-in sink opened before (or without) a Spark session: they touch Spark only to write frames."""
    assert name in _BUILT_IN, name
    return _opened(name, settings, 0, None)  # type: ignore[arg-type]


@dataclass
class _Status:
    """A sink's status file: what `cdc status`, the dashboard and the capture's metrics read from outside."""

    path: Location
    data: dict[str, Any] = field(default_factory=dict)
    _staged: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Location) -> _Status:
        return cls(path, cls._read(path))

    @staticmethod
    def _read(path: Location) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):  # absent, unreadable, or torn by a crash mid-write
            data = json.loads(path.read_text() or "{}")
            if isinstance(data, dict):
                return data
        return {}

    def update(self, **values: Any) -> None:
        """Writes ``values`` (and whatever :meth:`stage` held) now."""
        # Read, merge, replace: the app's loop (heartbeats, backoff) and the query's batches write the same
        # file from different threads and objects; none may undo another's fields.
        # Best effort: a full or read-only state disk must not end the app over a status line (the query's
        # own checkpoint writes fail loudly where it matters).
        with _STATUS_LOCK:
            values, self._staged = {**self._staged, **values}, {}
            try:
                self.data = {**self._read(self.path), **values, "updated_at": time.time()}
                self.path.write_text(json.dumps(self.data, indent=2))
            except OSError as exc:
                log.warning("cannot write %s: %s", self.path, exc)

    def stage(self, **values: Any) -> None:
        """Takes ``values`` at once (``data``) and writes them within a second, off the caller's thread.

        A batch's figures are written this way: a status file is a read and a write (two requests on an
        object store), which a batch of a few rows must not wait for.
        """
        with _STATUS_LOCK:
            self.data.update(values)
            self._staged.update(values)
        _FLUSHER.add(self)

    def flush(self) -> None:
        if self._staged:
            self.update()


class _Flusher:
    """Writes staged status values every half second, on a thread of its own (started on first use)."""

    def __init__(self) -> None:
        self._statuses: dict[int, _Status] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, status: _Status) -> None:
        with self._lock:
            self._statuses[id(status)] = status
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pgcdc-status", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                statuses, self._statuses = list(self._statuses.values()), {}
            for status in statuses:
                status.flush()


_FLUSHER = _Flusher()


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
            self.sink = _opened(name, settings, generation, self.spark)
        else:  # an instance made elsewhere (benchmarks: a reference sink that is not installed)
            self.sink = sink
            sink.open(SinkContext(name, settings, {}, generation, self.spark))
        self.decoder = Decoder(settings)
        self.shuffle_partitions = int(self.spark.conf.get("spark.sql.shuffle.partitions") or 200)
        self.rebuild = role == "rebuild"
        self.follow_swaps = role == "serve" and isinstance(self.sink, Rebuildable)
        base = settings.state() / name
        self.checkpoint = checkpoint_location(settings.state(), name, generation)
        self.checkpoint.make_dirs()
        self.served = (  # a store with generations reads one topic generation per table: sinks._served
            served_topics(settings, name, generation, lambda: topic_names(settings))
            if isinstance(self.sink, Rebuildable)
            else ServedTopics(settings.kafka.topic_prefix, None)
        )
        self._skipped: set[str] = set()  # the last batch's topics of generations this one does not read
        self.status = _Status.load(base / (REBUILD_FILE if self.rebuild else STATUS_FILE))
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
            log.info("sink %s: warm-up skipped (%s)", self.name, _short(exc))
        finally:
            context.setLocalProperty("spark.scheduler.pool", pool)  # type: ignore[arg-type]

    def _batch(self, raw: Any, batch_id: int) -> None:
        if self.follow_swaps and self.sink.current_generation() != self.generation:
            raise RuntimeError(_GENERATION_CHANGED)
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
        return _opened(self.name, self.settings, self.generation, None)  # type: ignore[arg-type]  # no Spark needed

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


def _close(sink: Any) -> None:
    sink.close()


def run(
    settings: SinkSettings,
    names: Sequence[str],
    stop: threading.Event,
    source_tables: Callable[[], Sequence[Any]] | None = None,
) -> int:
    """Run the sinks until ``stop``; a failing sink is restarted with backoff, the others go on.

    A sink that cannot be loaded is reported and skipped; only when none is left is it an error.
    ``source_tables``: the source's tables, to verify what the app rebuilds after a table moved to a new topic
    generation (sinks._moves); without it, such a rebuild is left to `cdc sinks rebuild`.
    """
    usable, problems = [], []
    for name in names:
        try:
            load(name)
            usable.append(name)
        except PluginError as exc:
            problems.append(exc)
            log.error("%s; running the other sinks", exc)
    if not usable:
        raise problems[0] if problems else SinkConfigError("no sinks to run: name some or set sinks.enabled")
    check_writable(settings.state(), "sinks.state_dir")
    ensure_dead_letter_topic(settings)
    cfg = settings.sinks
    share_decoding(cfg.shared_decode_records)  # the sinks read the same records: each is decoded once
    metrics = SinkMetrics()
    server = metrics.serve(cfg.metrics_host, cfg.metrics_port) if cfg.metrics_enabled else None
    # The built-ins open without Spark: what their topics hold past their checkpoints is applied while it starts.
    bridges = {
        name: Bridge(settings, name, lambda name=name: _opened_without_spark(name, settings))  # type: ignore[misc]
        for name in usable
        if name in _BUILT_IN
    }
    for bridge in bridges.values():
        bridge.start()
    spark = spark_session(settings, "pgcdc-sinks")
    supervisor = _Supervisor(settings, usable, spark, metrics)
    supervisor.bridges = bridges
    if cfg.rebuild_moved_tables and source_tables is not None:
        supervisor.mover = _mover(settings, spark, source_tables)
    try:
        supervisor.run(stop)
    finally:  # a bridge still running (a store that hangs) is not waited for: what it writes is written again
        for bridge in bridges.values():
            bridge.finish()
        if server is not None:
            server.shutdown()
        stop_session(spark)
    return 0


def _mover(settings: SinkSettings, spark: SparkSession, source_tables: Callable[[], Sequence[Any]]) -> Mover:
    """The app's rebuilds after a table moved (sinks._moves), on its own Spark application."""

    def rebuild_moved(names: list[str], stop: threading.Event, reason: str) -> list[Rebuilt]:
        return rebuild(settings, names, source_tables, report=log.info, app=InApp(spark, stop, reason))

    return Mover(rebuild_moved, lambda: topic_names(settings), settings.kafka.topic_prefix)


class _Supervisor:
    """Keeps each sink's query running: started with the generation it serves, restarted with backoff when it
    fails, switched when a rebuild swaps in a new generation, given up when retrying cannot help."""

    def __init__(self, settings: SinkSettings, names: list[str], spark: SparkSession, metrics: SinkMetrics) -> None:
        self.settings, self.names, self.spark, self.metrics = settings, names, spark, metrics
        self.queries: dict[str, SinkQuery] = {}
        self.delays: dict[str, float] = {}  # the next backoff per sink
        self.started_at: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}
        self.given_up: dict[str, SinkTerminalError] = {}
        self.starting: dict[str, threading.Thread] = {}  # sinks whose start runs on its own thread
        self.bridges: dict[str, Bridge] = {}  # the sinks' bridges (sinks._bridge), joined before their query
        self.feed = LaneFeed(settings, RegistryFolds(Decoder(settings)))  # every lane's one reader
        self.mover: Mover | None = None  # rebuilds the sinks a moved table leaves behind (sinks._moves)
        self._outcomes: queue.SimpleQueue[tuple[str, SinkQuery | None, Exception | None]] = queue.SimpleQueue()

    def run(self, stop: threading.Event) -> None:
        for name in self.names:
            _sink_status(self.settings, name).update(heartbeat_at=time.time())
        threading.Thread(target=self._heartbeat, args=(stop,), name="pgcdc-heartbeat", daemon=True).start()
        try:
            for name in self.names:
                self._start(name)
            while not stop.is_set():
                self._started()
                for name in self.names:
                    if name not in self.given_up and name not in self.starting:
                        self._check(name)
                if self.mover is not None:
                    self._follow_moves(self.mover)
                stop.wait(0.2 if self.starting else 1.0)
        finally:
            if self.mover is not None:
                self.mover.stop()
            for thread in list(self.starting.values()):  # a query started after this would outlive the app
                thread.join(120)
            with contextlib.suppress(CDCError):
                self._started()
            for q in self.queries.values():
                q.stop()
            self.feed.stop()
            for name in self.names:
                if name not in self.given_up:
                    _sink_status(self.settings, name).update(state="stopped")

    def _follow_moves(self, mover: Mover) -> None:
        """Switches the sinks whose rebuilt generation is now served; starts a rebuild when a table moved (after
        the switch: the replaced generations' queries, behind the move, must not ask for another)."""
        for name in mover.swapped():
            q = self.queries.pop(name, None)
            if q is not None:  # else its start is under way, or its backoff: either takes the served generation
                q.stop()
                log.info("sink %s: switching to the rebuilt generation", name)
                self._start(name, replaced=q.generation)
        mover.look(self.queries)

    def _heartbeat(self, stop: threading.Event) -> None:
        # "Alive" for readers outside the app (cdc status, the capture's dashboard and metrics). Its own
        # thread: the loop blocks while a sink starts or stops (Spark, a store's timeouts).
        while not stop.wait(HEARTBEAT_S):
            for name in self.names:
                _sink_status(self.settings, name).update(heartbeat_at=time.time())

    def _check(self, name: str) -> None:
        """Starts the sink when its backoff is over; looks at its query when it has stopped."""
        q = self.queries.get(name)
        if q is None:
            if time.monotonic() >= self.retry_at.get(name, 0):
                self._start(name)
            return
        if q.query is None:
            return
        if q.query.isActive:
            q.observe_progress()
            return
        error = q.query.exception()
        q.stop()
        self.queries.pop(name)
        if error is not None and _GENERATION_CHANGED in str(error):
            log.info("sink %s: a rebuild swapped in a new generation; switching to it", name)
            self._start(name, replaced=q.generation)
            return
        full = _state_disk_full(self.settings, name, error)
        if full is not None:  # terminal for the whole app: see common.errors.StateDiskFullError
            self.metrics.running.labels(name).set(0)
            raise full
        missing = missing_module(error)
        if missing is not None:
            self._give_up(name, missing)
            return
        if _raised_by(error) is None:  # not one of ours: its whole account (Spark's own log is off)
            log.warning("sink %s: the query failed:\n%s", name, error)
        self._back_off(name, f"stopped: {_short(error)}")

    def _start(self, name: str, replaced: int | None = None) -> None:
        """Starts the sink on a thread of its own: its warm-up takes seconds, which no other sink waits for.
        ``replaced``: the generation whose query stopped because a rebuild swapped in a new one."""
        self.started_at[name] = time.monotonic()
        thread = threading.Thread(target=self._launch, args=(name, replaced), name=f"pgcdc-start-{name}", daemon=True)
        self.starting[name] = thread
        thread.start()

    def _launch(self, name: str, replaced: int | None) -> None:
        try:
            q = self._warmed(name, replaced)
            q.start(self.metrics)
            q.status.update(state="running")
            self.metrics.running.labels(name).set(1)
            self._outcomes.put((name, q, None))
        except Exception as exc:
            self._outcomes.put((name, None, exc))

    def _warmed(self, name: str, replaced: int | None) -> SinkQuery:
        """The sink's query, warmed up, with its bridge ended: the query's batches never write beside it (see
        Bridge), whether the warm-up succeeded or not. ``replaced``: as for :meth:`_start`."""
        bridge = self.bridges.pop(name, None)
        try:
            if bridge is not None:  # the bridge settles (on a first start: creates) the served generation
                bridge.settled.wait(_BRIDGE_WAIT_S)
            probe = _opened(name, self.settings, 0, self.spark)
            generation = served_generation(probe)
            if replaced is not None and replaced < generation and isinstance(probe, DropsGeneration):
                probe.drop_generation(replaced)  # what its last batch wrote after the swap's drop: see the protocol
                log.info("sink %s: generation %d's query stopped; what it left was dropped", name, replaced)
            probe.close()
            q = SinkQuery(name, self.settings, self.spark, generation)
            q.feed = self.feed
            q.warm()
            return q
        finally:
            if bridge is not None:
                bridge.finish()
                bridge.join(_BRIDGE_WAIT_S)
                if bridge.is_alive():
                    log.warning("sink %s: its bridge still runs after %ds; the query starts", name, _BRIDGE_WAIT_S)

    def _started(self) -> None:
        """Takes the outcome of each start that has ended (on the supervisor's thread, which owns its state)."""
        while True:
            try:
                name, q, exc = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self.starting.pop(name, None)
            if q is not None:
                self.queries[name] = q
            elif isinstance(exc, SinkTerminalError):
                self._give_up(name, exc)
            else:  # the store or Kafka not reachable yet, a plugin's own failure
                full = _state_disk_full(self.settings, name, exc)
                if full is not None:
                    raise full from exc
                self._back_off(name, f"could not start ({_short(exc)})")

    def _back_off(self, name: str, why: str) -> None:
        # A query that ran a while before failing starts the backoff over; a crash loop doubles it up to 60 s.
        ran = time.monotonic() - self.started_at.get(name, time.monotonic())
        delay = 2.0 if ran > _HEALTHY_S else min(self.delays.get(name, 1.0) * 2, 60.0)
        self.delays[name], self.retry_at[name] = delay, time.monotonic() + delay
        self.metrics.running.labels(name).set(0)
        _sink_status(self.settings, name).update(state="backoff", last_error=why)
        log.error("sink %s %s; restarting in %.0fs", name, why, delay)

    def _give_up(self, name: str, exc: SinkTerminalError) -> None:
        # Retrying cannot help (its configuration, say): this sink stops, the others go on.
        self.queries.pop(name, None)
        bridge = self.bridges.pop(name, None)
        if bridge is not None:
            bridge.finish()
        self.given_up[name] = exc
        self.metrics.running.labels(name).set(0)
        _sink_status(self.settings, name).update(state="given_up", last_error=_short(exc))
        log.error("sink %s cannot run: %s; the other sinks go on", name, exc)
        if len(self.given_up) == len(self.names):
            raise exc


def _sink_status(settings: SinkSettings, name: str, file: str = STATUS_FILE) -> _Status:
    return _Status.load(settings.state() / name / file)


def _state_disk_full(settings: SinkSettings, name: str, error: Any) -> StateDiskFullError | None:
    """The operator's error when ``error`` is the sinks' state disk being full, else None.

    Spark reports a failed checkpoint write as the JVM's IOException text, without the path, so the text is
    matched and the state directory's free space decides whose disk it was: a store's own full disk (say, the
    warehouse's) is that sink's problem, retried with backoff like any store fault.
    """
    if not ((isinstance(error, OSError) and error.errno == errno.ENOSPC) or _NO_SPACE in str(error)):
        return None
    state = settings.state()
    if not state.local:
        return None  # an object store has no disk to fill
    state_dir = Path(state.path)
    try:
        free = shutil.disk_usage(state_dir).free
    except OSError:
        return None
    if free > _NEARLY_FULL:
        return None
    return StateDiskFullError(
        f"sink {name} cannot write its checkpoint under {state_dir / name}: the disk is full ({_NO_SPACE}; "
        f"{free:,} bytes free there). Nothing is lost: every sink resumes from its last completed batch. Free "
        "space on that disk, or stop the sinks and move sinks.state_dir (with everything in it) to a larger disk "
        "and set the new path (sinks.state_dir or CDC_SINKS__STATE_DIR); then run `cdc sinks run` again"
    )


# The last line of a Python traceback: "common.errors.SinkTransientError: Redis refused …".
_RAISED = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (?P<message>.*)$")


_OURS = CDCError.__module__ + "."  # where our error classes live, as a traceback names them


def _raised_by(error: Any) -> str | None:
    """What one of our errors (sinks.errors) said, when it ended a batch: Spark wraps it in a Python traceback."""
    lines = str(error).splitlines() if error is not None else []
    raised = [m for m in map(_RAISED.match, lines) if m is not None]
    if raised and raised[-1]["type"].startswith(_OURS):
        return raised[-1]["message"]
    return None


def _short(error: Any) -> str:
    """One line for status.json, the dashboard and the log: our own message, else the error's first line."""
    text = _raised_by(error) or (str(error) if error is not None else "stopped")
    return text.splitlines()[0][:500] if text else "stopped"


# --- verify -----------------------------------------------------------------------------------


def never_ran(settings: SinkSettings, name: str) -> SinkConfigError | None:
    """The error for a built-in sink whose store has no served generation yet, found before Spark starts (a
    plugin's ``open`` may need Spark: it is asked inside :func:`verify`)."""
    if name not in _BUILT_IN:
        return None
    sink = _opened_without_spark(name, settings)
    try:
        return None if sink.current_generation() is not None else _never_ran(name)
    finally:
        sink.close()


_CHANGED_UNDER_READ = "DELTA_SCHEMA_CHANGE_SINCE_ANALYSIS"  # Delta's error for a table altered during a read
_READS_UNDER_CHANGE = 5  # reads of a store that keeps changing its schema under them before verify gives up


def _never_ran(name: str) -> SinkConfigError:
    return SinkConfigError(f"sink {name!r} has never run: nothing to verify")


def verify(
    settings: SinkSettings,
    name: str,
    source_tables: Callable[[], Sequence[Any]],
    *,
    generation: int | None = None,
    wait_s: float = 0.0,
    spark: SparkSession | None = None,
) -> list[Drift]:
    """Compare until clean or ``wait_s`` has passed (a live store converges as its query catches up)."""
    session = spark if spark is not None else spark_session(settings, "pgcdc-verify")
    sink = _opened(name, settings, generation or 0, session)
    try:
        if not isinstance(sink, Rebuildable):
            raise SinkConfigError(f"sink {name!r} cannot be read back (it does not implement sinks.Rebuildable)")
        deadline, reads = time.monotonic() + wait_s, 0
        while True:
            gen = generation if generation is not None else sink.current_generation()
            if gen is None:
                if time.monotonic() < deadline:  # a sink started moments ago has not set up its store yet
                    time.sleep(2.0)
                    continue
                raise _never_ran(name)
            reports, reads = settings.state() / name / "verify", reads + 1
            try:
                drifts = compare(session, sink, source_tables(), gen, table_name=settings.table_name, reports=reports)
            except Exception as exc:
                if _CHANGED_UNDER_READ not in str(exc) or reads >= _READS_UNDER_CHANGE:
                    raise
                # The running sink gave a table a wider column (sinks._delta_widen) while it was read: read again.
                log.info("verify %s: a table's schema changed while it was read; reading it again", name)
                continue
            if all(d.clean for d in drifts) or time.monotonic() >= deadline:
                return drifts
            time.sleep(2.0)
    finally:
        sink.close()
        if spark is None:
            stop_session(session)


# --- rebuild ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InApp:
    """A rebuild inside the serving app (sinks._moves): its Spark session, and its stop (set: the rebuild ends
    before its swap)."""

    spark: SparkSession
    stop: threading.Event
    reason: str = ""  # why, for `cdc status` and the dashboard (the rebuild's status file)


@dataclass(frozen=True)
class Rebuilt:
    """One sink's part of a rebuild: the generation built beside the served one, and its final comparison."""

    name: str
    generation: int
    drifts: list[Drift]

    @property
    def clean(self) -> bool:
        return all(d.clean for d in self.drifts)


def rebuild(
    settings: SinkSettings,
    names: Sequence[str],
    source_tables: Callable[[], Sequence[Any]],
    *,
    verify_wait_s: float = 120.0,
    report: Callable[[str], None] = print,
    app: InApp | None = None,
) -> list[Rebuilt]:
    """Build generation N+1 of each sink from offset zero beside its served one, verify it, swap it in.

    The sinks rebuild side by side in one Spark application (one JVM start; their queries share its cores):
    ``app``'s when given (the serving app's: sinks._moves). Every new generation is swapped in only when all of
    them verify clean: on drift in any, none is swapped (the served copies stay) and the caller reports it, so
    a rebuild never leaves the stores half rebuilt.
    """
    check_writable(settings.state(), "sinks.state_dir")
    spark = app.spark if app is not None else spark_session(settings, f"pgcdc-rebuild-{'-'.join(names)}")
    stop = app.stop if app is not None else threading.Event()
    ensure_dead_letter_topic(settings)
    queries: list[SinkQuery] = []
    results: list[Rebuilt] = []
    try:
        for name in names:  # one that cannot start (a sink that cannot be rebuilt) stops those started before it
            q = _rebuild_query(settings, name, spark, report)
            queries.append(q)
            if app is not None and app.reason:
                q.status.update(reason=app.reason)
        for q in queries:
            _catch_up(q, settings, _CATCH_UP_TIMEOUT_S, stop)
            report(f"generation {q.generation} of {q.name} caught up with the topics")
        for q in queries:
            report(f"verifying generation {q.generation} of {q.name} against the source")
            q.status.update(state="verifying")
            drifts = verify(settings, q.name, source_tables, generation=q.generation, wait_s=verify_wait_s, spark=spark)
            results.append(Rebuilt(q.name, q.generation, drifts))
    finally:
        outcomes = {r.name: "done" if r.clean else "drift" for r in results}
        for q in queries:
            q.stop()
            q.status.update(state=outcomes.get(q.name, "failed"), finished_at=time.time())
    if all(r.clean for r in results):
        for r in results:
            swapper = _opened(r.name, settings, r.generation, spark)
            swapper.swap(r.generation)
            swapper.close()
            report(f"{r.name}: generation {r.generation} is now served; generation {r.generation - 1} was dropped")
    return results


def _rebuild_query(settings: SinkSettings, name: str, spark: SparkSession, report: Callable[[str], None]) -> SinkQuery:
    """A new generation of ``name`` prepared beside the served one, and its query started from offset zero."""
    probe: Any = _opened(name, settings, 0, spark)
    if not isinstance(probe, Rebuildable):
        raise SinkConfigError(f"sink {name!r} does not support rebuild (it does not implement sinks.Rebuildable)")
    current = served_generation(probe)
    new = current + 1
    probe.prepare_generation(new)
    _close(probe)
    (settings.state() / name / f"g{new}").remove_tree()
    report(f"rebuilding {name}: generation {new} from offset zero, while generation {current} keeps serving")
    # The rebuild's own status file: the served generation's status.json stays the running app's.
    (settings.state() / name / REBUILD_FILE).remove()
    q = SinkQuery(name, settings, spark, new, role="rebuild")
    q.status.update(state="running", serving=current, started_at=time.time())
    q.start()
    return q


def _catch_up(q: SinkQuery, settings: SinkSettings, timeout_s: float, stop: threading.Event) -> None:
    """Wait until the rebuild's query has read everything, with a progress bar (records of the topics)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    ends = TopicEnds(settings)
    progress = Progress(
        TextColumn(f"rebuild {q.name} g{q.generation}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    )
    task = progress.add_task("records", total=None)
    deadline = time.monotonic() + timeout_s

    def show() -> bool | None:
        """Update the bar; whether the checkpoint has reached the topics' ends (None: could not tell)."""
        with contextlib.suppress(Exception):  # progress is cosmetic: a metadata hiccup must not fail the rebuild
            marks = ends.read()
            done = checkpoint_offsets(q.checkpoint) or {}
            total = sum(high - low for low, high in marks.values())
            read = sum(min(high, done.get(tp, low)) - low for tp, (low, high) in marks.items())
            progress.update(task, total=total, completed=read)
            q.status.update(records_total=total, records_done=read)
            return reached(done, marks)
        return None

    try:
        with progress:
            for looks in itertools.count():
                if q.query is not None and not q.query.isActive:
                    error = q.query.exception()
                    if _raised_by(error) is None:  # not one of ours: its whole account (Spark's own log is off)
                        log.warning("rebuild of %s: the query failed:\n%s", q.name, error)
                    raise SinkError(f"rebuild query of {q.name} failed: {_short(error)}")
                if time.monotonic() > deadline:
                    raise SinkError(f"rebuild of {q.name} did not catch up within {timeout_s:.0f}s")
                if stop.is_set():
                    raise SinkError(f"rebuild of {q.name} stopped before it caught up")
                # Spark's own answer (lastProgress) is dozens of py4j round trips, ~80 ms of the JVM's CPU on
                # a busy machine: asked once the checkpoint says the end is near, and every 10 s regardless.
                if (show() is not False or looks % 10 == 9) and q.caught_up():
                    return
                stop.wait(1.0)
    finally:
        ends.close()
