"""Building the SparkSession the sinks run in."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Delta Lake plugs into Spark SQL through these two settings; without them MERGE and the delta format fail.
_DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # Avro and PostgreSQL names are case-sensitive: a table may have columns "Order" and "order". Spark's
    # default (case-insensitive) resolution finds two matches for either, in from_avro and in getField.
    "spark.sql.caseSensitive": "true",
    # One scheduler pool per sink's query (sinks._runner.SinkQuery.start): the queries share the cores
    # instead of queueing behind whichever submitted its tasks first.
    "spark.scheduler.mode": "FAIR",
    # Parquet timestamps as int64 µs: exact for every reader; INT96 (Spark's default) wraps for ±infinity.
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}

# Small-machine defaults: 200 shuffle partitions cost far more than they bring on a few cores.
_LOCAL_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
}


def build_session(
    app_name: str,
    jars: Sequence[str],
    *,
    master: str | None = "local[2]",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the Kafka source, spark-avro and Delta Lake on its classpath.

    ``jars`` are local paths (deploy/services.py fetches them); ``master=None`` leaves the master to
    spark-submit, so the same code runs on a cluster.
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
        for key, value in _LOCAL_CONF.items():
            builder = builder.config(key, value)
        if master.startswith("local"):
            # The sinks' writers run in Python worker processes; on this machine they must be this Python
            # (with pgcdc and the store clients installed), not whatever `python3` is first on PATH. PySpark
            # reads the variable when the SparkContext is made.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    for key, value in {**_DELTA_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # --log-level debug keeps Spark's account
        _quiet(session, _QUERY_FAILURE_LOGGER)
        # Pools are made on first use, each time with a warning that no allocation file configured it.
        _quiet(session, _POOL_LOGGER, "ERROR")
        # py4j logs the Python traceback of a batch that raised; the runner reports it (in full unless ours).
        logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)
    return session


# Spark logs a query that fails as a JVM stack trace of some 40 lines (around the Python traceback, when a
# batch raised). The runner (sinks._runner) reports every failed query itself: one line for a failure it
# knows (a full state disk, a store refusing its credentials: what, where, how to fix), the whole error for
# the others. Spark's own copy is silenced so that a known fault does not read as a crash.
_QUERY_FAILURE_LOGGER = "org.apache.spark.sql.execution.streaming.MicroBatchExecution"
_POOL_LOGGER = "org.apache.spark.scheduler.FairSchedulableBuilder"


def _quiet(session: SparkSession, logger: str, level: str = "OFF") -> None:
    try:
        jvm = session.sparkContext._jvm
        assert jvm is not None
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            logger, jvm.org.apache.logging.log4j.Level.getLevel(level)
        )
    except Exception as exc:  # only log tidiness: a Spark without log4j 2 keeps its default
        logging.getLogger(__name__).debug("cannot quieten %s: %s", logger, exc)
