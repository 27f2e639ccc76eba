"""sinks.connectors: the Maven coordinates Spark resolves when no jar list is configured."""

from __future__ import annotations

from pathlib import Path

import pyspark

from sinks import connectors


def test_the_kafka_source_and_spark_avro_are_the_installed_pysparks_own() -> None:
    assert connectors.packages() == [
        f"org.apache.spark:spark-sql-kafka-0-10_2.13:{pyspark.__version__}",
        f"org.apache.spark:spark-avro_2.13:{pyspark.__version__}",
    ]
    assert connectors.excludes() == []


def test_s3_adds_the_s3a_connector_of_the_hadoop_pyspark_ships_and_keeps_other_clouds_out() -> None:
    shipped = next((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar")).name
    hadoop = shipped.removeprefix("hadoop-client-api-").removesuffix(".jar")
    found = connectors.packages(s3=True)
    assert f"org.apache.hadoop:hadoop-aws:{hadoop}" in found
    cloud = [c for c in found if "spark-hadoop-cloud" in c]
    assert len(cloud) == 1
    if pyspark.__version__.startswith("4.2."):  # not published for 4.2: the 4.1 build, whose API 4.2 keeps
        assert cloud[0].endswith(":4.1.2")
    assert "org.apache.hadoop:hadoop-azure" in connectors.excludes(s3=True)


def test_the_dev_tools_jars_are_the_ones_the_sinks_would_resolve() -> None:
    """The dev services fetch jars for the tests (spark-jars, spark-cloud-jars) by the versions they pin: the same
    coordinates the sinks resolve without a jar list, so the tests run what users get."""
    from pgcdc_dev import services

    assert connectors.spark_version() == services.SPARK_VERSION
    assert connectors.SCALA_BINARY == services.SCALA_BINARY
    assert connectors.hadoop_version() == services.HADOOP_VERSION
    cloud = next(c for c in connectors.packages(s3=True) if "spark-hadoop-cloud" in c)
    assert cloud.endswith(f":{services.SPARK_HADOOP_CLOUD_VERSION}")
