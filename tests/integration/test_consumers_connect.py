"""Kafka Connect reads pgcdc's change topics: Debezium's JDBC sink keeps a second PostgreSQL database equal.

Nothing here is ours but the topic: a standalone Connect worker (``connect-runtime`` matching the broker), the
Debezium JDBC sink connector, and an Avro converter reading the registry, Apicurio's or Confluent's (the
``connect-jars`` local service, from Maven Central). The workload covers inserts, updates, a key change,
deletes, a column added while running and a truncate; docs/consumers.md gives the settings this test runs.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcdc_dev.discovery import find_or_skip
from psycopg.conninfo import conninfo_to_dict

from tests.integration._capture_helpers import scratch_database, wait_for
from tests.integration._consumers import Orders, java

pytestmark = pytest.mark.timeout(900)

CONVERTERS = {
    # The registry's native v2 API (Apicurio's converter has no client for the Confluent-compatible one), with
    # the Confluent wire format pgcdc writes: a 4-byte schema id that is the registry's content id, no headers.
    "apicurio": """\
{side}.converter=io.apicurio.registry.utils.converter.AvroConverter
{side}.converter.apicurio.registry.url={registry_v2}
{side}.converter.apicurio.registry.id-handler=io.apicurio.registry.serde.Legacy4ByteIdHandler
{side}.converter.apicurio.registry.use-id=contentId
{side}.converter.apicurio.registry.headers.enabled=false
""",
    # The Confluent-compatible API, as against Confluent's own registry.
    "confluent": """\
{side}.converter=io.confluent.connect.avro.AvroConverter
{side}.converter.schema.registry.url={registry}
""",
}


@dataclass(frozen=True)
class Setup(Orders):
    target: str  # the second database the sink writes
    home: Path  # the worker's runtime/ and plugins/
    converter: str  # a key of CONVERTERS


@pytest.fixture(params=sorted(CONVERTERS))
def setup(
    request: pytest.FixtureRequest, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str
) -> Iterator[Setup]:
    home = Path(find_or_skip("connect-jars"))
    with scratch_database(pg_dsn, f"cdc_{unique}") as source, scratch_database(pg_dsn, f"tgt_{unique}") as target:
        yield Setup(source, kafka_bootstrap, registry_url, unique, target, home, request.param)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connector_properties(setup: Setup) -> str:
    target = conninfo_to_dict(setup.target)
    registry_v2 = setup.registry.replace("/apis/ccompat/v7", "/apis/registry/v2")
    converter = CONVERTERS[setup.converter]
    converters = "".join(
        converter.format(side=side, registry=setup.registry, registry_v2=registry_v2) for side in ("key", "value")
    )
    return f"""\
name=pgcdc-orders-{setup.unique}
connector.class=io.debezium.connector.jdbc.JdbcSinkConnector
tasks.max=1
topics={setup.topic}
connection.url=jdbc:postgresql://{target.get("host", "127.0.0.1")}:{target.get("port", 5432)}/{target["dbname"]}
connection.username={target["user"]}
connection.password={target.get("password", "")}
insert.mode=upsert
delete.enabled=true
truncate.enabled=true
primary.key.mode=record_key
schema.evolution=basic
collection.name.format=${{source.table}}
consumer.override.isolation.level=read_committed
# numeric(p,s) is a union of a decimal and a string (for NaN), which reaches Connect as a struct that this sink
# cannot store: such columns are left out (docs/consumers.md).
field.exclude.list={setup.topic}:amount
{converters}"""


class ConnectWorker:
    """``connect-standalone`` as a user runs it: the worker's runtime on the classpath, plugins by plugin.path."""

    def __init__(self, setup: Setup, workdir: Path) -> None:
        self.log = workdir / "connect.log"
        worker = workdir / "worker.properties"
        worker.write_text(
            f"bootstrap.servers={setup.kafka}\n"
            "key.converter=org.apache.kafka.connect.json.JsonConverter\n"
            "value.converter=org.apache.kafka.connect.json.JsonConverter\n"
            f"offset.storage.file.filename={workdir / 'connect.offsets'}\n"
            "offset.flush.interval.ms=1000\n"
            f"plugin.path={setup.home / 'plugins'}\n"
            f"listeners=http://127.0.0.1:{_free_port()}\n"
            "consumer.auto.offset.reset=earliest\n"
            "connector.client.config.override.policy=All\n"
        )
        connector = workdir / "connector.properties"
        connector.write_text(connector_properties(setup))
        log4j = workdir / "log4j.properties"
        log4j.write_text(
            "log4j.rootLogger=INFO, stdout\n"
            "log4j.appender.stdout=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.stdout.layout.ConversionPattern=%d %p %c{1} - %m%n\n"
            "log4j.logger.org.hibernate=WARN\n"
            "log4j.logger.org.apache.kafka.clients=WARN\n"
        )
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                java(),
                "-Xmx768m",
                f"-Dlog4j.configuration=file:{log4j}",
                "-cp",
                f"{setup.home / 'runtime'}/*",
                "org.apache.kafka.connect.cli.ConnectStandalone",
                str(worker),
                str(connector),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    """The table's rows as comparable tuples; a timestamptz as µs since the epoch (what the sink stores)."""
    micros = "(extract(epoch FROM placed) * 1000000)::bigint" if table == "source" else "placed"
    try:
        with psycopg.connect(dsn) as conn:
            columns = {
                r[0]
                for r in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'orders'")
            }
            region = "region" if "region" in columns else "NULL::text"
            query = f"SELECT id, customer, qty, price::text, paid, {micros}, {region} FROM orders ORDER BY id"
            return [tuple(r) for r in conn.execute(query).fetchall()]
    except psycopg.errors.UndefinedTable:
        return []


def converged(setup: Setup, worker: ConnectWorker, what: str) -> None:
    """Wait until the target table holds exactly the source's rows."""
    expected: list[tuple[Any, ...]] = []

    def same() -> bool:
        nonlocal expected
        expected = rows(setup.source, "source")
        if worker.proc.poll() is not None:
            raise AssertionError(f"the Connect worker exited:\n{worker.tail()}")
        return rows(setup.target, "target") == expected

    try:
        wait_for(same, 240, what)
    except AssertionError:
        raise AssertionError(
            f"{what}: target {rows(setup.target, 'target')[:5]}… != source {expected[:5]}…\n{worker.tail()}"
        ) from None


def test_debeziums_jdbc_sink_keeps_a_second_database_equal_to_the_source(setup: Setup, tmp_path: Path) -> None:
    setup.create(replica_identity_full=False, amount=True)
    capture = setup.start_capture(tmp_path)
    worker: ConnectWorker | None = None
    try:
        worker = ConnectWorker(setup, tmp_path)
        converged(setup, worker, "the snapshot in the target")
        setup.change()
        converged(setup, worker, "updates, deletes, a key change and an added column in the target")
        setup.truncate_and_change()
        converged(setup, worker, "a truncate and the changes after it in the target")
    finally:
        if worker is not None:
            worker.stop()
        capture.stop()
