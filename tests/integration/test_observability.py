"""Operability: metrics move under a workload, sink lag climbs while the sinks are down, the dashboard shows it.

Every figure is read the way an operator reads it: Prometheus text from /metrics, the dashboard's JSON and
page (in a real headless Chromium), `cdc status --json`. The source is reached as a role with a distinctive
password, and every output is searched for it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from pgcdc_dev.discovery import tool_or_skip

from tests.integration._capture_helpers import CdcConfig, capture_role, drop_role, scratch_database, wait_for
from tests.integration._observe_helpers import api_status, free_port, http_get, metric, metric_sum, scrape
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, cdc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.mark.exclusive  # it sets the server-wide max_slot_wal_keep_size for a while
def test_capture_metrics_move_under_a_workload_and_never_show_the_password(
    *,
    pg_dsn: str,
    kafka_bootstrap: str,
    registry_url: str,
    unique: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_METRICS__SAMPLE_INTERVAL_S", "0.5")
    try:
        secret = f"Pw-{unique}-must-not-leak"  # a capture role's password that must never show up
        with scratch_database(pg_dsn, f"obs_{unique}") as admin, capture_role(admin, f"obs_{unique}", secret) as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, note text)")
                conn.execute("INSERT INTO orders (note) SELECT 'n' || g FROM generate_series(1, 2000) g")
            cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, f"o{unique}", ["public.orders"], f"s_{unique}", "p")
            config = cfg.write(tmp_path / "cdc.toml")
            capture = cfg.start(tmp_path)
            try:
                capture.wait_streaming(180)
                before = scrape(port)
                # The snapshot's progress, complete.
                assert metric(before, "pgcdc_snapshot_rows_done") == 2000
                assert (
                    metric(before, "pgcdc_snapshot_tables_done") == metric(before, "pgcdc_snapshot_tables_total") == 1
                )
                assert metric(before, "pgcdc_snapshot_running") == 0
                assert metric(before, "pgcdc_events_total", table="public.orders", op="r") == 2000
                assert metric(before, "pgcdc_capture_streaming") == 1

                with psycopg.connect(dsn, autocommit=True) as conn:
                    for i in range(30):
                        with conn.transaction():
                            conn.execute("INSERT INTO orders (note) SELECT 'w' FROM generate_series(1, 10)")
                            conn.execute("UPDATE orders SET note = note || 'u' WHERE id %% 30 = %s", (i,))
                    conn.execute("DELETE FROM orders WHERE id <= 50")

                def counted() -> bool:
                    m = scrape(port)
                    return metric(m, "pgcdc_events_total", table="public.orders", op="d") == 50

                wait_for(counted, 60, "the workload's events in the metrics", capture)
                after = scrape(port)
                # Exactly what was committed, per table and operation.
                assert metric(after, "pgcdc_events_total", table="public.orders", op="c") == 300
                assert (metric(after, "pgcdc_events_total", table="public.orders", op="u") or 0) > 0
                for name in ("pgcdc_kafka_transaction_events_count", "pgcdc_kafka_commit_seconds_count"):
                    assert (metric(after, name) or 0) > (metric(before, name) or 0), name
                assert (metric(after, "pgcdc_committed_lsn_bytes") or 0) > (
                    metric(before, "pgcdc_committed_lsn_bytes") or 0
                )
                assert (metric(after, "pgcdc_source_wal_lsn_bytes") or 0) >= (
                    metric(after, "pgcdc_committed_lsn_bytes") or 0
                )
                assert (metric(after, "pgcdc_last_source_commit_timestamp_seconds") or 0) > time.time() - 120
                assert metric(after, "pgcdc_slot_active", slot=f"s_{unique}") == 1
                assert metric(after, "pgcdc_slot_lost", slot=f"s_{unique}") == 0

                # Slot lag and time behind, moving: the capture is frozen while the source writes on.
                assert capture.proc is not None
                capture.proc.send_signal(signal.SIGSTOP)
                try:
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        for _ in range(20):
                            conn.execute(
                                "INSERT INTO orders (note) SELECT repeat('x', 500) FROM generate_series(1, 20)"
                            )
                            time.sleep(0.15)
                    frozen = cdc("status", "--config", str(config), "--json", timeout=120)
                finally:
                    capture.proc.send_signal(signal.SIGCONT)
                report = json.loads(frozen.stdout)
                assert report["source"]["lag_bytes"] > 100_000, report["source"]
                assert report["source"]["retained_wal_bytes"] >= report["source"]["lag_bytes"], report["source"]
                assert report["source"]["active"] is True
                wait_for(
                    lambda: metric(scrape(port), "pgcdc_events_total", table="public.orders", op="c") == 700,
                    60,
                    "the frozen interval's events",
                    capture,
                )
                history = api_status(port)["history"]
                assert max(v for v in history["behind_s"] if v is not None) >= 2.0, history["behind_s"][-30:]
                assert max(v for v in history["slot_lag_bytes"] if v is not None) > 0
                wait_for(
                    lambda: (metric(scrape(port), "pgcdc_slot_lag_bytes", slot=f"s_{unique}") or 1e9) < 100_000,
                    60,
                    "the slot lag to fall back",
                    capture,
                )
                rates = history["table_rates"]["public.orders"]
                assert max(r for r in rates if r is not None) > 0

                # With max_slot_wal_keep_size set, the WAL left before the slot would be invalidated is shown.
                with psycopg.connect(admin, autocommit=True) as conn:
                    keep = conn.execute("SHOW max_slot_wal_keep_size").fetchone()
                    if keep is not None and keep[0] == "-1":  # unlimited: no series at all
                        assert metric(scrape(port), "pgcdc_slot_safe_wal_bytes", slot=f"s_{unique}") is None
                    conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'")
                    conn.execute("SELECT pg_reload_conf()")
                try:
                    wait_for(
                        lambda: (metric(scrape(port), "pgcdc_slot_safe_wal_bytes", slot=f"s_{unique}") or 0) > 2**30,
                        30,
                        "the slot's safe WAL size",
                        capture,
                    )
                finally:
                    with psycopg.connect(admin, autocommit=True) as conn:
                        conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
                        conn.execute("SELECT pg_reload_conf()")

                # A transient fault (the replication connection cut by the server) is counted, shown and retried.
                with psycopg.connect(admin, autocommit=True) as conn:
                    conn.execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s",
                        (f"s_{unique}",),
                    )
                wait_for(
                    lambda: metric_sum(scrape(port), "pgcdc_errors_total", kind="transient") >= 1,
                    60,
                    "the transient error to be counted",
                    capture,
                )
                capture.wait_streaming(60)
                status = api_status(port)
                assert any(e["level"] in ("warning", "error") for e in status["errors"]), status["errors"]

                # The health endpoint and the page.
                wait_for(lambda: api_status(port)["service"]["state"] == "streaming", 60, "streaming again", capture)
                page = http_get(f"http://127.0.0.1:{port}/").decode()
                assert "<svg" in page or "data-chart" in page
                assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing from the network

                # The password is nowhere: not in metrics, status JSON, the page, the log, or `cdc status`.
                plain = cdc("status", "--config", str(config), timeout=120)
                outputs = {
                    "/metrics": http_get(f"http://127.0.0.1:{port}/metrics").decode(),
                    "/api/status": json.dumps(api_status(port)),
                    "/": page,
                    "cdc status": plain.stdout + plain.stderr,
                    "cdc status --json": frozen.stdout + frozen.stderr,
                    "log": capture.tail(100_000),
                }
                for where, text in outputs.items():
                    assert secret not in text, f"the password leaked into {where}"
                assert "password=***" in outputs["/api/status"]
                assert f"metrics on http://127.0.0.1:{port}/metrics" in outputs["log"]
            finally:
                capture.stop()
    finally:
        drop_role(pg_dsn, f"obs_{unique}")


class _Dom(HTMLParser):
    """The attributes of the elements the dashboard's test contract names (see pgcdc/dashboard.html)."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, str]] = {}
        self.sinks: dict[str, dict[str, str]] = {}
        self.stats: dict[str, str] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and "data-chart" in a:
            self.charts[a["data-chart"]] = a
        elif "data-sink" in a:
            self.sinks[a["data-sink"]] = a
        elif "data-stat" in a:
            self.stats[a["data-stat"]] = a.get("data-value", "")
        elif tag == "body":
            self.body = a


def _render(url: str, shot: Path) -> _Dom:
    chromium = tool_or_skip("chromium", "chromium-browser", install="apt-get install chromium")
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000", "--virtual-time-budget=4000"]
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    subprocess.run([chromium, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    parsed = _Dom()
    parsed.feed(dom)
    return parsed


@contextmanager
def _prometheus(tmp_path: Path, capture_port: int) -> Iterator[str]:
    """A real Prometheus scraping the capture every second with deploy/prometheus/alerts.yml, made quick.

    The rules are the shipped ones with two test-only changes: no ``for:`` delay, and the sink thresholds
    scaled down to what a one-minute test produces (10 records instead of 10000, 5 s instead of 300 s).
    """
    binary = tool_or_skip("prometheus", install="apt-get install prometheus")
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    scaled = {"PgcdcSinkLagHigh": ("> 10000", "> 10"), "PgcdcSinkStale": ("> 300", "> 5")}
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
            if rule["alert"] in scaled:
                old, new = scaled[rule["alert"]]
                assert old in rule["expr"], rule["expr"]  # the shipped threshold is still the documented one
                rule["expr"] = rule["expr"].replace(old, new)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "alerts.yml")],
                "scrape_configs": [
                    {"job_name": "pgcdc-capture", "static_configs": [{"targets": [f"127.0.0.1:{capture_port}"]}]}
                ],
            }
        )
    )
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def _firing(prometheus: str) -> set[tuple[str, str]]:
    try:
        alerts = json.loads(http_get(f"{prometheus}/api/v1/alerts"))["data"]["alerts"]
    except OSError:
        return set()  # not up yet
    return {(a["labels"]["alertname"], a["labels"].get("sink", "")) for a in alerts if a["state"] == "firing"}


@SPARK_WORKER
def test_sink_lag_climbs_while_the_sinks_are_down_and_the_dashboard_shows_it(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, sinks_port = free_port(), free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    with scratch_database(pg_dsn, f"lag_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 500) g")
        cfg = stack.config(dsn, ["public.items"], prefix=f"l{unique}", unique=unique, workdir=tmp_path)
        config = cfg.write(tmp_path / "cdc.toml")
        capture = cfg.start(tmp_path)
        sinks = SinksProcess(config, tmp_path / "sinks.log", ["cache"])
        sinks.start()
        next_id = [1000]
        cleanup = ExitStack()

        def write(n: int = 5) -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for _ in range(n):
                    conn.execute("INSERT INTO items VALUES (%s, 'new', 1)", (next_id[0],))
                    conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (next_id[0] % 500 + 1,))
                    next_id[0] += 1

        def cache_sink() -> dict[str, Any]:
            found = [s for s in api_status(port)["sinks"] if s["name"] == "cache"]
            return found[0] if found else {}

        try:
            capture.wait_streaming(180)
            write()
            wait_for(lambda: cache_sink().get("lag_records") == 0, 300, "the cache sink to catch up", sinks)
            prometheus_url = cleanup.enter_context(_prometheus(tmp_path, port))

            def scraped() -> bool:  # Prometheus has the sink's lag series and has evaluated the rules on it
                try:
                    query = f"{prometheus_url}/api/v1/query?query=pgcdc_sink_lag_records"
                    return bool(json.loads(http_get(query))["data"]["result"])
                except OSError:
                    return False

            wait_for(scraped, 60, "Prometheus to scrape the capture")
            time.sleep(2)
            assert not {a for a in _firing(prometheus_url) if a[0].startswith("PgcdcSink")}, _firing(prometheus_url)
            inside = scrape(sinks_port)
            assert metric(inside, "pgcdc_sink_running", sink="cache") == 1
            assert (metric(inside, "pgcdc_sink_batch_seconds_count", sink="cache") or 0) >= 1
            assert (metric(inside, "pgcdc_sink_records_total", sink="cache") or 0) >= 500
            assert (metric(inside, "pgcdc_sink_batch_latency_seconds", sink="cache") or -1) >= 0
            assert metric(scrape(port), "pgcdc_sink_freshness_seconds", sink="cache") == 0

            # The sinks app dies; the source keeps writing. Lag and freshness climb, measured from outside.
            sinks.kill()
            lags, ages = [], []
            for _ in range(12):
                write(3)
                time.sleep(2.0)
                m = scrape(port)
                lags.append(metric_sum(m, "pgcdc_sink_lag_records", sink="cache"))
                ages.append(metric(m, "pgcdc_sink_freshness_seconds", sink="cache") or 0.0)
            print(f"sinks down: lag {lags}, freshness {[round(a, 1) for a in ages]}")  # shown with pytest -s
            assert lags == sorted(lags), lags
            assert lags[-1] > lags[0], lags
            assert ages[-1] > ages[0], ages
            assert ages[-1] >= 15, ages
            wait_for(lambda: cache_sink().get("state") == "not running", 30, "the missing heartbeat to show")
            errors = api_status(port)["errors"]
            assert any(e["source"] == "sink cache" and "not running" in e["message"] for e in errors), errors

            # `cdc status` says the same, and exits 3: something needs attention.
            report = cdc("status", "--config", str(config), "--json", timeout=120)
            assert report.returncode == 3, report.stdout + report.stderr
            parsed = json.loads(report.stdout)
            (sink,) = [s for s in parsed["sinks"] if s["name"] == "cache"]
            assert sink["lag_records"] >= lags[-1]
            assert sink["state"] == "not running"
            assert any("cache" in p for p in parsed["problems"]), parsed["problems"]

            # Prometheus, scraping the capture, fires the sink alerts from the shipped rules.
            wait_for(
                lambda: {("PgcdcSinkLagHigh", "cache"), ("PgcdcSinkStale", "cache")} <= _firing(prometheus_url),
                60,
                "Prometheus to fire PgcdcSinkLagHigh and PgcdcSinkStale for the cache sink",
            )

            # The dashboard, in a real browser: live charts with non-zero data.
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard-sink-down.png"
            dom = _render(f"http://127.0.0.1:{port}/", shot)
            assert int(dom.body.get("data-renders", "0")) >= 1, dom.body
            for chart in ("slot_lag", "behind", "table_rates", "sink_lag", "sink_freshness"):
                assert int(dom.charts[chart]["data-points"] or 0) >= 10, (chart, dom.charts[chart])
            assert float(dom.charts["sink_lag"]["data-max"]) >= lags[-1] > 0
            assert float(dom.charts["sink_freshness"]["data-max"]) >= 15
            assert float(dom.charts["table_rates"]["data-max"]) > 0
            assert float(dom.sinks["cache"]["data-lag"]) > 0
            assert dom.stats["slot_active"] == "true"
            assert shot.stat().st_size > 20_000

            # Back up: it catches up, and the lag falls to zero.
            sinks.start()
            wait_for(lambda: cache_sink().get("lag_records") == 0, 300, "the restarted sink to catch up", sinks)
            assert cache_sink()["state"] == "running"
            shot_ok = ARTIFACTS / "dashboard-recovered.png"
            dom = _render(f"http://127.0.0.1:{port}/", shot_ok)
            assert float(dom.sinks["cache"]["data-lag"]) == 0
            assert sinks.terminate(120) == 0, sinks.tail()
        finally:
            cleanup.close()
            if sinks.alive():
                sinks.kill()
            capture.stop()
