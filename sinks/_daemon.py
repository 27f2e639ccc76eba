"""Spark's Python daemon for the sinks (``spark.python.daemon.module``): PySpark's own, with pgcdc's modules
imported once before it forks its workers.

Spark starts one daemon per executor and forks a Python worker from it for each task slot; the worker then
imports what its task needs. pgcdc's modules (the capture's codec and catalogs, the stores' clients) take
about 1.8 s of CPU to import, which every forked worker paid again: a quarter of a ``cdc verify``'s Python
time, and seconds of the first batch after a sink starts. Imported here, they are in every worker the daemon
forks, at no cost.

A fork copies only the thread that calls it, so the daemon must start no thread before it forks (PySpark's
daemon says so too): only modules that start none at import are listed here. pyarrow and pandas start threads
when imported, so the workers import those themselves; ``tests/unit/test_spark_daemon.py`` checks the list.
"""

from __future__ import annotations

import importlib
import sys

# What the sinks' executor tasks import: the capture's package (verify's source side reads through it),
# pyspark.sql (every task's functions refer to it) and the sinks' own modules.
PRELOADED = (
    "pyspark.worker",
    "pyspark.sql",
    "cdc",
    "sinks",
    "sinks._cache",
    "sinks._fold",
    "sinks._search",
    "sinks._sql",
    "sinks._taskfold",
    "sinks._verify",
    "sinks._warehouse",
    "sinks._write",
)


def preload() -> None:
    """Import PRELOADED; one that fails is said on stderr and left to the task that needs it, which reports
    it in full."""
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the daemon must start whatever an import does
            print(f"pgcdc: Python workers will import {name} themselves: {exc!r}", file=sys.stderr)


if __name__ == "__main__":
    preload()
    from pyspark.daemon import manager

    manager()
