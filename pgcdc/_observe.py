"""What the running capture service shows: /metrics for Prometheus, a live dashboard, and ``cdc status``.

A sampler thread measures, every ``metrics.sample_interval_s``, what the capture's own counters cannot
know: the slot's lag as the server sees it (its own connection, so a busy stream does not delay it) and
each sink's lag and freshness from outside the sinks (sinks/_progress.py: checkpoints against topic ends,
so the lag keeps climbing while a sink is down). It keeps a short history for the dashboard's charts.

Everything served is built from masked values: the DSN is ``display_dsn()``, errors are log messages
(which never contain secrets), and the server binds to 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cdc import __version__
from cdc.config import Settings
from cdc.metrics import DEAD_LETTER_OP, CaptureMetrics
from cdc.service import slot_invalidation
from decoders import format_lsn
from pgcdc_common.errors import ConfigError

log = logging.getLogger(__name__)

# The idle timeout (18+) invalidates a slot left without a consumer longer than it; 0 or absent: never.
_SLOT_SQL = """
SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END - '0/0')::bigint,
       (SELECT to_jsonb(s) FROM pg_replication_slots s WHERE s.slot_name = %s),
       (SELECT setting::bigint FROM pg_settings WHERE name = 'idle_replication_slot_timeout' AND unit = 's')
"""


def slot_status(conn: psycopg.Connection[Any], slot: str) -> dict[str, Any]:
    """The slot as the server sees it (to_jsonb: the columns differ between PostgreSQL versions; those of 17+,
    ``inactive_since``, ``invalidation_reason``, ``failover`` and ``synced``, are None before)."""
    row = conn.execute(_SLOT_SQL, (slot,)).fetchone()
    assert row is not None
    wal = int(row[0]) if row[0] is not None else None
    info: dict[str, Any] = row[1] or {}
    out: dict[str, Any] = {"wal_lsn_bytes": wal, "exists": bool(info), "idle_timeout_s": row[2] or None}
    if info:
        confirmed = _lsn(info.get("confirmed_flush_lsn"))
        restart = _lsn(info.get("restart_lsn"))
        out.update(
            active=bool(info.get("active")),
            active_pid=info.get("active_pid"),
            confirmed_flush_lsn=info.get("confirmed_flush_lsn"),
            wal_status=info.get("wal_status"),
            invalidated=slot_invalidation(info),
            inactive_since=info.get("inactive_since"),
            failover=info.get("failover"),
            synced=info.get("synced"),
            safe_wal_bytes=info.get("safe_wal_size"),
            lag_bytes=max(0, wal - confirmed) if wal is not None and confirmed is not None else None,
            retained_wal_bytes=max(0, wal - restart) if wal is not None and restart is not None else None,
        )
    return out


def _lsn(text: str | None) -> int | None:
    if not text:
        return None
    hi, _, lo = text.partition("/")
    return (int(hi, 16) << 32) + int(lo, 16)


_OBJECT_STORE_EVERY_S = 5.0


class SinksProbe:
    """Every sink's progress (see sinks/_progress.py), read from its state directory and the topics' ends.

    sinks/_progress.py is imported lazily: `cdc run` loads the sinks' modules only when the dashboard shows
    sinks, and that module does not load Spark.
    """

    def __init__(self, config_path: Path | None) -> None:
        from sinks.config import load_sink_settings  # noqa: PLC0415
        from sinks.progress import TopicEnds, sink_progress, sinks_present  # noqa: PLC0415

        self._settings = load_sink_settings(config_path)
        self._progress = sink_progress
        self._present = sinks_present
        self._new_ends = TopicEnds
        self._ends: Any = None  # the Kafka probe, made once some sink has a state directory
        # A state directory on an object store costs a request per file read (some 15 per look, billed on
        # S3): looked at every few seconds, not at every sample of the dashboard.
        self._every_s = 0.0 if self._settings.state.local else _OBJECT_STORE_EVERY_S
        self._last: tuple[float, list[dict[str, Any]]] | None = None

    def __call__(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self._every_s:
            return self._last[1]
        sinks = self._look()
        self._last = (now, sinks)
        return sinks

    def _look(self) -> list[dict[str, Any]]:
        if not self._present(self._settings):
            return []
        if self._ends is None:
            self._ends = self._new_ends(self._settings)
        ends = self._ends
        return [p.as_dict() for p in self._progress(self._settings, ends.read(), timestamp_at=ends.timestamp_at)]

    def close(self) -> None:
        if self._ends is not None:
            self._ends.close()


def sinks_probe(config_path: Path | None) -> SinksProbe | None:
    """The probe, or None when the sinks are not installed with this capture service."""
    try:
        return SinksProbe(config_path)
    except ImportError:
        return None


class _Errors(logging.Handler):
    """The last warnings and errors of this process, for the dashboard."""

    def __init__(self, keep: int = 50) -> None:
        super().__init__(logging.WARNING)
        self.items: deque[dict[str, Any]] = deque(maxlen=keep)

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.items.append(
                {
                    "ts": record.created,
                    "level": record.levelname.lower(),
                    "source": record.name,
                    "message": record.getMessage().splitlines()[0][:500],
                }
            )


class Observer:
    """The sampler, the history and the HTTP server of one capture service."""

    def __init__(self, settings: Settings, metrics: CaptureMetrics, *, config_path: Path | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.config_path = config_path
        self.started_at = time.time()
        cfg = settings.metrics
        self._points: deque[dict[str, Any]] = deque(maxlen=max(2, int(cfg.history_s / cfg.sample_interval_s)))
        self._latest: dict[str, Any] = {"source": {}, "sinks": []}
        self._stop = threading.Event()
        self._errors = _Errors()
        self._conn: psycopg.Connection[Any] | None = None
        self._probe: SinksProbe | None = None
        self._sink_errors: dict[str, str | None] = {}
        self._series: dict[Any, set[tuple[str, ...]]] = {}  # the label sets each sink gauge exports now
        self._warned: set[str] = set()
        self._prev_totals: tuple[float, dict[str, int]] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        s = settings.source
        metrics.info.info(
            {"version": __version__, "slot": s.slot, "publication": s.publication, "database": _dbname(settings)}
        )

    # --- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.settings.metrics
        try:
            self._server = ThreadingHTTPServer((cfg.host, cfg.port), _handler(self))
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics and the dashboard on {cfg.host}:{cfg.port} ({exc.strerror}); another "
                "`cdc run` may hold the port: set metrics.port (0 = any free port) or metrics.enabled = false"
            ) from exc
        self._server.daemon_threads = True
        logging.getLogger().addHandler(self._errors)
        try:
            self._probe = sinks_probe(self.config_path)
        except Exception as exc:  # a broken [sinks] section must not stop the capture: say it, go on
            log.warning("sink lag is not measured: %s", exc)
        for target, name in ((self._server.serve_forever, "pgcdc-http"), (self._sample_loop, "pgcdc-sampler")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("metrics on %s/metrics, live dashboard on %s/", self.url, self.url)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        logging.getLogger().removeHandler(self._errors)
        for thread in self._threads:
            thread.join(10)
        if self._conn is not None:
            self._conn.close()
        if self._probe is not None:
            self._probe.close()

    # --- sampling ----------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        interval = self.settings.metrics.sample_interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample()
            except Exception as exc:  # a probe failing must never take the capture down
                self._warn_once("sampling", exc)
            self._stop.wait(max(0.05, interval - (time.monotonic() - started)))

    def sample(self) -> None:
        now = time.time()
        point: dict[str, Any] = {"ts": now}
        source = self._sample_source()
        point["slot_lag_bytes"] = source.get("lag_bytes")
        point["behind_s"] = self.metrics.behind_s
        totals: dict[str, int] = {}
        for (table, op), n in self.metrics.event_totals().items():
            if op != DEAD_LETTER_OP:  # a rate of events written to the table's topic
                totals[table] = totals.get(table, 0) + n
        rates: dict[str, float] = {}
        if self._prev_totals is not None:
            then, before = self._prev_totals
            dt = max(1e-3, now - then)
            rates = {t: max(0.0, (n - before.get(t, 0)) / dt) for t, n in totals.items()}
        self._prev_totals = (now, totals)
        point["table_rates"] = rates
        sinks = self._sample_sinks(now)
        point["sink_lag"] = {s["name"]: s["lag_records"] for s in sinks}
        point["sink_freshness"] = {s["name"]: s["freshness_s"] for s in sinks}
        self._latest = {"source": source, "sinks": sinks, "rates": rates}
        self._points.append(point)

    def _warn_once(self, what: str, exc: BaseException) -> None:
        """A failing probe is said once per distinct error (every second would drown the log)."""
        text = f"{what} unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        if text not in self._warned:
            if len(self._warned) > 100:
                self._warned.clear()
            self._warned.add(text)
            log.warning("%s (the capture goes on; said once)", text)

    def _sample_source(self) -> dict[str, Any]:
        m, slot = self.metrics, self.settings.source.slot
        try:
            if self._conn is None or self._conn.closed:
                # Bounded: a hung statement or a half-open socket must not freeze the slot's gauges.
                self._conn = psycopg.connect(
                    self.settings.source.conninfo(
                        application_name="pgcdc-metrics",
                        options="-c statement_timeout=5000",
                        keepalives="1",
                        keepalives_idle="10",
                        keepalives_interval="5",
                        keepalives_count="3",
                    ),
                    autocommit=True,
                    connect_timeout=5,
                )
            info = slot_status(self._conn, slot)
        except psycopg.Error as exc:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self._warn_once("slot status", exc)
            return {"error": "source unreachable"}
        if info.get("wal_lsn_bytes") is not None:
            m.source_wal(info["wal_lsn_bytes"])
        if info.get("exists"):
            for gauge, key in (
                (m.slot_lag, "lag_bytes"),
                (m.slot_retained, "retained_wal_bytes"),
                (m.slot_safe, "safe_wal_bytes"),
            ):
                if info.get(key) is not None:
                    gauge.labels(slot).set(info[key])
                elif key == "safe_wal_bytes":
                    with contextlib.suppress(KeyError):  # unlimited (max_slot_wal_keep_size = -1): no series
                        gauge.remove(slot)
            m.slot_active.labels(slot).set(1 if info.get("active") else 0)
            m.slot_lost.labels(slot).set(1 if info.get("invalidated") else 0)
            m.slot_inactive_since(slot, info.get("inactive_since"))
        m.slot_idle_timeout(slot, info.get("idle_timeout_s") if info.get("exists") else None)
        return info

    def _sample_sinks(self, now: float) -> list[dict[str, Any]]:
        if self._probe is None:
            return []
        try:
            sinks = self._probe()
        except Exception as exc:
            self._warn_once("sink progress", exc)
            return list(self._latest.get("sinks", []))
        m = self.metrics
        values: dict[Any, dict[tuple[str, ...], float]] = {
            g: {} for g in (m.sink_lag, m.sink_freshness, m.sink_dead_letters, m.sink_generation, m.sink_rebuild)
        }
        for sink in sinks:
            name = sink["name"]
            for part in sink["partitions"]:
                values[m.sink_lag][(name, part["topic"], str(part["partition"]))] = part["lag"]
            if sink["freshness_s"] is not None:
                values[m.sink_freshness][(name,)] = sink["freshness_s"]
            values[m.sink_dead_letters][(name,)] = sink["dead_letters"]
            if sink["generation"] is not None:
                values[m.sink_generation][(name,)] = sink["generation"]
            rebuild = sink.get("rebuild") or {}
            if rebuild.get("state") in ("running", "verifying") and rebuild.get("total"):
                values[m.sink_rebuild][(name, str(rebuild["generation"]))] = rebuild["done"] / rebuild["total"]
        # Set the new values first, then remove the series that are gone: a scrape in between never sees a
        # sink without its lag (which would reset an alert's `for:` clock), nor a stale freshness.
        for gauge, new in values.items():
            for labels, value in new.items():
                gauge.labels(*labels).set(value)
            for labels in self._series.get(gauge, set()) - set(new):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
            self._series[gauge] = set(new)
        for sink in sinks:
            name = sink["name"]
            error = sink.get("last_error")
            state = sink.get("state")
            if state == "not running":
                error = "`cdc sinks run` is not running (no heartbeat): it was stopped or killed"
            if error and error != self._sink_errors.get(name) and state in ("backoff", "given_up", "not running"):
                self._errors.items.append({"ts": now, "level": "error", "source": f"sink {name}", "message": error})
            self._sink_errors[name] = error
        return sinks

    # --- the status document -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        m, s = self.metrics, self.settings
        latest = self._latest
        src = latest.get("source", {})
        totals = m.event_totals()
        tables: dict[str, dict[str, Any]] = {}
        for topic, table in sorted(m.tables.items(), key=lambda kv: kv[1]):
            tables[table] = {"table": table, "topic": topic, "events": {}, "rate": latest.get("rates", {}).get(table)}
        for (table, op), n in totals.items():
            tables.setdefault(table, {"table": table, "topic": None, "events": {}, "rate": None})["events"][op] = n
        points = list(self._points)
        names = sorted({t for p in points for t in p["table_rates"]})
        sink_names = sorted({n for p in points for n in p["sink_lag"]})
        committed = m.committed_lsn_value
        return {
            "service": {
                "name": "pgcdc capture",
                "version": __version__,
                "slot": s.source.slot,
                "publication": s.source.publication,
                "source": s.source.display_dsn(),
                "state": m.state,
                "started_at": self.started_at,
            },
            "now": time.time(),
            "source": {
                "wal_lsn": format_lsn(src["wal_lsn_bytes"]) if src.get("wal_lsn_bytes") is not None else None,
                "committed_lsn": format_lsn(committed) if committed is not None else None,
                "slot_lag_bytes": src.get("lag_bytes"),
                "behind_s": m.behind_s,
                "slot_active": src.get("active"),
                "wal_status": src.get("wal_status"),
                "slot_invalidated": src.get("invalidated"),
                "slot_inactive_since": src.get("inactive_since"),
                "slot_idle_timeout_s": src.get("idle_timeout_s"),
                "slot_failover": src.get("failover"),
                "safe_wal_bytes": src.get("safe_wal_bytes"),
                "retained_wal_bytes": src.get("retained_wal_bytes"),
                "error": src.get("error"),
            },
            "tables": list(tables.values()),
            "snapshot": m.snapshot,
            "backfills": m.backfills,
            "sinks": latest.get("sinks", []),
            "errors": sorted(self._errors.items, key=lambda e: -e["ts"]),
            "history": {
                "ts": [p["ts"] for p in points],
                "slot_lag_bytes": [p["slot_lag_bytes"] for p in points],
                "behind_s": [p["behind_s"] for p in points],
                "table_rates": {t: [p["table_rates"].get(t) for p in points] for t in names},
                "sink_lag": {n: [p["sink_lag"].get(n) for p in points] for n in sink_names},
                "sink_freshness": {n: [p["sink_freshness"].get(n) for p in points] for n in sink_names},
            },
        }


def _dbname(settings: Settings) -> str:
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    return str(conninfo_to_dict(settings.source.dsn.get_secret_value()).get("dbname", ""))


_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:"


def _handler(observer: Observer) -> type[BaseHTTPRequestHandler]:
    page = resources.files("pgcdc").joinpath("dashboard.html").read_bytes()

    class Handler(BaseHTTPRequestHandler):
        server_version = "pgcdc"
        sys_version = ""

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(observer.metrics.registry))
            elif path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/status":
                body = json.dumps(observer.status(), default=str).encode()
                self._send(200, "application/json", body)
            elif path == "/healthz":
                state = observer.metrics.state
                ok = state in ("streaming", "snapshot")
                self._send(200 if ok else 503, "application/json", json.dumps({"state": state}).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", _CSP)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes every few seconds would drown the log

    return Handler


def _health(url: str) -> str:
    """The running capture's state from its health endpoint; "not running" when nothing answers there."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - our own http:// URL
            body = resp.read()
    except urllib.error.HTTPError as exc:  # a 503 (not streaming) still carries the state
        body = exc.read()
    except OSError:
        return "not running"
    try:
        return str(json.loads(body).get("state"))
    except (ValueError, AttributeError):
        return "something else answers on the metrics port"


# --- cdc status --------------------------------------------------------------------------------------


def _capture_state(s: Settings, source: dict[str, Any]) -> str:
    """The running service's state from its health endpoint; what the slot tells when it has none to ask."""
    cfg = s.metrics
    if cfg.enabled and cfg.port:
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host  # noqa: S104 - a wildcard bind
        return _health(f"http://{host}:{cfg.port}/healthz")
    return _unreachable_state(source, "metrics.port = 0 (any free port)" if cfg.enabled else "metrics.enabled = false")


def _unreachable_state(source: dict[str, Any], why: str) -> str:
    """The capture's state as far as the slot tells it, when its health endpoint cannot be asked (``why``)."""
    if "error" in source:
        held = "unknown (the source cannot be reached either)"
    elif not source.get("exists"):
        held = "not running (its slot does not exist yet)"
    elif source.get("active"):
        held = f"running (a replication connection, pid {source.get('active_pid')}, holds the slot)"
    else:
        held = "not running (nothing holds its slot)"
    return f"{held}; its own state is not known: {why}, so cdc status cannot ask it (set a fixed metrics.port)"


def collect_status(settings: Settings, config_path: Path | None) -> dict[str, Any]:
    """One look at everything, from outside the processes: works whether they run or not."""
    from confluent_kafka import Consumer, TopicPartition  # noqa: PLC0415

    from cdc.kafka import OffsetStore  # noqa: PLC0415

    s = settings
    out: dict[str, Any] = {"source": {"dsn": s.source.display_dsn()}, "capture": {}, "topics": [], "sinks": []}
    try:
        with psycopg.connect(s.source.conninfo(application_name="pgcdc-status"), connect_timeout=5) as conn:
            out["source"].update(slot_status(conn, s.source.slot))
            out["source"]["server_version"] = conn.info.server_version
    except psycopg.Error as exc:
        out["source"]["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    out["capture"]["service"] = _capture_state(s, out["source"])
    conf = s.kafka.client_conf()
    try:
        state = OffsetStore(conf, s.offsets_topic, s.source.slot).load()
        lsn = state.lsn if state is not None else None
        out["capture"]["resume_lsn"] = format_lsn(lsn) if lsn is not None else None
        out["capture"]["snapshot"] = state.snapshot.status if state is not None and state.snapshot else None
        out["capture"]["backfills"] = [b.to_json() for b in state.backfills] if state is not None else []
        out["capture"]["generations"] = dict(state.generations) if state is not None else {}
        consumer = Consumer(
            {
                **conf,
                "group.id": "pgcdc-status",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        try:
            md = consumer.list_topics(timeout=10)
            prefix = s.kafka.topic_prefix + "."
            for topic in sorted(md.topics):
                meta = md.topics[topic]
                if not topic.startswith(prefix) or meta.error is not None or topic == s.offsets_topic:
                    continue
                count = 0
                for p in meta.partitions:
                    low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
                    count += high - low
                out["topics"].append({"topic": topic, "partitions": len(meta.partitions), "records": count})
        finally:
            consumer.close()
    except Exception as exc:
        out["capture"]["kafka_error"] = str(exc).splitlines()[0]
    try:
        probe = sinks_probe(config_path)
        if probe is not None:
            try:
                out["sinks"] = probe()
            finally:
                probe.close()
    except Exception as exc:
        out["sinks_error"] = str(exc).splitlines()[0]
    return out


__all__ = ["Observer", "SinksProbe", "collect_status", "sinks_probe", "slot_status"]
