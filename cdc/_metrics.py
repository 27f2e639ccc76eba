"""The capture service's Prometheus metrics, and the plain numbers the dashboard reads beside them.

The hot path only bumps a dict entry per event (``count``); the Prometheus counters are advanced once per
committed Kafka transaction (``committed``), so what they show was really delivered and the per-event cost
stays at a dictionary update. Names are the contract of deploy/prometheus/alerts.yml and the Grafana
dashboard (tests/unit/test_monitoring.py checks they agree).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BEHIND_WINDOW_S = 10.0
# The op under which CaptureMetrics.count counts a table's dead letters (cdc/_deadletter.py), next to c u d t r m.
DEAD_LETTER_OP = "dead_letter"
_SIZE_BUCKETS = (1, 2, 5, 10, 50, 100, 500, 1000, 5000, 10_000, 50_000, 100_000)


class CaptureMetrics:
    """Owned by the service (it outlives the restarts of Capture after transient faults)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.info = Info("pgcdc_capture", "The capture service", registry=r)
        self.streaming = Gauge("pgcdc_capture_streaming", "1 while changes are being streamed", registry=r)
        self._declare_slot(r)
        self._declare_progress(r)
        self._declare_snapshot(r)
        self._declare_backfills(r)
        self._declare_sinks(r)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], int] = {}
        self.totals: dict[tuple[str, str], int] = {}  # (table, op) -> committed events (for the dashboard)
        self.tables: dict[str, str] = {}  # topic -> "schema.table"
        self.state = "starting"
        self.committed_lsn_value: int | None = None
        self._wal_lsn_value = 0
        self.snapshot: dict[str, Any] | None = None
        self.backfills: list[dict[str, Any]] = []
        self._snap_started = 0.0
        self._snap_estimates: dict[str, int | None] = {}
        self._snap_rows: dict[str, int] = {}

    def _declare_slot(self, r: CollectorRegistry) -> None:
        """The replication slot as the server sees it."""
        self.slot_lag = Gauge(
            "pgcdc_slot_lag_bytes", "Server WAL position minus the slot's confirmed flush", ["slot"], registry=r
        )
        self.slot_retained = Gauge(
            "pgcdc_slot_retained_wal_bytes",
            "WAL the slot holds back (server position minus restart_lsn)",
            ["slot"],
            registry=r,
        )
        self.slot_safe = Gauge(
            "pgcdc_slot_safe_wal_bytes",
            "WAL that can still be written before the slot is invalidated",
            ["slot"],
            registry=r,
        )
        self.slot_active = Gauge(
            "pgcdc_slot_active", "1 while a consumer is attached to the slot", ["slot"], registry=r
        )
        self.slot_lost = Gauge(
            "pgcdc_slot_lost",
            "1 when the server invalidated the slot (max_slot_wal_keep_size; on 17+ also the idle timeout and "
            "the other reasons of invalidation_reason): a re-snapshot is needed",
            ["slot"],
            registry=r,
        )
        self._slot_inactive = Gauge(
            "pgcdc_slot_inactive_since_timestamp_seconds",
            "Since when no consumer has been attached to the slot (PostgreSQL 17+; no series while one is)",
            ["slot"],
            registry=r,
        )
        self._slot_idle_timeout = Gauge(
            "pgcdc_slot_idle_timeout_seconds",
            "idle_replication_slot_timeout (PostgreSQL 18+): a slot inactive this long is invalidated; no series "
            "when it is off",
            ["slot"],
            registry=r,
        )
        self.wal_lsn = Gauge("pgcdc_source_wal_lsn_bytes", "The server's current WAL position", registry=r)

    def slot_inactive_since(self, slot: str, since: str | None) -> None:
        """``inactive_since`` as the server reports it (ISO 8601), or None: no series."""
        _set_or_clear(self._slot_inactive, slot, datetime.fromisoformat(since).timestamp() if since else None)

    def slot_idle_timeout(self, slot: str, seconds: int | None) -> None:
        _set_or_clear(self._slot_idle_timeout, slot, seconds or None)

    def _declare_progress(self, r: CollectorRegistry) -> None:
        """What the capture committed, how far behind the source it is, its Kafka transactions and errors."""
        self.committed_lsn = Gauge(
            "pgcdc_committed_lsn_bytes", "Resume LSN committed to Kafka (and acknowledged to the server)", registry=r
        )
        self.behind = Gauge(
            "pgcdc_behind_source_seconds",
            "Worst delay of the last 10 s: Kafka commit time minus the source commit time of the oldest "
            "transaction in each batch, or the age of the oldest transaction not yet in Kafka; 0 when nothing "
            "is pending",
            registry=r,
        )
        self._pending_since_us: int | None = None  # source commit time of the oldest transaction not in Kafka
        # A scrape every 15 s must not miss a 0.5 s spike: the gauge is the worst value of a short window.
        self._behind: deque[tuple[float, float]] = deque()
        self.behind.set_function(self._behind_recent)
        self.last_commit_ts = Gauge(
            "pgcdc_last_source_commit_timestamp_seconds",
            "Source commit time of the last transaction captured",
            registry=r,
        )
        self.events = Counter(
            "pgcdc_events",
            "Change events committed to Kafka (op: c u d t, r = snapshot, m = message)",
            ["table", "op"],
            registry=r,
        )
        self.txn_events = Histogram(
            "pgcdc_kafka_transaction_events", "Records per Kafka transaction", buckets=_SIZE_BUCKETS, registry=r
        )
        self.commit_seconds = Histogram(
            "pgcdc_kafka_commit_seconds", "Kafka transaction commit duration", buckets=_COMMIT_BUCKETS, registry=r
        )
        self.errors = Counter("pgcdc_errors", "Errors by class", ["error", "kind"], registry=r)
        self.dead_letters = Counter(
            "pgcdc_capture_dead_letters",
            "Changes and snapshot rows written to <topic_prefix>.capture-dead-letter (capture.on_unencodable)",
            ["table"],
            registry=r,
        )

    def _declare_snapshot(self, r: CollectorRegistry) -> None:
        self.snapshot_running = Gauge("pgcdc_snapshot_running", "1 while a snapshot runs", registry=r)
        self.snapshot_tables_total = Gauge("pgcdc_snapshot_tables_total", "Tables in the snapshot", registry=r)
        self.snapshot_tables_done = Gauge("pgcdc_snapshot_tables_done", "Tables whose snapshot is done", registry=r)
        self.snapshot_rows_estimated = Gauge(
            "pgcdc_snapshot_rows_estimated", "Rows the snapshot expects (pg_class.reltuples)", registry=r
        )
        self.snapshot_rows_done = Gauge("pgcdc_snapshot_rows_done", "Rows snapshotted so far", registry=r)
        self.snapshot_eta = Gauge("pgcdc_snapshot_eta_seconds", "Estimated time to finish the snapshot", registry=r)

    def _declare_backfills(self, r: CollectorRegistry) -> None:
        self.backfills_running = Gauge("pgcdc_backfills_running", "Backfills reading their table now", registry=r)
        self.backfills_queued = Gauge("pgcdc_backfills_queued", "Backfills waiting for their turn", registry=r)
        self.backfill_rows = Gauge(
            "pgcdc_backfill_rows_done", "Rows a backfill has written", ["backfill", "table"], registry=r
        )

    def backfills_changed(self, backfills: list[dict[str, Any]]) -> None:
        """The backfills as the state holds them (BackfillProgress.to_json), for the metrics and the dashboard."""
        self.backfills = backfills
        self.backfills_running.set(sum(b["status"] == "running" for b in backfills))
        self.backfills_queued.set(sum(b["status"] in ("queued", "paused") for b in backfills))
        self.backfill_rows.clear()
        for b in backfills:
            if b["status"] not in ("done", "cancelled", "failed"):
                self.backfill_rows.labels(b["id"], b["table"]).set(b["rows"])

    def _declare_sinks(self, r: CollectorRegistry) -> None:
        """The sinks as seen from outside (checkpoints against topic ends): still measured when they are down."""
        self.sink_lag = Gauge(
            "pgcdc_sink_lag_records",
            "Topic end offset minus the sink's applied offset",
            ["sink", "topic", "partition"],
            registry=r,
        )
        self.sink_freshness = Gauge(
            "pgcdc_sink_freshness_seconds",
            "Age of the oldest change the sink has not applied (0: caught up)",
            ["sink"],
            registry=r,
        )
        self.sink_dead_letters = Gauge(
            "pgcdc_sink_dead_letters", "Records the sink has sent to the dead-letter topic", ["sink"], registry=r
        )
        self.sink_generation = Gauge("pgcdc_sink_generation", "The served generation of the sink", ["sink"], registry=r)
        self.sink_rebuild = Gauge(
            "pgcdc_sink_rebuild_progress_ratio",
            "Share of the topics a running rebuild has read",
            ["sink", "generation"],
            registry=r,
        )

    # --- the capture's hot path ----------------------------------------------------------------

    def count(self, topic: str, op: str, n: int = 1) -> None:
        key = (topic, op)
        pending = self._pending
        pending[key] = pending.get(key, 0) + n

    def pending(self, commit_time_us: int) -> None:
        """A source transaction is being read: until its Kafka commit, its age is how far behind we are."""
        if self._pending_since_us is None:
            self._pending_since_us = commit_time_us

    def committed(self, records: int, seconds: float, lsn: int, commits_us: tuple[int, int] | None) -> None:
        """A Kafka transaction committed: its events count now. ``commits_us``: its oldest and newest source
        transaction commit times."""
        pending, self._pending = self._pending, {}
        self._pending_since_us = None
        with self._lock:
            for (topic, op), n in pending.items():
                table = self.tables.get(topic, topic)
                (self.dead_letters.labels(table) if op == DEAD_LETTER_OP else self.events.labels(table, op)).inc(n)
                self.totals[(table, op)] = self.totals.get((table, op), 0) + n
        self.txn_events.observe(records)
        self.commit_seconds.observe(seconds)
        self.committed_lsn.set(lsn)
        self.committed_lsn_value = lsn
        if lsn > self._wal_lsn_value:  # the server has written at least what it sent
            self.source_wal(lsn)
        if commits_us is not None:
            self.last_commit_ts.set(commits_us[1] / 1e6)
            self.set_behind(max(0.0, time.time() - commits_us[0] / 1e6))

    def aborted(self) -> None:
        self._pending = {}
        self._pending_since_us = None

    def set_behind(self, seconds: float) -> None:
        now = time.monotonic()
        window = self._behind
        window.append((now, seconds))
        while window and now - window[0][0] > _BEHIND_WINDOW_S:
            window.popleft()

    def _behind_recent(self) -> float:
        window = list(self._behind)
        now = time.monotonic()
        recent = max((v for t, v in window if now - t <= _BEHIND_WINDOW_S), default=0.0)
        since = self._pending_since_us
        # A stall (a hanging commit, a huge transaction being read) shows as the oldest pending one's age.
        return max(recent, time.time() - since / 1e6) if since is not None else recent

    @property
    def behind_s(self) -> float | None:
        return self._behind_recent() if self._behind or self._pending_since_us is not None else None

    def source_wal(self, lsn: int) -> None:
        """The server's WAL position, as sampled. Never shown behind the committed LSN: a sample taken just before
        a commit would be, and a dashboard's "WAL minus committed" would go negative."""
        self._wal_lsn_value = max(lsn, self.committed_lsn_value or 0)
        self.wal_lsn.set(self._wal_lsn_value)

    def set_state(self, state: str) -> None:
        self.state = state
        self.streaming.set(1 if state == "streaming" else 0)

    def error(self, exc: BaseException, *, transient: bool) -> None:
        self.errors.labels(type(exc).__name__, "transient" if transient else "terminal").inc()

    # --- snapshot progress ---------------------------------------------------------------------

    def snapshot_started(self, estimates: dict[str, int | None]) -> None:
        self._snap_started = time.monotonic()
        self._snap_estimates = dict(estimates)
        self._snap_rows = dict.fromkeys(estimates, 0)
        self.set_state("snapshot")
        self.snapshot_running.set(1)
        self.snapshot_tables_total.set(len(estimates))
        self.snapshot_rows_estimated.set(sum(e or 0 for e in estimates.values()))
        self._snap_publish(done_tables=0)

    def snapshot_rows(self, table: str, rows: int, *, table_done: bool, done_tables: int) -> None:
        self._snap_rows[table] = self._snap_rows.get(table, 0) + rows
        if table_done:  # the estimate was only an estimate: the table is as big as what was read
            self._snap_estimates[table] = self._snap_rows[table]
        self._snap_publish(done_tables)

    def _snap_publish(self, done_tables: int) -> None:
        done = sum(self._snap_rows.values())
        total = sum(max(e or 0, self._snap_rows.get(t, 0)) for t, e in self._snap_estimates.items())
        elapsed = time.monotonic() - self._snap_started
        eta = (total - done) * elapsed / done if done and total >= done else None
        self.snapshot_rows_done.set(done)
        self.snapshot_rows_estimated.set(total)
        self.snapshot_tables_done.set(done_tables)
        if eta is not None:
            self.snapshot_eta.set(eta)
        self.snapshot = {
            "running": True,
            "tables_total": len(self._snap_estimates),
            "tables_done": done_tables,
            "rows_total": total,
            "rows_done": done,
            "eta_s": eta,
        }

    def snapshot_finished(self) -> None:
        self.snapshot_running.set(0)
        self.snapshot_eta.set(0)
        if self.snapshot is not None:
            self.snapshot = {**self.snapshot, "running": False, "eta_s": 0.0}

    def event_totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.totals)


__all__ = ["DEAD_LETTER_OP", "CaptureMetrics"]


def _set_or_clear(gauge: Gauge, label: str, value: float | None) -> None:
    """The labelled series set to ``value``, or gone when there is none (a gauge at 0 would say something)."""
    if value is None:
        with contextlib.suppress(KeyError):
            gauge.remove(label)
        return
    gauge.labels(label).set(value)
