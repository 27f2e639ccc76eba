#!/usr/bin/env python3
"""Debezium Server's rows/s into Kafka on this machine: proves bench/_debezium.py with a small measured run.

    ./dev python -m bench.debezium_smoke [--rows 100000] [--txn-rows 5000] [--mode both]

Creates a scratch database with capture_throughput's table minus the padding (5 small columns incl. numeric
and jsonb), then
1. streaming: starts Debezium (snapshot.mode=no_data), waits until it streams from its slot, streams
   ``--warmup-rows`` through it (a cold JVM spends most of a short run in its JIT compilers), then inserts
   ``--rows`` rows in transactions of ``--txn-rows`` and times, from the first INSERT, until the topic holds
   every row;
2. snapshot: a second table already holding ``--rows`` rows, Debezium with snapshot.mode=initial, timed from
   the JVM's launch and from the first record (the JVM's and Quarkus' start-up excluded) to the last.
Prints rows/s with the JVM's peak RSS and CPU seconds, checks one record's framing (magic 0 + a schema id the
registry's ccompat API resolves) and writes JSON to bench/results/debezium_smoke_<avro>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition
from pgcdc_dev import CHECKOUT as ROOT
from pgcdc_dev import services
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench import _debezium as dbz

_TABLE = (
    "CREATE TABLE {} (id bigint PRIMARY KEY, kind text NOT NULL, amount numeric(12,2), payload jsonb, "
    "at timestamptz NOT NULL DEFAULT now())"
)
_INSERT = (
    "INSERT INTO {} (id, kind, amount, payload) SELECT g, 'kind-' || (g %% 10), g * 0.01, "
    "jsonb_build_object('n', g, 'tag', 'x') FROM generate_series(%s::bigint, %s::bigint) g"
)


def _insert(conn: psycopg.Connection[Any], table: str, rows: int, txn_rows: int, first_id: int = 1) -> None:
    for first in range(first_id, first_id + rows, txn_rows):
        conn.execute(
            sql.SQL(_INSERT).format(sql.Identifier(table)),
            (first, min(first + txn_rows, first_id + rows) - 1),
        )


def _timed_insert(dsn: str, table: str, rows: int, txn_rows: int, first_id: int) -> float:
    start = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, table, rows, txn_rows, first_id)
    return time.monotonic() - start


def _cpu(run: dbz.Debezium, before: dict[str, float]) -> dict[str, float]:
    """CPU seconds by thread kind since `before` (a run.thread_cpu() reading)."""
    now = run.thread_cpu()
    return {kind: round(now[kind] - before[kind], 2) for kind in now}


def _framing(kafka: str, topic: str, registry: str) -> dict[str, object]:
    """Magic byte and schema id of the first value, and whether the registry's ccompat API knows that id."""
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": "pgcdc-bench-peek", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        msg = consumer.poll(30)
        if msg is None or msg.error() or not msg.value():
            return {"error": "no record read"}
        value: bytes = msg.value()  # type: ignore[assignment]
        magic, schema_id = value[0], struct.unpack(">I", value[1:5])[0]
        with urllib.request.urlopen(f"{registry}/schemas/ids/{schema_id}", timeout=10) as resp:  # noqa: S310
            known = resp.status == 200 and b"schema" in resp.read()
        return {"magic": magic, "schema_id": schema_id, "registry_resolves_id": known, "value_bytes": len(value)}
    finally:
        consumer.close()


@dataclass(frozen=True)
class _Smoke:
    """The run's scratch database (``db`` on ``dsn``), its logs' directory, Kafka and the registry, and the
    arguments."""

    db: str
    dsn: str
    work: Path
    ep: dict[str, str]
    args: argparse.Namespace


def main() -> int:
    args = _arguments()
    admin = str(services.SERVICES["postgres"].endpoint()["dsn"])
    ep = dbz.endpoints()
    dbz.install()
    stamp = int(time.time())
    db = f"bench_dbz_{stamp}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    params = conninfo_to_dict(admin)
    params["dbname"] = db
    dsn = make_conninfo("", **params)
    work = Path(tempfile.mkdtemp(prefix="pgcdc-debezium-"))
    result: dict[str, Any] = {
        "debezium": dbz.DEBEZIUM_VERSION,
        "java": str(services.java_home(dbz.JAVA_MIN)),
        "format": f"avro ({args.avro} converter; magic 0 + 4-byte schema id)",
        "tuning": vars(dbz.Tuning()),
        "rows": args.rows,
        "txn_rows": args.txn_rows,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),  # a shared machine: say how busy it was
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    smoke = _Smoke(db=db, dsn=dsn, work=work, ep=ep, args=args)
    try:
        if args.mode in ("streaming", "both"):
            result["streaming"] = _streaming(smoke)
        if args.mode in ("snapshot", "both"):
            result["snapshot"] = _snapshot(smoke)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"debezium_smoke_{args.avro}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"logs: {work}")
    return 0


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--txn-rows", type=int, default=5_000)
    ap.add_argument("--mode", choices=["streaming", "snapshot", "both"], default="both")
    ap.add_argument(
        "--warmup-rows", type=int, default=50_000, help="streamed and drained before timing (0: a cold JVM)"
    )
    ap.add_argument("--avro", choices=["confluent", "apicurio"], default="confluent", help="Debezium's converter")
    return ap.parse_args()


def _streaming(smoke: _Smoke) -> dict[str, Any]:
    """Debezium streaming ``--rows`` inserts (after ``--warmup-rows`` drained), timed from the first INSERT."""
    args, dsn, kafka = smoke.args, smoke.dsn, smoke.ep["kafka"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_TABLE).format(sql.Identifier("events")))
    options = dbz.RunOptions(
        topic_prefix=f"{smoke.db}_stream", snapshot="no_data", work=smoke.work / "stream", avro=args.avro
    )
    with dbz.running(dsn, ["public.events"], options) as run:
        topic = run.topics["public.events"]
        startup_s = run.wait_streaming()
        warm = args.warmup_rows
        if warm:  # the same path, drained before timing: the measured rows meet compiled code
            with psycopg.connect(dsn, autocommit=True) as conn:
                _insert(conn, "events", warm, args.txn_rows)
            dbz.wait_for_records(kafka, topic, warm, time.monotonic())
        cpu0 = run.thread_cpu()
        start = time.monotonic()
        # Write from a thread and watch the topic meanwhile, so the first record's time is real.
        with ThreadPoolExecutor(1) as pool:
            writing = pool.submit(_timed_insert, dsn, "events", args.rows, args.txn_rows, warm + 1)
            arrival = dbz.wait_for_records(kafka, topic, warm + args.rows, start)
            write_s = writing.result()
        cpu = _cpu(run, cpu0)
        streaming = {
            "startup_to_streaming_s": round(startup_s, 2),
            "warmup_rows": warm,
            "write_s": round(write_s, 2),
            "first_record_s": round(arrival.first_s, 2),
            "all_records_s": round(arrival.last_s, 2),
            "rows_per_s": round(args.rows / arrival.last_s),
            "cpu_s": round(sum(cpu.values()), 2),
            "cpu_s_by_thread": cpu,
            "cpu_us_per_row_excl_jit": round((cpu["other"] + cpu["gc"]) / args.rows * 1e6),
            "cpu_s_total": round(run.cpu_seconds(), 2),
            "peak_rss_mb": run.peak_rss_mb(),
            "framing": _framing(kafka, run.topics["public.events"], smoke.ep["registry"]),
        }
    streaming["clean_stop"] = not run.killed  # exit code 143 is the JVM's for a SIGTERM
    return streaming


def _snapshot(smoke: _Smoke) -> dict[str, Any]:
    """Debezium's initial snapshot of a table holding ``--rows`` rows, from the JVM's launch."""
    args = smoke.args
    with psycopg.connect(smoke.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_TABLE).format(sql.Identifier("snap")))
        _insert(conn, "snap", args.rows, args.txn_rows)
    options = dbz.RunOptions(
        topic_prefix=f"{smoke.db}_snap",
        slot="bench_debezium_snap",
        publication="bench_debezium_snap",
        snapshot="initial",
        work=smoke.work / "snap",
        avro=args.avro,
    )
    with dbz.running(smoke.dsn, ["public.snap"], options) as run:
        cpu0 = {"jit": 0.0, "gc": 0.0, "other": 0.0}  # cold by nature: a snapshot is what starts first
        arrival = dbz.wait_for_records(smoke.ep["kafka"], run.topics["public.snap"], args.rows, run.started)
        snapshot = {
            "first_record_s": round(arrival.first_s, 2),
            "all_records_s": round(arrival.last_s, 2),
            "rows_per_s_from_launch": round(args.rows / arrival.last_s),
            "rows_per_s_from_first_record": round(args.rows / (arrival.last_s - arrival.first_s)),
            "cpu_s_total": round(run.cpu_seconds(), 2),
            "cpu_s_by_thread": _cpu(run, cpu0),
            "peak_rss_mb": run.peak_rss_mb(),
        }
    snapshot["clean_stop"] = not run.killed
    return snapshot


if __name__ == "__main__":
    sys.exit(main())
