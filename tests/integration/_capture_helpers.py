"""Helpers for the capture tests: a scratch database, the `cdc` process, and a plain Avro consumer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


@contextmanager
def scratch_database(admin_dsn: str, name: str) -> Iterator[str]:
    """A fresh database for one test; dropped (with its slots) afterwards."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(admin_dsn)
    params["dbname"] = name
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                for _ in range(50):
                    try:
                        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                        break
                    except psycopg.errors.ObjectInUse:
                        time.sleep(0.2)
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def mariadb_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    """``query`` (names quoted as PostgreSQL quotes them) on the MariaDB database of ``url``, through PyMySQL, its
    plain client, in autocommit."""
    import pymysql
    import sqlalchemy as sa

    parsed = sa.engine.make_url(url)
    connection = pymysql.connect(
        host=parsed.host,
        port=parsed.port or 3306,
        user=parsed.username,
        password=parsed.password or "",
        database=parsed.database,
        charset="utf8mb4",
        autocommit=True,
    )
    with connection, connection.cursor() as cursor:
        cursor.execute(query.replace('"', "`"))
        return [tuple(row) for row in cursor.fetchall()]


@contextlib.contextmanager
def scratch_mariadb(server_url: str, name: str) -> Iterator[str]:
    """A MariaDB database of its own on the server at ``server_url`` (dropped afterwards); its URL."""
    import sqlalchemy as sa

    engine = sa.create_engine(server_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        yield f"{server_url.rstrip('/')}/{name}"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        engine.dispose()


@contextmanager
def capture_role(db_dsn: str, name: str, password: str, *, member_of: str | None = None) -> Iterator[str]:
    """A LOGIN REPLICATION role with ``password`` that may create tables and publications in ``db_dsn``'s
    database (CREATE on it and on its public schema); yields the role's DSN. What it owns is dropped after; the
    role itself goes with :func:`drop_role` once the database is gone (its database privilege holds it till then).
    """
    create = sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD {}").format(sql.Identifier(name), sql.Literal(password))
    if member_of is not None:
        create = sql.SQL("{} IN ROLE {}").format(create, sql.Identifier(member_of))
    dbname = str(conninfo_to_dict(db_dsn)["dbname"])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(create)
        conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(dbname), sql.Identifier(name)))
        conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(db_dsn, user=name, password=password)
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))


def drop_role(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@dataclass
class CdcConfig:
    dsn: str
    kafka: str
    registry: str
    prefix: str
    tables: list[str]
    slot: str
    publication: str
    extra: str = ""  # more keys of [capture]
    heartbeat_interval_s: float = 1.0
    source_extra: str = ""  # more keys of [source]
    kafka_extra: str = ""  # more keys of [kafka] (security…)
    registry_extra: str = ""  # more keys of [registry]

    def write(self, path: Path) -> Path:
        # A JSON string is a valid TOML basic string, but only without \uD83D-style surrogate escapes (TOML
        # refuses them): emoji and other non-BMP characters in table names are written as they are.
        tables = ", ".join(json.dumps(t, ensure_ascii=False) for t in self.tables)
        path.write_text(
            f"""
[source]
dsn = "{self.dsn}"
tables = [{tables}]
slot = "{self.slot}"
publication = "{self.publication}"
{self.source_extra}

[kafka]
bootstrap_servers = "{self.kafka}"
topic_prefix = "{self.prefix}"
{self.kafka_extra}

[registry]
url = "{self.registry}"
{self.registry_extra}

[metrics]
port = 0  # any free port: several captures run at once in the tests

[capture]
heartbeat_interval_s = {self.heartbeat_interval_s}
{self.extra}
"""
        )
        return path

    def start(self, workdir: Path) -> CdcProcess:
        """Write the configuration into ``workdir`` and start `cdc run` on it (log: workdir/cdc.log)."""
        proc = CdcProcess(self.write(workdir / "cdc.toml"), workdir / "cdc.log")
        proc.start()
        return proc


class LogView:
    """What a running `cdc` has written to ``log``: child processes and the in-process sinks alike."""

    log: Path

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


class ChildProcess(LogView):
    """A `cdc …` command as a child process, as an operator would run it; output appended to ``log``."""

    def __init__(self, args: list[str], log: Path, launcher: list[str] | None = None) -> None:
        self.args = args
        self.log = log
        # What runs ``cdc``'s arguments: the CLI itself, or e.g. spark-submit and the Spark application file.
        self.launcher = launcher or [sys.executable, "-m", "pgcdc"]
        self.env: dict[str, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._run_starts_at = 0  # where this run's output begins in ``log`` (earlier runs' output comes before)

    def start(self) -> None:
        self._run_starts_at = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child, closed by it
        self.proc = subprocess.Popen(
            [*self.launcher, *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,  # a kill takes the child's own children with it (spark-submit's Python)
        )
        out.close()

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def this_run(self) -> str:
        """What the process started last has written (a restart's output, not its predecessors')."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as f:
            f.seek(self._run_starts_at)
            return f.read().decode(errors="replace")


class CdcProcess(ChildProcess):
    """`cdc run` on a configuration file."""

    def __init__(self, config: Path, log: Path, *, new_slot: bool = False) -> None:
        extra = ["--new-slot"] if new_slot else []
        super().__init__(["--log-level", "info", "run", "--config", str(config), *extra], log)
        self.config = config

    def wait_streaming(self, timeout: float = 120) -> None:
        """Until the snapshot (if any) is done and changes are being streamed, said by this run's log (a busy
        debug log can push the line out of any fixed tail before a poll sees it)."""
        wait_for(lambda: "streaming from slot" in self.this_run(), timeout, "streaming to start", self)

    def stop(self) -> None:
        """SIGTERM if still running; a clean shutdown must exit 0."""
        if self.alive():
            assert self.terminate() == 0, self.tail()


@dataclass
class Event:
    key: dict[str, Any] | None
    value: dict[str, Any] | None
    partition: int
    offset: int


def records_to_end(
    bootstrap: str, topic: str, *, committed: bool = True, partitions: int | None = None, timeout: float = 60
) -> list[Message]:
    """Every record ``topic`` holds now, up to each partition's end (its last stable offset when
    ``committed``): the read ends when the broker says it has reached the end, never after an idle wait. A
    topic that does not exist (yet) holds nothing; ``partitions``: read these (0..N-1) without asking."""
    if partitions is None:
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=30)
        if topic not in md.topics or md.topics[topic].error is not None:
            return []
        numbers = sorted(md.topics[topic].partitions)
    else:
        numbers = list(range(partitions))
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed" if committed else "read_uncommitted",
            "enable.partition.eof": True,
        }
    )
    found: list[Message] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in numbers])
        pending = set(numbers)
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, f"timed out reading {topic} to its end"
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    continue
                raise AssertionError(err)
            found.append(msg)
    finally:
        consumer.close()
    return found


def read_topic(bootstrap: str, registry: str, topic: str, timeout: float = 60) -> list[Event]:
    """Everything committed in ``topic`` (read_committed), decoded with confluent-kafka's AvroDeserializer."""
    client = SchemaRegistryClient({"url": registry, "timeout": 30})
    # The default strategy asks the registry for "associations" on every record (Apicurio answers 404):
    # the topic strategy is what the capture registers under, and one request per schema is enough.
    conf = {"subject.name.strategy.type": "TOPIC"}
    key_de, value_de = AvroDeserializer(client, conf=conf), AvroDeserializer(client, conf=conf)
    ctx_k = SerializationContext(topic, MessageField.KEY)
    ctx_v = SerializationContext(topic, MessageField.VALUE)
    events: list[Event] = []
    for msg in records_to_end(bootstrap, topic, timeout=timeout):
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None
        assert offset is not None
        events.append(Event(key_de(msg.key(), ctx_k), value_de(msg.value(), ctx_v), partition, offset))
    return events


def committed_records(
    kafka: str, topic: str, partitions: int, *, in_order: bool = False
) -> list[tuple[int, bytes | None, bytes | None]]:
    """The committed records of ``topic``: sorted, or ``in_order`` (by partition, each in offset order)."""
    found: list[tuple[int, bytes | None, bytes | None]] = []
    for msg in records_to_end(kafka, topic, partitions=partitions):
        partition = msg.partition()
        assert partition is not None
        found.append((partition, msg.key(), msg.value()))
    return sorted(found, key=lambda r: r[0]) if in_order else sorted(found)


def latest_by_key(events: list[Event], key_field: str) -> dict[Any, dict[str, Any]]:
    """Replay events the way a compacting consumer would: the last event per key wins; deletes remove."""
    state: dict[Any, dict[str, Any]] = {}
    for ev in sorted(events, key=lambda e: (e.partition, e.offset)):
        if ev.key is None or ev.key.get(key_field) is None:
            if ev.value is not None and ev.value["op"] == "t":
                state.clear()
            continue
        k = ev.key[key_field]
        if ev.value is None or ev.value["op"] == "d":
            state.pop(k, None)
        else:
            state[k] = ev.value["after"]
    return state


class Watched(Protocol):
    """What :func:`wait_for` watches while it waits: a child process, or the sinks run in the test process."""

    def alive(self) -> bool: ...
    def tail(self, n: int = 60) -> str: ...


def wait_for(predicate: Any, timeout: float, what: str, proc: Watched | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and not proc.alive():
            raise AssertionError(f"cdc exited while waiting for {what}:\n{proc.tail()}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{proc.tail()}" if proc else ""))


def source_items(dsn: str) -> dict[int, tuple[str, int]]:
    """The ``items`` test table (id, name, qty) as PostgreSQL holds it now."""
    with psycopg.connect(dsn) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items").fetchall()}


def latest_value_fields(registry: str, topic: str) -> list[dict[str, Any]]:
    """The row fields (``Value`` record) of the topic's latest registered value schema (confluent-kafka's client)."""
    client = SchemaRegistryClient({"url": registry, "timeout": 30})
    envelope = json.loads(str(client.get_latest_version(f"{topic}-value").schema.schema_str))
    before = next(f for f in envelope["fields"] if f["name"] == "before")
    record = next(b for b in before["type"] if isinstance(b, dict))
    return list(record["fields"])


def topic_items(kafka: str, registry: str, topic: str) -> dict[int, tuple[str, int]]:
    """The ``items`` table as a consumer replaying its topic sees it."""
    return {k: (v["name"], v["qty"]) for k, v in latest_by_key(read_topic(kafka, registry, topic), "id").items()}


def stop_workload_and_converge(
    done: threading.Event,
    writer: threading.Thread,
    *,
    dsn: str,
    kafka: str,
    registry: str,
    topic: str,
    proc: CdcProcess,
) -> None:
    """Let the workload run a little longer, stop it, then wait until the topic equals the table."""
    time.sleep(2)
    done.set()
    writer.join(30)
    expected = source_items(dsn)
    wait_for(lambda: topic_items(kafka, registry, topic) == expected, 180, "convergence", proc)


def set_compatibility(registry: str, subject: str, level: str) -> None:
    """A registry subject's compatibility level (BACKWARD is Confluent's default; Apicurio's is none)."""
    request = urllib.request.Request(  # noqa: S310
        f"{registry}/config/{subject}",
        data=json.dumps({"compatibility": level}).encode(),
        method="PUT",
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
    )
    urllib.request.urlopen(request).close()  # noqa: S310
