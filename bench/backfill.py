#!/usr/bin/env python3
"""Backfill while streaming: a large table read again while changes stream on other tables, in one run.

    ./dev python -m bench.backfill [--rows 5000000] [--rate 2000] [--seconds 20]

Creates a scratch database with the snapshot scenario's table (``--rows`` rows: bigint key, text, int, numeric,
boolean, timestamptz, jsonb; VACUUM ANALYZEd, CHECKPOINTed and read once) and a small table the stream load
updates. Then
1. the reference: `cdc run` with ``capture.snapshot = "initial"`` and ``snapshot_scan_max_mb = 0`` (the table read
   in key order, as a backfill reads it) on a fresh slot, timed from "snapshot of 1 table(s)" to "snapshot done";
2. ours: `cdc run` on a second slot capturing both tables with no snapshot; pgbench commits single-row UPDATEs
   of the small table at ``--rate`` transactions/s (paced, ``-R``) and a read_committed consumer measures each
   event's commit -> readable-in-Kafka latency (as the latency scenario does). After ``--seconds`` of that
   (the latency without a backfill), `cdc snapshot public.big` asks for the backfill; it is timed from the log's
   "backfill … started" to "… done" lines, and the latency is measured over the same time.
Measures: backfill rows/s (target: at least 0.5 of the key-order snapshot's), the stream's p99 latency during the
backfill (target: at most 2x the same run's p99 without it, and under 150 ms), the capture's CPU and peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition
from pgcdc_dev import discovery
from pgcdc_dev.bench.report import Measure, Result, percentile, write_result
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql

from bench import _debezium as dbz
from bench._capture_bench import drop_slots, dsn_for, stop_process
from bench.capture_latency import _SCRIPT, _Decoder
from bench.snapshot import _CREATE, _FILL

SCENARIO = "backfill"
BIG, SMALL = "big", "lat"
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5_000_000, help="rows of the backfilled table")
    ap.add_argument("--rate", type=float, default=2000.0, help="stream load, transactions/s on the small table")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of load measured before the backfill")
    ap.add_argument("--writers", type=int, default=4, help="pgbench clients")
    ap.add_argument("--chunk-rows", type=int, default=None, help="capture.backfill_chunk_rows (default: its default)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    return ap


def _config(path: Path, dsn: str, *, kafka: str, registry: str, prefix: str, slot: str, extra: str) -> Path:
    tables = f'["public.{BIG}"]' if "initial" in extra else f'["public.{SMALL}", "public.{BIG}"]'
    path.write_text(
        f'[source]\ndsn = "{dsn}"\ntables = {tables}\nslot = "{slot}"\npublication = "{slot}"\n'
        f'signal_table = "public.signal_{slot}"\n'
        f'[kafka]\nbootstrap_servers = "{kafka}"\ntopic_prefix = "{prefix}"\n'
        f'[registry]\nurl = "{registry}"\n[metrics]\nport = 0\n[capture]\n{extra}\n'
    )
    return path


def _start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pgcdc", "--log-level", "info", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _log_time(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """The time (epoch seconds) of the first log line containing ``text``, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m and text in line:
                return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if proc.poll() is not None:
            raise RuntimeError(f"cdc run exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"no {text!r} in {log} within {timeout:.0f} s")


class _Latency:
    """A read_committed consumer of the small table's topic: (commit time s, latency ms) per streamed event."""

    def __init__(self, kafka: str, registry: str, topic: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._decoder = _Decoder(registry)
        self._consumer = Consumer(
            {
                "bootstrap.servers": kafka,
                "group.id": f"{topic}-latency",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
                "fetch.min.bytes": 1,
            }
        )
        deadline = time.monotonic() + 60
        while True:  # the topic is made by the capture at the table's first change
            md = self._consumer.list_topics(topic, timeout=30)
            if topic in md.topics and md.topics[topic].error is None and md.topics[topic].partitions:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic} was not created")
            time.sleep(0.2)
        self._consumer.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            first = self._consumer.poll(0.05)
            msgs = [] if first is None else [first, *self._consumer.consume(1000, 0)]
            now = time.time()
            for msg in msgs:
                data = msg.value()
                if msg.error() is not None or not data:
                    continue
                value = self._decoder.value(data)
                if value["op"] != "r":
                    commit_s = value["source"]["ts_us"] / 1e6
                    self.samples.append((commit_s, (now - commit_s) * 1000))

    def p99(self, start: float, end: float) -> tuple[float, int]:
        window = sorted(ms for at, ms in self.samples if start <= at < end)
        return (percentile(window, 99) if window else math.nan), len(window)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def _fill(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_CREATE).format(sql.Identifier(BIG)))
        step = 1_000_000
        for low in range(1, rows + 1, step):
            conn.execute(sql.SQL(_FILL).format(sql.Identifier(BIG)), (low, min(rows, low + step - 1)))
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL)").format(
                sql.Identifier(SMALL)
            )
        )
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT g, 0, now() FROM generate_series(1, 1000) g").format(sql.Identifier(SMALL))
        )
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
        conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(BIG)))


def _reference(dsn: str, work: Path, *, kafka: str, registry: str, prefix: str, rows: int, timeout: float) -> float:
    """The key-order snapshot's rows/s."""
    config = _config(
        work / "ref.toml",
        dsn,
        kafka=kafka,
        registry=registry,
        prefix=f"{prefix}_ref",
        slot=f"{prefix}_ref",
        extra='snapshot = "initial"\nsnapshot_scan_max_mb = 0',
    )
    proc = _start(config, work / "ref.log")
    try:
        began = _log_time(work / "ref.log", "snapshot of 1 table(s)", proc, 300)
        done = _log_time(work / "ref.log", "snapshot done", proc, timeout)
    finally:
        stop_process(proc)
    return rows / (done - began)


def _pgbench(dsn: str, work: Path, rate: float, writers: int, seconds: float) -> subprocess.Popen[bytes]:
    with psycopg.connect(dsn) as conn:
        bindir = conn.execute("SELECT setting FROM pg_config() WHERE name = 'BINDIR'").fetchone()
        quoted = sql.Identifier(SMALL).as_string(conn)
    assert bindir is not None
    script = work / "update.sql"
    script.write_text(_SCRIPT.format(rows=1000, table=quoted))
    return subprocess.Popen(
        [
            str(Path(bindir[0]) / "pgbench"),
            "-n",
            "-f",
            str(script),
            "-R",
            str(rate),
            "-T",
            str(math.ceil(seconds)),
            "-c",
            str(writers),
            "-j",
            str(writers),
            "-M",
            "prepared",
            dsn,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)
    admin, kafka, registry = (discovery.find(n).value for n in ("postgres", "kafka", "registry"))
    prefix = f"bench_bf_{int(time.time())}"
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-backfill-"))
    result = Result(
        SCENARIO, params={"rows": args.rows, "rate": args.rate, "seconds": args.seconds, "writers": args.writers}
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(prefix)))
    dsn = dsn_for(admin, prefix)
    proc: subprocess.Popen[bytes] | None = None
    load: subprocess.Popen[bytes] | None = None
    latency: _Latency | None = None
    try:
        _fill(dsn, args.rows)
        ref_rate = _reference(
            dsn, work, kafka=kafka, registry=registry, prefix=prefix, rows=args.rows, timeout=args.timeout
        )
        print(f"key-order snapshot: {ref_rate:,.0f} rows/s", file=sys.stderr)
        config = _config(
            work / "cdc.toml",
            dsn,
            kafka=kafka,
            registry=registry,
            prefix=prefix,
            slot=prefix,
            extra='snapshot = "never"' + (f"\nbackfill_chunk_rows = {args.chunk_rows}" if args.chunk_rows else ""),
        )
        proc = _start(config, work / "cdc.log")
        _log_time(work / "cdc.log", "streaming from slot", proc, 300)
        load = _pgbench(dsn, work, args.rate, args.writers, args.timeout)
        latency = _Latency(kafka, registry, f"{prefix}.public.{SMALL}")
        time.sleep(3)  # warm-up
        quiet = (time.time(), time.time() + args.seconds)
        time.sleep(args.seconds)
        asked = subprocess.run(
            [sys.executable, "-m", "pgcdc", "snapshot", f"public.{BIG}", "--config", str(config)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(asked.stdout.strip(), file=sys.stderr)
        cpu0 = dbz.cpu_seconds(proc.pid)
        began = _log_time(work / "cdc.log", f"of public.{BIG} started", proc, 120)
        done = _log_time(work / "cdc.log", f"of public.{BIG} done", proc, args.timeout)
        cpu = dbz.cpu_seconds(proc.pid) - cpu0
        peak = dbz.peak_rss_mb(proc.pid)
        time.sleep(2)  # the last events of the window reach the consumer
        p99_quiet, n_quiet = latency.p99(*quiet)
        p99_during, n_during = latency.p99(began, done)
    finally:
        if load is not None:
            load.kill()
        if latency is not None:
            latency.close()
        stop_process(proc)
        drop_slots(admin, prefix)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(prefix)))
        with contextlib.suppress(Exception):
            topics = [f"{prefix}.public.{BIG}", f"{prefix}.public.{SMALL}", f"{prefix}_ref.public.{BIG}"]
            delete_topics(kafka, [*topics, f"{prefix}.offsets", f"{prefix}_ref.offsets"])
            dbz.delete_subjects(registry, topics)
    rate = args.rows / (done - began)
    result.measures += [
        Measure(
            "backfill rows/s",
            "rows/s",
            round(rate),
            reference=round(ref_rate),
            reference_name="snapshot in key order",
            target_ratio=0.5,
            note="from the log's 'backfill … started' to '… done'; the reference is `cdc run`'s initial snapshot "
            "of the same table with snapshot_scan_max_mb = 0",
        ),
        Measure(
            "stream p99 during the backfill",
            "ms",
            round(p99_during, 1),
            reference=round(p99_quiet, 1),
            reference_name="p99 without a backfill",
            higher_is_better=False,
            target_ratio=0.5,
            note=f"commit -> readable (read_committed) of {n_during:,} events during the backfill, against "
            f"{n_quiet:,} in the {args.seconds:g} s before it; pgbench -R {args.rate:g}",
        ),
        Measure(
            "stream p99 during the backfill (absolute)", "ms", round(p99_during, 1), higher_is_better=False, limit=150
        ),
        Measure("capture CPU during the backfill", "cores", round(cpu / (done - began), 2), higher_is_better=False),
        Measure("capture peak RSS", "MB", peak, higher_is_better=False),
    ]
    result.notes.append(f"logs: {work}")
    return result


if __name__ == "__main__":
    write_result(run())
