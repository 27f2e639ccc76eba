"""The Prometheus/Grafana side of monitoring in deploy/: scrape config, alert rules, dashboard, docker-compose.

The alert rules' behaviour on synthetic series is tested by deploy/prometheus/alerts.test.yml (promtool).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pgcdc_dev.discovery import tool_or_skip

from cdc.metrics import CaptureMetrics
from sinks._metrics import SinkMetrics, query_name, sink_of_query

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "pgcdc-dashboard.json"
COMPOSE = ROOT / "docker-compose.yml"


def _exported() -> dict[str, str]:
    """The metrics the code exports (the capture's and the sinks app's registries), by family name and type.

    As Prometheus scrapes them: a counter family ``pgcdc_events`` is the series ``pgcdc_events_total``, the Info
    ``pgcdc_capture`` is ``pgcdc_capture_info``; histograms by their base name.
    """
    out: dict[str, str] = {}
    for registry in (CaptureMetrics().registry, SinkMetrics().registry):
        for family in registry.collect():
            name = {"counter": f"{family.name}_total", "info": f"{family.name}_info"}.get(family.type, family.name)
            out[name] = family.type
    return out


EXPORTED = _exported()


def test_the_exported_metrics_are_the_documented_ones() -> None:
    """The contract of the alert rules and the dashboard: a renamed metric must fail here, not in production."""
    assert "pgcdc_slot_lag_bytes" in EXPORTED
    assert EXPORTED["pgcdc_events_total"] == "counter"
    assert EXPORTED["pgcdc_sink_batch_seconds"] == "histogram"
    assert EXPORTED["pgcdc_sink_batch_phase_seconds"] == "histogram"
    assert EXPORTED["pgcdc_sink_lane_records_total"] == "counter"
    assert EXPORTED["pgcdc_capture_info"] == "info"


ALERTS = {
    "PgcdcCaptureDown",
    "PgcdcSinksDown",
    "PgcdcSlotLagHigh",
    "PgcdcSlotLagCritical",
    "PgcdcSlotWalNearLimit",
    "PgcdcSlotInactive",
    "PgcdcSlotLost",
    "PgcdcBehindSource",
    "PgcdcCaptureErrors",
    "PgcdcSinkLagHigh",
    "PgcdcSinkStale",
    "PgcdcDeadLetters",
    "PgcdcCaptureDeadLetters",
    "PgcdcSinkNotRunning",
}


def _series_names() -> set[str]:
    names: set[str] = set()
    for name, kind in EXPORTED.items():
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool_or_skip("promtool", install="apt-get install prometheus")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _panels() -> list[dict[str, Any]]:
    panels = _dashboard()["panels"]
    assert isinstance(panels, list)
    assert panels, "the dashboard has no panels"
    return panels


# --- promtool -----------------------------------------------------------------------------------------------


def test_prometheus_config_is_valid(promtool: str) -> None:
    # `check config` also checks the rule files the configuration loads.
    proc = _run(promtool, "check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


def test_alert_rules_are_valid(promtool: str) -> None:
    proc = _run(promtool, "check", "rules", str(PROMETHEUS / "alerts.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_alert_rules_fire_as_their_unit_tests_say(promtool: str) -> None:
    proc = _run(promtool, "test", "rules", str(PROMETHEUS / "alerts.test.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_queries_are_promql(promtool: str, tmp_path: Path) -> None:
    # Each query becomes a recording rule, which promtool parses; Grafana's variables get a plausible value.
    rules = []
    for panel in _panels():
        for target in panel["targets"]:
            expr = re.sub(r"\$__(rate_)?interval\b", "1m", target["expr"])
            expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
            rules.append({"record": f"panel_{panel['id']}_{target['refId']}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")  # JSON is YAML
    proc = _run(promtool, "check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- alert rules --------------------------------------------------------------------------------------------


def test_every_alert_has_a_duration_a_severity_and_a_runbook() -> None:
    text = (PROMETHEUS / "alerts.yml").read_text(encoding="utf-8")
    blocks = re.split(r"^\s*- alert: ", text, flags=re.MULTILINE)[1:]
    found = {block.split()[0] for block in blocks}
    assert found == ALERTS
    for block in blocks:
        name = block.split()[0]
        assert re.search(r"^\s+for: \d+[smh]$", block, re.MULTILINE), f"{name}: no `for:`"
        assert re.search(r"^\s+severity: (warning|critical)$", block, re.MULTILINE), f"{name}: no severity"
        assert re.search(r"^\s+summary: \S", block, re.MULTILINE), f"{name}: no summary"
        description = re.search(r"^\s+description: >-\n((?:[ ]{12,}\S.*\n?)+)", block, re.MULTILINE)
        assert description, f"{name}: no description"
        assert len(description.group(1).split()) >= 25, f"{name}: the description should say what to do"


def test_every_alert_is_unit_tested() -> None:
    tests = (PROMETHEUS / "alerts.test.yml").read_text(encoding="utf-8")
    firing = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels:", tests))
    assert firing == ALERTS


# --- dashboard ----------------------------------------------------------------------------------------------


def test_dashboard_panels_have_an_id_a_title_and_queries() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "pgcdc"
    assert isinstance(dashboard["schemaVersion"], int)
    panels = _panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for panel in panels:
        assert panel.get("title"), f"panel {panel['id']} has no title"
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r}: a target without an expression"
            assert target["datasource"]["uid"] == "${datasource}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == "prometheus"  # the provisioned data source's uid


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    exprs = "\n".join(target["expr"] for panel in _panels() for target in panel["targets"])
    for wanted in (
        "pgcdc_slot_lag_bytes",
        "pgcdc_behind_source_seconds",
        "sum by (table, op) (rate(pgcdc_events_total[1m]))",
        "pgcdc_kafka_commit_seconds_bucket",
        "pgcdc_kafka_transaction_events",
        "pgcdc_snapshot_rows_done / pgcdc_snapshot_rows_estimated",
        "pgcdc_snapshot_tables_done",
        "pgcdc_snapshot_eta_seconds",
        "pgcdc_sink_lag_records",
        "pgcdc_sink_freshness_seconds",
        "pgcdc_sink_batch_seconds_bucket",
        "rate(pgcdc_sink_records_total",
        "pgcdc_sink_dead_letters",
        "rate(pgcdc_errors_total[5m])",
        "pgcdc_sink_rebuild_progress_ratio",
    ):
        assert wanted in exprs, wanted


# --- the contract with the code -----------------------------------------------------------------------------


def _unknown(text: str, known: set[str]) -> list[str]:
    used = set(re.findall(r"\bpgcdc_[a-z_]+\b", text))
    assert used, "no pgcdc metric found"
    return sorted(used - known)


@pytest.mark.parametrize(
    "path",
    [PROMETHEUS / "alerts.yml", PROMETHEUS / "alerts.test.yml", DASHBOARD],
    ids=lambda p: p.name,
)
def test_only_exported_metrics_are_named(path: Path) -> None:
    # Prose (descriptions, comments) may name a histogram by its family name.
    unknown = _unknown(path.read_text(encoding="utf-8"), _series_names() | set(EXPORTED))
    assert not unknown, f"{path.name} names metrics the code does not export: {unknown}"


def test_queries_use_exported_series() -> None:
    # A query must use the series as scraped: a histogram's _bucket/_sum/_count, a counter's _total.
    alerts = (PROMETHEUS / "alerts.yml").read_text(encoding="utf-8")
    exprs = re.findall(r"^\s+expr: (.*)$", alerts, re.MULTILINE)
    exprs += [target["expr"] for panel in _panels() for target in panel["targets"]]
    unknown = _unknown("\n".join(exprs), _series_names())
    assert not unknown, f"queries use series the code does not export: {unknown}"


# --- docker-compose -----------------------------------------------------------------------------------------


def _published_ports(text: str) -> list[str]:
    """Every `ports:` entry, in flow (`ports: ["a:b"]`) or block (`ports:` then `- "a:b"`) style."""
    ports: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)ports:\s*(.*)$", line)
        if not match:
            continue
        indent, rest = len(match.group(1)), match.group(2).split("#")[0].strip()
        if rest:
            assert rest.startswith("["), line
            assert rest.endswith("]"), line
            ports += [p.strip().strip("'\"") for p in rest[1:-1].split(",") if p.strip()]
            continue
        for item in lines[i + 1 :]:
            item_match = re.match(r"^(\s*)- (.*)$", item)
            if not item_match or len(item_match.group(1)) < indent:
                break
            ports.append(item_match.group(2).split("#")[0].strip().strip("'\""))
    return ports


def test_compose_publishes_ports_on_localhost_only() -> None:
    ports = _published_ports(COMPOSE.read_text(encoding="utf-8"))
    assert "127.0.0.1:9090:9090" in ports
    assert "127.0.0.1:3000:3000" in ports
    exposed = [port for port in ports if not port.startswith("127.0.0.1:")]
    assert not exposed, f"ports published beyond 127.0.0.1: {exposed}"


def test_compose_file_parses_and_mounts_what_exists() -> None:
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    services: dict[str, Any] = compose["services"]
    assert {"prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond 127.0.0.1"
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]


def test_the_wal_position_is_never_shown_behind_the_committed_lsn() -> None:
    """A sample of the server's position taken just before a commit must not show the server behind it."""
    m = CaptureMetrics()

    def shown() -> float | None:
        return m.registry.get_sample_value("pgcdc_source_wal_lsn_bytes")

    m.source_wal(1_000)
    m.committed(3, 0.01, 1_500, None)
    assert shown() == 1_500
    m.source_wal(1_200)  # sampled before that commit, stored after it
    assert shown() == 1_500
    m.source_wal(2_000)
    assert shown() == 2_000


def test_a_sink_is_known_by_its_query_name() -> None:
    assert sink_of_query(query_name("cache", 3)) == "cache"
    assert sink_of_query(query_name("my-g2-sink", 12)) == "my-g2-sink"  # the last -g<N> is the generation
    assert sink_of_query("someone else's query") is None
    assert sink_of_query(None) is None
