"""The container files (deploy/docker/*.Dockerfile, docker-compose.yml) against the code they package.

No container engine runs here, so the images are never built in the suite: the Dockerfiles are linted with
hadolint, and everything they and the compose file state about the code (commands, configuration keys,
ports, health checks, versions) is checked against the code itself: the CLI's parsers, the configuration
loaders, the health and metrics endpoints served for real, and the pinned versions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pgcdc_dev.pins import pinned_python

from cdc.config import load_settings
from cdc.metrics import CaptureMetrics
from pgcdc import cli, sinks_cli
from pgcdc._observe import _handler
from sinks import connectors
from sinks._metrics import SinkMetrics
from sinks.config import load_sink_settings

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
CAPTURE, SINKS = DOCKER / "capture.Dockerfile", DOCKER / "sinks.Dockerfile"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
SERVICES: dict[str, Any] = COMPOSE["services"]
CONFIG_IN_CONTAINER = "/etc/pgcdc/pgcdc.toml"


def _instruction(dockerfile: Path, name: str) -> list[str]:
    """Each ``name`` instruction's argument (continuation lines joined), in file order."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text(encoding="utf-8"))
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def _exec_form(dockerfile: Path, name: str) -> list[str]:
    (argument,) = _instruction(dockerfile, name)
    parsed = json.loads(argument)
    assert isinstance(parsed, list), f"{dockerfile.name}: {name} must use the exec form"
    return [str(p) for p in parsed]


def _health_url(dockerfile: Path) -> str:
    (check,) = _instruction(dockerfile, "HEALTHCHECK")
    found = re.search(r"http://127\.0\.0\.1:\d+/[a-z]*", check)
    assert found, check
    return found.group(0)


def _mounted_config(service: str) -> Path:
    """The host file a compose service mounts as its configuration."""
    for volume in SERVICES[service].get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if target == CONFIG_IN_CONTAINER:
            return ROOT / source
    raise AssertionError(f"{service} mounts no {CONFIG_IN_CONTAINER}")


@pytest.fixture
def compose_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the CDC_* variables compose gives the containers (none of the test run's own)."""
    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)
    for name, value in SERVICES["capture"].get("environment", {}).items():
        monkeypatch.setenv(name, str(value))


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - a local test server
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_dockerfiles_pass_hadolint() -> None:
    # The virtualenv's own (the dev extra installs it), else one on PATH.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]')"
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(CAPTURE), str(SINKS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_both_images_run_as_a_numeric_unprivileged_user() -> None:
    for dockerfile in (CAPTURE, SINKS):
        user = _instruction(dockerfile, "USER")[-1]
        uid = user.split(":")[0]
        assert uid.isdigit(), f"{dockerfile.name}: USER {user}"
        assert int(uid) != 0, f"{dockerfile.name} runs as root"


def test_the_pipeline_services_are_in_compose_and_built_from_the_dockerfiles() -> None:
    assert {"demo-db", "capture", "workload", "sinks", "prometheus", "grafana"} <= set(SERVICES)
    built = {s["build"]["dockerfile"]: s["image"] for s in SERVICES.values() if "build" in s}
    assert built == {
        "deploy/docker/capture.Dockerfile": "pgcdc-capture:dev",
        "deploy/docker/sinks.Dockerfile": "pgcdc-sinks:dev",
    }
    for name in ("demo-db", "capture", "workload"):
        assert SERVICES[name]["image"] == "pgcdc-capture:dev", name
    assert SERVICES["capture"]["depends_on"]["demo-db"]["condition"] == "service_completed_successfully"
    assert SERVICES["workload"]["depends_on"]["capture"]["condition"] == "service_healthy"
    assert SERVICES["sinks"]["depends_on"]["capture"]["condition"] == "service_healthy"


def test_the_commands_are_ones_the_cli_accepts() -> None:
    parser = cli.build_parser()
    assert _exec_form(CAPTURE, "ENTRYPOINT") == ["cdc"]
    assert _exec_form(SINKS, "ENTRYPOINT") == ["cdc"]
    run = parser.parse_args(SERVICES["capture"]["command"])
    assert run.command == "run"
    assert run.config == Path(CONFIG_IN_CONTAINER)
    assert _exec_form(CAPTURE, "CMD") == SERVICES["capture"]["command"]
    setup = parser.parse_args(SERVICES["demo-db"]["command"])
    assert (setup.command, setup.setup_only, setup.workload_only) == ("demo", True, False)
    workload = parser.parse_args(SERVICES["workload"]["command"])
    assert (workload.command, workload.workload_only, workload.seconds) == ("demo", True, 0.0)
    sinks = SERVICES["sinks"]["command"]
    assert _exec_form(SINKS, "CMD") == sinks
    sinks_args = sinks_cli.build_parser().parse_args(sinks)
    assert sinks_args.config == Path(CONFIG_IN_CONTAINER)


def test_the_compose_configuration_loads_and_names_the_compose_services(compose_env: None) -> None:
    assert _mounted_config("capture") == _mounted_config("sinks") == DOCKER / "pgcdc.toml"
    settings = load_settings(_mounted_config("capture"))
    assert settings.source.dsn.get_secret_value().startswith("postgresql://postgres:postgres@postgres:5432/")
    kafka_listeners = SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"INTERNAL://{settings.kafka.bootstrap_servers}" in kafka_listeners
    registry_port = SERVICES["registry"]["ports"][0].rsplit(":", 1)[1]
    assert settings.registry.url.startswith(f"http://registry:{registry_port}/")
    sink_settings = load_sink_settings(_mounted_config("sinks")).sinks
    assert sink_settings.search.url == "http://opensearch:9200"
    assert sink_settings.cache.url.get_secret_value().startswith("redis://redis:6379/")
    jars_env = dict(e.split("=", 1) for e in _instruction(SINKS, "ENV")[-1].split())
    assert sink_settings.spark_jars == (jars_env["CDC_SINKS__SPARK_JARS"],)
    assert sink_settings.state_dir.startswith("/var/lib/pgcdc/")
    assert any(str(v).endswith(":/var/lib/pgcdc") for v in SERVICES["sinks"]["volumes"])


def test_ports_health_checks_and_scrape_targets_agree(compose_env: None) -> None:
    capture_port = load_settings(_mounted_config("capture")).metrics.port
    sinks_port = load_sink_settings(_mounted_config("sinks")).sinks.metrics_port
    assert SERVICES["capture"]["ports"] == [f"127.0.0.1:{capture_port}:{capture_port}"]
    assert SERVICES["sinks"]["ports"] == [f"127.0.0.1:{sinks_port}:{sinks_port}"]
    assert _instruction(CAPTURE, "EXPOSE") == [str(capture_port)]
    assert _instruction(SINKS, "EXPOSE") == [str(sinks_port)]
    assert _health_url(CAPTURE) == f"http://127.0.0.1:{capture_port}/healthz"
    assert _health_url(SINKS) == f"http://127.0.0.1:{sinks_port}/metrics"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape["scrape_configs"]}
    assert targets == {"pgcdc-capture": [f"capture:{capture_port}"], "pgcdc-sinks": [f"sinks:{sinks_port}"]}


def test_the_capture_health_check_path_is_served_and_follows_the_state() -> None:
    metrics = CaptureMetrics()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(SimpleNamespace(metrics=metrics)))  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        path = _health_url(CAPTURE).split("/", 3)[3]
        url = f"http://127.0.0.1:{server.server_port}/{path}"
        assert _get(url) == 503  # starting: not healthy yet
        metrics.set_state("streaming")
        assert _get(url) == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_sinks_health_check_path_is_served() -> None:
    server = SinkMetrics().serve("127.0.0.1", 0)
    try:
        path = _health_url(SINKS).split("/", 3)[3]
        assert _get(f"http://127.0.0.1:{server.server_port}/{path}") == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_sinks_image_takes_its_versions_from_pyproject() -> None:
    """The image writes no connector version: it resolves them with the sinks' own builder from the pyspark and
    delta-spark it installs (pyproject.toml's pins), and stops its build when the base image's Spark is another
    than that pyspark. Its default base is the pinned Spark's."""
    spark, scala = pinned_python("pyspark"), connectors.SCALA_BINARY
    image = next(a for a in _instruction(SINKS, "ARG") if a.startswith("SPARK_IMAGE="))
    assert image == f"SPARK_IMAGE=apache/spark:{spark}-scala{scala}-java17-ubuntu"
    runs = _instruction(SINKS, "RUN")
    assert not [a for a in _instruction(SINKS, "ARG") if a.startswith("SPARK_PACKAGES")]
    assert any("build_session(" in r and "spark.jars.ivy" in r for r in runs), runs
    assert any("spark-core_*-{v}.jar" in r and "sys.exit(" in r for r in runs), runs
    assert not re.search(r"\d+\.\d+\.\d+", " ".join(runs)), "a version written in the image's steps"
