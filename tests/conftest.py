"""Fixtures shared by every test: the real services, found by tests/_services.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import _services
from tests.integration._sinks_helpers import Stack

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in Path(str(item.path)).parts:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def unique() -> str:
    """A short suffix that keeps names (tables, slots, topics, indices) apart across tests and runs."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    return _services.find_or_skip("postgres")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    return _services.find_or_skip("kafka")


@pytest.fixture(scope="session")
def registry_url() -> str:
    return _services.find_or_skip("registry")


@pytest.fixture(scope="session")
def opensearch_url() -> str:
    return _services.find_or_skip("opensearch")


@pytest.fixture(scope="session")
def redis_url() -> str:
    return _services.find_or_skip("redis")


@pytest.fixture(scope="session")
def spark_jars() -> list[str]:
    return [jar for jar in _services.find_or_skip("spark-jars").split(",") if jar]


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
