#!/usr/bin/env python3
"""Capture latency: commit in PostgreSQL to readable in Kafka (read_committed), under a fixed offered load.

    ./dev python -m bench.capture_latency [--rate 2000] [--seconds 30] [--writers 4]

Creates a scratch database with a small table (``--table-rows`` rows), starts `cdc run` on it (the table's
snapshot is tiny) and waits until it streams. Then pgbench, ``--writers`` clients, commits single-row UPDATE
transactions paced at ``--rate`` transactions/s in all (``pgbench -R``: a schedule, not a closed loop) for
``--warmup-seconds`` (not measured) plus ``--seconds``. Meanwhile a confluent-kafka consumer (read_committed,
fetch.wait.max.ms 10) reads the table's topic and decodes each value with fastavro and the writer schema from
the registry; per event, latency = the wall-clock time the consumer got it - ``source.ts_us`` (PostgreSQL's
commit timestamp). Consumer and PostgreSQL run on the same machine, so their clocks agree.

Measures: p50 and p99 latency (limits 10 ms and 50 ms) and the achieved transaction rate (committed events whose
commit time falls in the measured window, per second), plus the capture's CPU and peak RSS. Result.series holds a
latency histogram, p50/p99 per second and up to 5,000 evenly spaced raw samples.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fastavro
import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from pgcdc_dev import discovery
from pgcdc_dev.bench.report import Measure, Result, percentile, write_result
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql

from bench import _debezium as dbz
from bench._capture_bench import dsn_for, stop_process

SCENARIO = "latency"
TABLE = "lat"

# The load: pgbench (C, paced with -R) so that generating 2,000 transactions/s leaves the 2 cores to PostgreSQL,
# Kafka and the capture; Python writer processes took half a core more and made the box, not the capture, the
# bottleneck (run queue 5-17). One statement per transaction, the row picked at random.
_SCRIPT = """\\set id random(1, {rows})
UPDATE {table} SET v = v + 1, at = now() WHERE id = :id;
"""
_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_LAG = re.compile(r"schedule lag: avg ([\d.]+) \(max ([\d.]+)\) ms")


class _Decoder:
    """Confluent-framed Avro values -> dicts, with the writer schemas fetched once by id."""

    def __init__(self, registry: str) -> None:
        self._client = SchemaRegistryClient({"url": registry, "timeout": 30})
        self._schemas: dict[int, Any] = {}

    def value(self, data: bytes) -> dict[str, Any]:
        if len(data) < 5 or data[0] != 0:
            raise ValueError("not a Confluent-framed Avro value")
        (schema_id,) = struct.unpack_from(">I", data, 1)
        schema = self._schemas.get(schema_id)
        if schema is None:
            text = self._client.get_schema(schema_id).schema_str
            assert text is not None
            schema = self._schemas[schema_id] = fastavro.parse_schema(json.loads(text))
        record = fastavro.schemaless_reader(io.BytesIO(data[5:]), schema)
        assert isinstance(record, dict)
        return record


def _histogram(samples: list[float]) -> dict[str, list[float]]:
    """Counts per latency bucket (ms), buckets growing by a quarter of a power of two from 0.25 ms."""
    edges = [0.25 * 2 ** (i / 4) for i in range(0, 80)]
    counts = [0] * (len(edges) + 1)
    for s in samples:
        i = 0 if s <= edges[0] else min(len(edges), int(math.log2(s / 0.25) * 4) + 1)
        counts[i] += 1
    last = max((i for i, c in enumerate(counts) if c), default=0)
    return {"upper_ms": [round(e, 3) for e in edges[: last + 1]], "count": [float(c) for c in counts[: last + 1]]}


def _wait_streaming(proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "streaming from slot" in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"cdc run exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"cdc run did not start streaming within {timeout:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2000.0, help="offered load, transactions/s over all writers")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds of load")
    ap.add_argument("--warmup-seconds", type=float, default=5.0, help="load before the measured window")
    ap.add_argument("--writers", type=int, default=4, help="pgbench clients (one connection each)")
    ap.add_argument("--table-rows", type=int, default=1000)
    ap.add_argument("--drain-seconds", type=float, default=30.0, help="after the load: wait this long at most")
    return ap


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)

    admin = discovery.find("postgres").value
    kafka = discovery.find("kafka").value
    registry = discovery.find("registry").value
    prefix = f"bench_lat_{int(time.time())}"
    db = prefix
    topic = f"{prefix}.public.{TABLE}"
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-latency-"))
    result = Result(
        SCENARIO,
        params={
            "rate_offered": args.rate,
            "seconds": args.seconds,
            "warmup_seconds": args.warmup_seconds,
            "writers": args.writers,
            "table_rows": args.table_rows,
            "transaction": "UPDATE of one row (bigint key, int, timestamptz), autocommit",
        },
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    dsn = dsn_for(admin, db)
    proc: subprocess.Popen[bytes] | None = None
    consumer: Consumer | None = None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL)").format(
                    sql.Identifier(TABLE)
                )
            )
            conn.execute(
                sql.SQL("INSERT INTO {} SELECT g, 0, now() FROM generate_series(1, %s) g").format(
                    sql.Identifier(TABLE)
                ),
                (args.table_rows,),
            )
        config = work / "cdc.toml"
        config.write_text(
            f'[source]\ndsn = "{dsn}"\ntables = ["public.{TABLE}"]\nslot = "{prefix}"\npublication = "{prefix}"\n'
            f'[kafka]\nbootstrap_servers = "{kafka}"\ntopic_prefix = "{prefix}"\n'
            f'[registry]\nurl = "{registry}"\n[metrics]\nport = 0\n[capture]\nsnapshot = "initial"\n'
        )
        log = work / "cdc.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pgcdc", "--log-level", "info", "run", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_streaming(proc, log)

        decoder = _Decoder(registry)
        consumer = Consumer(
            {
                "bootstrap.servers": kafka,
                "group.id": f"{prefix}-latency",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
                "fetch.min.bytes": 1,
            }
        )
        md = consumer.list_topics(topic, timeout=30)
        consumer.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])

        with psycopg.connect(dsn) as conn:
            bindir = conn.execute("SELECT setting FROM pg_config() WHERE name = 'BINDIR'").fetchone()
            quoted = sql.Identifier(TABLE).as_string(conn)
        assert bindir is not None
        script = work / "update.sql"
        script.write_text(_SCRIPT.format(rows=args.table_rows, table=quoted))
        start = time.time() + 0.5  # pgbench's connections are open by then
        window = (start + args.warmup_seconds, start + args.warmup_seconds + args.seconds)
        writers = [
            subprocess.Popen(
                [
                    str(Path(bindir[0]) / "pgbench"),
                    "-n",
                    "-f",
                    str(script),
                    "-R",
                    str(args.rate),
                    "-T",
                    str(math.ceil(args.warmup_seconds + args.seconds + 0.5)),
                    "-c",
                    str(args.writers),
                    "-j",
                    str(args.writers),
                    "-M",
                    "prepared",
                    dsn,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        ]
        cpu0 = dbz.cpu_seconds(proc.pid)
        # The measuring loop must not pause: a full collection of this process's heap (fastavro's schemas,
        # confluent-kafka, psycopg: 40-80 ms here) in the window added its length to every event
        # consumed after it. Nothing here makes cyclic garbage worth collecting during one run.
        gc.collect()
        gc.freeze()
        gc.disable()
        samples: list[tuple[float, float]] = []  # (commit time s, latency ms) of events committed in the window
        # The two legs of each latency: commit -> the capture read the transaction (the event's ts_us, stamped at
        # its Begin), and from there -> readable by a read_committed consumer (encode, Kafka commit, fetch).
        legs: list[tuple[float, float]] = []
        streamed = 0
        sent: int | None = None
        behind = ""
        drain_deadline = math.inf
        while time.time() < drain_deadline:
            # consume(n, timeout) waits the whole timeout unless n messages arrive: that would add up to the
            # timeout to every latency. poll() returns at the first message; consume(n, 0) takes what else is there.
            first = consumer.poll(0.05)
            msgs = [] if first is None else [first, *consumer.consume(1000, 0)]
            now = time.time()
            for msg in msgs:
                if msg.error() is not None:
                    raise RuntimeError(str(msg.error()))
                data = msg.value()
                if not data:
                    continue  # a tombstone
                value = decoder.value(data)
                if value["op"] == "r":
                    continue  # the snapshot
                streamed += 1
                commit_s = value["source"]["ts_us"] / 1e6
                if window[0] <= commit_s < window[1]:
                    samples.append((commit_s, (now - commit_s) * 1000))
                    seen_s = value["ts_us"] / 1e6
                    legs.append(((seen_s - commit_s) * 1000, (now - seen_s) * 1000))
            if sent is None and all(w.poll() is not None for w in writers):
                report = writers[0].communicate()[0].decode()
                processed = _PROCESSED.search(report)
                if writers[0].returncode != 0 or processed is None:
                    raise RuntimeError(f"pgbench failed (exit {writers[0].returncode}): {report[-2000:]}")
                sent = int(processed.group(1))
                lag = _LAG.search(report)
                behind = f"schedule lag avg {lag.group(1)} ms, max {lag.group(2)} ms" if lag else "no schedule lag"
                drain_deadline = time.time() + args.drain_seconds
            if sent is not None and streamed >= sent:
                break
        gc.enable()
        cpu = dbz.cpu_seconds(proc.pid) - cpu0
        peak = dbz.peak_rss_mb(proc.pid)
    finally:
        if consumer is not None:
            consumer.close()
        stop_process(proc)
        with psycopg.connect(admin, autocommit=True) as conn:
            for _ in range(50):
                try:
                    conn.execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                        (prefix,),
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.2)
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
        with contextlib.suppress(Exception):
            delete_topics(kafka, [topic, f"{prefix}.offsets"])
            dbz.delete_subjects(registry, [topic])

    latencies = sorted(s[1] for s in samples)
    achieved = len(samples) / args.seconds
    missing = (sent or 0) - streamed
    result.measures += [
        Measure("p50 latency", "ms", round(percentile(latencies, 50), 2), higher_is_better=False, limit=10),
        Measure("p99 latency", "ms", round(percentile(latencies, 99), 2), higher_is_better=False, limit=50),
        Measure(
            "achieved txn/s",
            "txn/s",
            round(achieved),
            reference=args.rate,
            reference_name="offered load",
            note=f"pgbench -R, {args.writers} clients; committed events whose commit time is in the measured window",
        ),
        Measure(
            "capture CPU",
            "cores",
            round(cpu / (args.warmup_seconds + args.seconds), 2),
            higher_is_better=False,
            note="CPU seconds of `cdc run` over the load, per second of load",
        ),
        Measure("capture peak RSS", "MB", peak, higher_is_better=False),
    ]
    result.notes += [
        f"latency = consumer wall clock when the record was returned - source.ts_us (commit time); "
        f"max {latencies[-1] if latencies else float('nan'):.1f} ms, mean "
        f"{sum(latencies) / len(latencies) if latencies else float('nan'):.1f} ms over {len(latencies):,} events",
        "legs, p50/p99 ms: commit -> read by the capture "
        f"{percentile(sorted(x[0] for x in legs), 50):.1f}/{percentile(sorted(x[0] for x in legs), 99):.1f}, "
        "read by the capture -> readable in Kafka "
        f"{percentile(sorted(x[1] for x in legs), 50):.1f}/{percentile(sorted(x[1] for x in legs), 99):.1f}",
        f"pgbench committed {sent} transactions ({behind}); "
        f"{streamed} streamed events read back ({missing} missing after the drain)",
        "consumer: confluent-kafka, isolation.level=read_committed, fetch.wait.max.ms=10; the capture commits a "
        "Kafka transaction whenever it has read everything PostgreSQL sent (cdc/_stream.py, cdc/_batch.py)",
        f"logs: {work}",
    ]
    per_second: list[dict[str, float]] = []
    for sec in range(math.ceil(args.seconds)):
        lo = window[0] + sec
        chunk = sorted(s[1] for s in samples if lo <= s[0] < lo + 1)
        if chunk:
            per_second.append(
                {
                    "t_s": float(sec),
                    "txn": float(len(chunk)),
                    "p50_ms": round(percentile(chunk, 50), 2),
                    "p99_ms": round(percentile(chunk, 99), 2),
                }
            )
    step = max(1, len(samples) // 5000)
    result.series = {
        "latency_histogram_ms": _histogram(latencies),
        "per_second": per_second,
        "samples": {
            "t_s": [round(s[0] - window[0], 4) for s in samples[::step]],
            "latency_ms": [round(s[1], 2) for s in samples[::step]],
        },
    }
    return result


if __name__ == "__main__":
    write_result(run())
