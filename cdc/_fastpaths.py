"""Which of the capture's hot paths run in C, and why not where they do not: decided once, said once.

Every C path has a Python twin that writes the same bytes; a C path runs only when the C build is installed,
``CDC_PURE_PYTHON`` does not rule it out, and the library it calls into is the very copy its Python package
loaded, found by public means (cdc/_libs.py). Anything else falls back to Python, with the reason logged at
start (``fast paths: …``), never an error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from confluent_kafka import libversion

from cdc._encoder import native_module
from cdc._libs import libpq_addresses, librdkafka_addresses

log = logging.getLogger(__name__)

# What the C readers call in libpq (cdc/_native.pyx's CopyReader and ChangeReader); a libpq lacking one of them
# is not used. The producer's librdkafka functions are cdc._native.LIBRDKAFKA_FUNCTIONS.
LIBPQ_FUNCTIONS = (
    "PQisnonblocking",
    "PQsetnonblocking",
    "PQsendQuery",
    "PQgetResult",
    "PQresultStatus",
    "PQclear",
    "PQgetCopyData",
    "PQconsumeInput",
    "PQfreemem",
    "PQerrorMessage",
    "PQresultErrorMessage",
    "PQresultErrorField",
)


@dataclass(frozen=True)
class FastPath:
    name: str
    native: bool
    why: str  # what it runs on, or why it does not run in C

    def __str__(self) -> str:
        return f"{self.name}={'c' if self.native else 'python'} ({self.why})"


def _encoder() -> FastPath:
    if native_module() is not None:
        return FastPath("encoder", True, "cdc._native")
    if os.environ.get("CDC_PURE_PYTHON", "") not in ("", "0"):
        return FastPath("encoder", False, "CDC_PURE_PYTHON is set")
    return FastPath("encoder", False, "the C build is not installed (a C compiler and Python's headers build it)")


def _library(
    name: str, find: Callable[[tuple[str, ...]], dict[str, int]], names: tuple[str, ...], which: str
) -> FastPath:
    if native_module() is None:
        return FastPath(name, False, _encoder().why)  # the same reason: no C build, or CDC_PURE_PYTHON
    try:
        find(names)
    except (OSError, AttributeError) as exc:
        return FastPath(name, False, str(exc))
    return FastPath(name, True, which)


def probe() -> list[FastPath]:
    """Each hot path: the row encoder, the readers on libpq (snapshot COPY, streamed changes), the producer."""
    return [
        _encoder(),
        _library(
            "libpq readers",
            libpq_addresses,
            LIBPQ_FUNCTIONS,
            f"psycopg {psycopg.pq.__impl__}'s libpq {psycopg.pq.version()}",
        ),
        _library(
            "librdkafka producer",
            librdkafka_addresses,
            getattr(native_module(), "LIBRDKAFKA_FUNCTIONS", ()),
            f"its own producer on confluent_kafka's librdkafka {libversion()[0]}",
        ),
    ]


def log_fast_paths() -> list[FastPath]:
    paths = probe()
    log.info("fast paths: %s", ", ".join(str(p) for p in paths))
    return paths
