"""Finding the real services the integration tests and the benchmarks talk to.

For each service, in order:
1. an environment variable names it (``CDC_TEST_PG_DSN``, ``CDC_TEST_KAFKA``, ``CDC_TEST_REGISTRY``,
   ``CDC_TEST_OPENSEARCH``, ``CDC_TEST_REDIS``,
   ``CDC_TEST_MARIADB``; ``CDC_TEST_SPARK_JARS`` is a comma-separated jar list;
   ``CDC_TEST_SPARK_MASTER`` a standalone master with two workers, ``spark://host:port``);
2. else, where a Docker engine answers, testcontainers starts it (once per test run);
3. else the local services of ``pgcdc_dev.services`` are used, started on demand.

``CDC_TEST_PG`` picks the PostgreSQL major version where ``CDC_TEST_PG_DSN`` is not set: ``15`` (the default,
Debian's server here), ``16``, ``17`` or ``18`` (the ``postgres-<N>`` local service, a ``postgres:<N>`` container);
``find("postgres", pg=...)`` asks for a version itself (the tests' ``pg_server`` fixture does, for pg_matrix suites).

When none of these yields the service, its tests skip, saying why — unless ``CDC_TEST_REQUIRE_SERVICES=1``
(set by the README's test command and CI), where a missing service fails the run instead.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NoReturn

import pytest

from pgcdc_dev.pins import compose_image

ENV_VARS = {
    "postgres": "CDC_TEST_PG_DSN",
    "kafka": "CDC_TEST_KAFKA",
    "registry": "CDC_TEST_REGISTRY",
    "opensearch": "CDC_TEST_OPENSEARCH",
    "redis": "CDC_TEST_REDIS",
    "mariadb": "CDC_TEST_MARIADB",  # a SQLAlchemy URL (mariadb+pymysql://user:password@host:port/)
    "spark-jars": "CDC_TEST_SPARK_JARS",
    "spark-cluster": "CDC_TEST_SPARK_MASTER",
    "s3": "CDC_TEST_S3",
    "spark-cloud-jars": "CDC_TEST_SPARK_CLOUD_CLASSPATH",
    "flink-jars": "CDC_TEST_FLINK_CLASSPATH",
    "connect-jars": "CDC_TEST_CONNECT_HOME",
}


class ServiceUnavailableError(Exception):
    """A service could not be found or started; the message says how each way failed."""


@dataclass(frozen=True)
class Found:
    """Where a service is, and which of the three ways found it."""

    value: str
    source: str  # "env", "testcontainers" or "deploy"


def require_services() -> bool:
    return os.environ.get("CDC_TEST_REQUIRE_SERVICES", "") not in ("", "0", "false", "no")


def from_env(name: str, environ: dict[str, str] | None = None) -> str | None:
    value = (environ if environ is not None else os.environ).get(ENV_VARS[name], "").strip()
    return value or None


@cache
def docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:  # no client library, no socket, engine down: all mean "no Docker here"
        return False


# --- testcontainers --------------------------------------------------------------------------

_containers: list[Any] = []


def _keep(container: Any) -> Any:
    container.start()
    _containers.append(container)
    return container


@atexit.register
def _stop_containers() -> None:
    for container in reversed(_containers):
        try:
            container.stop()
        except Exception as exc:  # a container that is already gone is what we wanted
            print(f"warning: stopping {container!r}: {exc}", file=sys.stderr)


# CDC_TEST_PG -> the local service that runs it
PG_VERSIONS = {"15": "postgres", "16": "postgres-16", "17": "postgres-17", "18": "postgres-18"}
DEFAULT_PG_VERSION = "15"  # Debian's server here: the whole suite runs on it


def pg_version() -> str:
    """The PostgreSQL major version the run asks for (CDC_TEST_PG, default 15)."""
    version = os.environ.get("CDC_TEST_PG", "").strip() or DEFAULT_PG_VERSION
    if version not in PG_VERSIONS:
        raise ServiceUnavailableError(f"CDC_TEST_PG={version!r}: the versions on offer are {', '.join(PG_VERSIONS)}")
    return version


def _tc_postgres(version: str) -> str:
    from testcontainers.postgres import PostgresContainer

    pg = PostgresContainer(f"postgres:{version}", username="postgres", password="postgres", dbname="postgres")
    pg.with_command("postgres -c wal_level=logical -c max_wal_senders=20 -c max_replication_slots=20")
    _keep(pg)
    return f"postgresql://postgres:postgres@{pg.get_container_host_ip()}:{pg.get_exposed_port(5432)}/postgres"


@cache
def _tc_kafka() -> str:
    from testcontainers.kafka import KafkaContainer

    kafka = KafkaContainer("confluentinc/cp-kafka:7.8.0").with_kraft()
    _keep(kafka)
    return str(kafka.get_bootstrap_server())


def _tc_registry() -> str:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    registry = DockerContainer(compose_image("apicurio/apicurio-registry")).with_exposed_ports(8080)
    _keep(registry)
    wait_for_logs(registry, "Installed features", timeout=120)
    host, port = registry.get_container_host_ip(), registry.get_exposed_port(8080)
    return f"http://{host}:{port}/apis/ccompat/v7"


def _tc_opensearch() -> str:
    from testcontainers.opensearch import OpenSearchContainer

    search = _keep(OpenSearchContainer(compose_image("opensearchproject/opensearch")))
    config = search.get_config()
    return f"http://{config['host']}:{config['port']}"


def _tc_redis() -> str:
    from testcontainers.redis import RedisContainer

    redis = _keep(RedisContainer("redis:7.4"))
    return f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0"


_TESTCONTAINERS: dict[str, Callable[[], str]] = {
    "kafka": _tc_kafka,
    "registry": _tc_registry,
    "opensearch": _tc_opensearch,
    "redis": _tc_redis,
}


# --- pgcdc_dev.services ----------------------------------------------------------------------


def _deploy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", *args], capture_output=True, text=True, check=False, timeout=900
    )


@cache
def _deploy_endpoints(name: str) -> dict[str, Any]:
    """Start (or find running) the local service and return its endpoint record."""
    proc = _deploy("up", name)
    if proc.returncode != 0:
        raise ServiceUnavailableError(
            f"pgcdc_dev.services up {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    record: dict[str, Any] = json.loads(_deploy("endpoints").stdout)[name]
    if not record.get("running"):
        raise ServiceUnavailableError(f"pgcdc_dev.services started {name} but it does not answer; see its log")
    return record


_DEPLOY_KEYS = {
    "postgres": "dsn",
    "kafka": "bootstrap",
    "registry": "url",
    "opensearch": "url",
    "redis": "url",
    "mariadb": "url",
    "spark-cluster": "url",
    "s3": "url",
    "spark-cloud-jars": "classpath",
    "flink-jars": "classpath",
    "connect-jars": "home",
}


def deploy_record(name: str) -> dict[str, Any]:
    """pgcdc_dev.services's endpoint record of ``name`` (credentials of its local services included)."""
    return _deploy_endpoints(name)


def _from_deploy(name: str, pg: str) -> str:
    record = _deploy_endpoints(PG_VERSIONS[pg] if name == "postgres" else name)
    if name == "spark-jars":
        return ",".join(record["jars"])
    return str(record[_DEPLOY_KEYS[name]])


# --- the one entry point ----------------------------------------------------------------------


@cache
def find(name: str, pg: str | None = None) -> Found:
    """Locate service ``name`` (see the module docstring for the order); raise ServiceUnavailableError.

    ``pg`` is PostgreSQL's major version (CDC_TEST_PG's by default); a server CDC_TEST_PG_DSN names is used
    whatever its version."""
    pg = (pg or pg_version()) if name == "postgres" else ""
    if name == "postgres" and pg not in PG_VERSIONS:
        raise ServiceUnavailableError(f"PostgreSQL {pg!r}: the versions on offer are {', '.join(PG_VERSIONS)}")
    value = from_env(name)
    if value:
        return Found(value, "env")
    failures = []
    start = functools.partial(_tc_postgres, pg) if name == "postgres" else _TESTCONTAINERS.get(name)
    if start is not None and docker_engine_answers():
        try:
            return Found(start(), "testcontainers")
        except Exception as exc:  # fall through to the local services, but keep the reason
            failures.append(f"testcontainers: {exc}")
    try:
        return Found(_from_deploy(name, pg), "deploy")
    except (ServiceUnavailableError, OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        failures.append(f"pgcdc_dev.services: {exc}")
    raise ServiceUnavailableError(
        f"{name} not available: set {ENV_VARS[name]}, run a Docker engine, or run "
        f"`python -m pgcdc_dev.services up {PG_VERSIONS.get(pg, name)}`. Tried: " + "; ".join(failures)
    )


def tool_or_skip(*names: str, install: str) -> str:
    """The path of a command-line tool (chromium, promtool…), or skip (fail when services are required)."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    reason = f"{names[0]} is not installed: {install} (./dev bootstrap installs it)"
    if require_services():
        pytest.fail(f"required tool missing (CDC_TEST_REQUIRE_SERVICES is set): {reason}")
    pytest.skip(reason)


def tls_endpoints_or_skip() -> dict[str, Any]:
    """The local services' TLS endpoints: PostgreSQL's CA and TLS-only role, Kafka's SASL_SSL listener, the
    registry behind HTTPS with a password (pgcdc_dev.services). Services given by environment variables or
    testcontainers have no such endpoints: the security tests then skip, saying so."""
    given = [ENV_VARS[n] for n in ("postgres", "kafka", "registry") if from_env(n)]
    if given or docker_engine_answers():
        pytest.skip(
            "the TLS tests need pgcdc_dev.services's TLS endpoints (a SASL_SSL Kafka listener, an HTTPS registry); "
            f"services come from {', '.join(given) or 'testcontainers'} here"
        )
    try:
        for name in ("postgres", "kafka", "registry-tls"):
            _deploy_endpoints(name)
    except ServiceUnavailableError as exc:
        skip_unavailable(exc)
    endpoints: dict[str, Any] = json.loads(_deploy("endpoints").stdout)
    return endpoints


def skip_unavailable(exc: ServiceUnavailableError, why: str = "") -> NoReturn:
    """Skip the test saying which service is missing (and ``why`` it is needed); fail instead when services are
    required (CDC_TEST_REQUIRE_SERVICES), so that a missing service never passes as a skip in CI."""
    if require_services():
        pytest.fail(f"required service missing (CDC_TEST_REQUIRE_SERVICES is set): {exc}")
    pytest.skip(f"{why}: {exc}" if why else str(exc))


def find_or_skip(name: str, pg: str | None = None) -> str:
    """The service's address, or skip (fail when services are required) with the reason."""
    try:
        return find(name, pg).value
    except ServiceUnavailableError as exc:
        skip_unavailable(exc)
