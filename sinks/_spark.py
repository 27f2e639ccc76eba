"""Building the SparkSession the sinks run in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Delta Lake plugs into Spark SQL through these two settings; without them MERGE and the delta format fail.
_DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
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
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    for key, value in {**_DELTA_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
