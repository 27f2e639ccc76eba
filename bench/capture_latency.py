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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
import psycopg
from confluent_kafka import Consumer, Message, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from pgcdc_dev.bench.report import Measure, Result, percentile, write_result
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql

from bench import _capture_bench as cb
from bench import _debezium as dbz
from bench._capture_bench import stop_process

SCENARIO = "latency"
TABLE = "lat"

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


@dataclass
class _Seen:
    """What the consumer read: per event committed in the measured window, (commit time s, latency ms) and the
    latency's two legs (ms); every streamed event counted; pgbench's transactions and schedule lag, once it ended."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    # The two legs of each latency: commit -> the capture read the transaction (the event's ts_us, stamped at
    # its Begin), and from there -> readable by a read_committed consumer (encode, Kafka commit, fetch).
    legs: list[tuple[float, float]] = field(default_factory=list)
    streamed: int = 0
    sent: int | None = None
    behind: str = ""


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)

    db = cb.own_database("bench_lat", "latency")
    topic = f"{db.prefix}.public.{TABLE}"
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
    proc: subprocess.Popen[bytes] | None = None
    consumer: Consumer | None = None
    try:
        _create_table(db.dsn, args.table_rows)
        proc = cb.launch_cdc(cb.snapshot_config(db.work / "cdc.toml", db, TABLE), db.work / "cdc.log")
        _wait_streaming(proc, db.work / "cdc.log")

        decoder = _Decoder(db.ep.registry)
        consumer = cb.latency_consumer(db.ep.kafka, f"{db.prefix}-latency")
        md = consumer.list_topics(topic, timeout=30)
        consumer.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])

        window, writers = _start_load(db, args)
        cpu0 = dbz.cpu_seconds(proc.pid)
        # The measuring loop must not pause: a full collection of this process's heap (fastavro's schemas,
        # confluent-kafka, psycopg: 40-80 ms here) in the window added its length to every event
        # consumed after it. Nothing here makes cyclic garbage worth collecting during one run.
        gc.collect()
        gc.freeze()
        gc.disable()
        seen = _consume(consumer, decoder, writers, window, args.drain_seconds)
        gc.enable()
        cpu = dbz.cpu_seconds(proc.pid) - cpu0
        peak = dbz.peak_rss_mb(proc.pid)
    finally:
        if consumer is not None:
            consumer.close()
        stop_process(proc)
        _drop(db, topic)

    latencies = sorted(s[1] for s in seen.samples)
    result.measures += _measures(args, latencies, len(seen.samples) / args.seconds, cpu, peak)
    result.notes += _notes(seen, latencies, db.work)
    result.series = _series(seen.samples, latencies, window, args.seconds)
    return result


def _create_table(dsn: str, rows: int) -> None:
    """The table the load updates, ``rows`` rows of it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL)").format(
                sql.Identifier(TABLE)
            )
        )
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT g, 0, now() FROM generate_series(1, %s) g").format(sql.Identifier(TABLE)),
            (rows,),
        )


def _start_load(
    db: cb.OwnDatabase, args: argparse.Namespace
) -> tuple[tuple[float, float], list[subprocess.Popen[bytes]]]:
    """pgbench's paced updates for the warm-up and the measured seconds: the measured window (epoch s) and the
    writers."""
    # The load: pgbench (C, paced with -R) so that generating 2,000 transactions/s leaves the 2 cores to
    # PostgreSQL, Kafka and the capture; Python writer processes took half a core more and made the box, not the
    # capture, the bottleneck (run queue 5-17). One statement per transaction, the row picked at random.
    seconds = math.ceil(args.warmup_seconds + args.seconds + 0.5)
    load = cb.PacedLoad(TABLE, args.table_rows, args.rate, args.writers, seconds, report=True)
    files = cb.paced_script(db.dsn, db.work, load)
    start = time.time() + 0.5  # pgbench's connections are open by then
    window = (start + args.warmup_seconds, start + args.warmup_seconds + args.seconds)
    return window, [cb.start_paced(db.dsn, files, load)]


def _consume(
    consumer: Consumer,
    decoder: _Decoder,
    writers: list[subprocess.Popen[bytes]],
    window: tuple[float, float],
    drain_seconds: float,
) -> _Seen:
    """Reads the topic until every transaction pgbench committed was read back, or ``drain_seconds`` after
    pgbench ended."""
    seen = _Seen()
    drain_deadline = math.inf
    while time.time() < drain_deadline:
        # consume(n, timeout) waits the whole timeout unless n messages arrive: that would add up to the
        # timeout to every latency. poll() returns at the first message; consume(n, 0) takes what else is there.
        first = consumer.poll(0.05)
        msgs = [] if first is None else [first, *consumer.consume(1000, 0)]
        _take(msgs, time.time(), decoder, window, seen)
        if seen.sent is None and all(w.poll() is not None for w in writers):
            _pgbench_ended(writers[0], seen)
            drain_deadline = time.time() + drain_seconds
        if seen.sent is not None and seen.streamed >= seen.sent:
            break
    return seen


def _take(msgs: list[Message], now: float, decoder: _Decoder, window: tuple[float, float], seen: _Seen) -> None:
    """Counts the streamed events of ``msgs`` (got at ``now``); those committed in ``window`` are samples."""
    for msg in msgs:
        if msg.error() is not None:
            raise RuntimeError(str(msg.error()))
        data = msg.value()
        if not data:
            continue  # a tombstone
        value = decoder.value(data)
        if value["op"] == "r":
            continue  # the snapshot
        seen.streamed += 1
        commit_s = value["source"]["ts_us"] / 1e6
        if window[0] <= commit_s < window[1]:
            seen.samples.append((commit_s, (now - commit_s) * 1000))
            seen_s = value["ts_us"] / 1e6
            seen.legs.append(((seen_s - commit_s) * 1000, (now - seen_s) * 1000))


def _pgbench_ended(writer: subprocess.Popen[bytes], seen: _Seen) -> None:
    """pgbench's committed transactions and schedule lag, from its report."""
    report = writer.communicate()[0].decode()
    processed = _PROCESSED.search(report)
    if writer.returncode != 0 or processed is None:
        raise RuntimeError(f"pgbench failed (exit {writer.returncode}): {report[-2000:]}")
    seen.sent = int(processed.group(1))
    lag = _LAG.search(report)
    seen.behind = f"schedule lag avg {lag.group(1)} ms, max {lag.group(2)} ms" if lag else "no schedule lag"


def _drop(db: cb.OwnDatabase, topic: str) -> None:
    """The slot, once `cdc run` let go of it, the database, and (best effort) the topics and subjects."""
    with psycopg.connect(db.ep.admin, autocommit=True) as conn:
        cb.drop_slot_when_free(conn, db.prefix)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db.prefix)))
    with contextlib.suppress(Exception):
        delete_topics(db.ep.kafka, [topic, f"{db.prefix}.offsets"])
        dbz.delete_subjects(db.ep.registry, [topic])


def _measures(
    args: argparse.Namespace, latencies: list[float], achieved: float, cpu: float, peak: float
) -> list[Measure]:
    """p50 and p99 latency against their limits, the achieved rate against the offered one, the capture's CPU
    and peak RSS."""
    return [
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


def _notes(seen: _Seen, latencies: list[float], work: Path) -> list[str]:
    """The latencies' max and mean, their two legs, what pgbench committed against what was read back, how the
    consumer reads, and where the logs are."""
    legs = seen.legs
    missing = (seen.sent or 0) - seen.streamed
    return [
        f"latency = consumer wall clock when the record was returned - source.ts_us (commit time); "
        f"max {latencies[-1] if latencies else float('nan'):.1f} ms, mean "
        f"{sum(latencies) / len(latencies) if latencies else float('nan'):.1f} ms over {len(latencies):,} events",
        "legs, p50/p99 ms: commit -> read by the capture "
        f"{percentile(sorted(x[0] for x in legs), 50):.1f}/{percentile(sorted(x[0] for x in legs), 99):.1f}, "
        "read by the capture -> readable in Kafka "
        f"{percentile(sorted(x[1] for x in legs), 50):.1f}/{percentile(sorted(x[1] for x in legs), 99):.1f}",
        f"pgbench committed {seen.sent} transactions ({seen.behind}); "
        f"{seen.streamed} streamed events read back ({missing} missing after the drain)",
        "consumer: confluent-kafka, isolation.level=read_committed, fetch.wait.max.ms=10; the capture commits a "
        "Kafka transaction whenever it has read everything PostgreSQL sent (cdc/_stream.py, cdc/_batch.py)",
        f"logs: {work}",
    ]


def _series(
    samples: list[tuple[float, float]], latencies: list[float], window: tuple[float, float], seconds: float
) -> dict[str, Any]:
    """A latency histogram, p50/p99 per second of the window and up to 5,000 evenly spaced samples."""
    per_second: list[dict[str, float]] = []
    for sec in range(math.ceil(seconds)):
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
    return {
        "latency_histogram_ms": _histogram(latencies),
        "per_second": per_second,
        "samples": {
            "t_s": [round(s[0] - window[0], 4) for s in samples[::step]],
            "latency_ms": [round(s[1], 2) for s in samples[::step]],
        },
    }


if __name__ == "__main__":
    write_result(run())
