"""How tests/discovery.py chooses where a service comes from."""

from __future__ import annotations

import pytest
from pgcdc_dev import discovery


def test_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_TEST_REDIS", "redis://example.invalid:1/0")
    discovery.find.cache_clear()
    try:
        assert discovery.find("redis") == discovery.Found("redis://example.invalid:1/0", "env")
    finally:
        discovery.find.cache_clear()


def test_blank_variable_is_ignored() -> None:
    assert discovery.from_env("kafka", {"CDC_TEST_KAFKA": "  "}) is None
    assert discovery.from_env("kafka", {"CDC_TEST_KAFKA": "h:9092"}) == "h:9092"


@pytest.mark.parametrize(("raw", "required"), [("", False), ("0", False), ("no", False), ("1", True)])
def test_require_services_flag(monkeypatch: pytest.MonkeyPatch, raw: str, required: bool) -> None:
    monkeypatch.setenv("CDC_TEST_REQUIRE_SERVICES", raw)
    assert discovery.require_services() is required


def test_every_service_has_a_variable() -> None:
    assert set(discovery.ENV_VARS) == {
        *("postgres", "kafka", "registry", "opensearch", "redis", "spark-jars", "spark-cluster"),
        *("s3", "spark-cloud-jars", "flink-jars", "connect-jars", "mariadb"),
    }


@pytest.mark.parametrize(
    ("topic", "deleted"),
    [
        ("plainf964bd61a3", True),  # a test's prefix and its `unique` suffix
        ("txgap.table.0a1b2c3d4e", True),
        ("hb55af816e1.public.t", True),
        ("pgcdc.public.orders", False),  # a demo's
        ("bench_bigtxn_1795542778686.public.events", False),  # a benchmark's: digits only
        ("kafkasql-snapshots", False),  # the registry's
        ("registry-events", False),
        ("__consumer_offsets", False),
        ("_apicurio_registry", False),
    ],
)
def test_only_topics_named_like_a_tests_are_cleaned_up(topic: str, deleted: bool) -> None:
    from tests.conftest import _made_by_a_test

    assert _made_by_a_test(topic) is deleted
