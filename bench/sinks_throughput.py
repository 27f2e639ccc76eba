#!/usr/bin/env python3
"""Sink throughput and freshness, each against a reference measured in the same run.

    ./dev python bench/sinks_throughput.py [--rows 200000] [--freshness-seconds 60] [--rate 5]

1. Snapshots a scratch table of ``--rows`` rows (6 columns incl. numeric, timestamptz, jsonb) into Kafka with
   `cdc run`, then stops the capture.
2. Throughput: each sink alone (search, cache, warehouse) replays the whole topic from offset zero into a fresh
   copy as fast as it can, in this process; the reference is the same Spark query with a sink that only
   materialises the decoded, last-per-key frame (read + decode + dedupe: what every sink pays before its
   store). events/s and the ratio sink / reference.
3. Freshness: `cdc run` streams again and `cdc sinks run` keeps all three stores as in production while
   ``--rate`` single-row transactions per second are committed for ``--freshness-seconds``; every store records
   when it applied each change (applied_ms), so freshness = applied - commit time (source ts_ms), p50/p99.
   The search index makes a document searchable at its next refresh (1 s by default) after that.
Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from opensearchpy import OpenSearch  # noqa: E402

from sinks import BaseSink, Batch  # noqa: E402
from sinks._config import load_sink_settings  # noqa: E402
from sinks._runner import SinkQuery, spark_session  # noqa: E402
from tests import _services  # noqa: E402 - finds (or starts) the local services like the tests do


class _Reference(BaseSink):
    """Materialises what every sink starts from, and nothing more."""

    name = "reference"

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            table.frame.count()


def _dsn_for(admin: str, db: str) -> str:
    params = conninfo_to_dict(admin)
    params["dbname"] = db
    return make_conninfo("", **params)


def _config(path: Path, dsn: str, *, kafka: str, registry: str, prefix: str, extra: str) -> None:
    path.write_text(
        f"""[source]
dsn = "{dsn}"
tables = ["public.events"]
slot = "{prefix}"
publication = "{prefix}"

[kafka]
bootstrap_servers = "{kafka}"
topic_prefix = "{prefix}"

[registry]
url = "{registry}"
{extra}
"""
    )


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--freshness-seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5.0, help="transactions per second during freshness")
    parser.add_argument("--max-offsets", type=int, default=50_000, help="maxOffsetsPerTrigger for the replay")
    args = parser.parse_args()

    admin = _services.find("postgres").value
    kafka, registry = _services.find("kafka").value, _services.find("registry").value
    opensearch, redis_url = _services.find("opensearch").value, _services.find("redis").value
    jars = [j for j in _services.find("spark-jars").value.split(",") if j]
    run_id = str(int(time.time()))
    prefix = f"sbench_{run_id}"
    db = f"sbench_{run_id}"
    work = Path(tempfile.mkdtemp(prefix="pgcdc-sinks-bench-"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    dsn = _dsn_for(admin, db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE events (id bigint PRIMARY KEY, name text, qty int, price numeric(12,2), "
            "at timestamptz DEFAULT now(), payload jsonb)"
        )
        conn.execute(
            "INSERT INTO events SELECT g, 'name ' || g, g %% 1000, g / 100.0, now(), "
            "jsonb_build_object('g', g, 'tags', jsonb_build_array('a', 'b')) FROM generate_series(1, %s) g",
            (args.rows,),
        )
    sinks_toml = f"""
[sinks]
state_dir = "{work / "state"}"
spark_jars = {json.dumps(jars)}
trigger_interval_s = 1.0
max_offsets_per_trigger = {args.max_offsets}

[sinks.search]
url = "{opensearch}"

[sinks.cache]
url = "{redis_url}"

[sinks.warehouse]
path = "{work / "warehouse"}"
"""
    config = work / "cdc.toml"
    _config(config, dsn, kafka=kafka, registry=registry, prefix=prefix, extra=sinks_toml)
    log = open(work / "cdc.log", "ab")  # noqa: SIM115 - handed to the child
    capture = subprocess.Popen(
        [sys.executable, "-m", "cdc.cli", "run", "--config", str(config)], stdout=log, stderr=log
    )
    topic = f"{prefix}.public.events"

    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"bench-{run_id}"})
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
        except Exception:
            high = 0
        if high >= args.rows:
            break
        time.sleep(1)
    capture.send_signal(signal.SIGTERM)
    capture.wait(120)
    print(f"snapshot of {args.rows:,} rows in {topic}", file=sys.stderr)

    settings = load_sink_settings(config)
    spark = spark_session(settings, "pgcdc-sinks-bench")
    throughput: dict[str, float] = {}
    # The first replay in a JVM pays for class loading and JIT: a warm-up pass of the reference is not counted.
    for name in ("warm-up", "reference", "search", "cache", "warehouse"):
        sink = _Reference() if name in ("warm-up", "reference") else None
        query = SinkQuery(name, settings, spark, 1000, follow_swaps=False, sink=sink)
        started = time.monotonic()
        query.start()
        while not query.caught_up():
            if query.query is not None and not query.query.isActive:
                raise SystemExit(f"{name} failed: {query.query.exception()}")
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        query.stop()
        if name != "warm-up":
            throughput[name] = args.rows / elapsed
        print(f"{name}: {args.rows / elapsed:,.0f} events/s ({elapsed:.1f} s)", file=sys.stderr)
    spark.stop()

    # Freshness: the production shape, capture and all three sinks as processes, on a state of their own.
    _config(
        config,
        dsn,
        kafka=kafka,
        registry=registry,
        prefix=prefix,
        extra=sinks_toml.replace(str(work / "state"), str(work / "state-live")),
    )
    capture = subprocess.Popen(
        [sys.executable, "-m", "cdc.cli", "run", "--config", str(config)], stdout=log, stderr=log
    )
    sinks_log = open(work / "sinks.log", "ab")  # noqa: SIM115 - handed to the child
    sinks = subprocess.Popen(
        [sys.executable, "-m", "cdc.cli", "sinks", "run", "--config", str(config)], stdout=sinks_log, stderr=sinks_log
    )
    status = [work / "state-live" / n / "status.json" for n in ("search", "cache", "warehouse")]

    def caught_up_all() -> bool:
        return all(p.exists() and json.loads(p.read_text()).get("records", 0) >= args.rows for p in status)

    deadline = time.monotonic() + 1800
    while not caught_up_all() and time.monotonic() < deadline:
        time.sleep(2)
    time.sleep(10)  # steady state: the replay's last batches are done
    rnd = random.Random(1)  # noqa: S311 - workload values, not secrets
    first = args.rows + 1
    n = int(args.freshness_seconds * args.rate)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(n):
            conn.execute(
                "INSERT INTO events (id, name, qty, price, payload) VALUES (%s, 'probe', %s, 1.5, '{}')",
                (first + i, rnd.randint(0, 9)),
            )
            time.sleep(1 / args.rate)
    time.sleep(30)
    sinks.send_signal(signal.SIGTERM)
    sinks.wait(180)
    capture.send_signal(signal.SIGTERM)
    capture.wait(120)
    ids = list(range(first, first + n))
    freshness: dict[str, list[float]] = {}

    client = OpenSearch(opensearch)
    docs = client.mget(index=f"{prefix}-public.events".lower(), body={"ids": [f"[{i}]" for i in ids]})["docs"]
    freshness["search"] = [
        d["_source"]["__cdc"]["applied_ms"] - d["_source"]["__cdc"]["ts_ms"] for d in docs if d.get("found")
    ]

    r = redis.Redis.from_url(redis_url)
    gen = int(r.get(f"{prefix}:current") or 1)
    pipe = r.pipeline()
    for i in ids:
        pipe.hmget(f"{prefix}:g{gen}:public.events:[{i}]", "applied_ms", "ts_ms")
    freshness["cache"] = [int(a) - int(t) for a, t in pipe.execute() if a]
    spark = spark_session(settings, "pgcdc-sinks-bench-read")
    current = (work / "warehouse" / "_cdc_current").read_text().strip()
    rows = (
        spark.read.format("delta")
        .load(str(work / "warehouse" / f"g{current}" / "public.events"))
        .where(f"id >= {first}")
        .select("__applied_ms", "__ts_ms")
        .collect()
    )
    freshness["warehouse"] = [float(x["__applied_ms"] - x["__ts_ms"]) for x in rows]
    spark.stop()

    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "rows": args.rows,
        "max_offsets_per_trigger": args.max_offsets,
        "throughput_events_per_s": {k: round(v) for k, v in throughput.items()},
        "ratio_to_reference": {k: round(v / throughput["reference"], 2) for k, v in throughput.items()},
        "freshness_ms": {
            k: {
                "probes": len(v),
                "seen": f"{len(v)}/{n}",
                "p50": _percentile(v, 50),
                "p99": _percentile(v, 99),
                "mean": round(statistics.fmean(v)) if v else None,
            }
            for k, v in freshness.items()
        },
        "freshness_load": f"{args.rate} single-row transactions/s for {args.freshness_seconds:.0f} s, 3 sinks at once",
    }
    out = ROOT / "bench" / "results" / f"sinks-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (prefix,)
        )
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
