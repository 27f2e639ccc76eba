"""The C paths find their libraries by public means, check the version, and fall back saying why."""

from __future__ import annotations

import ctypes
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import libversion

from cdc import _libs
from cdc._encoder import native_module
from cdc._fastpaths import LIBPQ_FUNCTIONS, probe

needs_c = pytest.mark.skipif(native_module() is None, reason="the C build (cdc._native) is not installed")


@needs_c
def test_libpq_is_the_copy_psycopg_runs() -> None:
    if psycopg.pq.__impl__ == "python":
        pytest.skip("psycopg runs its ctypes wrapper here: the C readers are off by design")
    found = _libs.libpq_addresses(LIBPQ_FUNCTIONS)
    assert set(found) == set(LIBPQ_FUNCTIONS)
    version = ctypes.CFUNCTYPE(ctypes.c_int)(_libs.libpq_addresses(("PQlibVersion",))["PQlibVersion"])
    assert version() == psycopg.pq.version()


@needs_c
def test_librdkafka_is_the_copy_confluent_kafka_runs() -> None:
    names = native_module().LIBRDKAFKA_FUNCTIONS  # type: ignore[union-attr]
    found = _libs.librdkafka_addresses(names)
    assert set(found) == set(names)
    version = ctypes.CFUNCTYPE(ctypes.c_int)(_libs.librdkafka_addresses(("rd_kafka_version",))["rd_kafka_version"])
    assert version() == libversion()[1]


def test_a_library_of_another_version_is_refused() -> None:
    from confluent_kafka import cimpl

    with pytest.raises(OSError, match="not the 1 its package reports"):
        _libs.linked_library(str(cimpl.__file__), 1, "rd_kafka_version")


def test_a_module_not_loaded_is_not_loaded_now(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="not reachable"):
        _libs.linked_library(str(tmp_path / "nowhere.so"), 1, "PQlibVersion")


def test_every_path_says_what_it_runs_on_and_pure_python_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = probe()
    assert [p.name for p in paths] == ["encoder", "libpq readers", "librdkafka producer"]
    assert all(p.why for p in paths)
    monkeypatch.setenv("CDC_PURE_PYTHON", "1")
    off = probe()
    assert not any(p.native for p in off)
    assert off[0].why == "CDC_PURE_PYTHON is set"
    assert str(off[0]) == "encoder=python (CDC_PURE_PYTHON is set)"
