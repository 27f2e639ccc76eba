#!/usr/bin/env python3
"""pgbench: the TPC-B-like workload captured while it runs; catch-up after it ends; pg_recvlogical afterwards.

    ./dev python -m bench.pgbench_tpcb [--scale 10] [--seconds 60] [--clients 4] [--jobs 2]
                                                         [--baseline-seconds 30]

``pgbench -i -s <scale>`` into a scratch database (pgbench from pg_config's BINDIR); pgbench_history has no
primary key, which `cdc run` refuses (a table's events need a key): it gets one, an added
``id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY`` (pgbench names its insert's columns, so it does not
notice). The publication holds the four pgbench tables; the two slots are created after the initialisation, so
the stream holds only what pgbench's run does (per transaction: 3 updates, 1 insert).
1. optionally (``--baseline-seconds``, before the slots exist) pgbench alone, for its tps without capture;
2. ``cdc run`` (default configuration, snapshot off) is started, then ``pgbench -T <seconds> -c <clients>``
   runs while it captures; at pgbench's end the end LSN is taken and the time until our slot's
   confirmed_flush_lsn reaches it is the catch-up lag;
3. pg_recvlogical then reads the same WAL from its slot to the end LSN: the reference rate.
Measures: changes/s (ours: changes / (pgbench's run + the catch-up), bounded by pgbench's own rate when the
capture keeps up; the reference: the same changes drained afterwards), the catch-up lag in seconds, and
pgbench's tps with capture running.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from dataclasses import dataclass

from pgcdc_dev.bench.report import Measure, Result, write_result
from psycopg import sql

from bench import _capture_bench as cb

SCENARIO = "pgbench"
TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")
PUBLICATION = "bench"
SLOT_CDC, SLOT_REF = "bench_cdc", "bench_ref"
CHANGES_PER_TXN = 4  # tpcb-like: UPDATE accounts, tellers, branches; INSERT history (the SELECT writes nothing)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pgbench_tpcb.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", type=int, default=10, help="pgbench -i -s (100,000 accounts per unit)")
    ap.add_argument("--seconds", type=int, default=60, help="pgbench -T while capturing")
    ap.add_argument("--clients", type=int, default=4, help="pgbench -c")
    ap.add_argument("--jobs", type=int, default=2, help="pgbench -j")
    ap.add_argument(
        "--baseline-seconds", type=int, default=30, help="first run pgbench this long without capture (0: skip)"
    )
    return ap.parse_args(argv)


def _pgbench(s: cb.Scratch, args: list[str]) -> str:
    proc = subprocess.run(
        [str(s.bindir / "pgbench"), *args],
        env=cb.libpq_env(s.dsn),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def _parse(out: str) -> tuple[int, float]:
    """(transactions processed, tps without the initial connection time) from pgbench's report."""
    txns = re.search(r"number of transactions actually processed: (\d+)", out)
    tps = re.search(r"tps = ([\d.]+) \((?:without|excluding) initial connection", out)
    if txns is None or tps is None:
        raise RuntimeError(f"cannot read pgbench's report:\n{out[-2000:]}")
    return int(txns.group(1)), float(tps.group(1))


@dataclass(frozen=True)
class _Captured:
    """pgbench's run with `cdc run` capturing: its report, its start and end (time.monotonic()), the end LSN
    taken after it, and `cdc run`'s usage timed from pgbench's start until its slot reached that LSN."""

    report: str
    started: float
    ended: float
    end_lsn: int
    ours: cb.Usage


def run(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    result = Result(
        SCENARIO,
        params={
            "scale": args.scale,
            "seconds": args.seconds,
            "clients": args.clients,
            "jobs": args.jobs,
            "load_avg_1m_at_start": cb.load_avg(),
        },
    )
    run_args = ["-n", "-T", str(args.seconds), "-c", str(args.clients), "-j", str(args.jobs)]
    with cb.scratch("bench_pgbench") as s:
        baseline_tps = _initialise(s, args)
        qualified = [f"public.{t}" for t in TABLES]
        s.create_publication(PUBLICATION, qualified)
        start_lsn = s.create_slots([SLOT_REF, SLOT_CDC])
        captured = _capture(s, qualified, run_args)
        txns, tps = _parse(captured.report)
        changes = txns * CHANGES_PER_TXN
        ref = s.recvlogical(SLOT_REF, PUBLICATION, captured.end_lsn)

        result.params.update(
            transactions=txns,
            changes=changes,
            wal_mb=round((captured.end_lsn - start_lsn) / 2**20, 1),
            pgbench_s=round(captured.ended - captured.started, 2),
        )
        result.series["pg_recvlogical"] = ref.as_json()
        result.series["cdc"] = captured.ours.as_json()
        result.measures += _measures(changes, captured, ref, tps, baseline_tps)
    result.notes.append(
        "pgbench_history has no primary key, which `cdc run` refuses; it gets an added identity column as primary "
        "key (`id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY`), so all four tables are captured under "
        "REPLICA IDENTITY DEFAULT."
    )
    return result


def _initialise(s: cb.Scratch, args: argparse.Namespace) -> float | None:
    """pgbench's tables at ``--scale``, pgbench_history with a primary key; then, with ``--baseline-seconds``,
    pgbench alone: its tps (None without)."""
    _pgbench(s, ["-i", "-q", "-s", str(args.scale)])
    with s.connect() as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY").format(
                sql.Identifier("pgbench_history"), sql.Identifier("id")
            )
        )
    baseline_tps = None
    if args.baseline_seconds:
        base = ["-n", "-T", str(args.baseline_seconds), "-c", str(args.clients), "-j", str(args.jobs)]
        _, baseline_tps = _parse(_pgbench(s, base))
        with s.connect() as conn:
            conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier("pgbench_history")))
    return baseline_tps


def _capture(s: cb.Scratch, qualified: list[str], run_args: list[str]) -> _Captured:
    """`cdc run` streaming before pgbench starts, pgbench's run, then `cdc run` until it caught up."""
    with s.cdc(SLOT_CDC, PUBLICATION, qualified) as ours_run:
        ours_run.wait_streaming()  # attached and streaming before pgbench starts
        t0 = time.monotonic()
        out = _pgbench(s, run_args)
        bench_end = time.monotonic()
        end_lsn = s.end_lsn(fence_for=[SLOT_CDC])
        ours = ours_run.wait_for(end_lsn, since=t0)
    return _Captured(report=out, started=t0, ended=bench_end, end_lsn=end_lsn, ours=ours)


def _measures(
    changes: int, captured: _Captured, ref: cb.Usage, tps: float, baseline_tps: float | None
) -> list[Measure]:
    """Ours against the reference, the catch-up after pgbench ended, pgbench's tps, and our peak RSS."""
    ours = captured.ours
    lag_s = captured.started + ours.seconds - captured.ended
    return [
        Measure(
            "capture changes/s",
            "changes/s",
            round(changes / ours.seconds),
            reference=round(changes / ref.seconds),
            reference_name="pg_recvlogical",
            note="ours: changes / (pgbench's run + catch-up), captured while pgbench ran, so at most "
            "pgbench's own rate; the reference drains the same WAL afterwards, alone",
        ),
        Measure(
            "catch-up after pgbench ended",
            "s",
            round(max(lag_s, 0.0), 2),
            higher_is_better=False,
            note="from pgbench's exit to our slot's confirmed_flush_lsn reaching the end LSN",
        ),
        Measure(
            "pgbench tps with capture running",
            "tps",
            round(tps, 1),
            reference=None if baseline_tps is None else round(baseline_tps, 1),
            reference_name="pgbench alone" if baseline_tps is not None else "",
            note="pgbench's tps (excluding connection time) while `cdc run` captures on the same 2 cores",
        ),
        Measure("peak RSS", "MB", ours.peak_rss_mb, higher_is_better=False, note="VmHWM of `cdc run`"),
    ]


if __name__ == "__main__":
    write_result(run())
