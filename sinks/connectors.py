"""Spark's connectors for the sinks, by Maven coordinates: what ``spark.jars.packages`` resolves when no jar list
is configured (``sinks.spark_jars``).

The sinks need three connectors that pyspark does not ship: Spark's Kafka source and spark-avro, which must be
the installed PySpark's own version, and Delta Lake, whose Maven artifact delta-spark's pip package names for
its own version and the installed PySpark (``delta.configure_spark_with_delta_pip``). Spark resolves them once,
at the session's start, from Maven Central (:func:`ivy_settings`) into the local Ivy cache (``spark.jars.ivy``,
default ``~/.ivy2.5.2``), and hands them to the executors itself. A state directory or warehouse on S3
(``s3a://``) adds Hadoop's S3A connector at the Hadoop version pyspark ships, and Spark's cloud checkpoint
manager.

Air-gapped sites list local jars in ``sinks.spark_jars`` instead; a mirror is named with Spark's own
``spark.jars.repositories`` (``sinks.spark_conf``).
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

SCALA_BINARY = "2.13"  # every PySpark 4 distribution is built for Scala 2.13
# Spark's cloud checkpoint manager (spark-hadoop-cloud) by PySpark's major.minor: 4.2.0 is not on Maven Central.
# Its 4.1.2 is built against the checkpoint API of Spark 4.1 on, which 4.2 keeps.
_HADOOP_CLOUD = {"4.2": "4.1.2"}
# spark-hadoop-cloud depends on every cloud's connector; of them only hadoop-aws (S3A) is wanted.
_CLOUD_EXCLUDES = (
    "org.apache.hadoop:hadoop-azure",
    "org.apache.hadoop:hadoop-azure-datalake",
    "org.apache.hadoop:hadoop-cloud-storage",
    "org.apache.hadoop:hadoop-openstack",
    "com.google.cloud.bigdataoss:gcs-connector",
)


CENTRAL = "https://repo1.maven.org/maven2/"
# Spark's own Ivy chain reads ~/.m2 first, and takes a module whose POM is there without its jar (as Maven leaves
# after resolving a build's dependencies) from there, then fails to find the jar: `cdc sinks run` stopped with
# "download failed: org.slf4j#slf4j-api;2.0.13!slf4j-api.jar" on a machine where Maven had run. These settings
# resolve from Maven Central alone; Spark puts spark.jars.repositories (a mirror) in front of it.
_IVY_SETTINGS = f"""<ivysettings>
  <settings defaultResolver="central"/>
  <resolvers>
    <ibiblio name="central" m2compatible="true" root="{CENTRAL}"/>
  </resolvers>
</ivysettings>
"""


def ivy_settings(directory: Path) -> Path:
    """The Ivy settings file for ``spark.jars.ivySettings``, written into ``directory`` (atomically)."""
    path = directory / "ivysettings.xml"
    if not path.exists() or path.read_text() != _IVY_SETTINGS:
        directory.mkdir(parents=True, exist_ok=True)
        written = directory / f".ivysettings.xml.{os.getpid()}"
        written.write_text(_IVY_SETTINGS)
        written.replace(path)
    return path


def spark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


@cache
def hadoop_version() -> str:
    """The Hadoop version the installed pyspark ships (its jars/hadoop-client-api-<version>.jar)."""
    import pyspark

    for jar in (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"):
        found = re.fullmatch(r"hadoop-client-api-(.+)\.jar", jar.name)
        if found:
            return found.group(1)
    raise RuntimeError(f"no hadoop-client-api jar in pyspark's jars ({pyspark.__file__}): a broken pyspark install")


def packages(*, s3: bool = False) -> list[str]:
    """The coordinates the sinks add to Delta's (``delta.configure_spark_with_delta_pip``): Spark's Kafka source
    and spark-avro of the installed PySpark, and with ``s3`` Hadoop's S3A connector and the checkpoint manager."""
    spark = spark_version()
    found = [
        f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_BINARY}:{spark}",
        f"org.apache.spark:spark-avro_{SCALA_BINARY}:{spark}",
    ]
    if s3:
        cloud = _HADOOP_CLOUD.get(".".join(spark.split(".")[:2]), spark)
        found += [
            f"org.apache.hadoop:hadoop-aws:{hadoop_version()}",
            f"org.apache.spark:spark-hadoop-cloud_{SCALA_BINARY}:{cloud}",
        ]
    return found


def excludes(*, s3: bool = False) -> list[str]:
    """``spark.jars.excludes`` for :func:`packages`: the cloud connectors spark-hadoop-cloud would bring."""
    return list(_CLOUD_EXCLUDES) if s3 else []


__all__ = ["CENTRAL", "SCALA_BINARY", "excludes", "hadoop_version", "ivy_settings", "packages", "spark_version"]
