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
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from pgcdc_dev import discovery
from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.cpu import cpu_bound_note
from pgcdc_dev.bench.report import Measure, Result, write_result
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql

from bench import _debezium as dbz
from bench._capture_bench import drop_slots, dsn_for, stop_process

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


def _config(path: Path, dsn: str, *, kafka: str, registry: str, prefix: str) -> Path:
    path.write_text(
        f'[source]\ndsn = "{dsn}"\ntables = ["public.{TABLE}"]\nslot = "{prefix}"\npublication = "{prefix}"\n'
        f'[kafka]\nbootstrap_servers = "{kafka}"\ntopic_prefix = "{prefix}"\n'
        f'[registry]\nurl = "{registry}"\n[metrics]\nport = 0\n[capture]\nsnapshot = "initial"\n'
    )
    return path


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
    dsn: str, work: Path, *, kafka: str, registry: str, prefix: str, timeout: float, processes: dict[str, int | None]
) -> tuple[dict[str, float], dict[str, float]]:
    """`cdc run`'s snapshot: its timings, CPU and peak RSS; and the CPU per part (``processes``: PostgreSQL's
    postmaster, the broker; the capture by thread) from its "snapshot of" log line to "snapshot done"."""
    config = _config(work / "cdc.toml", dsn, kafka=kafka, registry=registry, prefix=prefix)
    log = work / "cdc.log"
    with open(log, "wb") as out:
        launched = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgcdc", "--log-level", "info", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
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


def _debezium(dsn: str, work: Path, rows: int, prefix: str) -> dict[str, float]:
    ep = dbz.endpoints()
    dbz.install()
    with dbz.running(
        dsn,
        [f"public.{TABLE}"],
        topic_prefix=f"{prefix}_dbz",
        slot=f"{prefix}_dbz",
        publication=f"{prefix}_dbz",
        snapshot="initial",
        work=work / "debezium",
    ) as run:
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


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)

    admin = discovery.find("postgres").value
    kafka = discovery.find("kafka").value
    registry = discovery.find("registry").value
    prefix = f"bench_snap_{int(time.time())}"
    db = prefix
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-snapshot-"))
    result = Result(SCENARIO, params={"rows": args.rows, "debezium": args.debezium, "table": _CREATE.format(TABLE)})
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    dsn = dsn_for(admin, db)
    topics: list[str] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL(_CREATE).format(sql.Identifier(TABLE)))
            t0 = time.monotonic()
            step = 500_000
            for first in range(1, args.rows + 1, step):
                conn.execute(sql.SQL(_FILL).format(sql.Identifier(TABLE)), (first, min(first + step - 1, args.rows)))
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(TABLE)))
            # The load and the VACUUM leave ~1 GB of dirty pages and WAL: flushed now, not by a checkpoint that
            # would run through one of the measured reads and not the other.
            conn.execute("CHECKPOINT")
            size = conn.execute(
                sql.SQL("SELECT pg_size_pretty(pg_table_size({}))").format(sql.Literal(TABLE))
            ).fetchone()
            result.params["load_s"] = round(time.monotonic() - t0, 1)
            result.params["table_size"] = size[0] if size else None
        print(f"{args.rows:,} rows loaded ({result.params['table_size']})", file=sys.stderr)

        # The CPU of each part, so that a ratio can be read: PostgreSQL and the broker when they run here.
        with psycopg.connect(admin) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        processes = {"PostgreSQL": _cpu.postmaster_pid(row[0]) if row else None}
        reference_split = _cpu.CpuSplit(processes, {"COPY reader": os.getpid()})
        processes["Kafka broker"] = _cpu.java_pid("kafka.Kafka")

        _copy_seconds(dsn, "binary", reference_split)  # warm-up: the table into the page cache
        copies = {fmt: _copy_seconds(dsn, fmt, reference_split) for fmt in ("binary", "text")}
        best = min(copies, key=lambda f: copies[f][0])
        ref_rate = args.rows / copies[best][0]
        for fmt, (secs, nbytes, _) in copies.items():
            result.notes.append(
                f"COPY of the whole table TO STDOUT, FORMAT {fmt}, read by psycopg and dropped: "
                f"{args.rows / secs:,.0f} rows/s ({secs:.2f} s, {nbytes / 1e6:,.0f} MB)"
            )
            print(result.notes[-1], file=sys.stderr)
        result.notes.append(f"COPY {best}: " + _cpu.CpuSplit.per_unit_note(copies[best][2], args.rows, "row"))

        topics.append(f"{prefix}.public.{TABLE}")
        ours, parts = _ours(
            dsn, work, kafka=kafka, registry=registry, prefix=prefix, timeout=args.timeout, processes=processes
        )
        print(f"cdc run: {ours}", file=sys.stderr)
        split = [line.split("INFO cdc._snapshot: ", 1)[-1] for line in (work / "cdc.log").read_text().splitlines()]
        result.notes += [line for line in split if "key ranges read at once" in line]
        result.notes.append("cdc run: " + _cpu.CpuSplit.per_unit_note(parts, args.rows, "row"))
        result.notes.append(cpu_bound_note(parts, args.rows, ours["snapshot_s"], ref_rate, 0.7))
        result.series["cpu_s"] = {
            f"COPY {best}": {k: round(v, 3) for k, v in copies[best][2].items()},
            "cdc run": {k: round(v, 3) for k, v in parts.items()},
        }
        result.measures += [
            Measure(
                "snapshot rows/s",
                "rows/s",
                round(args.rows / ours["snapshot_s"]),
                reference=round(ref_rate),
                reference_name=f"COPY {best}",
                target_ratio=0.7,
                note="cdc run: from its 'snapshot of 1 table(s)' log line to 'snapshot done' (committed in Kafka)",
            ),
            Measure(
                "snapshot rows/s from launch",
                "rows/s",
                round(args.rows / ours["from_launch_s"]),
                reference=round(ref_rate),
                reference_name=f"COPY {best}",
                note="cdc run from process launch: start-up, slot creation and registry included",
            ),
            Measure("capture peak RSS", "MB", ours["peak_rss_mb"], higher_is_better=False),
            Measure(
                "capture CPU per row",
                "µs/row",
                round(ours["cpu_s"] / args.rows * 1e6, 2),
                higher_is_better=False,
                note=f"{ours['cpu_s']:.1f} CPU s of the cdc process (user + system) for the whole run",
            ),
        ]
        result.series["timings_s"] = {
            "copy_binary": round(copies["binary"][0], 3),
            "copy_text": round(copies["text"][0], 3),
            "cdc_snapshot": round(ours["snapshot_s"], 3),
            "cdc_from_launch": round(ours["from_launch_s"], 3),
        }

        if args.debezium:
            d = _debezium(dsn, work, args.rows, prefix)
            print(f"debezium: {d}", file=sys.stderr)
            dbz_rate = args.rows / (d["all_records_s"] - d["first_record_s"])
            result.measures += [
                Measure(
                    "snapshot rows/s vs Debezium",
                    "rows/s",
                    round(args.rows / ours["snapshot_s"]),
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
    finally:
        if not args.keep:
            drop_slots(admin, db)
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
            with contextlib.suppress(Exception):
                delete_topics(kafka, [*topics, f"{prefix}.offsets"])
                dbz.delete_subjects(registry, topics)
    result.notes.append(f"logs: {work}")
    return result


if __name__ == "__main__":
    write_result(run())
