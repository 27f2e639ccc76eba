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
import datetime as dt
import math
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka import TopicPartition
from pgcdc_dev.bench.report import Measure, Result, percentile, write_result
from psycopg import sql

from bench import _capture_bench as cb
from bench import _debezium as dbz
from bench._capture_bench import stop_process
from bench.capture_latency import _Decoder
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


def _config(path: Path, db: cb.OwnDatabase, name: str, extra: str) -> Path:
    """`cdc run`'s configuration: slot, publication and topics named ``name``; ``extra`` ends its [capture]."""
    tables = f'["public.{BIG}"]' if "initial" in extra else f'["public.{SMALL}", "public.{BIG}"]'
    path.write_text(
        f'[source]\ndsn = "{db.dsn}"\ntables = {tables}\nslot = "{name}"\npublication = "{name}"\n'
        f'signal_table = "public.signal_{name}"\n'
        f'[kafka]\nbootstrap_servers = "{db.ep.kafka}"\ntopic_prefix = "{name}"\n'
        f'[registry]\nurl = "{db.ep.registry}"\n[metrics]\nport = 0\n[capture]\n{extra}\n'
    )
    return path


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
        self._consumer = cb.latency_consumer(kafka, f"{topic}-latency")
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


def _reference(db: cb.OwnDatabase, rows: int, timeout: float) -> float:
    """The key-order snapshot's rows/s."""
    config = _config(db.work / "ref.toml", db, f"{db.prefix}_ref", 'snapshot = "initial"\nsnapshot_scan_max_mb = 0')
    proc = cb.launch_cdc(config, db.work / "ref.log")
    try:
        began = _log_time(db.work / "ref.log", "snapshot of 1 table(s)", proc, 300)
        done = _log_time(db.work / "ref.log", "snapshot done", proc, timeout)
    finally:
        stop_process(proc)
    return rows / (done - began)


def _pgbench(db: cb.OwnDatabase, rate: float, writers: int, seconds: float) -> subprocess.Popen[bytes]:
    """pgbench's paced updates of the small table, ``seconds`` long at most (it is killed at the run's end)."""
    load = cb.PacedLoad(SMALL, 1000, rate, writers, math.ceil(seconds))
    return cb.start_paced(db.dsn, cb.paced_script(db.dsn, db.work, load), load)


@dataclass(frozen=True)
class _Backfill:
    """The backfill as the capture's log dates it (epoch s), the capture's CPU seconds over it and its peak RSS."""

    began: float
    done: float
    cpu: float
    peak: float


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)
    db = cb.own_database("bench_bf", "backfill")
    result = Result(
        SCENARIO, params={"rows": args.rows, "rate": args.rate, "seconds": args.seconds, "writers": args.writers}
    )
    proc: subprocess.Popen[bytes] | None = None
    load: subprocess.Popen[bytes] | None = None
    latency: _Latency | None = None
    try:
        _fill(db.dsn, args.rows)
        ref_rate = _reference(db, args.rows, args.timeout)
        print(f"key-order snapshot: {ref_rate:,.0f} rows/s", file=sys.stderr)
        chunks = f"\nbackfill_chunk_rows = {args.chunk_rows}" if args.chunk_rows else ""
        config = _config(db.work / "cdc.toml", db, db.prefix, 'snapshot = "never"' + chunks)
        proc = cb.launch_cdc(config, db.work / "cdc.log")
        _log_time(db.work / "cdc.log", "streaming from slot", proc, 300)
        load = _pgbench(db, args.rate, args.writers, args.timeout)
        latency = _Latency(db.ep.kafka, db.ep.registry, f"{db.prefix}.public.{SMALL}")
        time.sleep(3)  # warm-up
        quiet = (time.time(), time.time() + args.seconds)
        time.sleep(args.seconds)
        backfill = _backfill(config, proc, db.work / "cdc.log", args.timeout)
        time.sleep(2)  # the last events of the window reach the consumer
        p99_quiet = latency.p99(*quiet)
        p99_during = latency.p99(backfill.began, backfill.done)
    finally:
        if load is not None:
            load.kill()
        if latency is not None:
            latency.close()
        stop_process(proc)
        topics = [f"{db.prefix}.public.{BIG}", f"{db.prefix}.public.{SMALL}", f"{db.prefix}_ref.public.{BIG}"]
        cb.drop_own_database(db, topics, [db.prefix, f"{db.prefix}_ref"])
    result.measures += _measures(args, ref_rate, backfill, p99_quiet, p99_during)
    result.notes.append(f"logs: {db.work}")
    return result


def _backfill(config: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> _Backfill:
    """`cdc snapshot` asks the running capture for the big table's backfill, which is waited for."""
    asked = subprocess.run(
        [sys.executable, "-m", "pgcdc", "snapshot", f"public.{BIG}", "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
    )
    print(asked.stdout.strip(), file=sys.stderr)
    cpu0 = dbz.cpu_seconds(proc.pid)
    began = _log_time(log, f"of public.{BIG} started", proc, 120)
    done = _log_time(log, f"of public.{BIG} done", proc, timeout)
    cpu = dbz.cpu_seconds(proc.pid) - cpu0
    return _Backfill(began=began, done=done, cpu=cpu, peak=dbz.peak_rss_mb(proc.pid))


def _measures(
    args: argparse.Namespace,
    ref_rate: float,
    backfill: _Backfill,
    p99_quiet: tuple[float, int],
    p99_during: tuple[float, int],
) -> list[Measure]:
    """The backfill's rows/s against the key-order snapshot's, the stream's p99 during it against before it, and
    the capture's CPU and peak RSS."""
    seconds = backfill.done - backfill.began
    (quiet, n_quiet), (during, n_during) = p99_quiet, p99_during
    return [
        Measure(
            "backfill rows/s",
            "rows/s",
            round(args.rows / seconds),
            reference=round(ref_rate),
            reference_name="snapshot in key order",
            target_ratio=0.5,
            note="from the log's 'backfill … started' to '… done'; the reference is `cdc run`'s initial snapshot "
            "of the same table with snapshot_scan_max_mb = 0",
        ),
        Measure(
            "stream p99 during the backfill",
            "ms",
            round(during, 1),
            reference=round(quiet, 1),
            reference_name="p99 without a backfill",
            higher_is_better=False,
            target_ratio=0.5,
            note=f"commit -> readable (read_committed) of {n_during:,} events during the backfill, against "
            f"{n_quiet:,} in the {args.seconds:g} s before it; pgbench -R {args.rate:g}",
        ),
        Measure("stream p99 during the backfill (absolute)", "ms", round(during, 1), higher_is_better=False, limit=150),
        Measure("capture CPU during the backfill", "cores", round(backfill.cpu / seconds, 2), higher_is_better=False),
        Measure("capture peak RSS", "MB", backfill.peak, higher_is_better=False),
    ]


if __name__ == "__main__":
    write_result(run())
