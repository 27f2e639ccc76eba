"""The sinks app's own Prometheus metrics (``sinks.metrics_port``, 127.0.0.1 by default).

How far behind each sink is (lag, freshness) is measured from outside by the capture service and ``cdc
status`` (sinks/_progress.py); these are the app's inside view: batches, their durations, records, dead
letters and whether each sink's query is running.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from sinks.errors import SinkConfigError

log = logging.getLogger(__name__)

_BATCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
QUERY_PREFIX = "pgcdc-sink-"  # a sink's query is named pgcdc-sink-<sink>-g<generation>


def query_name(sink: str, generation: int) -> str:
    return f"{QUERY_PREFIX}{sink}-g{generation}"


def sink_of_query(name: str | None) -> str | None:
    """The sink whose query is named ``name`` (None: not one of ours)."""
    if not name or not name.startswith(QUERY_PREFIX):
        return None
    sink, _, generation = name[len(QUERY_PREFIX) :].rpartition("-g")
    return sink if sink and generation.isdigit() else None


class SinkMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batch_seconds = Histogram(
            "pgcdc_sink_batch_seconds", "Duration of a sink's micro-batch", ["sink"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.records = Counter("pgcdc_sink_records", "Change records read by a sink", ["sink"], registry=r)
        self.lane_records = Counter(
            "pgcdc_sink_lane_records",
            "Change records a sink's lane applied as they arrived, ahead of its micro-batches (search, cache)",
            ["sink"],
            registry=r,
        )
        self.dead_letters = Counter(
            "pgcdc_sink_dead_letters", "Records a sink sent to the dead-letter topic", ["sink"], registry=r
        )
        self.batch_latency = Gauge(
            "pgcdc_sink_batch_latency_seconds",
            "Applied time minus the source commit time of the newest event in the sink's last batch",
            ["sink"],
            registry=r,
        )
        self.running = Gauge("pgcdc_sink_running", "1 while the sink's streaming query runs", ["sink"], registry=r)
        self.phase_seconds = Histogram(
            "pgcdc_sink_batch_phase_seconds",
            "Where a micro-batch's time goes: Spark's phases (latestOffset, walCommit, addBatch, commitOffsets, "
            "queryPlanning, triggerExecution…) and, inside addBatch, pgcdc's plan and write; Spark's phases are "
            "those of the last batch of each second (its query's lastProgress, read once a second)",
            ["sink", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )

    def observe_phases(self, sink: str, durations_ms: dict[str, int]) -> None:
        """One batch's phases, from its query's progress (``durationMs``)."""
        for phase, ms in durations_ms.items():
            self.phase_seconds.labels(sink, phase).observe(ms / 1000)

    def serve(self, host: str, port: int) -> Any:
        """Serve /metrics; a port in use is a configuration error (say which, and how to change it)."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise SinkConfigError(
                f"cannot serve the sinks' metrics on {host}:{port} ({exc.strerror}); another `cdc sinks run` "
                "may hold it: set sinks.metrics_port (0 = any free port) or sinks.metrics_enabled = false"
            ) from exc
        log.info("sinks metrics on http://%s:%d/metrics", host, server.server_port)
        return server
