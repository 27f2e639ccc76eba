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


def test_a_version_the_services_do_not_offer_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CDC_TEST_PG_DSN", raising=False)
    with pytest.raises(discovery.ServiceUnavailableError, match="PostgreSQL '14'"):
        discovery.find("postgres", pg="14")


def test_a_server_named_by_its_dsn_serves_every_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_TEST_PG_DSN", "postgresql://example.invalid/x")
    discovery.find.cache_clear()
    try:
        assert discovery.find("postgres", pg="18") == discovery.Found("postgresql://example.invalid/x", "env")
    finally:
        discovery.find.cache_clear()
