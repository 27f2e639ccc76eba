"""Fixtures shared by every test: the real services, found by tests/discovery.py."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pgcdc_dev import discovery, leftovers
from pgcdc_dev.cluster import ObjectStore

from tests.integration._sinks_helpers import Stack

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers it adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long_profile = os.environ.get("CDC_TEST_LONG", "") not in ("", "0")
    _one_version_params(config, items)
    for item in items:
        if "integration" in Path(str(item.path)).parts:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("long") and not long_profile:
            # Opt-in, so the default run stays well inside CI's time; what it covers is said at each test.
            item.add_marker(pytest.mark.skip(reason="in the long profile only: CDC_TEST_LONG=1 ./dev test"))


# After pytest-xdist's worker has added each test's group to its id.
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_grouped(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`, a grouped test whose id lacks its group would run on any worker (the Spark
    tests side by side): a pytest that pytest-xdist cannot mark this way is refused, not run silently."""
    if not getattr(config.option, "loadgroup", False):  # set in each worker when the run has --dist loadgroup
        return
    lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        message = (
            f"pytest-xdist did not mark the xdist_group of {len(lost)} tests (first: {lost[0]}): this pytest and "
            "pytest-xdist do not group together (pytest-xdist issue 1386); install the versions pyproject.toml "
            "names (./dev reinstalls them)"
        )
        print(message, file=sys.stderr)  # a worker's UsageError reaches the terminal only as an INTERNALERROR
        raise pytest.UsageError(message)


_ISSUED: set[str] = set()  # the `unique` suffixes this process handed out
# Another pytest process shares the services (an xdist worker, say): what it made is not this one's to clean up.
_SHARED = bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.fixture
def unique() -> str:
    """A short suffix that keeps names (tables, slots, topics, indices) apart across tests and runs."""
    suffix = uuid.uuid4().hex[: leftovers.UNIQUE_LEN]  # what leftovers recognises
    _ISSUED.add(suffix)
    return suffix


# The servers a pg_matrix suite runs on when the run names none (CDC_TEST_PG, CDC_TEST_PG_DSN): the oldest
# supported and the newest, in one run, so each version's tests share the run's workers with everything else.
MATRIX = (discovery.DEFAULT_PG_VERSION, "18")


def _matrix() -> tuple[str, ...]:
    named = os.environ.get("CDC_TEST_PG_DSN") or os.environ.get("CDC_TEST_PG", "").strip()
    return () if named else MATRIX


def _one_version_params(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A pg_matrix test's case marked one_version (``pytest.param(…, marks=pytest.mark.one_version)``) runs on
    the matrix's first server only: pytest_generate_tests sees the function's markers, not its cases'."""
    dropped = [
        item
        for item in items
        if item.get_closest_marker("one_version")
        and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("pg_server", MATRIX[0]) != MATRIX[0]  # type: ignore[attr-defined]
    ]
    if dropped:
        items[:] = [item for item in items if item not in dropped]
        config.hook.pytest_deselected(items=dropped)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A pg_matrix test (not one_version) runs once per server of the matrix, with ids [pg15] and [pg18]."""
    node = metafunc.definition
    if "pg_server" not in metafunc.fixturenames or not node.get_closest_marker("pg_matrix"):
        return
    if node.get_closest_marker("one_version") or not _matrix():
        return
    versions = list(_matrix())
    metafunc.parametrize("pg_server", versions, indirect=True, scope="session", ids=[f"pg{v}" for v in versions])


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> str:
    """The PostgreSQL major version the test's server runs: a pg_matrix test's parameter, else CDC_TEST_PG's
    (15 by default)."""
    return str(getattr(request, "param", None) or discovery.pg_version())


@pytest.fixture(scope="session")
def pg_dsn(pg_server: str) -> str:
    return discovery.find_or_skip("postgres", pg=pg_server)


@pytest.fixture(scope="session")
def mariadb_url() -> str:
    """A MariaDB server's SQLAlchemy URL (mariadb+pymysql://…/, no database): a target of the sql sink."""
    return discovery.find_or_skip("mariadb")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """The broker. On the local one (pgcdc_dev.services: neither CDC_TEST_KAFKA nor testcontainers), the topics
    the run created are deleted at its end.

    A run creates ~2,000 topics: kept, runs piled up thousands of partitions on the local broker, whose metadata
    then filled most of its heap and slowed its start-up (and the benchmarks run on it). A broker named by the
    environment may be shared and a testcontainers one is thrown away, so nothing of them is deleted. The local
    one may be in use meanwhile too (a demo, say), so only topics created during the run whose names carry a
    test's ``unique`` suffix (ten hex digits, a letter among them) go.
    """
    from confluent_kafka.admin import AdminClient

    bootstrap = discovery.find_or_skip("kafka")
    local = discovery.find("kafka").source == "deploy"
    # A client per end, not one held for the session: a held one keeps librdkafka's threads running in the
    # test process all run long, where tests measure this process's CPU by thread (test_bench_cpu).
    before = leftovers.topics(AdminClient({"bootstrap.servers": bootstrap})) if local else set()
    yield bootstrap
    if local:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        try:
            doomed = {t for t in leftovers.topics(admin) - before if _ours(t)}
        except Exception as exc:  # the run's results stand either way (a broker a fault test left down, say)
            warnings.warn(f"could not list the test topics: {type(exc).__name__}: {exc}", stacklevel=1)
        else:
            leftovers.delete_topics(admin, doomed)


def _ours(name: str) -> bool:
    """Made by a test of this run, and, when other processes run tests beside this one, by one of this
    process's tests (a `unique` suffix it handed out)."""
    return leftovers.made_by_a_test(name) and (
        not _SHARED or any(run in _ISSUED for run in leftovers.UNIQUE.findall(name.lower()))
    )


@pytest.fixture(scope="session")
def registry_url() -> str:
    return discovery.find_or_skip("registry")


@pytest.fixture(scope="session")
def opensearch_url() -> Iterator[str]:
    """OpenSearch. On the local one, the indices the run's tests created are deleted at its end (as the topics
    are, see kafka_bootstrap): each of them is a shard the node keeps open, run after run."""
    from opensearchpy import OpenSearch

    url = discovery.find_or_skip("opensearch")
    local = discovery.find("opensearch").source == "deploy"
    before = set(OpenSearch(url).indices.get(index="*", expand_wildcards="all")) if local else set()
    yield url
    if local:
        with _cleaning("indices"):
            client = OpenSearch(url, timeout=60)
            doomed = sorted(i for i in set(client.indices.get(index="*")) - before if _ours(i))
            for i in range(0, len(doomed), 100):  # a URL per request: bounded in length
                client.indices.delete(index=",".join(doomed[i : i + 100]), ignore_unavailable=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """Redis. On the local one, the keys of namespaces the run's tests created are deleted at its end: kept,
    they made every SCAN with a pattern (verify, a truncate, a rebuild's clean-up) walk millions of keys, and the
    server's start replay its append-only file."""
    import redis

    url = discovery.find_or_skip("redis")
    local = discovery.find("redis").source == "deploy"
    client = redis.Redis.from_url(url)
    before = {key.split(b":", 1)[0] for key in client.scan_iter(count=10_000)} if local else set()
    yield url
    if local:
        with _cleaning("cache keys"):
            doomed: list[bytes] = []
            for key in client.scan_iter(count=10_000):
                space = key.split(b":", 1)[0]
                if space not in before and _ours(space.decode(errors="replace")):
                    doomed.append(key)
                if len(doomed) >= 5_000:
                    client.unlink(*doomed)
                    doomed.clear()
            if doomed:
                client.unlink(*doomed)
    client.close()


@contextlib.contextmanager
def _cleaning(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # the run's results stand either way
        warnings.warn(f"could not delete the test {what}: {type(exc).__name__}: {exc}", stacklevel=1)


@pytest.fixture(scope="session")
def spark_jars() -> list[str]:
    return [jar for jar in discovery.find_or_skip("spark-jars").split(",") if jar]


@pytest.fixture(scope="session")
def object_store() -> ObjectStore:
    """pgcdc_dev.services's S3 server, with the jars Spark reaches it with."""
    url = discovery.find_or_skip("s3")
    classpath = discovery.find_or_skip("spark-cloud-jars")
    # s3proxy predates the integrity checksums AWS's SDKs send by default since 2025 (pyarrow's among them):
    # the SDKs' documented switch for such stores, inherited by every `cdc` this run starts.
    os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    access = os.environ.get("CDC_TEST_S3_ACCESS_KEY") or discovery.deploy_record("s3")["access_key"]
    secret = os.environ.get("CDC_TEST_S3_SECRET_KEY") or discovery.deploy_record("s3")["secret_key"]
    return ObjectStore(url, access, secret, classpath)


@pytest.fixture(scope="session")
def stack(kafka_bootstrap: str, registry_url: str, opensearch_url: str, redis_url: str, spark_jars: list[str]) -> Stack:
    """Every service the whole pipeline (capture and sinks) needs."""
    return Stack(kafka_bootstrap, registry_url, opensearch_url, redis_url, spark_jars)


@pytest.fixture(scope="session")
def spark(spark_jars: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """One SparkSession for the whole run: it takes a quarter of a minute to start on two cores."""
    from sinks.app import build_session

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = build_session(
        "pgcdc-tests",
        spark_jars,
        conf={"spark.sql.warehouse.dir": str(warehouse), "spark.driver.memory": "1g"},
    )
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()
