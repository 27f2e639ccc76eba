"""The dev tool reads the versions where they are pinned (pgcdc_dev.pins): the local services run what
docker-compose.yml and pyproject.toml name, and a version missing from them is an error, not a default."""

from __future__ import annotations

import tomllib

import pytest
import yaml
from pgcdc_dev import CHECKOUT, services
from pgcdc_dev.pins import compose_image, compose_tag, pinned_python


def test_the_local_services_run_the_images_compose_runs() -> None:
    compose = yaml.safe_load((CHECKOUT / "docker-compose.yml").read_text(encoding="utf-8"))
    images = {service["image"] for service in compose["services"].values() if "image" in service}
    base = services._base
    assert f"apache/kafka:{base.KAFKA_VERSION}" in images
    assert f"apicurio/apicurio-registry:{base.APICURIO_VERSION}" in images
    assert f"opensearchproject/opensearch:{base.OPENSEARCH_VERSION}" in images
    assert compose_image("redis") in images


def test_spark_and_delta_are_pyprojects_pins() -> None:
    sinks = tomllib.loads((CHECKOUT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert f"pyspark=={services.SPARK_VERSION}" in sinks["sinks"]
    assert f"delta-spark=={services.DELTA_VERSION}" in sinks["sinks"]


def test_a_version_not_pinned_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="pins no nosuch=="):
        pinned_python("nosuch")
    with pytest.raises(RuntimeError, match="runs no nosuch/image:<tag>"):
        compose_tag("nosuch/image")
    with pytest.raises(RuntimeError, match="pins no pandas=="):
        pinned_python("pandas")  # a range (pandas>=2,<3) is no pin
