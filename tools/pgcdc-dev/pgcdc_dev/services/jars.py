"""Jar sets: installed, nothing runs. The connectors Spark lacks for the sinks (Kafka source, spark-avro,
Delta Lake), Hadoop's S3A connector with Spark's cloud checkpoint manager, Flink's table runtime with its Kafka
connector and registry Avro format, and a Kafka Connect worker with its plugins (the consumer tests')."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import (
    APICURIO_CONVERTER_VERSION,
    CONFLUENT_CARRIER,
    CONFLUENT_JARS,
    CONFLUENT_VERSION,
    DEBEZIUM_JDBC_VERSION,
    DELTA_VERSION,
    FLINK_KAFKA_CONNECTOR_VERSION,
    FLINK_VERSION,
    HADOOP_VERSION,
    KAFKA_VERSION,
    LOG4J_VERSION,
    OPT,
    SCALA_BINARY,
    SPARK_HADOOP_CLOUD_VERSION,
    SPARK_VERSION,
    DeployError,
)
from pgcdc_dev.services._install import download, extract, maven_copy_dependencies, maven_url
from pgcdc_dev.services._process import Service


def _artifact(jar_name: str) -> str:
    """'zstd-jni-1.5.6-10.jar' -> 'zstd-jni': the name before the first '-<digits>.<digits>'."""
    match = re.match(r"^(.*?)-\d+\.\d+", jar_name)
    return match.group(1) if match else jar_name.removesuffix(".jar")


class SparkJars(Service):
    """Jars Spark lacks for our sinks; nothing runs. Jars pyspark already ships are left out."""

    name = "spark-jars"

    def dir(self) -> Path:
        return OPT / f"spark-jars-{SPARK_VERSION}-delta-{DELTA_VERSION}"

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} connectors, Delta {DELTA_VERSION}"

    def install(self) -> None:
        s, sb = SPARK_VERSION, SCALA_BINARY
        # Delta names its artifact after the Spark version from Delta 4.1 on (delta-spark_4.1_2.13).
        delta = (
            f"delta-spark_{sb}"
            if DELTA_VERSION.startswith("4.0.")
            else f"delta-spark_{'.'.join(s.split('.')[:2])}_{sb}"
        )
        maven_copy_dependencies(
            [
                f"org.apache.spark:spark-sql-kafka-0-10_{sb}:{s}",
                f"org.apache.spark:spark-avro_{sb}:{s}",
                f"io.delta:{delta}:{DELTA_VERSION}",
            ],
            self.dir(),
            {},
        )

    def jars(self) -> list[str]:
        shipped: set[str] = set()
        try:
            import pyspark  # the project's virtualenv has it

            shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
        except ImportError:
            pass
        return sorted(str(p) for p in self.dir().glob("*.jar") if _artifact(p.name) not in shipped)

    def up(self) -> None:
        self.install()

    def ready(self) -> bool:
        return self.dir().exists()

    def stop(self) -> None:
        pass

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else []}


class SparkCloudJars(SparkJars):
    """Hadoop's S3A connector (hadoop-aws and the AWS SDK bundle it names) and Spark's cloud checkpoint manager.

    Apart from spark-jars: the SDK bundle is 690 MB, and every jar in ``spark.jars`` is copied to each
    executor (in local mode too). These belong on the JVMs' classpath instead (``spark.driver.extraClassPath``
    and ``spark.executor.extraClassPath``), where a cluster's image would have them.
    """

    name = "spark-cloud-jars"

    def dir(self) -> Path:
        return OPT / f"spark-cloud-jars-{SPARK_HADOOP_CLOUD_VERSION}-hadoop-{HADOOP_VERSION}"

    def version(self) -> str:
        return f"hadoop-aws {HADOOP_VERSION}, spark-hadoop-cloud {SPARK_HADOOP_CLOUD_VERSION}"

    def install(self) -> None:
        cloud = f"org.apache.spark:spark-hadoop-cloud_{SCALA_BINARY}:{SPARK_HADOOP_CLOUD_VERSION}"
        # spark-hadoop-cloud brings every cloud's connector; of them only hadoop-aws is wanted (above).
        maven_copy_dependencies([f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}", cloud], self.dir(), {cloud: ["*:*"]})

    def endpoint(self) -> dict[str, Any]:
        jars = self.jars() if self.dir().exists() else []
        return {"jars": jars, "classpath": f"{self.dir()}/*"}


class FlinkJars(SparkJars):
    """Flink's table runtime with its Kafka connector and the Confluent-registry Avro format; nothing runs.

    A test runs its SQL in one JVM (a local mini-cluster) with these jars on the classpath."""

    name = "flink-jars"

    def dir(self) -> Path:
        return OPT / f"flink-jars-{FLINK_VERSION}-kafka-{FLINK_KAFKA_CONNECTOR_VERSION}"

    def version(self) -> str:
        return f"Flink {FLINK_VERSION}, Kafka connector {FLINK_KAFKA_CONNECTOR_VERSION}"

    def install(self) -> None:
        f = FLINK_VERSION
        maven_copy_dependencies(
            [
                f"org.apache.flink:flink-table-api-java-bridge:{f}",
                f"org.apache.flink:flink-table-planner-loader:{f}",
                f"org.apache.flink:flink-table-runtime:{f}",
                f"org.apache.flink:flink-clients:{f}",
                f"org.apache.flink:flink-connector-base:{f}",  # flink-dist has it; the connector expects it
                f"org.apache.flink:flink-sql-connector-kafka:{FLINK_KAFKA_CONNECTOR_VERSION}",
                f"org.apache.flink:flink-sql-avro-confluent-registry:{f}",
                f"org.apache.logging.log4j:log4j-slf4j-impl:{LOG4J_VERSION}",
            ],
            self.dir(),
            {},
        )

    def jars(self) -> list[str]:
        return sorted(str(p) for p in self.dir().glob("*.jar"))

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else [], "classpath": f"{self.dir()}/*"}


class ConnectJars(SparkJars):
    """A Kafka Connect worker's runtime and three plugins: Debezium's JDBC sink, Apicurio's Avro converter and
    Confluent's (whose folder also serves a plain Java consumer with Confluent's ``KafkaAvroDeserializer``).

    ``runtime/`` is the worker's classpath; ``plugins/`` its ``plugin.path`` (one folder per plugin, so each
    loads in its own class loader). A test starts a standalone worker on them."""

    name = "connect-jars"

    def dir(self) -> Path:
        return OPT / f"connect-{KAFKA_VERSION}-debezium-jdbc-{DEBEZIUM_JDBC_VERSION}-confluent-{CONFLUENT_VERSION}"

    def version(self) -> str:
        return f"Connect {KAFKA_VERSION}, Debezium JDBC {DEBEZIUM_JDBC_VERSION}, Confluent Avro {CONFLUENT_VERSION}"

    def install(self) -> None:
        if self.dir().exists():
            return
        tmp = self.dir().with_name(self.dir().name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        k = KAFKA_VERSION
        maven_copy_dependencies(
            [
                f"org.apache.kafka:connect-runtime:{k}",
                f"org.apache.kafka:connect-json:{k}",
                f"org.apache.kafka:connect-transforms:{k}",
                "org.slf4j:slf4j-reload4j:1.7.36",
            ],
            tmp / "runtime",
            {},
        )
        # The worker brings Kafka's client and the logging API; a plugin's own copies would clash with them.
        maven_copy_dependencies(
            [f"io.apicurio:apicurio-registry-utils-converter:{APICURIO_CONVERTER_VERSION}"],
            tmp / "plugins" / "apicurio-converter",
            {
                f"io.apicurio:apicurio-registry-utils-converter:{APICURIO_CONVERTER_VERSION}": [
                    "org.apache.kafka:*",
                    "org.slf4j:*",
                ]
            },
        )
        archive = download(
            maven_url("io.debezium", "debezium-connector-jdbc", DEBEZIUM_JDBC_VERSION, "tar.gz", "plugin")
        )
        extract(archive, tmp / "plugins" / "debezium-connector-jdbc", "debezium-connector-jdbc")
        group, artifact, version = CONFLUENT_CARRIER
        carrier = download(maven_url(group, artifact, version, "tar.gz", "plugin"))
        confluent = tmp / "plugins" / "confluent-avro-converter"
        confluent.mkdir(parents=True)
        with tarfile.open(carrier) as tf:
            members = {Path(m.name).name: m for m in tf.getmembers() if m.isfile()}
            missing = [name for name in CONFLUENT_JARS if name not in members]
            if missing:
                raise DeployError(f"{carrier.name} lacks {', '.join(missing)}: CONFLUENT_JARS names what it holds")
            for name in CONFLUENT_JARS:
                source = tf.extractfile(members[name])
                assert source is not None  # a regular file
                with source, open(confluent / name, "wb") as out:
                    shutil.copyfileobj(source, out)
        tmp.rename(self.dir())

    def jars(self) -> list[str]:
        return sorted(str(p) for p in (self.dir() / "runtime").glob("*.jar"))

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else [], "home": str(self.dir())}
