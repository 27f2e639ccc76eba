"""Kafka Connect with Debezium's JDBC sink connector as the SQL sink's same-run reference.

What runs: a standalone Connect worker (``connect-runtime`` matching the broker) with Debezium's JDBC sink and
Confluent's Avro converter against the registry's Confluent-compatible API, from the ``connect-jars`` local
service (Maven Central), started as a user runs ``connect-standalone``, in a scratch directory of its own. It
reads the benchmark's change topic from offset zero into a database of its own on the source's server, with
the settings docs/consumers.md gives (upsert by the record key, deletes, truncates, the table created from the
schema), at its shipped batch sizes and one task (the topic has one partition).

What it does not do that the SQL sink does, to say beside any figure: it writes no position guard (a replayed
record can move a row backwards); it does not fold (every event is a statement of a batch); it stores a partial
update's unchanged TOAST column as NULL (it does not know pgcdc's ``unchanged_toast``); and it leaves out a
``numeric`` column, whose Avro form (a union of a decimal and a string, for NaN) it cannot store.

Its time runs from the sink task's start (its log line, so the JVM's launch and the plugins' scan are left
out, as the SQL sink's replay leaves out its Spark session's) to every record's offset committed by the task's
consumer group: Connect commits a sink task's offsets after the connector has written them, every
``offset.flush.interval.ms`` (here 250 ms).
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from pgcdc_dev import discovery, services
from psycopg.conninfo import conninfo_to_dict

from bench._capture_bench import stop_process

_STARTED = re.compile(r"WorkerSinkTask\{id=[^}]+\} Sink task finished initialization and start")


@dataclass(frozen=True)
class ConnectRun:
    """One replay by the JDBC sink: seconds from its task's start (and from the worker's launch) to the end."""

    seconds: float
    launch_seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connector(name: str, topic: str, registry: str, target: str, exclude: str) -> str:
    t = conninfo_to_dict(target)
    url = f"jdbc:postgresql://{t.get('host', '127.0.0.1')}:{t.get('port', 5432)}/{t['dbname']}"
    converters = "".join(
        f"{side}.converter=io.confluent.connect.avro.AvroConverter\n{side}.converter.schema.registry.url={registry}\n"
        for side in ("key", "value")
    )
    return (
        f"name={name}\nconnector.class=io.debezium.connector.jdbc.JdbcSinkConnector\ntasks.max=1\n"
        f"topics={topic}\nconnection.url={url}\nconnection.username={t['user']}\n"
        f"connection.password={t.get('password', '')}\n"
        "insert.mode=upsert\ndelete.enabled=true\ntruncate.enabled=true\nprimary.key.mode=record_key\n"
        "schema.evolution=basic\ncollection.name.format=${source.table}\n"
        f"consumer.override.isolation.level=read_committed\nfield.exclude.list={topic}:{exclude}\n{converters}"
    )


# Connect's runtime logs through reload4j (log4j 1): warnings, and the sink task's start line.
_LOG4J = (
    "log4j.rootLogger=WARN, stdout\n"
    "log4j.appender.stdout=org.apache.log4j.ConsoleAppender\n"
    "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout\n"
    "log4j.appender.stdout.layout.ConversionPattern=%d %p %c{1} - %m%n\n"
    "log4j.logger.org.apache.kafka.connect.runtime.WorkerSinkTask=INFO\n"
)


def _worker(kafka: str, home: Path, workdir: Path) -> str:
    return (
        f"bootstrap.servers={kafka}\n"
        "key.converter=org.apache.kafka.connect.json.JsonConverter\n"
        "value.converter=org.apache.kafka.connect.json.JsonConverter\n"
        f"offset.storage.file.filename={workdir / 'connect.offsets'}\n"
        "offset.flush.interval.ms=250\n"
        f"plugin.path={home / 'plugins'}\n"
        f"listeners=http://127.0.0.1:{_free_port()}\n"
        "consumer.auto.offset.reset=earliest\n"
        "connector.client.config.override.policy=All\n"
    )


def _committed(kafka: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        consumer.close()


@dataclass(frozen=True)
class Replay:
    """What the JDBC sink replays: ``topic`` of ``kafka`` (its schemas in ``registry``) from offset zero into
    ``target``, without the fields of ``exclude``, until every record of ``ends`` is committed (partition ->
    high watermark; a transactional topic's last offset is a commit marker, which the task never counts, so one
    short of it is the end), within ``timeout_s``. The worker's files and log go into ``workdir``."""

    kafka: str
    registry: str
    topic: str
    ends: dict[int, int]
    target: str
    exclude: str
    workdir: Path
    timeout_s: float = 900


def jdbc_sink_replay(replay: Replay) -> ConnectRun:
    """The JDBC sink on a standalone Connect worker doing ``replay``, timed."""
    home = Path(discovery.find("connect-jars").value)
    jdk = services.java_home(17)
    if jdk is None:
        raise RuntimeError("Kafka Connect needs Java 17+: apt-get install -y openjdk-17-jre-headless")
    workdir = replay.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"pgcdc-bench-{int(time.time())}"
    (workdir / "worker.properties").write_text(_worker(replay.kafka, home, workdir))
    (workdir / "connector.properties").write_text(
        _connector(name, replay.topic, replay.registry, replay.target, replay.exclude)
    )
    (workdir / "log4j.properties").write_text(_LOG4J)
    log = workdir / "connect.log"
    launched = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                str(jdk / "bin" / "java"),
                "-Xmx768m",
                f"-Dlog4j.configuration=file:{workdir / 'log4j.properties'}",
                "-cp",
                f"{home / 'runtime'}/*",
                "org.apache.kafka.connect.cli.ConnectStandalone",
                str(workdir / "worker.properties"),
                str(workdir / "connector.properties"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        group = (replay.kafka, f"connect-{name}", replay.topic, replay.ends)
        return _wait(proc, log, launched, group, replay.timeout_s)
    finally:
        stop_process(proc)


def _wait(
    proc: subprocess.Popen[bytes],
    log: Path,
    launched: float,
    group: tuple[str, str, str, dict[int, int]],
    timeout_s: float,
) -> ConnectRun:
    kafka, name, topic, ends = group
    started: float | None = None
    deadline = launched + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Connect worker exited ({proc.returncode}); log: {log}")
        if started is None and _STARTED.search(log.read_text(errors="replace")):
            started = time.monotonic()
        if started is not None:
            committed = _committed(kafka, name, topic, len(ends))
            if all(committed.get(p, -1) >= end - 1 for p, end in ends.items()):
                now = time.monotonic()
                return ConnectRun(now - started, now - launched)
        time.sleep(0.2)
    raise RuntimeError(f"the JDBC sink did not reach the topic's end within {timeout_s:g} s; log: {log}")
