"""Pure logic of pgcdc_dev.services (the services themselves are exercised by the integration tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pgcdc_dev import services
from pgcdc_dev.services import _install, _process


@pytest.fixture(scope="module")
def deploy() -> ModuleType:
    return services


@pytest.mark.parametrize(
    ("jar", "artifact"),
    [
        ("kafka-clients-3.9.0.jar", "kafka-clients"),
        ("spark-sql-kafka-0-10_2.13-4.0.0.jar", "spark-sql-kafka-0-10_2.13"),
        ("delta-spark_2.13-4.0.0.jar", "delta-spark_2.13"),
        ("delta-spark_4.2_2.13-4.4.0.jar", "delta-spark_4.2_2.13"),
        ("zstd-jni-1.5.6-10.jar", "zstd-jni"),
        ("jsr305-3.0.0.jar", "jsr305"),
    ],
)
def test_artifact_name_drops_the_version(deploy: ModuleType, jar: str, artifact: str) -> None:
    assert deploy._artifact(jar) == artifact


def test_selecting_a_service_brings_its_dependencies(deploy: ModuleType) -> None:
    assert [s.name for s in deploy.select(["registry"])] == ["kafka", "registry"]
    # A bare `up` starts what every run needs; the Spark cluster, the Kafka cluster and its registry, and
    # PostgreSQL 16 and 17 only when named.
    on_demand = (
        *("spark-master", "spark-worker-1", "spark-worker-2", "spark-cluster", "postgres-16", "postgres-17"),
        *("kafka-node-1", "kafka-node-2", "kafka-node-3", "kafka-cluster", "registry-cluster"),
    )
    everyday = [n for n in deploy.SERVICES if n not in on_demand]
    assert [s.name for s in deploy.select([])] == everyday
    cluster = ["spark-master", "spark-worker-1", "spark-worker-2", "spark-cluster"]
    assert [s.name for s in deploy.select(["spark-cluster"])] == cluster


def test_unknown_service_is_a_clear_error(deploy: ModuleType) -> None:
    with pytest.raises(deploy.DeployError, match=r"unknown service.*kafak.*choose from"):
        deploy.select(["kafak"])


def test_maven_url(deploy: ModuleType) -> None:
    url = deploy.maven_url("io.apicurio", "apicurio-registry-app", "3.3.3", "tar.gz", "all")
    assert url.endswith("/io/apicurio/apicurio-registry-app/3.3.3/apicurio-registry-app-3.3.3-all.tar.gz")


def test_bad_port_variable_says_what_to_do(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", "status"],
        env={"CDC_LOCAL_REDIS_PORT": "six", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "CDC_LOCAL_REDIS_PORT='six' is not a port number" in proc.stderr


def test_a_service_log_over_the_limit_is_rotated_at_start(deploy: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    assert deploy.rotate_log(log, limit=10) is False  # no log yet
    log.write_bytes(b"0123456789")
    assert deploy.rotate_log(log, limit=10) is False  # at the limit: kept
    assert log.read_bytes() == b"0123456789"
    log.write_bytes(b"0123456789ab")
    (tmp_path / "kafka.log.1").write_bytes(b"older")
    assert deploy.rotate_log(log, limit=10) is True
    assert not log.exists()
    assert (tmp_path / "kafka.log.1").read_bytes() == b"0123456789ab"  # the one before is replaced


def test_maven_that_cannot_fetch_its_plugin_says_what_to_check(
    deploy: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With -q Maven only says it found no plugin for 'dependency'; the error names the likely cause (Java not
    trusting the repository's certificate) and the way to see it."""
    monkeypatch.setattr(shutil, "which", lambda _name: "/usr/bin/mvn")

    def refuse(cmd: list[str], **_kw: object) -> None:
        raise deploy.DeployError("command failed (1): mvn …\n[ERROR] No plugin found for prefix 'dependency' in …")

    monkeypatch.setattr(_install, "run", refuse)  # maven_copy_dependencies runs Maven through its module's run
    with pytest.raises(deploy.DeployError, match="update-ca-certificates -f") as raised:
        deploy.maven_copy_dependencies(["g:a:1"], tmp_path / "libs", {})
    assert "mvn -X -s settings.xml dependency:copy-dependencies in " in str(raised.value)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        # ./dev test added the JIT option to a caller's own trust store: the services get the trust store back.
        (
            {"JAVA_TOOL_OPTIONS": "-Djavax.net.ssl.trustStore=/t -XX:TieredStopAtLevel=1",
             "CDC_SERVICES_JAVA_TOOL_OPTIONS": "-Djavax.net.ssl.trustStore=/t"},
            "-Djavax.net.ssl.trustStore=/t",
        ),
        # The caller had none: the services have none.
        ({"JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1", "CDC_SERVICES_JAVA_TOOL_OPTIONS": ""}, None),
        # Not started by ./dev test: whatever the caller set is left alone.
        ({"JAVA_TOOL_OPTIONS": "-Xss4m"}, "-Xss4m"),
    ],
)  # fmt: skip
def test_services_get_the_callers_java_options_not_the_test_runs(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: str | None
) -> None:
    for name in ("JAVA_TOOL_OPTIONS", "CDC_SERVICES_JAVA_TOOL_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    got = services.service_environ()
    assert got.get("JAVA_TOOL_OPTIONS") == expected
    assert "CDC_SERVICES_JAVA_TOOL_OPTIONS" not in got


def test_a_pid_file_whose_pid_now_names_another_process_is_stale(
    deploy: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pid files outlive a machine's processes and pids wrap at pid_max: a recorded pid that now belongs to
    another process must read as stopped (so `up` starts the service) and `down` must not signal it."""
    monkeypatch.setattr(_process, "RUN", tmp_path)  # where the pid files are, in the module that keeps them
    other = subprocess.Popen(["sleep", "120"])
    try:
        deploy.write_pid("svc", other.pid)
        assert deploy.running_pid("svc") == other.pid
        deploy.pid_file("svc").write_text(f"{other.pid} 1")  # the same pid, recorded for an earlier process
        assert deploy.running_pid("svc") is None
        deploy.stop_pid("svc")
        assert other.poll() is None, "stop_pid signalled a process that is not the service"
        assert not deploy.pid_file("svc").exists()
    finally:
        other.kill()
        other.wait()


def test_the_status_of_a_server_not_installed_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`./dev services status postgres-16` before its on-demand install: a line, not a traceback."""
    from pgcdc_dev.services import postgres

    monkeypatch.setattr(postgres, "OPT", tmp_path)
    assert postgres.PostgresZonky("16").version() == "not installed"
