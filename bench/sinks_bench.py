#!/usr/bin/env python3
"""Sinks against the limits of the parts underneath them, measured on the same topic in the same run.

    ./dev python -m bench.sinks_bench [--rows 1000000] [--heavy-seconds 120] [--no-live] [--cluster]

1. Workload: a table of ``--rows`` rows (numeric, timestamptz, jsonb, and a 2.2 kB text stored out of line
   in one row of 20) is snapshotted into Kafka by `cdc run`, which then streams ~22 % of the rows updated
   (the out-of-line text unchanged: partial rows with ``unchanged_toast``) and ~6 % deleted, in transactions
   of 3,000 rows. The topic's records are the unit of every rate below (tombstones included).
2. References (`bench/_sink_refs.py`): Kafka read + Avro decode on one Python thread (confluent-kafka +
   fastavro, no Spark); each store's native load of the same changes (Redis pipelined, OpenSearch bulk with
   refresh off, a plain Spark Delta append); a COPY of the source and a plain scan of each store.
3. Replay: each sink alone, in this process, with the shipped defaults, from offset zero into a fresh
   generation; events/s against the slower of (read + decode, its store's native load): target ≥ 0.5x. The
   CPU of the Spark driver (this Python process and the JVM's threads other than executor tasks) per event
   against the sink's whole CPU per event (plus the executors' task threads and Python workers): target < 10 %.
4. Rebuild: `cdc sinks rebuild NAME`, what an operator runs, for each sink, every phase timed; target: start to
   swap ≤ its replay time + 1.5 x (COPY of the source + a plain scan of the new store) + start-up.
5. Live (`--no-live` skips): `cdc run` and `cdc sinks run` serve the rebuilt generations as in production.
   Light load: ``--rate`` (200) single-row transactions/s; freshness = when each store's plain client first
   finds the row (bench/_outside.py: redis-py, OpenSearch's real-time GET, delta-rs) - its commit time, beside
   the sinks' own ``applied_ms``: search and cache p50 < 0.3 s and p99 < 0.8 s, the warehouse p99 < 10 s.
   Keeping up: 2,000 changes/s in 20-row
   transactions for ``--heavy-seconds``; freshness as `cdc status` measures it from outside (the age of each
   sink's oldest unapplied change, sampled every second): p99 < 1.5 s for search and cache, < 15 s for the
   warehouse. Bounded: 5,000 changes/s for ``--sustained-seconds``; each sink's mean lag over the load's last
   third against its middle third (half a second added to both): < 1.5x, no upward trend. Restart: `cdc sinks
   run` is SIGKILLed under load and started again; from its launch to each sink's first applied batch: target
   ≤ 5 s for search and cache, ≤ 15 s for the warehouse.
First start (`--first-start`, scenario ``sinks-first-start``, instead of steps 2-5): `cdc run` snapshotting the
table and `cdc sinks run` on a fresh state directory without the JVM's class archive, launched together; from
then, each sink's first rows applied (target ≤ 20 s), against a restart of the same app in the same run.
Cluster (`--cluster`, scenario ``sinks-cluster``, instead of steps 3-5): each sink is rebuilt by `cdc sinks
rebuild NAME` on local[*], then under spark-submit on the local standalone cluster (a master and two one-core
workers) with checkpoints and warehouse in the local S3-compatible server; every phase timed, the local run as
the reference (no target: the two workers share this machine's two cores with everything else).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psycopg
import redis
from confluent_kafka import Consumer, TopicPartition
from opensearchpy import OpenSearch
from pgcdc_dev import discovery
from pgcdc_dev.bench.cpu import MachineCpu, own_cpu, stat, tree_cpu
from pgcdc_dev.bench.cpu import tree as _tree
from pgcdc_dev.bench.report import Measure, Result, percentile, write_result
from pgcdc_dev.bench.warm_broker import delete_topics
from pgcdc_dev.cluster import (  # spark-submit as the cluster tests run it
    ObjectStore,
    ObjectStoreBucket,
    pgcdc_pex,
    submit_command,
    submit_env,
)
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from bench import _debezium as dbz
from bench import _sink_refs as refs
from bench._capture_bench import drop_slot_when_free, dsn_for
from bench._connect import Replay, jdbc_sink_replay
from bench._outside import POLL_S, OutsideWatch
from sinks import BaseSink, Batch
from sinks.app import SinkQuery, spark_session, sqlalchemy_url
from sinks.config import load_sink_settings
from sinks.progress import TopicEnds, checkpoint_offsets, reached, sink_progress

SCENARIO = "sinks"
CLUSTER_SCENARIO = "sinks-cluster"
LIVE_SCENARIO = "sinks-live"  # --only-live: the live steps alone
FIRST_START_SCENARIO = "sinks-first-start"  # --first-start: a first start beside a snapshot, and a restart
SINKS = ("search", "cache", "warehouse")
REPLAY_SINKS = (*SINKS, "sql")  # the sql sink (into a second database on the same server) is measured in replay
TABLE = "events"
LIGHT_P99_S = {"search": 0.8, "cache": 0.8, "warehouse": 10.0}
LIGHT_P50_S = {"search": 0.3, "cache": 0.3}
RESTART_LIMIT_S = {"search": 5.0, "cache": 5.0, "warehouse": 15.0}
FIRST_START_LIMIT_S = 20.0  # a first start beside a snapshot: the demo's bound for a cold machine
HEAVY_LIMIT_S = {"search": 1.5, "cache": 1.5, "warehouse": 15.0}
HEAVY_RATE = 2000  # changes/s
SUSTAINED_RATE = 5000  # changes/s: the lag must stay bounded, not within a bound
GROWTH_LIMIT = 1.5  # the last third's mean lag against the middle third's: linear growth from zero gives 1.67
GROWTH_FLOOR_S = 0.5  # added to both means: a lag moving within half a second is no trend
HEAVY_TXN_ROWS = 20
HEADROOM_CORES = 0.3  # the sinks' processes together at light load: room left for a slower day
_METRICS_LINE = re.compile(r"sinks metrics on (http://\S+/metrics)")
# Changes applied while Spark starts (sinks._bridge); the groups line up with _BATCH_LINE's.
_BRIDGE_LINE = re.compile(r"sink (\w+): ()applied (\d+) record\(s\) before its query started, the first")
_BATCH_LINE = re.compile(r"sink (\w+): batch (\d+): (\d+) record\(s\) in ([\d.]+)s")


class _Reference(BaseSink):
    """Materialises what every sink starts from (the decoded, last-per-key frame), and nothing more."""

    name = "reference"

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            table.frame.count()


@dataclass
class Env:
    """The run's services, scratch names and files."""

    admin: str
    kafka: str
    registry: str
    opensearch: str
    redis_url: str
    jars: list[str]
    prefix: str
    work: Path

    @property
    def topic(self) -> str:
        return f"{self.prefix}.public.{TABLE}"

    @property
    def dsn(self) -> str:
        return dsn_for(self.admin, self.prefix)

    @property
    def sql_dsn(self) -> str:
        """The sql sink's target: a database of its own on the source's server."""
        return dsn_for(self.admin, f"{self.prefix}_sql")

    @property
    def sql_url(self) -> str:
        return sqlalchemy_url(self.sql_dsn)

    @property
    def bucket(self) -> str:
        return self.prefix.replace("_", "-")  # S3 bucket names have no underscores

    def config(
        self,
        state: str,
        bucket: ObjectStoreBucket | None = None,
        spark_conf: dict[str, str] | None = None,
        *,
        sql_sink: bool = True,
    ) -> Path:
        """The run's cdc.toml; state and warehouse in ``work`` or, with ``bucket``, in an object store, where
        the search and cache sinks get names of their own (``-cl`` and ``:cl``) beside the local ones.
        ``sql_sink=False`` leaves out the sql sink's section (a revision older than that sink refuses it)."""
        path = self.work / f"cdc-{state}.toml"
        state_dir, warehouse, storage = str(self.work / state), str(self.work / f"warehouse-{state}"), ""
        search, cache = "", ""
        if spark_conf:
            pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in spark_conf.items())
            storage = f"spark_conf = {{ {pairs} }}\n"
        if bucket is not None:
            state_dir, warehouse, storage = bucket.uri(state), bucket.uri(f"warehouse-{state}"), bucket.toml()
            search, cache = f'index_prefix = "{self.prefix}-cl"', f'namespace = "{self.prefix}:cl"'
        sql = f'\n[sinks.sql]\nurl = "{self.sql_url}"\n' if sql_sink else ""
        path.write_text(
            f"""[source]
dsn = "{self.dsn}"
tables = ["public.{TABLE}"]
slot = "{self.prefix}"
publication = "{self.prefix}"

[kafka]
bootstrap_servers = "{self.kafka}"
topic_prefix = "{self.prefix}"

[registry]
url = "{self.registry}"

[metrics]
port = 0

[sinks]
state_dir = "{state_dir}"
spark_jars = {json.dumps(self.jars)}
{storage}
[sinks.search]
url = "{self.opensearch}"
{search}

[sinks.cache]
url = "{self.redis_url}"
{cache}

[sinks.warehouse]
path = "{warehouse}"
{sql}"""
        )
        return path


def run_cdc(args: list[str], log: IO[bytes], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # A session of its own: a SIGKILL of the group takes its Spark JVM at the same instant, like a container's.
    return subprocess.Popen(
        [sys.executable, "-m", "pgcdc", *args],
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- 1. workload --------------------------------------------------------------------------------------------


def create_source(env: Env, rows: int) -> None:
    with psycopg.connect(env.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(env.prefix)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(f"{env.prefix}_sql")))
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        table = sql.Identifier(TABLE)
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigint PRIMARY KEY, name text, qty int, price numeric(12,2), "
                "at timestamptz DEFAULT now(), payload jsonb, doc text)"
            ).format(table)
        )
        # EXTERNAL: stored out of line uncompressed, so an update that leaves it alone sends it as unchanged TOAST
        conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN doc SET STORAGE EXTERNAL").format(table))
        conn.execute(
            sql.SQL(
                "INSERT INTO {} SELECT g, 'name ' || g, g %% 1000, g / 100.0, now(), "
                "jsonb_build_object('g', g, 'tags', jsonb_build_array('a', 'b')), "
                "CASE WHEN g %% 20 = 1 THEN repeat(md5(g::text), 70) END FROM generate_series(1, %s) g"
            ).format(table),
            (rows,),
        )


def _changes(env: Env, rows: int) -> int:
    """Updates (id % 10 in 1..3, the out-of-line text untouched) and deletes (id % 100 in 40..47), 3,000-row
    transactions; returns the WAL position after the last commit."""
    table = sql.Identifier(TABLE)
    update = sql.SQL(
        "UPDATE {} SET qty = qty + 1, name = name || '+' WHERE id BETWEEN %s AND %s AND id %% 10 IN (1, 2, 3)"
    )
    delete = sql.SQL("DELETE FROM {} WHERE id BETWEEN %s AND %s AND id %% 100 BETWEEN 40 AND 47")
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        for stmt, span in ((update, 10_000), (delete, 37_500)):
            for low in range(1, rows + 1, span):
                conn.execute(stmt.format(table), (low, low + span - 1))
        lsn = conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
    assert lsn is not None
    return int(lsn[0])


def capture_changes(env: Env, rows: int, config: Path, log: IO[bytes]) -> None:
    """Snapshot, stream the changes, and stop once the slot has confirmed the last of them."""
    capture = run_cdc(["run", "--config", str(config)], log)
    try:
        with psycopg.connect(env.admin, autocommit=True) as conn, _topic_end(env) as end_of_topic:
            wait_until(lambda: end_of_topic() >= rows, capture, "the snapshot")
            end = _changes(env, rows)
            query = "SELECT confirmed_flush_lsn - '0/0' >= %s FROM pg_replication_slots WHERE slot_name = %s"
            wait_until(
                lambda: bool((conn.execute(query, (end, env.prefix)).fetchone() or [False])[0]), capture, "changes"
            )
    finally:
        stop_process(capture, 120)


@contextlib.contextmanager
def _topic_end(env: Env) -> Iterator[Callable[[], int]]:
    """The change topic's end offset, asked through one consumer (0 until the topic exists)."""
    consumer = Consumer({"bootstrap.servers": env.kafka, "group.id": f"{env.prefix}-probe"})

    def end() -> int:
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(env.topic, 0), timeout=5)[1])
        except Exception:
            return 0

    try:
        yield end
    finally:
        consumer.close()


def wait_until(done: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise RuntimeError(f"cdc exited with {proc.returncode} during {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not done within {timeout:.0f} s")
        time.sleep(1)


# -- 3. replays ---------------------------------------------------------------------------------------------


class _SparkCpu(threading.Thread):
    """CPU of this Spark application (local mode: this process and its JVM child) while it runs, by role.

    - driver: this Python process (foreachBatch, planning) and the JVM's own threads (scheduler, listeners,
      the streaming query's thread, RPC);
    - executors: the JVM's task threads ("Executor task launch worker ...") and the Python workers under it;
    - runtime: the JVM's JIT compiler and GC threads, which serve both and cannot be split in local mode.

    Threads are sampled every 0.25 s, so a task thread that ends keeps the CPU it was last seen with.
    """

    def __init__(self) -> None:
        super().__init__(name="spark-cpu", daemon=True)
        self.jvm = _jvm_pid()
        self.halt = threading.Event()
        self.first: dict[str, tuple[str, float]] = {}
        self.last: dict[str, tuple[str, float]] = {}
        self.start_self = self._self()
        self.start_workers = self._workers()
        self.own = 0.0  # this sampler's own CPU, not the driver's
        self._sample(initial=True)

    def _self(self) -> float:
        found = stat(Path(f"/proc/{os.getpid()}/stat"))
        return own_cpu(found[1]) if found else 0.0

    def _workers(self) -> float:
        if self.jvm is None:
            return 0.0
        found = stat(Path(f"/proc/{self.jvm}/stat"))
        return tree_cpu(self.jvm) - (own_cpu(found[1]) if found else 0.0)

    def _sample(self, *, initial: bool = False) -> None:
        for task in Path(f"/proc/{self.jvm}/task").glob("*") if self.jvm else ():
            thread = stat(task / "stat")
            if thread is not None:
                cpu = own_cpu(thread[1])
                self.first.setdefault(task.name, (thread[0], cpu if initial else 0.0))  # born since: from 0
                self.last[task.name] = (thread[0], cpu)

    def run(self) -> None:
        while not self.halt.wait(0.25):
            self._sample()
        self.own = time.thread_time()

    def stop(self) -> dict[str, float]:
        self.halt.set()
        self.join(5)
        self._sample()
        driver = self._self() - self.start_self - self.own
        out = {"driver": driver, "executors": self._workers() - self.start_workers}
        out["runtime"] = 0.0
        for tid, (comm, cpu) in self.last.items():
            spent = cpu - self.first[tid][1]
            role = "executors" if comm.startswith("Executor task") else "driver"
            if comm.startswith(("C1 Compiler", "C2 Compiler", "GC Thread", "G1 ", "VM Thread")):
                role = "runtime"
            out[role] += spent
        return out


def _machine_cpu(sinks_pid: int) -> MachineCpu:
    """The machine's CPU by process kind (:func:`_kind`) from now, sampled until its ``stop``."""
    sampler = MachineCpu(lambda pid, comm: _kind(pid, comm, sinks=set(_tree(sinks_pid)), sinks_pid=sinks_pid))
    sampler.start()
    return sampler


_JAVA_KINDS = {
    "kafka.Kafka": "Kafka",
    "OpenSearch": "OpenSearch",
    "quarkus-run.jar": "registry",
    "deploy.master": "Spark cluster",
    "deploy.worker": "Spark cluster",
    "s3proxy": "S3 store",
}


def _kind(pid: int, comm: str, *, sinks: set[int], sinks_pid: int) -> str:
    """What a process is, for :func:`_machine_cpu`: the sinks app's parts (its Python, its JVM, Spark's Python
    workers), the stores, Kafka, PostgreSQL, the capture, this benchmark."""
    if pid in sinks:
        return "sinks: driver" if pid == sinks_pid else "sinks: JVM" if comm == "java" else "sinks: Python workers"
    if pid == os.getpid():
        return "this benchmark"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = ""
    if comm == "java":
        return next((kind for mark, kind in _JAVA_KINDS.items() if mark in cmdline), "other JVM")
    if comm.startswith(("postgres", "postmaster")):
        return "PostgreSQL"
    if comm.startswith("redis"):
        return "Redis"
    if " run --config" in cmdline:
        return "capture"
    return "other"


def _jvm_pid() -> int | None:
    try:
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].endswith(b"java"):
                return int(child)
    return None


def _replay(name: str, settings: Any, spark: Any, records: int) -> tuple[float, dict[str, float]]:
    """Seconds for one sink (or the reference) to replay the topic from zero, and the CPU it took."""
    sink = _Reference() if name in ("warm-up", "reference") else None
    query = SinkQuery(name, settings, spark, 1000, role="fixed", sink=sink)
    ends = TopicEnds(settings)
    try:
        marks = ends.read()  # the topic does not move during the replays
    finally:
        ends.close()
    cpu = _SparkCpu()
    cpu.start()
    started = time.monotonic()
    query.start()
    while True:
        if query.query is not None and not query.query.isActive:
            raise RuntimeError(f"{name} failed: {query.query.exception()}")
        # Spark's own answer (lastProgress) is dozens of py4j round trips, ~80 ms of the JVM's CPU: asked only
        # once the checkpoint has reached the topic's end, so the driver's CPU below is the sink's own.
        if reached(checkpoint_offsets(query.checkpoint) or {}, marks) and query.caught_up():
            break
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    spent = cpu.stop()
    query.stop()
    print(f"{name}: {records / elapsed:,.0f} events/s ({elapsed:.1f} s); CPU s {spent}", file=sys.stderr)
    return elapsed, spent


def _replays(env: Env, changes: refs.Changes, result: Result) -> dict[str, float]:
    settings = load_sink_settings(env.config("state-replay"))
    spark = spark_session(settings, "pgcdc-sinks-bench")
    limits: dict[str, tuple[float, str]] = {}
    try:
        _replay("warm-up", settings, spark, changes.records)  # class loading and JIT, not counted
        ref_s, _ = _replay("reference", settings, spark, changes.records)
        native = _natives(env, spark, changes, result)
        for name in REPLAY_SINKS:
            limits[name] = min((changes.rate, "read + decode"), (native[name], f"{name} native"))
        seconds: dict[str, float] = {}
        for name in REPLAY_SINKS:
            elapsed, cpu = _replay(name, settings, spark, changes.records)
            seconds[name] = elapsed
            limit, limit_name = limits[name]
            total = sum(cpu.values())
            result.measures += [
                Measure(
                    f"{name} replay events/s",
                    "events/s",
                    round(changes.records / elapsed),
                    reference=round(limit),
                    reference_name=limit_name,
                    target_ratio=0.5,
                    note=f"one sink alone from offset zero, shipped defaults; Spark decode-only query: "
                    f"{changes.records / ref_s:,.0f} events/s",
                ),
                Measure(
                    f"{name} driver CPU share",
                    "%",
                    round(100 * cpu["driver"] / total, 1) if total else float("nan"),
                    higher_is_better=False,
                    limit=10,
                    note="CPU-µs per event: "
                    + ", ".join(f"{k} {v * 1e6 / changes.records:.1f}" for k, v in cpu.items())
                    + " (runtime: the JVM's JIT and GC, counted in the total only)",
                ),
            ]
    finally:
        spark.stop()
    result.measures.append(_against_connect(env, settings, changes, seconds["sql"]))
    return seconds


def _against_connect(env: Env, settings: Any, changes: refs.Changes, ours_s: float) -> Measure:
    """The SQL sink's replay beside Kafka Connect's: Debezium's JDBC sink connector reading the same topic from
    offset zero into a database of its own on the same server (bench._connect says what it does not do)."""
    target = f"{env.prefix}_connect"
    with psycopg.connect(env.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(target)))
    ends = TopicEnds(settings)
    try:
        marks = {p: high for (t, p), (_, high) in ends.read().items() if t == env.topic}
    finally:
        ends.close()
    run = jdbc_sink_replay(
        Replay(
            kafka=env.kafka,
            registry=env.registry,
            topic=env.topic,
            ends=marks,
            target=dsn_for(env.admin, target),
            exclude="price",
            workdir=env.work / "connect",
        )
    )
    print(
        f"Kafka Connect JDBC sink: {changes.records / run.seconds:,.0f} events/s ({run.seconds:.1f} s)", file=sys.stderr
    )
    return Measure(
        "sql replay vs Kafka Connect",
        "events/s",
        round(changes.records / ours_s),
        reference=round(changes.records / run.seconds),
        reference_name="Debezium JDBC sink on Kafka Connect",
        target_ratio=1.0,
        note="the same topic from offset zero into PostgreSQL, each into a database of its own on the same server; "
        f"Connect timed from its sink task's start ({run.launch_seconds:.0f} s from the worker's launch), one task, "
        "shipped batch sizes, upsert by key; it neither folds nor guards by position, and leaves out the "
        "numeric column (price), whose Avro union it cannot store",
    )


def _natives(env: Env, spark: Any, changes: refs.Changes, result: Result) -> dict[str, float]:
    """Each store's native load of the changes, as records/s (and as measures, for the table)."""
    seconds = {
        "cache": refs.redis_native(env.redis_url, f"{env.prefix}-native", changes),
        "search": refs.opensearch_native(env.opensearch, f"{env.prefix}-native", changes),
        "warehouse": refs.delta_append(spark, changes),
        "sql": refs.postgres_copy(env.sql_dsn, changes),
    }
    how = {
        "cache": "Redis pipelined HSET/DEL, 1,000 per round trip, one Python thread",
        "search": "OpenSearch helpers.bulk, 1,000 per request, refresh off, no replicas, one Python thread",
        "warehouse": "plain Spark Delta append of the rows (no MERGE), local[*]",
        "sql": "PostgreSQL COPY of the rows into a new table of the sink's database, one Python thread",
    }
    for name, s in seconds.items():
        result.measures.append(
            Measure(f"{name} store native load", "events/s", round(changes.records / s), note=how[name])
        )
        print(f"{name} native: {changes.records / s:,.0f} records/s", file=sys.stderr)
    return {name: changes.records / s for name, s in seconds.items()}


# -- 4. rebuilds --------------------------------------------------------------------------------------------


def _rebuild(name: str, config: Path, log: Path, launcher: list[str] | None = None) -> dict[str, float]:
    """Run `cdc sinks rebuild NAME` (by ``launcher``: spark-submit …); seconds from launch to its 'rebuilding',
    'caught up' and final lines."""
    marks: dict[str, float] = {}
    started = time.monotonic()
    with open(log, "ab") as out:
        args = ["sinks", "rebuild", name, "--config", str(config), "--verify-wait", "60"]
        proc = subprocess.Popen(
            [*(launcher or [sys.executable, "-m", "pgcdc"]), *args],
            stdout=subprocess.PIPE,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(submit_env() if launcher else {})},
        )
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            out.write(raw)
            now = time.monotonic() - started
            if line.startswith(f"rebuilding {name}"):
                marks["rebuilding"] = now
            elif "caught up with the topics" in line:
                marks["caught_up"] = now
        code = proc.wait(60)
    marks["exit"] = time.monotonic() - started
    if code != 0 or "rebuilding" not in marks or "caught_up" not in marks:
        raise RuntimeError(f"cdc sinks rebuild {name} failed (exit {code}); log: {log}")
    return marks


def _scan(env: Env, spark: Any, name: str, generation: int) -> float:
    if name == "cache":
        return refs.scan_cache(env.redis_url, f"{env.prefix}:g{generation}:public.{TABLE}:*")
    if name == "search":
        return refs.scan_search(env.opensearch, f"{env.prefix}-public.{TABLE}".lower())
    return refs.scan_warehouse(spark, str(env.work / "warehouse-state-live" / f"g{generation}" / f"public.{TABLE}"))


def _rebuilds(env: Env, replay_s: dict[str, float], records: int, result: Result) -> None:
    config = env.config("state-live")
    copy_s = refs.copy_source(env.dsn, TABLE)
    marks: dict[str, dict[str, float]] = {}
    for name in SINKS:
        marks[name] = _rebuild(name, config, env.work / f"rebuild-{name}.log")
        print(f"rebuild {name}: {marks[name]}", file=sys.stderr)
    spark = spark_session(load_sink_settings(config), "pgcdc-sinks-bench-scan")
    try:
        scans = {name: _scan(env, spark, name, 2) for name in SINKS}
    finally:
        spark.stop()
    for name in SINKS:
        m = marks[name]
        bound = replay_s[name] + 1.5 * (copy_s + scans[name]) + m["rebuilding"]
        result.measures.append(
            Measure(
                f"{name} rebuild start to swap",
                "s",
                round(m["exit"], 1),
                higher_is_better=False,
                limit=round(bound, 1),
                note=f"start-up {m['rebuilding']:.1f} s, replay {m['caught_up'] - m['rebuilding']:.1f} s "
                f"({records / (m['caught_up'] - m['rebuilding']):,.0f} events/s), verify and swap "
                f"{m['exit'] - m['caught_up']:.1f} s; bound = replay {replay_s[name]:.1f} + 1.5 x (COPY "
                f"{copy_s:.1f} + scan {scans[name]:.1f}) + start-up",
            )
        )
    result.series["rebuild_s"] = {k: {p: round(v, 2) for p, v in m.items()} for k, m in marks.items()}


# -- 6. cluster ---------------------------------------------------------------------------------------------


def _object_store() -> ObjectStore:
    url = discovery.find("s3").value
    record = discovery.deploy_record("s3")
    # s3proxy predates the integrity checksums AWS's SDKs send by default (pyarrow's among them).
    os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    return ObjectStore(url, record["access_key"], record["secret_key"], discovery.find("spark-cloud-jars").value)


def _cluster(env: Env, records: int, result: Result) -> None:
    """Each sink rebuilt by `cdc sinks rebuild NAME` on local[*] (state in ``work``), then under spark-submit on
    the standalone cluster with state and warehouse in S3; the local run is the cluster run's reference."""
    store = _object_store()
    bucket = store.bucket(env.bucket)
    cluster_config = env.config("state-cluster", bucket)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    launcher = submit_command(
        master=discovery.find("spark-cluster").value,
        pex=pgcdc_pex(Path(os.environ.get("CDC_LOCAL_CACHE", Path.home() / ".cache" / "pgcdc"))),
        jars=env.jars,
        ui_port=port,
        classpath=store.classpath,
    )
    marks: dict[str, dict[str, dict[str, float]]] = {"local": {}, "cluster": {}}
    for name in SINKS:
        local = marks["local"][name] = _rebuild(name, env.config("state-live"), env.work / f"rebuild-{name}.log")
        m = marks["cluster"][name] = _rebuild(name, cluster_config, env.work / f"cluster-{name}.log", launcher)
        print(f"rebuild {name}: local {local}, cluster {m}", file=sys.stderr)
        result.measures.append(
            Measure(
                f"{name} rebuild on the cluster + S3, start to swap",
                "s",
                round(m["exit"], 1),
                reference=round(local["exit"], 1),
                reference_name="local[*], local disk",
                higher_is_better=False,
                note=f"cluster: {_phases(m, records)}; local[*]: {_phases(local, records)}",
            )
        )
    result.series["rebuild_s"] = {
        where: {n: {p: round(v, 2) for p, v in m.items()} for n, m in by.items()} for where, by in marks.items()
    }


def _phases(m: dict[str, float], records: int) -> str:
    replay = m["caught_up"] - m["rebuilding"]
    return (
        f"start-up {m['rebuilding']:.1f} s, replay {replay:.1f} s ({records / replay:,.0f} events/s), verify and "
        f"swap {m['exit'] - m['caught_up']:.1f} s"
    )


# -- 5. live ------------------------------------------------------------------------------------------------


class LagSampler(threading.Thread):
    """Each sink's lag (records, and the age of its oldest unapplied change) every second, as `cdc status`
    measures it: from outside, its checkpoint against the topics' ends."""

    def __init__(self, config: Path) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self.settings = load_sink_settings(config)
        self.samples: dict[str, list[tuple[float, int | None, float | None]]] = {n: [] for n in SINKS}
        self.started = time.monotonic()
        self.halt = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.started

    def run(self) -> None:
        ends = TopicEnds(self.settings)
        try:
            while not self.halt.is_set():
                with contextlib.suppress(Exception):  # a metadata hiccup is a missing sample, not a failure
                    marks = ends.read()
                    t = self.now()
                    for p in sink_progress(self.settings, marks, timestamp_at=ends.timestamp_at):
                        if p.name in self.samples:
                            self.samples[p.name].append((t, p.lag_records, p.freshness_s))
                self.halt.wait(1.0)
        finally:
            ends.close()

    def caught_up(self) -> bool:
        return all(s and s[-1][1] == 0 for s in self.samples.values())

    def ages(self, name: str, start: float, end: float) -> list[float]:
        return [s[2] for s in self.samples[name] if start <= s[0] <= end and s[2] is not None]


def next_id(dsn: str, rows: int) -> int:
    """The first id past the ``rows`` loaded at the start (some deleted since) and every row inserted after them:
    each load starts there, after every earlier one (they run one after the other), whatever their sizes."""
    query = sql.SQL("SELECT greatest(max(id), %s) + 1 FROM {}").format(sql.Identifier(TABLE))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, (rows,)).fetchone()
    assert row is not None
    return int(row[0])


class Load(threading.Thread):
    """Inserts ``rows_per_txn``-row transactions at ``changes_per_s`` from ``first`` until stopped."""

    def __init__(self, dsn: str, first: int, changes_per_s: float, rows_per_txn: int, seconds: float) -> None:
        super().__init__(name="load", daemon=True)
        self.dsn, self.first, self.rate, self.rows, self.seconds = dsn, first, changes_per_s, rows_per_txn, seconds
        self.done = 0
        self.elapsed = 0.0

    def run(self) -> None:
        insert = sql.SQL(
            "INSERT INTO {} (id, name, qty, price, payload) SELECT g, 'probe', %s, 1.5, '{{}}' "
            "FROM generate_series(%s::int, %s::int) g"
        ).format(sql.Identifier(TABLE))
        rnd = random.Random(1)  # noqa: S311 - workload values, not secrets
        txns = int(self.seconds * self.rate / self.rows)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            t0 = time.monotonic()
            for i in range(txns):
                low = self.first + i * self.rows
                conn.execute(insert, (rnd.randint(0, 9), low, low + self.rows - 1))
                self.done += self.rows
                time.sleep(max(0.0, t0 + (i + 1) * self.rows / self.rate - time.monotonic()))
            self.elapsed = time.monotonic() - t0

    @property
    def ids(self) -> range:
        return range(self.first, self.first + self.done)


def _applied(env: Env, ids: range) -> dict[str, list[float]]:
    """Per store, applied - commit time (ms) of each of ``ids`` it holds."""
    client = OpenSearch(env.opensearch, timeout=120)
    docs = client.mget(index=f"{env.prefix}-public.{TABLE}".lower(), body={"ids": [f"[{i}]" for i in ids]})["docs"]
    out = {
        "search": [d["_source"]["__cdc"]["applied_ms"] - d["_source"]["__cdc"]["ts_ms"] for d in docs if d.get("found")]
    }
    r = redis.Redis.from_url(env.redis_url)
    gen = int(r.get(f"{env.prefix}:current") or 1)
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(f"{env.prefix}:g{gen}:public.{TABLE}:[{i}]", "applied_ms", "ts_ms")
    out["cache"] = [int(a) - int(t) for a, t in pipe.execute() if a]
    return out


def _phase_sums(log: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """(sum of seconds, batches) per (sink, phase) of the sinks app's batch-phase histogram, scraped from the
    metrics endpoint its log names: Spark's phases of each micro-batch (latestOffset, walCommit, addBatch,
    commitOffsets, triggerExecution, ...) and pgcdc's inside addBatch (pgcdc_plan, pgcdc_write)."""
    found = _METRICS_LINE.findall(log.read_text(errors="replace"))
    if not found:
        return {}
    with urllib.request.urlopen(found[-1], timeout=10) as resp:  # noqa: S310 - the app's own http:// URL
        text = resp.read().decode()
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pgcdc_sink_batch_phase_seconds":
            continue
        for sample in family.samples:
            key = (sample.labels["sink"], sample.labels["phase"])
            total, count = out.get(key, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                out[key] = (sample.value, count)
            elif sample.name.endswith("_count"):
                out[key] = (total, sample.value)
    return out


def _phase_means(
    before: dict[tuple[str, str], tuple[float, float]], after: dict[tuple[str, str], tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per sink, each phase's mean seconds per batch between two scrapes."""
    out: dict[str, dict[str, float]] = {}
    for (sink, phase), (total, count) in after.items():
        total0, count0 = before.get((sink, phase), (0.0, 0.0))
        if count > count0:
            out.setdefault(sink, {})[phase] = round((total - total0) / (count - count0), 3)
    return out


def _note_phases(means: dict[str, dict[str, float]], result: Result) -> None:
    """Where a light-load batch's time goes, per sink: kept as a series and summed up in a note."""
    result.series["light_batch_phase_s"] = means
    for sink, phases in sorted(means.items()):
        listed = ", ".join(f"{phase} {s:.3f}" for phase, s in sorted(phases.items(), key=lambda kv: -kv[1]))
        result.notes.append(f"light load, {sink}, mean seconds per batch: {listed}")


def light_load(
    env: Env, sampler: LagSampler, rows: int, args: argparse.Namespace, result: Result, *, sinks_pid: int
) -> None:
    """Single-row transactions at ``--rate``: each row's commit time is recorded as its insert returns, and
    freshness is measured twice: by the stores' plain clients polling for the rows (bench._outside) and by each
    row's ``applied_ms`` (when the sink's writer applied it)."""
    watch = _watch_stores(env)
    first = next_id(env.dsn, rows)
    count = int(args.rate * args.freshness_seconds)
    achieved, machine = _paced_inserts(env, watch, first, count, rate=args.rate, sinks_pid=sinks_pid)
    watch.wait(120)
    outside, missing = watch.stop(), watch.missing()
    applied = {k: sorted(v / 1000 for v in values) for k, values in _applied(env, range(first, first + count)).items()}
    result.series["light_freshness_s_percentiles"] = {  # p1 … p100 of each, not every row's figure
        kind: {name: _percentiles(values) for name, values in figures.items()}
        for kind, figures in (("outside", outside), ("applied", applied))
    }
    result.measures.append(_light_cpu(*machine))
    for name in SINKS:
        seen = outside.get(name, [])
        own = applied.get(name)
        note = (
            f"{achieved:,.0f} single-row transactions/s for {args.freshness_seconds:g} s; commit to first seen by "
            f"the store's plain client (polled every {POLL_S[name] * 1000:g} ms); {len(seen)}/{count} rows seen"
            + (f", {missing[name]} never" if missing.get(name) else "")
        )
        if own:
            note += f"; the sink's own applied_ms: p50 {percentile(own, 50):.2f} s, p99 {percentile(own, 99):.2f} s"
        for pct, limits, text in ((99, LIGHT_P99_S, note), (50, LIGHT_P50_S, "the same rows' median")):
            if name in limits:
                result.measures.append(
                    Measure(
                        f"{name} freshness p{pct}, light load",
                        "s",
                        round(percentile(seen, pct), 2) if seen else float("nan"),
                        higher_is_better=False,
                        limit=limits[name],
                        note=text,
                    )
                )


def _watch_stores(env: Env) -> OutsideWatch:
    """The stores' plain clients polling the generations the live state serves (bench._outside), started."""
    return OutsideWatch.for_stores(
        redis_url=env.redis_url,
        redis_prefix=f"{env.prefix}:g{_served(env, 'cache')}:public.{TABLE}:",
        opensearch=env.opensearch,
        index=f"{env.prefix}-public.{TABLE}".lower(),
        delta_path=str(env.work / "warehouse-state-live" / f"g{_served(env, 'warehouse')}" / f"public.{TABLE}"),
    ).start()


def _paced_inserts(
    env: Env, watch: OutsideWatch, first: int, count: int, *, rate: float, sinks_pid: int
) -> tuple[float, tuple[float, dict[str, float], float]]:
    """``count`` single-row inserts from id ``first``, ``rate`` a second, each told to ``watch`` as its commit
    returns: the transactions/s achieved, and the machine's CPU meanwhile (seconds, by process kind, busy)."""
    insert = sql.SQL("INSERT INTO {} (id, name, qty, price, payload) VALUES (%s, 'probe', 1, 1.5, '{{}}')").format(
        sql.Identifier(TABLE)
    )
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        t0, cpu = time.monotonic(), _machine_cpu(sinks_pid)
        for i in range(count):
            conn.execute(insert, (first + i,))
            watch.commit([first + i])
            time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
        achieved = count / (time.monotonic() - t0)
        machine = cpu.stop()
    return achieved, machine


def _light_cpu(elapsed: float, spent: dict[str, float], busy: float) -> Measure:
    """The sinks app's CPU over the light load (``spent`` by process kind over ``elapsed`` s), with the whole
    machine's beside it."""
    sinks_cpu = {k: v for k, v in spent.items() if k.startswith("sinks: ")}
    return Measure(
        "sinks' CPU, light load",
        "cores",
        round(sum(sinks_cpu.values()) / elapsed, 2),
        higher_is_better=False,
        limit=HEADROOM_CORES,
        note="`cdc sinks run` with search, cache and warehouse, CPU over the "
        f"{elapsed:.0f} s of light load (/proc, in cores): "
        + ", ".join(f"{kind[7:]} {v / elapsed:.2f}" for kind, v in sinks_cpu.items())
        + f"; the whole machine was busy {busy / elapsed:.2f} of its {os.cpu_count()} cores: "
        + ", ".join(f"{kind} {v / elapsed:.2f}" for kind, v in spent.items() if kind not in sinks_cpu)
        + " (this benchmark polls the stores for the rows every 20 ms)",
    )


def _percentiles(values: list[float]) -> list[float]:
    return [round(percentile(values, p), 3) for p in range(1, 101)] if values else []


def _served(env: Env, name: str) -> int:
    """The generation ``name`` serves in the live state (1 unless a rebuild swapped another in)."""
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads((env.work / "state-live" / name / "status.json").read_text()).get("generation", 1))
    return 1


def _heavy(
    env: Env, sampler: LagSampler, rows: int, args: argparse.Namespace, result: Result, *, sinks_pid: int
) -> None:
    load = Load(env.dsn, next_id(env.dsn, rows), HEAVY_RATE, HEAVY_TXN_ROWS, args.heavy_seconds)
    start, cpu = sampler.now(), _machine_cpu(sinks_pid)
    load.run()
    end = sampler.now()
    elapsed, spent, busy = cpu.stop()
    result.notes.append(
        f"{HEAVY_RATE:,} changes/s, the machine's CPU by process (cores): busy {busy / elapsed:.2f} of "
        f"{os.cpu_count()}: " + ", ".join(f"{kind} {v / elapsed:.2f}" for kind, v in spent.items() if v > 0)
    )
    drained = _drain(sampler, 120)
    achieved = load.done / load.elapsed
    for name in SINKS:
        ages = sampler.ages(name, start, end)
        result.measures.append(
            Measure(
                f"{name} freshness p99, {HEAVY_RATE:,} changes/s",
                "s",
                round(percentile(ages, 99), 2) if ages else float("nan"),
                higher_is_better=False,
                limit=HEAVY_LIMIT_S[name],
                note=f"age of the oldest unapplied change as `cdc status` sees it, {len(ages)} samples over "
                f"{args.heavy_seconds:g} s at {achieved:,.0f} changes/s in {HEAVY_TXN_ROWS}-row transactions; "
                f"max {max(ages, default=float('nan')):.2f} s; all sinks at lag 0 {drained:.0f} s after the load",
            )
        )
    result.series["lag"] = {
        name: {"t_s": [round(s[0] - start, 1) for s in v], "records": [s[1] for s in v], "age_s": [s[2] for s in v]}
        for name, v in sampler.samples.items()
    }
    result.series["lag_load_window_s"] = [0.0, round(end - start, 1)]


def _sustained(env: Env, sampler: LagSampler, rows: int, args: argparse.Namespace, result: Result) -> None:
    """SUSTAINED_RATE changes/s for ``--sustained-seconds``: each sink's lag (the age of its oldest unapplied
    change, as `cdc status` sees it) over the load's last third against its middle third (the first third is
    the climb from idle); bounded when the ratio stays under GROWTH_LIMIT."""
    if args.sustained_seconds <= 0:
        return
    load = Load(env.dsn, next_id(env.dsn, rows), SUSTAINED_RATE, HEAVY_TXN_ROWS, args.sustained_seconds)
    start = sampler.now()
    load.run()
    end = sampler.now()
    drained = _drain(sampler, 300)  # the restart step that follows starts from lag 0 (or says it could not)
    after = f"{'all' if sampler.caught_up() else 'not all'} sinks at lag 0 {drained:.0f} s after the load"
    third = (end - start) / 3
    achieved = load.done / load.elapsed
    for name in SINKS:
        middle = sampler.ages(name, start + third, start + 2 * third)
        last = sampler.ages(name, start + 2 * third, end)
        if not middle or not last:
            growth, text = float("nan"), "no lag samples"
        else:
            m, l_ = statistics.fmean(middle), statistics.fmean(last)
            growth = (l_ + GROWTH_FLOOR_S) / (m + GROWTH_FLOOR_S)
            text = f"mean lag {m:.2f} s over the middle third, {l_:.2f} s over the last, max {max(last):.2f} s"
        result.measures.append(
            Measure(
                f"{name} lag growth, {SUSTAINED_RATE:,} changes/s",
                "x",
                round(growth, 2),
                higher_is_better=False,
                limit=GROWTH_LIMIT,
                note=f"{text} ({GROWTH_FLOOR_S:g} s added to both); {achieved:,.0f} changes/s in "
                f"{HEAVY_TXN_ROWS}-row transactions for {args.sustained_seconds:g} s; {after}",
            )
        )


def _drain(sampler: LagSampler, timeout_s: float) -> float:
    """Seconds until every sink is at lag 0 (at most ``timeout_s``)."""
    start = sampler.now()
    deadline = time.monotonic() + timeout_s
    while not sampler.caught_up() and time.monotonic() < deadline:
        time.sleep(1)
    return sampler.now() - start


@contextlib.contextmanager
def _profiled(pid: int, out: Path | None, seconds: float) -> Iterator[None]:
    """py-spy samples ``pid``'s Python threads (not the JVM's) for ``seconds`` while the body runs; a line per
    distinct stack with its count, for `sort -k2 -n` or a flame graph. Without ``out``, nothing."""
    if out is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50"]
    sampler = subprocess.Popen([*cmd, "--nonblocking", "--format", "raw", "--output", str(out)])
    try:
        yield
    finally:
        sampler.wait(timeout=seconds + 120)


def _batches(log: Path, start: int, end: int | None = None) -> dict[str, list[tuple[int, float]]]:
    """Each sink's (records, seconds) per batch logged between byte offsets ``start`` and ``end``."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read(-1 if end is None else end - start).decode(errors="replace")
    out: dict[str, list[tuple[int, float]]] = {n: [] for n in SINKS}
    for m in _BATCH_LINE.finditer(text):
        if m.group(1) in out:
            out[m.group(1)].append((int(m.group(3)), float(m.group(4))))
    return out


def _live(env: Env, rows: int, args: argparse.Namespace, result: Result) -> None:
    config = env.config("state-live")
    sinks_log = env.work / "sinks.log"
    with open(env.work / "live.log", "ab") as log, open(sinks_log, "ab") as out:
        capture = run_cdc(["run", "--config", str(config)], log)
        sinks = run_cdc(["sinks", "run", "--config", str(config)], out)
        sampler = LagSampler(config)
        sampler.start()
        try:
            wait_until(sampler.caught_up, sinks, "the sinks' catch-up")
            # A first batch after a start pays the JVM's warm-up (measured below, after a SIGKILL): one row
            # through every sink first, so the light load measures the steady state.
            Load(env.dsn, next_id(env.dsn, rows), 1, 1, 1).run()
            wait_until(lambda: all(batches_done(env, n) > 0 for n in SINKS), sinks, "the sinks' first batch")
            time.sleep(10)
            phases = _phase_sums(sinks_log)
            with _profiled(sinks.pid, args.profile_light, args.freshness_seconds):
                light_load(env, sampler, rows, args, result, sinks_pid=sinks.pid)
            _note_phases(_phase_means(phases, _phase_sums(sinks_log)), result)
            with _profiled(sinks.pid, args.profile_heavy, args.heavy_seconds):
                _heavy(env, sampler, rows, args, result, sinks_pid=sinks.pid)
            _sustained(env, sampler, rows, args, result)
            sinks = _restart(env, sinks, _SinksApp(config=config, log=sinks_log, out=out), rows, result)
        finally:
            sampler.halt.set()
            stop_process(sinks, 180)
            stop_process(capture, 120)


def batches_done(env: Env, name: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads((env.work / "state-live" / name / "status.json").read_text()).get("batches", 0))
    return 0


@dataclass(frozen=True)
class _SinksApp:
    """How the live steps run `cdc sinks run`: its configuration, its log and the open file it writes it with."""

    config: Path
    log: Path
    out: IO[bytes]


def _restart(
    env: Env, sinks: subprocess.Popen[bytes], app: _SinksApp, rows: int, result: Result
) -> subprocess.Popen[bytes]:
    """SIGKILL `cdc sinks run` (its JVM with it) under load, start it again: how long after its launch each sink
    has applied its first batch of changes, and that batch's time against the steady ones before."""
    log = app.log
    load = Load(env.dsn, next_id(env.dsn, rows), 200, HEAVY_TXN_ROWS, 90)
    load.start()
    steady_from = log.stat().st_size
    time.sleep(30)
    killed_at = log.stat().st_size
    os.killpg(sinks.pid, signal.SIGKILL)
    sinks.wait(30)
    time.sleep(5)
    restarted_at = log.stat().st_size
    launched = time.time()
    sinks = run_cdc(["sinks", "run", "--config", str(app.config)], app.out)
    load.join()
    time.sleep(10)
    steady = _batches(log, steady_from, killed_at)
    after = _batches(log, restarted_at)
    done = _first_applied(log, restarted_at)
    for name in SINKS:
        times = [s for r, s in steady[name] if r > 0]
        typical = statistics.median(times) if times else float("nan")
        first = next(((r, s) for r, s in after[name] if r > 0), (0, float("nan")))
        applied = done.get(name)
        result.measures.append(
            Measure(
                f"{name} first change applied after a SIGKILL",
                "s",
                round(applied - launched, 1) if applied else float("nan"),
                higher_is_better=False,
                limit=RESTART_LIMIT_S[name],
                note=f"from the launch of `cdc sinks run` to its first changes applied (while Spark starts, or its "
                f"first batch); its first batch with changes ({first[0]} "
                f"records, the changes written while it was down: {first[1]:.2f} s against a median of "
                f"{typical:.2f} s over {len(times)} batches before, under 200 changes/s)",
            )
        )
    return sinks


def _first_start(env: Env, rows: int, result: Result) -> None:
    """A first start: `cdc run` snapshotting the table and `cdc sinks run` on a fresh state directory without
    the JVM's class archive, launched together; from that moment, each sink's first rows applied and its
    catch-up with the snapshot. The reference, in the same run: the same app SIGKILLed once caught up and
    started again after a few changes (a restart: state on disk, the page cache warm)."""
    config = env.config("state-first", sql_sink=False)
    cold = {"CDC_SINKS__JVM_CLASS_ARCHIVE": "false"}
    sinks_log = env.work / "sinks-first.log"
    with open(env.work / "capture-first.log", "ab") as log, open(sinks_log, "ab") as out:
        launched = time.time()
        capture = run_cdc(["run", "--config", str(config)], log)
        sinks = run_cdc(["sinks", "run", "--config", str(config)], out, cold)
        sampler = LagSampler(config)
        sampler.start()
        try:
            with _topic_end(env) as end_of_topic:
                wait_until(lambda: end_of_topic() >= rows and sampler.caught_up(), sinks, "the first start's catch-up")
            caught_up = time.time()
            first = _first_applied(sinks_log, 0)
            restarted = _restarted(env, sinks, sinks_log, out=out, config=config, extra=cold)
            sinks = restarted.proc
        finally:
            sampler.halt.set()
            stop_process(sinks, 180)
            stop_process(capture, 120)
    for name in SINKS:
        applied = first.get(name)
        again = restarted.first.get(name)
        result.measures.append(
            Measure(
                f"{name} first rows on a first start",
                "s",
                round(applied - launched, 1) if applied else float("nan"),
                reference=round(again - restarted.launched, 1) if again else None,
                reference_name="a restart",
                higher_is_better=False,
                limit=FIRST_START_LIMIT_S,
                note=f"from the launch of `cdc run` (snapshotting {rows:,} rows) and `cdc sinks run` (fresh state, no "
                f"class archive) together to its first rows applied; all of the snapshot applied after "
                f"{caught_up - launched:.1f} s (every sink); the reference: launch to first changes applied after a "
                "SIGKILL once caught up",
            )
        )


@dataclass
class _Restart:
    proc: subprocess.Popen[bytes]
    launched: float
    first: dict[str, float]


def _restarted(
    env: Env, sinks: subprocess.Popen[bytes], log: Path, *, out: IO[bytes], config: Path, extra: dict[str, str]
) -> _Restart:
    """SIGKILL the sinks app, change 100 rows, start it again; when each sink first applied changes after."""
    os.killpg(sinks.pid, signal.SIGKILL)
    sinks.wait(30)
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET qty = qty + 1 WHERE id <= 100").format(sql.Identifier(TABLE)))
    start = log.stat().st_size
    launched = time.time()
    proc = run_cdc(["sinks", "run", "--config", str(config)], out, extra)
    wait_until(lambda: len(_first_applied(log, start)) == len(SINKS), proc, "the restart's first changes", 600)
    return _Restart(proc, launched, _first_applied(log, start))


def _first_applied(log: Path, start: int) -> dict[str, float]:
    """Per sink, when (epoch s, from the log line's time) it first applied records after ``start``: while Spark
    started (sinks._bridge), or its first batch with records."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _BATCH_LINE.search(line) or _BRIDGE_LINE.search(line)
        if m and int(m.group(3)) > 0 and m.group(1) not in out:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out[m.group(1)] = stamp.timestamp()  # the log's local time, as time.time() counts it
    return out


# -- the run ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--freshness-seconds", type=float, default=60.0, help="seconds of light load")
    parser.add_argument("--rate", type=float, default=200.0, help="transactions per second of the light load")
    parser.add_argument("--heavy-seconds", type=float, default=120.0, help="seconds at 2,000 changes/s")
    parser.add_argument(
        "--sustained-seconds", type=float, default=120.0, help="seconds at 5,000 changes/s (0: not measured)"
    )
    parser.add_argument("--no-rebuild", action="store_true", help="skip step 4")
    parser.add_argument("--no-live", action="store_true", help="skip step 5")
    parser.add_argument(
        "--only-live", action="store_true", help="steps 1, 2 and 5 (no replays, no rebuilds): scenario sinks-live"
    )
    parser.add_argument(
        "--first-start",
        action="store_true",
        help="instead of steps 2-5: the sinks' first start beside the capture's snapshot, and a restart "
        "(sinks-first-start)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="instead of steps 3-5: rebuild each sink locally and on the standalone cluster with S3 (sinks-cluster)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch database, stores, topics and logs")
    parser.add_argument(
        "--profile-light",
        type=Path,
        metavar="FILE",
        help="sample the sinks app's Python (py-spy, collapsed stacks) through the light load into FILE",
    )
    parser.add_argument(
        "--profile-heavy",
        type=Path,
        metavar="FILE",
        help="sample the sinks app's Python (py-spy, collapsed stacks) through the 2,000 changes/s load into FILE",
    )
    return parser


def make_env() -> Env:
    run_id = str(int(time.time()))
    return Env(
        admin=discovery.find("postgres").value,
        kafka=discovery.find("kafka").value,
        registry=discovery.find("registry").value,
        opensearch=discovery.find("opensearch").value,
        redis_url=discovery.find("redis").value,
        jars=[j for j in discovery.find("spark-jars").value.split(",") if j],
        prefix=f"sbench_{run_id}",
        work=Path(tempfile.mkdtemp(prefix="pgcdc-sinks-bench-")),
    )


def _workload(env: Env, rows: int, result: Result) -> refs.Changes:
    create_source(env, rows)
    with open(env.work / "capture.log", "ab") as log:
        capture_changes(env, rows, env.config("state-live"), log)
    changes = refs.read_and_decode(env.kafka, env.registry, env.topic)
    events = sum(v for k, v in changes.ops.items() if k != "tombstone")
    result.params["topic"] = {
        "records": changes.records,
        "ops": changes.ops,
        "updates_share": round(changes.ops.get("u", 0) / events, 3),
        "deletes_share": round(changes.ops.get("d", 0) / events, 3),
    }
    result.measures.append(
        Measure(
            "Kafka read + Avro decode",
            "events/s",
            round(changes.rate),
            note="confluent-kafka + fastavro, keys and values, one Python thread, no Spark",
        )
    )
    print(f"read + decode: {changes.rate:,.0f} records/s; {result.params['topic']}", file=sys.stderr)
    return changes


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)
    env = make_env()
    result = Result(
        SCENARIO,
        params={
            "rows": args.rows,
            "table": "id bigint PK, name text, qty int, price numeric(12,2), at timestamptz, payload jsonb, "
            "doc text (2.2 kB, out of line, in 1 row of 20)",
            "defaults": "shipped: trigger 0 s (cache, search) and 5 s (warehouse), maxOffsetsPerTrigger 200,000",
        },
    )
    if args.cluster:
        result.scenario = CLUSTER_SCENARIO
    if args.only_live:
        result.scenario = LIVE_SCENARIO
    if args.first_start:
        result.scenario = FIRST_START_SCENARIO
    try:
        if args.first_start:
            create_source(env, args.rows)
            _first_start(env, args.rows, result)
            return result
        changes = _workload(env, args.rows, result)
        if args.cluster:
            _cluster(env, changes.records, result)
            return result
        replay_s = {} if args.only_live else _replays(env, changes, result)
        records = changes.records
        del changes  # ~GBs of decoded rows
        if not (args.no_rebuild or args.only_live):
            _rebuilds(env, replay_s, records, result)
        if not args.no_live:
            _live(env, args.rows, args, result)
    finally:
        if not args.keep:
            cleanup(env)
    if args.keep:
        result.notes.append(f"logs and state: {env.work}")
    result.notes.append(
        "rates are topic records per second (tombstones included); a sink's limit is the slower of read + decode "
        "and its store's native load of the same changes; driver CPU = this Python process and the JVM's threads "
        "other than executor tasks"
    )
    return result


def cleanup(env: Env) -> None:
    with psycopg.connect(env.admin, autocommit=True) as conn:
        drop_slot_when_free(conn, env.prefix)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(env.prefix)))
        for suffix in ("_sql", "_connect"):
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(env.prefix + suffix)))
    with contextlib.suppress(Exception):
        OpenSearch(env.opensearch).indices.delete(index=f"{env.prefix}*", expand_wildcards="all")
    with contextlib.suppress(Exception):
        r = redis.Redis.from_url(env.redis_url)
        for keys in refs.chunks(r.scan_iter(match=f"{env.prefix}:*", count=5000), 5000):
            r.unlink(*keys)  # millions of keys: one round trip per 5,000, freed in the background
    with contextlib.suppress(Exception):
        delete_topics(env.kafka, [env.topic, f"{env.prefix}.offsets", f"{env.prefix}.dead-letter"])
        dbz.delete_subjects(env.registry, [env.topic])
    with contextlib.suppress(Exception):
        store = _object_store().filesystem()
        if store.get_file_info(env.bucket).type.name != "NotFound":
            store.delete_dir(env.bucket)
    shutil.rmtree(env.work, ignore_errors=True)


if __name__ == "__main__":
    write_result(run())
