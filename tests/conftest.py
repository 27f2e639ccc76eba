"""Fixtures shared by every test: the real services, found by tests/discovery.py."""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pgcdc_dev import discovery
from pgcdc_dev.cluster import ObjectStore

from tests.integration._sinks_helpers import Stack

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient
    from pyspark.sql import SparkSession


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    long_profile = os.environ.get("CDC_TEST_LONG", "") not in ("", "0")
    for item in items:
        if "integration" in Path(str(item.path)).parts:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("long") and not long_profile:
            # Opt-in, so the default run stays well inside CI's time; what it covers is said at each test.
            item.add_marker(pytest.mark.skip(reason="in the long profile only: CDC_TEST_LONG=1 ./dev test"))


_UNIQUE_LEN = 10  # hex digits; the end-of-run topic clean-up (kafka_bootstrap) recognises them


@pytest.fixture
def unique() -> str:
    """A short suffix that keeps names (tables, slots, topics, indices) apart across tests and runs."""
    return uuid.uuid4().hex[:_UNIQUE_LEN]


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    return discovery.find_or_skip("postgres")


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
    before = _topics(AdminClient({"bootstrap.servers": bootstrap})) if local else set()
    yield bootstrap
    if local:
        _delete_test_topics(AdminClient({"bootstrap.servers": bootstrap}), before)


_UNIQUE = re.compile(f"[0-9a-f]{{{_UNIQUE_LEN}}}")  # the `unique` fixture's suffix, which test topics carry


def _made_by_a_test(topic: str) -> bool:
    return not topic.startswith("_") and any(set(run) & set("abcdef") for run in _UNIQUE.findall(topic))


def _topics(admin: AdminClient) -> set[str]:
    return set(admin.list_topics(timeout=30).topics)


def _delete_test_topics(admin: AdminClient, before: set[str], budget_s: float = 180.0) -> None:
    """Deletes the tests' topics created since ``before``, in batches, within ``budget_s``; a failure is a
    warning, not a failed run (a broker a fault test left down, say)."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + budget_s
    try:
        doomed = sorted(t for t in _topics(admin) - before if _made_by_a_test(t))
        for i in range(0, len(doomed), 200):
            left = deadline - time.monotonic()
            if left <= 0:
                warnings.warn(f"left {len(doomed) - i} test topics undeleted: out of time", stacklevel=1)
                return
            for future in admin.delete_topics(doomed[i : i + 200], operation_timeout=min(60.0, left)).values():
                with contextlib.suppress(KafkaException):  # already gone, say
                    future.result(timeout=max(1.0, deadline - time.monotonic()))
    except Exception as exc:  # the run's results stand either way
        warnings.warn(f"could not delete the test topics: {type(exc).__name__}: {exc}", stacklevel=1)


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
            doomed = sorted(i for i in set(client.indices.get(index="*")) - before if _made_by_a_test(i))
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
                if space not in before and _made_by_a_test(space.decode(errors="replace")):
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
    from sinks._spark import build_session

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = build_session(
        "pgcdc-tests",
        spark_jars,
        conf={"spark.sql.warehouse.dir": str(warehouse), "spark.driver.memory": "1g"},
    )
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()
