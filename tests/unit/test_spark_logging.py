"""py4j's records on the root logger (a failed call to a JVM that is exiting) stay out of the sinks' log."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import py4j
import pytest

from sinks._spark import _PY4J_ON_ROOT


def _log_as_py4j(message: str) -> None:
    # The record py4j's client makes with logging.info(...): on the root logger, from its own file.
    root = logging.getLogger()
    if root.isEnabledFor(logging.INFO):
        path = os.path.join(os.path.dirname(py4j.__file__), "java_gateway.py")
        root.handle(root.makeRecord("root", logging.INFO, path, 1055, message, (), None))


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def root() -> Iterator[_Kept]:
    logger = logging.getLogger()
    level, handlers = logger.level, logger.handlers[:]
    kept = _Kept()
    logger.handlers[:] = [kept]
    logger.addFilter(_PY4J_ON_ROOT)
    try:
        yield kept
    finally:
        logger.removeFilter(_PY4J_ON_ROOT)
        logger.handlers[:] = handlers
        logger.setLevel(level)


def test_py4j_root_records_are_dropped_at_info(root: _Kept) -> None:
    logging.getLogger().setLevel(logging.INFO)
    _log_as_py4j("Exception while sending command.")
    logging.info("ours")
    assert [r.getMessage() for r in root.records] == ["ours"]


def test_py4j_root_records_are_kept_at_debug(root: _Kept) -> None:
    logging.getLogger().setLevel(logging.DEBUG)
    _log_as_py4j("Exception while sending command.")
    assert [r.getMessage() for r in root.records] == ["Exception while sending command."]


def test_named_loggers_are_left_alone(root: _Kept) -> None:
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("sinks._query").info("a batch")  # another logger's record: the root's filter never sees it
    assert [r.getMessage() for r in root.records] == ["a batch"]
