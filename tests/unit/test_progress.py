"""Pure logic of operability: sink lag from Spark checkpoints, freshness, heartbeats, the capture's counters."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cdc.metrics import CaptureMetrics
from sinks._query import batch_starts, offsets_moved
from sinks._storage import StorageConfig, location
from sinks.config import SinksConfig, SinkSettings
from sinks.progress import checkpoint_offsets, reached, sink_progress


def _batch(checkpoint: Path, batch: int, offsets: dict[str, dict[str, int]], *, committed: bool) -> None:
    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    (checkpoint / "commits").mkdir(parents=True, exist_ok=True)
    # Spark's layout: version, batch metadata, then one line per source with the batch's end offsets.
    (checkpoint / "offsets" / str(batch)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(offsets)}\n')
    if committed:
        (checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_the_newest_committed_batch_is_what_was_applied(tmp_path: Path) -> None:
    checkpoint = location(tmp_path, StorageConfig())
    assert checkpoint_offsets(checkpoint) is None
    _batch(tmp_path, 0, {"p.public.a": {"0": 5}}, committed=True)
    _batch(tmp_path, 1, {"p.public.a": {"0": 9}, "p.public.b": {"0": 3, "1": 4}}, committed=True)
    _batch(tmp_path, 2, {"p.public.a": {"0": 20}}, committed=False)  # planned, not done: not applied
    assert checkpoint_offsets(checkpoint) == {("p.public.a", 0): 9, ("p.public.b", 0): 3, ("p.public.b", 1): 4}


def test_the_end_is_reached_only_when_every_partition_is() -> None:
    ends = {("p.public.a", 0): (0, 9), ("p.public.b", 0): (4, 4)}  # b: compacted away, nothing left to read
    assert reached({("p.public.a", 0): 9}, ends)
    assert not reached({("p.public.a", 0): 8, ("p.public.b", 0): 4}, ends)
    assert not reached({}, {("p.public.a", 0): (0, 9)}), "a partition the checkpoint does not name read nothing"
    assert reached({}, {}), "no topics: nothing to read"


def _settings(state: Path) -> SinkSettings:
    return SinkSettings(sinks=SinksConfig(state_dir=str(state)))


def _status(base: Path, name: str, **values: object) -> None:
    (base / name).mkdir(parents=True, exist_ok=True)
    (base / name / "status.json").write_text(json.dumps(values))


def test_what_the_lane_applied_beyond_the_checkpoint_is_not_lag(tmp_path: Path) -> None:
    """Search's and cache's lanes apply changes ahead of the batches; the status file says how far, for the
    generation they wrote. Another generation's figures (a swap since) are not this one's."""
    _batch(tmp_path / "cache" / "g2" / "checkpoint", 0, {"pgcdc.public.a": {"0": 50, "1": 70}}, committed=True)
    ends = {("pgcdc.public.a", 0): (0, 100), ("pgcdc.public.a", 1): (0, 80)}
    lane = [["pgcdc.public.a", 0, 95], ["pgcdc.public.a", 1, 60]]  # partition 1: the checkpoint is further
    _status(tmp_path, "cache", generation=2, lane_generation=2, lane_applied=lane)
    (cache,) = sink_progress(_settings(tmp_path), ends)
    assert [(p.committed, p.lag) for p in cache.partitions] == [(95, 5), (70, 10)]
    _status(tmp_path, "cache", generation=2, lane_generation=1, lane_applied=lane)
    (cache,) = sink_progress(_settings(tmp_path), ends)
    assert [(p.committed, p.lag) for p in cache.partitions] == [(50, 50), (70, 10)]


def test_lag_per_partition_freshness_and_heartbeat(tmp_path: Path) -> None:
    now = time.time()
    _status(tmp_path, "cache", generation=1, state="running", heartbeat_at=now - 1, last_source_ts_ms=1000)
    _batch(tmp_path / "cache" / "g1" / "checkpoint", 0, {"pgcdc.public.a": {"0": 90}}, committed=True)
    ends = {
        ("pgcdc.public.a", 0): (0, 100),
        ("pgcdc.public.new", 0): (4, 10),  # not in the checkpoint yet: read from the earliest offset
        ("other.public.a", 0): (0, 50),  # not a change topic of this prefix
    }
    asked = []

    def stamp(topic: str, partition: int, offset: int) -> float | None:
        asked.append((topic, partition, offset))
        return now - 30 if topic == "pgcdc.public.a" else now - 5

    (cache,) = sink_progress(_settings(tmp_path), ends, now=now, timestamp_at=stamp)
    assert cache.lag_records == 10 + 6
    assert [(p.topic, p.committed, p.lag) for p in cache.partitions] == [
        ("pgcdc.public.a", 90, 10),
        ("pgcdc.public.new", 4, 6),
    ]
    # Freshness: the age of the oldest record not applied (the first unapplied offset of each partition).
    assert sorted(asked) == [("pgcdc.public.a", 0, 90), ("pgcdc.public.new", 0, 4)]
    assert abs(cache.freshness_s - 30) < 1e-6  # type: ignore[operator]
    assert cache.state == "running"

    # Caught up: fresh, whatever the age of the last event.
    (cache,) = sink_progress(_settings(tmp_path), {("pgcdc.public.a", 0): (0, 90)}, now=now, timestamp_at=stamp)
    assert cache.lag_records == 0
    assert cache.freshness_s == 0.0

    # The app stopped writing heartbeats: it is not running, whatever its last word was.
    _status(tmp_path, "cache", generation=1, state="running", heartbeat_at=now - 60)
    (cache,) = sink_progress(_settings(tmp_path), ends, now=now)
    assert cache.state == "not running"
    assert cache.freshness_s is None  # no timestamps and no applied event: unknown, not zero


def test_a_sink_that_never_completed_a_batch_is_behind_by_everything(tmp_path: Path) -> None:
    _status(tmp_path, "search", generation=1, state="running", heartbeat_at=time.time())
    _status(tmp_path, "cache", state="backoff", heartbeat_at=time.time())  # never even started a query
    cache, search = sink_progress(_settings(tmp_path), {("pgcdc.public.a", 0): (10, 100)})
    assert search.lag_records == 90
    assert cache.lag_records == 90
    assert search.freshness_s is None  # nothing applied and no timestamps asked for: unknown, not zero


def test_events_count_only_once_their_kafka_transaction_commits() -> None:
    m = CaptureMetrics()
    m.tables["p.public.a"] = "public.a"
    m.count("p.public.a", "c", 3)
    m.aborted()  # the transaction was aborted: its events were never delivered
    assert m.event_totals() == {}
    m.count("p.public.a", "c", 2)
    m.count("p.public.a", "d")
    now_us = int(time.time() * 1e6)
    m.committed(3, 0.01, 1234, (now_us - 5_000_000, now_us - 1_000_000))
    assert m.event_totals() == {("public.a", "c"): 2, ("public.a", "d"): 1}
    # Time behind is the oldest transaction's delay, and stays visible for the window after it.
    assert m.behind_s is not None
    assert m.behind_s > 4.5  # the oldest transaction's delay (5 s), not the newest's (1 s)
    m.set_behind(0.0)
    assert m.behind_s > 4.5
    # A transaction read but not yet in Kafka (a stall, a huge transaction): its age is how far behind.
    fresh = CaptureMetrics()
    fresh.pending(int((time.time() - 20) * 1e6))
    assert fresh.behind_s is not None
    assert fresh.behind_s >= 19.9
    fresh.committed(1, 0.01, 1, None)
    assert (fresh.behind_s or 0.0) < 1


def test_snapshot_progress_and_eta() -> None:
    m = CaptureMetrics()
    m.snapshot_started({"public.a": 100, "public.b": None})
    m.snapshot_rows("public.a", 50, table_done=False, done_tables=0)
    assert m.snapshot is not None
    assert m.snapshot["rows_done"] == 50
    assert m.snapshot["rows_total"] == 100
    assert m.snapshot["eta_s"] is not None
    m.snapshot_rows("public.b", 30, table_done=True, done_tables=1)  # b had no estimate: it is what was read
    m.snapshot_rows("public.a", 80, table_done=True, done_tables=2)  # a was bigger than estimated
    assert m.snapshot["rows_total"] == m.snapshot["rows_done"] == 160
    m.snapshot_finished()
    assert m.snapshot["running"] is False


def test_a_batch_spans_the_offsets_between_its_end_and_the_last_batchs_end() -> None:
    before = {("p.s.a", 0): 10, ("p.s.a", 1): 5, ("p.s.b", 0): 7}
    end = {("p.s.a", 0): 12, ("p.s.a", 1): 8, ("p.s.b", 0): 7, ("p.s.c", 0): 3}
    moved = offsets_moved(before, end)
    assert moved["p.s.a"] == 5  # both partitions
    assert "p.s.b" not in moved  # nothing new: not read by the batch
    assert moved["p.s.c"] >= 1 << 40  # a topic new to the query is read from its start: its size is unknown


def test_the_first_batch_and_a_new_partition_start_at_the_partitions_beginning() -> None:
    end = {("p.s.a", 0): 12, ("p.s.a", 1): 8, ("p.s.c", 0): 3}
    # A fresh checkpoint's first batch: Spark reads every partition from its earliest offset.
    assert batch_starts(0, None, end) == {("p.s.a", 0): 0, ("p.s.a", 1): 0, ("p.s.c", 0): 0}
    assert offsets_moved(batch_starts(0, None, end), end) == {"p.s.a": 20, "p.s.c": 3}
    # A later batch: from where the batch before ended; a topic new to the query from its beginning.
    before = {("p.s.a", 0): 10, ("p.s.a", 1): 5}
    assert batch_starts(4, before, end) == {("p.s.a", 0): 10, ("p.s.a", 1): 5, ("p.s.c", 0): 0}
    # The batch before is not known any more: nothing is assumed.
    assert batch_starts(4, None, end) == {}
