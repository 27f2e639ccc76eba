#!/usr/bin/env python3
"""Initial snapshot of one table: `cdc run` against PostgreSQL's own COPY of the same table, in one run.

    ./dev python -m bench.snapshot [--rows 5000000] [--debezium]

Creates a scratch database with one table of ``--rows`` rows (bigint key, text, int, numeric, boolean,
timestamptz, jsonb), VACUUM ANALYZEs and CHECKPOINTs it and reads it once (warm cache, hint bits set, nothing
left to flush), then
1. the reference: ``COPY (SELECT * FROM t) TO STDOUT`` read by psycopg and dropped, in binary and in text
   format; the faster of the two is the reference (both are in the notes);
2. ours: `cdc run` with ``capture.snapshot = "initial"`` on a fresh slot, timed from the log line
   "snapshot of 1 table(s)" (slot created, exported snapshot taken) to the log line "snapshot done" (every
   chunk committed to Kafka with the snapshot's progress); the time from launch is reported too;
3. with ``--debezium``: Debezium Server's snapshot of the same table (snapshot.mode=initial), from its first
   record to the last (the JVM's start-up excluded) — a second reference.
Measures rows/s (target: at least 0.7 of COPY's), the capture's peak RSS and CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.cpu import cpu_bound_note
from pgcdc_dev.bench.report import Measure, Result, write_result
from psycopg import sql

from bench import _capture_bench as cb
from bench import _debezium as dbz
from bench._capture_bench import stop_process

SCENARIO = "snapshot"
TABLE = "snap"
_CREATE = (
    "CREATE TABLE {} (id bigint PRIMARY KEY, kind text NOT NULL, qty int, amount numeric(12,2), "
    "active boolean, at timestamptz NOT NULL, payload jsonb)"
)
_FILL = (
    "INSERT INTO {} SELECT g, 'kind-' || (g %% 10), (g %% 1000)::int, g * 0.01, g %% 2 = 0, "
    "timestamptz '2026-01-01' + g * interval '1 second', jsonb_build_object('n', g, 'tag', 'x') "
    "FROM generate_series(%s::bigint, %s::bigint) g"
)


def _copy_seconds(dsn: str, fmt: str, split: _cpu.CpuSplit) -> tuple[float, int, dict[str, float]]:
    """Seconds to read the whole table with COPY TO STDOUT in ``fmt`` (binary|text), the bytes read, and the
    CPU each part spent meanwhile (``split``: PostgreSQL and this process, whose main thread reads)."""
    query = sql.SQL("COPY (SELECT * FROM {}) TO STDOUT (FORMAT {})").format(sql.Identifier(TABLE), sql.SQL(fmt))
    nbytes = 0
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        split.start()
        start = time.monotonic()
        with cur.copy(query) as copy:
            for block in copy:
                nbytes += len(block)
        return time.monotonic() - start, nbytes, split.now()


def _wait_log(proc: subprocess.Popen[bytes], log: Path, text: str, timeout: float, peak: list[float]) -> float:
    """Monotonic time when ``text`` first appears in ``log``; samples the process's peak RSS meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return time.monotonic()
        peak[0] = max(peak[0], dbz.peak_rss_mb(proc.pid))
        if proc.poll() is not None:
            raise RuntimeError(f"cdc run exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"no {text!r} in {log} after {timeout:.0f} s")


def _ours(
    db: cb.OwnDatabase, timeout: float, processes: dict[str, int | None]
) -> tuple[dict[str, float], dict[str, float]]:
    """`cdc run`'s snapshot: its timings, CPU and peak RSS; and the CPU per part (``processes``: PostgreSQL's
    postmaster, the broker; the capture by thread) from its "snapshot of" log line to "snapshot done"."""
    config = cb.snapshot_config(db.work / "cdc.toml", db, TABLE)
    log = db.work / "cdc.log"
    launched = time.monotonic()
    proc = cb.launch_cdc(config, log)
    peak = [0.0]
    split = _cpu.CpuSplit(processes, {"capture": proc.pid})
    try:
        started = _wait_log(proc, log, "snapshot of 1 table(s)", timeout, peak)
        split.start()
        done = _wait_log(proc, log, "snapshot done", timeout, peak)
        parts = split.now()
        cpu = dbz.cpu_seconds(proc.pid)
        peak[0] = max(peak[0], dbz.peak_rss_mb(proc.pid))
    finally:
        stop_process(proc)
    timings = {"snapshot_s": done - started, "from_launch_s": done - launched, "cpu_s": cpu, "peak_rss_mb": peak[0]}
    return timings, parts


def _debezium(db: cb.OwnDatabase, rows: int) -> dict[str, float]:
    ep = dbz.endpoints()
    dbz.install()
    options = dbz.RunOptions(
        topic_prefix=f"{db.prefix}_dbz",
        slot=f"{db.prefix}_dbz",
        publication=f"{db.prefix}_dbz",
        snapshot="initial",
        work=db.work / "debezium",
    )
    with dbz.running(db.dsn, [f"public.{TABLE}"], options) as run:
        arrival = dbz.wait_for_records(ep["kafka"], run.topics[f"public.{TABLE}"], rows, run.started, timeout=3600)
        return {
            "first_record_s": arrival.first_s,
            "all_records_s": arrival.last_s,
            "cpu_s": run.cpu_seconds(),
            "peak_rss_mb": run.peak_rss_mb(),
        }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--debezium", action="store_true", help="also time Debezium Server's snapshot (a JVM: slow)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the snapshot")
    ap.add_argument("--keep", action="store_true", help="keep the scratch database, topics and logs")
    return ap


@dataclass(frozen=True)
class _Copies:
    """The reference: COPY of the whole table by format (seconds, bytes read, CPU per part), the faster one
    ``best``, over ``rows`` rows."""

    by_format: dict[str, tuple[float, int, dict[str, float]]]
    best: str
    rows: int

    @property
    def rate(self) -> float:
        return self.rows / self.by_format[self.best][0]


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)

    db = cb.own_database("bench_snap", "snapshot")
    result = Result(SCENARIO, params={"rows": args.rows, "debezium": args.debezium, "table": _CREATE.format(TABLE)})
    topics: list[str] = []
    try:
        _load(db.dsn, args.rows, result)
        processes, reference_split = _processes(db.ep.admin)
        copies = _copies(db.dsn, args.rows, reference_split, result)
        topics.append(f"{db.prefix}.public.{TABLE}")
        ours = _time_ours(db, args, processes, copies, result)
        if args.debezium:
            _against_debezium(db, args.rows, ours, result)
    finally:
        if not args.keep:
            cb.drop_own_database(db, topics, [db.prefix])
    result.notes.append(f"logs: {db.work}")
    return result


def _load(dsn: str, rows: int, result: Result) -> None:
    """The table's rows, VACUUM ANALYZEd and CHECKPOINTed: its load time and size go into the params."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_CREATE).format(sql.Identifier(TABLE)))
        t0 = time.monotonic()
        step = 500_000
        for first in range(1, rows + 1, step):
            conn.execute(sql.SQL(_FILL).format(sql.Identifier(TABLE)), (first, min(first + step - 1, rows)))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(TABLE)))
        # The load and the VACUUM leave ~1 GB of dirty pages and WAL: flushed now, not by a checkpoint that
        # would run through one of the measured reads and not the other.
        conn.execute("CHECKPOINT")
        size = conn.execute(sql.SQL("SELECT pg_size_pretty(pg_table_size({}))").format(sql.Literal(TABLE))).fetchone()
        result.params["load_s"] = round(time.monotonic() - t0, 1)
        result.params["table_size"] = size[0] if size else None
    print(f"{rows:,} rows loaded ({result.params['table_size']})", file=sys.stderr)


def _processes(admin: str) -> tuple[dict[str, int | None], _cpu.CpuSplit]:
    """The processes whose CPU each run is split by, and the COPY reader's split (this process reads)."""
    # The CPU of each part, so that a ratio can be read: PostgreSQL and the broker when they run here.
    with psycopg.connect(admin) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    processes = {"PostgreSQL": _cpu.postmaster_pid(row[0]) if row else None}
    reference_split = _cpu.CpuSplit(processes, {"COPY reader": os.getpid()})
    processes["Kafka broker"] = _cpu.java_pid("kafka.Kafka")
    return processes, reference_split


def _copies(dsn: str, rows: int, split: _cpu.CpuSplit, result: Result) -> _Copies:
    """The table read once to warm the cache, then by COPY in binary and in text; each in the notes."""
    _copy_seconds(dsn, "binary", split)  # warm-up: the table into the page cache
    by_format = {fmt: _copy_seconds(dsn, fmt, split) for fmt in ("binary", "text")}
    best = min(by_format, key=lambda f: by_format[f][0])
    for fmt, (secs, nbytes, _) in by_format.items():
        result.notes.append(
            f"COPY of the whole table TO STDOUT, FORMAT {fmt}, read by psycopg and dropped: "
            f"{rows / secs:,.0f} rows/s ({secs:.2f} s, {nbytes / 1e6:,.0f} MB)"
        )
        print(result.notes[-1], file=sys.stderr)
    result.notes.append(f"COPY {best}: " + _cpu.CpuSplit.per_unit_note(by_format[best][2], rows, "row"))
    return _Copies(by_format=by_format, best=best, rows=rows)


def _time_ours(
    db: cb.OwnDatabase,
    args: argparse.Namespace,
    processes: dict[str, int | None],
    copies: _Copies,
    result: Result,
) -> dict[str, float]:
    """`cdc run`'s snapshot against the faster COPY: its notes, CPU, measures and timings; its figures."""
    ours, parts = _ours(db, args.timeout, processes)
    print(f"cdc run: {ours}", file=sys.stderr)
    split = [line.split("INFO cdc._snapshot: ", 1)[-1] for line in (db.work / "cdc.log").read_text().splitlines()]
    result.notes += [line for line in split if "key ranges read at once" in line]
    result.notes.append("cdc run: " + _cpu.CpuSplit.per_unit_note(parts, args.rows, "row"))
    result.notes.append(cpu_bound_note(parts, args.rows, ours["snapshot_s"], copies.rate, 0.7))
    best = copies.best
    result.series["cpu_s"] = {
        f"COPY {best}": {k: round(v, 3) for k, v in copies.by_format[best][2].items()},
        "cdc run": {k: round(v, 3) for k, v in parts.items()},
    }
    result.measures += _measures(args.rows, ours, copies)
    result.series["timings_s"] = {
        "copy_binary": round(copies.by_format["binary"][0], 3),
        "copy_text": round(copies.by_format["text"][0], 3),
        "cdc_snapshot": round(ours["snapshot_s"], 3),
        "cdc_from_launch": round(ours["from_launch_s"], 3),
    }
    return ours


def _measures(rows: int, ours: dict[str, float], copies: _Copies) -> list[Measure]:
    """Ours against the faster COPY (streaming and from launch), and its peak RSS and CPU per row."""
    ref_rate = copies.rate
    return [
        Measure(
            "snapshot rows/s",
            "rows/s",
            round(rows / ours["snapshot_s"]),
            reference=round(ref_rate),
            reference_name=f"COPY {copies.best}",
            target_ratio=0.7,
            note="cdc run: from its 'snapshot of 1 table(s)' log line to 'snapshot done' (committed in Kafka)",
        ),
        Measure(
            "snapshot rows/s from launch",
            "rows/s",
            round(rows / ours["from_launch_s"]),
            reference=round(ref_rate),
            reference_name=f"COPY {copies.best}",
            note="cdc run from process launch: start-up, slot creation and registry included",
        ),
        Measure("capture peak RSS", "MB", ours["peak_rss_mb"], higher_is_better=False),
        Measure(
            "capture CPU per row",
            "µs/row",
            round(ours["cpu_s"] / rows * 1e6, 2),
            higher_is_better=False,
            note=f"{ours['cpu_s']:.1f} CPU s of the cdc process (user + system) for the whole run",
        ),
    ]


def _against_debezium(db: cb.OwnDatabase, rows: int, ours: dict[str, float], result: Result) -> None:
    """Debezium Server's snapshot of the same table: its rows/s, peak RSS and CPU against ours."""
    d = _debezium(db, rows)
    print(f"debezium: {d}", file=sys.stderr)
    dbz_rate = rows / (d["all_records_s"] - d["first_record_s"])
    result.measures += [
        Measure(
            "snapshot rows/s vs Debezium",
            "rows/s",
            round(rows / ours["snapshot_s"]),
            reference=round(dbz_rate),
            reference_name=f"Debezium {dbz.DEBEZIUM_VERSION}",
            note="Debezium: first record to last in the topic (JVM start-up excluded); no Kafka transactions",
        ),
        Measure(
            "peak RSS vs Debezium",
            "MB",
            ours["peak_rss_mb"],
            reference=d["peak_rss_mb"],
            reference_name="Debezium",
            higher_is_better=False,
        ),
        Measure(
            "CPU s vs Debezium",
            "CPU s",
            round(ours["cpu_s"], 1),
            reference=round(d["cpu_s"], 1),
            reference_name="Debezium",
            higher_is_better=False,
        ),
    ]
    result.series["timings_s"]["debezium_from_launch"] = round(d["all_records_s"], 3)
    result.series["timings_s"]["debezium_first_to_last"] = round(d["all_records_s"] - d["first_record_s"], 3)


if __name__ == "__main__":
    write_result(run())
