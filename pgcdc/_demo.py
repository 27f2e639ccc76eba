"""`cdc demo`: a small shop database with a live workload, captured into Kafka, shown as it happens.

It creates (or resets) the database ``pgcdc_demo`` on the given server, starts the capture service as a
child process (exactly as `cdc run` would run), writes orders, updates and deletes for a while, and prints
what a plain Avro consumer reads from each table's topic, then stops the capture with SIGTERM.

With ``--opensearch``, ``--redis`` and ``--spark-jars`` it runs the whole pipeline: `cdc sinks run` keeps
the search index, the cache and the warehouse as the workload goes, the live table shows them filling, and
at the end `cdc verify` compares each with PostgreSQL.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb
from rich.console import Console
from rich.live import Live
from rich.table import Table

DEMO_DB = "pgcdc_demo"
TABLES = ("public.customers", "public.orders")

_SCHEMA = """
CREATE TABLE customers (
    id bigint PRIMARY KEY,
    name text NOT NULL,
    email text,
    tier text NOT NULL DEFAULT 'standard',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE orders (
    id bigserial PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES customers(id),
    total numeric(12,2) NOT NULL,
    status text NOT NULL DEFAULT 'new',
    items jsonb NOT NULL DEFAULT '[]',
    placed_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO customers (id, name, email)
SELECT g, 'Customer ' || g, 'customer' || g || '@example.com' FROM generate_series(1, 200) g;
"""


def _reset_database(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for (slot,) in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = %s AND NOT active", (DEMO_DB,)
        ).fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DEMO_DB)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DB)))
    dsn = _demo_dsn(admin_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_SCHEMA)
    return dsn


def _demo_dsn(admin_dsn: str) -> str:
    params = conninfo_to_dict(admin_dsn)
    params["dbname"] = DEMO_DB
    return make_conninfo("", **params)


def ensure_database(admin_dsn: str) -> str:
    """The demo database and its tables, created where absent and otherwise left as they are (a capture may be
    attached to them: ``docker compose up`` runs the capture and the workload as services of their own)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DEMO_DB,)).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DB)))
    dsn = _demo_dsn(admin_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('public.orders')").fetchone() == (None,):
            conn.execute(_SCHEMA)
    return dsn


def run_workload(admin_dsn: str, seconds: float, *, console: Console | None = None) -> int:
    """The demo's workload alone, for ``seconds`` (0: until stopped), on the demo database made if absent; the
    capture runs elsewhere (`cdc run` with source.dsn naming ``pgcdc_demo``)."""
    dsn = ensure_database(admin_dsn)
    out = console or Console(stderr=True)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))  # a container's stop
    # Said once the stop is handled: from this line on, SIGTERM ends the workload with exit 0.
    out.print(f"workload on database {DEMO_DB!r}: inserts, updates and deletes of {', '.join(TABLES)}")
    rnd = random.Random(42)  # noqa: S311 - a demo workload, not cryptography
    deadline = time.monotonic() + seconds if seconds > 0 else float("inf")
    steps = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop and time.monotonic() < deadline:
            _workload_step(conn, rnd)
            steps += 1
            time.sleep(0.05)  # ~20 transactions a second: a live feed, not a load test
    out.print(f"workload stopped after {steps} transactions")
    return 0


def _workload_step(conn: psycopg.Connection[Any], rnd: random.Random) -> None:
    choice = rnd.random()
    if choice < 0.6:
        items = [{"sku": f"SKU-{rnd.randint(1, 50)}", "qty": rnd.randint(1, 3)} for _ in range(rnd.randint(1, 3))]
        conn.execute(
            "INSERT INTO orders (customer_id, total, items) VALUES (%s, %s, %s::jsonb)",
            (rnd.randint(1, 200), round(rnd.uniform(5, 500), 2), Jsonb(items)),
        )
    elif choice < 0.85:
        conn.execute(
            "UPDATE orders SET status = %s WHERE id = (SELECT id FROM orders ORDER BY random() LIMIT 1)",
            (rnd.choice(["paid", "shipped", "delivered"]),),
        )
    elif choice < 0.95:
        conn.execute(
            "UPDATE customers SET tier = %s WHERE id = %s", (rnd.choice(["gold", "standard"]), rnd.randint(1, 200))
        )
    else:
        conn.execute("DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")


def _reset_topics(kafka: str, prefix: str) -> None:
    """The demo starts from empty topics, so what it shows is this run's events only."""
    admin = AdminClient({"bootstrap.servers": kafka})
    existing = [t for t in admin.list_topics(timeout=30).topics if t.startswith(f"{prefix}.")]
    for future in admin.delete_topics(existing, operation_timeout=30).values() if existing else []:
        future.result(30)
    deadline = time.monotonic() + 30  # deletion completes in the background
    while existing and time.monotonic() < deadline:
        if not any(t.startswith(f"{prefix}.") for t in admin.list_topics(timeout=30).topics):
            break
        time.sleep(0.2)


@dataclass(frozen=True)
class DemoSinks:
    opensearch: str
    redis: str
    spark_jars: str  # comma-separated local paths


def _sinks_section(sinks: DemoSinks, workdir: Path, run_id: str) -> str:
    jars = json.dumps([j for j in sinks.spark_jars.split(",") if j])
    return f"""
[sinks]
state_dir = "{workdir / "sinks-state"}"
spark_jars = {jars}

[sinks.search]
url = "{sinks.opensearch}"
index_prefix = "demo-{run_id}"

[sinks.cache]
url = "{sinks.redis}"
namespace = "demo-{run_id}"

[sinks.warehouse]
path = "{workdir / "warehouse"}"
"""


def _store_counts(sinks: DemoSinks, workdir: Path, run_id: str) -> dict[str, tuple[int, str]]:
    """How much each store holds now, per table, as (rows, what to show): documents per index, cache entries,
    rows of the warehouse's Delta tables."""
    import redis  # noqa: PLC0415 - the sinks' client, only for the whole-pipeline demo

    out: dict[str, tuple[int, str]] = {}
    for table in TABLES:
        url = f"{sinks.opensearch}/demo-{run_id}-{table}/_count"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - the configured OpenSearch URL
                n = int(json.load(resp)["count"])
                out[f"search {table}"] = (n, f"{n} documents")
        except OSError:
            out[f"search {table}"] = (0, "-")
    try:
        client = redis.Redis.from_url(sinks.redis, socket_timeout=5)
        generation = str(int(client.get(f"demo-{run_id}:current") or 0))
        for table in TABLES:
            n = sum(1 for _ in client.scan_iter(match=f"demo-{run_id}:g{generation}:{table}:*", count=1000))
            out[f"cache {table}"] = (n, f"{n} entries")
    except redis.RedisError:
        out["cache"] = (0, "-")
    for table in TABLES:
        rows = _delta_rows(workdir / "warehouse" / "current" / table)
        out[f"warehouse {table}"] = (rows or 0, "-" if rows is None else f"{rows} rows")
    return out


def _delta_rows(path: Path) -> int | None:
    """The rows of the served copy of a warehouse table (read as a reader would, with delta-rs); None before
    its first commit."""
    from deltalake import DeltaTable  # noqa: PLC0415 - the sinks' dependency, only for the whole-pipeline demo
    from deltalake.exceptions import DeltaError  # noqa: PLC0415

    try:
        return int(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).num_rows)
    except (DeltaError, OSError):  # not there yet, or its first commit not written yet
        return None


class _FirstRows:
    """When each store first showed a change of the live workload, in seconds from its first committed change:
    the first row of ``public.orders`` in it (the table is empty until the live part begins, so every row of it
    is a live change: the snapshot's customers, maybe still arriving, cannot be taken for one)."""

    def __init__(self) -> None:
        self.first_change: float | None = None
        self.after: dict[str, float] = {}

    def changed(self) -> None:
        """A change of the workload committed."""
        if self.first_change is None:
            self.first_change = time.monotonic()

    def look(self, stores: dict[str, tuple[int, str]]) -> None:
        """The stores' counts now."""
        if self.first_change is None:
            return
        for line, (n, _) in stores.items():
            store, _, table = line.partition(" ")
            if table == _LIVE_TABLE and n > 0 and store not in self.after:
                self.after[store] = time.monotonic() - self.first_change

    def note(self, line: str) -> str:
        seconds = self.after.get(line.split(maxsplit=1)[0])
        return "" if seconds is None else f" (changes arriving {seconds:.1f}s after the first one)"

    def summary(self) -> str:
        told = [f"{store} {self.after[store]:.1f}s" for store in _STORES if store in self.after]
        missing = [store for store in _STORES if store not in self.after]
        return "the live workload's first change reached the stores after: " + ", ".join(
            told + [f"{store} never during the live part" for store in missing]
        )


_STORES = ("search", "cache", "warehouse")
_LIVE_TABLE = "public.orders"  # empty until the live part: the workload inserts its rows
_DEMO_METRICS_PORT = 9464  # the documented default, so the README's address is right


def run_demo(
    admin_dsn: str,
    kafka: str,
    registry: str,
    seconds: float,
    *,
    console: Console | None = None,
    sinks: DemoSinks | None = None,
) -> int:
    demo = _Demo(console or Console(stderr=False), kafka, registry, sinks)
    dsn = _reset_database(admin_dsn)
    _reset_topics(kafka, demo.prefix)
    config = demo.write_config(dsn)
    log = demo.workdir / "cdc.log"
    demo.console.print(f"[bold]pgcdc demo[/]: database {DEMO_DB!r}, topics {demo.prefix}.public.*, capture log {log}")
    demo.console.print(
        f"live dashboard: [bold]http://127.0.0.1:{_DEMO_METRICS_PORT}/[/] (metrics at /metrics); "
        f"or run `cdc status --config {config}` in another terminal"
    )
    proc = _start(["run", "--config", str(config)], log)
    sinks_proc = None
    if sinks:
        sinks_log = demo.workdir / "sinks.log"
        demo.console.print(f"sinks: search index, cache and warehouse kept by `cdc sinks run` (log {sinks_log})")
        sinks_proc = _start(["sinks", "run", "--config", str(config)], sinks_log)
    try:
        if sinks_proc is not None:
            demo.wait_for_sinks(proc, sinks_proc)
        if not demo.wait_streaming(proc, log) or not demo.watch(dsn, proc, seconds):
            demo.console.print(f"[red]the capture service exited ({proc.returncode}); see {log}[/]")
            if sinks_proc is not None:
                sinks_proc.send_signal(signal.SIGTERM)
                sinks_proc.wait(120)
            return 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    demo.console.print(f"capture stopped (exit {proc.returncode}). Topics stay in Kafka; read them again any time.")
    verified = sinks_proc is None or demo.verify_and_stop(config, sinks_proc)
    return 0 if proc.returncode == 0 and verified else 1


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`cdc ARGS` in a process of its own, its output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pgcdc", *args], stdout=out, stderr=subprocess.STDOUT)


class _Demo:
    """One run of the demo: its configuration, the live table of what Kafka holds, the stores' verification."""

    def __init__(self, console: Console, kafka: str, registry: str, sinks: DemoSinks | None) -> None:
        self.console, self.kafka, self.registry, self.sinks = console, kafka, registry, sinks
        self.prefix = "demo"
        self.run_id = str(int(time.time()))
        self.workdir = Path(tempfile.mkdtemp(prefix="pgcdc-demo-"))
        self.first_rows = _FirstRows()
        self.stores: dict[str, tuple[int, str]] = {}  # the stores' counts last seen

    def write_config(self, dsn: str) -> Path:
        config = self.workdir / "cdc.toml"
        config.write_text(
            f"""[source]
dsn = "{dsn}"
tables = {list(TABLES)!r}
slot = "pgcdc_demo"
publication = "pgcdc_demo"

[kafka]
bootstrap_servers = "{self.kafka}"
topic_prefix = "{self.prefix}"
transactional_id = "pgcdc-demo-{self.run_id}"
offsets_topic = "{self.prefix}.offsets.{self.run_id}"

[registry]
url = "{self.registry}"

[metrics]
port = {_DEMO_METRICS_PORT}
""".replace("'", '"')
            + (_sinks_section(self.sinks, self.workdir, self.run_id) if self.sinks else "")
        )
        return config

    def wait_for_sinks(
        self, proc: subprocess.Popen[bytes], sinks_proc: subprocess.Popen[bytes], timeout_s: float = 300
    ) -> None:
        """Until each store holds the snapshot's rows (applied before Spark is up: sinks._bridge), shown as it
        goes; the live part then shows the workload's changes arriving."""
        assert self.sinks is not None
        started = time.monotonic()
        ready: dict[str, float] = {}
        with Live(console=self.console, refresh_per_second=4, transient=True) as live:
            while any(s not in ready for s in _STORES) and time.monotonic() - started < timeout_s:
                if proc.poll() is not None or sinks_proc.poll() is not None:
                    break  # said by the caller (the capture) or by wait_caught_up (the sinks)
                self.stores = _store_counts(self.sinks, self.workdir, self.run_id)
                for line, (n, _) in self.stores.items():
                    store = line.split(maxsplit=1)[0]
                    if n > 0 and store not in ready:
                        ready[store] = time.monotonic() - started
                shown = [f"{s} {ready[s]:.1f}s" if s in ready else f"{s} …" for s in _STORES]
                waited = time.monotonic() - started
                live.update(f"the sinks' first start, {waited:.0f}s: the snapshot's rows in " + ", ".join(shown))
                time.sleep(0.5)
        told = ", ".join(f"{s} {ready[s]:.1f}s" if s in ready else f"{s} not yet" for s in _STORES)
        self.console.print(f"the sinks' first start: the snapshot's rows in the stores after {told}")

    def wait_streaming(self, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> bool:
        """Until the capture has taken its snapshot and streams from its slot, so the live part's seconds are all
        spent streaming; False when it exited first (the caller says so)."""
        started = time.monotonic()
        with self.console.status("the capture starts: its slot, the snapshot, then streaming"):
            while proc.poll() is None and time.monotonic() - started < timeout_s:
                if "streaming from slot" in log.read_text(errors="replace"):
                    self.console.print(f"the capture streams after {time.monotonic() - started:.1f}s")
                    return True
                time.sleep(0.2)
        if proc.poll() is None:
            self.console.print(f"[yellow]the capture is not streaming after {timeout_s:.0f}s; see {log}[/]")
            return True  # the live part shows what does arrive
        return False

    def watch(self, dsn: str, proc: subprocess.Popen[bytes], seconds: float) -> bool:
        """The workload for ``seconds``, with a live table of the events read back from Kafka (and the stores'
        counts); False when the capture service exited meanwhile."""
        stores = self.stores
        last_counted = 0.0
        reader = _EventCounter(self.kafka, self.registry, [f"{self.prefix}.{t}" for t in TABLES], self.console)
        rnd = random.Random(42)  # noqa: S311 - a demo workload, not cryptography
        try:
            with (
                psycopg.connect(dsn, autocommit=True) as conn,
                Live(console=self.console, refresh_per_second=4) as live,
            ):
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    if proc.poll() is not None:
                        return False
                    _workload_step(conn, rnd)
                    self.first_rows.changed()
                    reader.poll()
                    if self.sinks and time.monotonic() - last_counted > 1:
                        stores, last_counted = _store_counts(self.sinks, self.workdir, self.run_id), time.monotonic()
                        self.first_rows.look(stores)
                    shown = {line: text + self.first_rows.note(line) for line, (_, text) in stores.items()}
                    live.update(_table(reader.counts, reader.last, deadline, shown))
        finally:
            reader.close()
        if self.sinks:
            self.console.print(self.first_rows.summary())
        return True

    def verify_and_stop(self, config: Path, sinks_proc: subprocess.Popen[bytes]) -> bool:
        """Once every sink has applied what the topics hold, the sinks stopped, then `cdc verify` of each store
        against PostgreSQL; whether every store matched. Stopped first, the sinks leave both cores to the
        comparison, which then finds the stores at rest and compares each once."""
        assert self.sinks is not None
        console = self.console
        caught_up = self.wait_caught_up(config, sinks_proc)
        sinks_proc.send_signal(signal.SIGTERM)
        sinks_proc.wait(120)
        console.print(f"sinks stopped (exit {sinks_proc.returncode}); the warehouse is in {self.workdir / 'warehouse'}")
        console.print("`cdc verify` compares each store with PostgreSQL")
        # The three stores in one command: one Spark application compares them all (a sink that had not caught
        # up, said above, shows as drift: what it lacks).
        result = subprocess.run(
            [sys.executable, "-m", "pgcdc", "verify", *_STORES, "--config", str(config)],
            capture_output=True,
            text=True,
            check=False,
        )
        console.print(result.stdout.rstrip() or result.stderr.rstrip())
        for key, (_, value) in _store_counts(self.sinks, self.workdir, self.run_id).items():
            console.print(f"  {key}: {value}")
        return result.returncode == 0 and caught_up

    def wait_caught_up(self, config: Path, sinks_proc: subprocess.Popen[bytes], timeout_s: float = 180) -> bool:
        """Until each sink's checkpoint reaches the topics' ends (read from outside, as `cdc status` does);
        False when the time is up or the sinks exited first (said here)."""
        from sinks.config import load_sink_settings  # noqa: PLC0415 - the whole-pipeline demo only
        from sinks.progress import TopicEnds, sink_progress  # noqa: PLC0415

        settings = load_sink_settings(config)
        ends = TopicEnds(settings)
        started = time.monotonic()
        try:
            with self.console.status("the workload stopped; the sinks apply what is left") as status:
                while sinks_proc.poll() is None and time.monotonic() - started < timeout_s:
                    lags = {p.name: p.lag_records for p in sink_progress(settings, ends.read())}
                    if set(_STORES) <= set(lags) and all(lags[s] == 0 for s in _STORES):
                        self.console.print(f"every sink caught up {time.monotonic() - started:.1f}s after the workload")
                        return True
                    status.update("the workload stopped; the sinks apply what is left: " + _behind(lags))
                    time.sleep(0.5)
        finally:
            ends.close()
        why = f"exited ({sinks_proc.returncode})" if sinks_proc.poll() is not None else f"not after {timeout_s:.0f}s"
        self.console.print(f"[yellow]the sinks did not catch up: {why}; see {self.workdir / 'sinks.log'}[/]")
        return False


def _behind(lags: dict[str, int | None]) -> str:
    return ", ".join(f"{s} {'?' if lags.get(s) is None else lags[s]} record(s) behind" for s in _STORES)


class _EventCounter:
    """The demo topics' events read back from Kafka (read_committed), counted per operation."""

    def __init__(self, kafka: str, registry: str, topics: list[str], console: Console) -> None:
        client = SchemaRegistryClient({"url": registry, "timeout": 30})
        self._value_de = AvroDeserializer(client, conf={"subject.name.strategy.type": "TOPIC"})
        self._console = console
        self._topics = topics
        self._consumer = Consumer(
            {
                "bootstrap.servers": kafka,
                "group.id": f"pgcdc-demo-{time.time_ns()}",
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                # It subscribes before the capture has created the topics; librdkafka looks for them again only
                # at each metadata refresh (every 5 minutes by default), so a topic made later would stay unread.
                "topic.metadata.refresh.interval.ms": 1000,
            }
        )
        self._subscribed = False
        self.counts: dict[str, dict[str, int]] = {t: {} for t in topics}
        self.last: dict[str, str] = {}

    def poll(self) -> None:
        """Everything that has arrived, counted."""
        if not self._subscribed:
            self._consumer.subscribe(self._topics)
            self._subscribed = True
        msg = self._consumer.poll(0.05)
        while msg is not None:
            err = msg.error()
            topic = msg.topic() or ""
            if err is None:
                value = self._value_de(msg.value(), SerializationContext(topic, MessageField.VALUE))
                op = value["op"] if value else "tombstone"
                self.counts[topic][op] = self.counts[topic].get(op, 0) + 1
                if value and value.get("after"):
                    self.last[topic] = ", ".join(f"{k}={v}" for k, v in list(value["after"].items())[:4])
            elif err.code() not in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                # An unknown topic is expected until the capture has created it.
                self._console.print(f"[yellow]{err}[/]")
            msg = self._consumer.poll(0)

    def close(self) -> None:
        self._consumer.close()


def _table(counts: dict[str, dict[str, int]], last: dict[str, str], deadline: float, stores: dict[str, str]) -> Table:
    table = Table(
        title=f"events read back from Kafka (read_committed) — {max(0, deadline - time.monotonic()):.0f}s left"
    )
    for col in ("topic", "r", "c", "u", "d", "tombstone", "latest row"):
        table.add_column(col)
    for topic, ops in counts.items():
        table.add_row(topic, *(str(ops.get(op, 0)) for op in ("r", "c", "u", "d", "tombstone")), last.get(topic, ""))
    for store, what in stores.items():
        table.add_row(f"[bold]{store}[/]", "", "", "", "", "", what)
    return table
