#!/usr/bin/env python3
"""Capture throughput against pg_recvlogical on the same WAL, in one run.

    ./dev python bench/capture_throughput.py [--rows 1000000] [--txn-rows 5000] [--pad 0]
    ./dev python bench/capture_throughput.py --rows 1000000 --txn-rows 1000000 --pad 1000   # one ~1 GB transaction

Creates a scratch database with one 5-column table (incl. jsonb and numeric), creates two pgoutput slots at
the same point, writes ``--rows`` rows in transactions of ``--txn-rows``, then
1. times ``pg_recvlogical`` (pgoutput, same publication, to /dev/null) reading to the end LSN — the reference:
   what logical decoding itself delivers on this machine;
2. times ``cdc run`` (snapshot off) from its slot until the slot's confirmed flush LSN — which only moves after
   the Kafka transaction holding the events committed — reaches the same end LSN.
Prints rows/s for both, the ratio, and the capture process's peak RSS; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
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

from tests import _services  # noqa: E402 - finds (or starts) the local services like the tests do


def _dsn_for(admin: str, db: str) -> str:
    params = conninfo_to_dict(admin)
    params["dbname"] = db
    return make_conninfo("", **params)


def _lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _fmt(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _peak_rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--txn-rows", type=int, default=5_000)
    ap.add_argument("--pad", type=int, default=0, help="bytes of extra text per row (makes rows, and WAL, larger)")
    args = ap.parse_args()

    admin = _services.find("postgres").value
    kafka = _services.find("kafka").value
    registry = _services.find("registry").value
    db = f"bench_{int(time.time())}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
        bindir = Path(
            conn.execute("SELECT setting FROM pg_config() WHERE name = 'BINDIR'").fetchone()[0]  # type: ignore[index]
        )
    dsn = _dsn_for(admin, db)
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-"))
    result: dict[str, object] = {
        "pad_bytes": args.pad,
        "rows": args.rows,
        "txn_rows": args.txn_rows,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE events (id bigint PRIMARY KEY, kind text NOT NULL, amount numeric(12,2), "
                "payload jsonb, at timestamptz NOT NULL DEFAULT now(), pad text)"
            )
            conn.execute("CREATE PUBLICATION bench FOR TABLE events")
            conn.execute("SELECT pg_create_logical_replication_slot('bench_ref', 'pgoutput')")
            conn.execute("SELECT pg_create_logical_replication_slot('bench_cdc', 'pgoutput')")
            start = time.monotonic()
            for first in range(0, args.rows, args.txn_rows):
                conn.execute(
                    "INSERT INTO events (id, kind, amount, payload, pad) SELECT g, 'kind-' || (g %% 10), g * 0.01, "
                    "jsonb_build_object('n', g, 'tag', 'x'), CASE WHEN %s > 0 THEN repeat('x', %s) END "
                    "FROM generate_series(%s::bigint, %s::bigint) g",
                    (args.pad, args.pad, first + 1, min(first + args.txn_rows, args.rows)),
                )
            result["write_s"] = round(time.monotonic() - start, 2)
            end = _lsn(conn)
            row = conn.execute(
                "SELECT pg_size_pretty((pg_current_wal_lsn() - confirmed_flush_lsn)::bigint) "
                "FROM pg_replication_slots WHERE slot_name = 'bench_cdc'"
            ).fetchone()
            result["wal_to_decode"] = row[0] if row else None

        # 1. the reference
        t0 = time.monotonic()
        subprocess.run(
            [
                str(bindir / "pg_recvlogical"),
                "-d",
                dsn,
                "--slot",
                "bench_ref",
                "--start",
                "-o",
                "proto_version=2",
                "-o",
                "publication_names=bench",
                "-o",
                "binary=true",
                "--endpos",
                _fmt(end),
                "-f",
                "/dev/null",
            ],
            check=True,
        )
        ref_s = time.monotonic() - t0

        # 2. pgcdc
        config = work / "cdc.toml"
        config.write_text(
            f'[source]\ndsn = "{dsn}"\ntables = ["public.events"]\nslot = "bench_cdc"\npublication = "bench"\n'
            f'[kafka]\nbootstrap_servers = "{kafka}"\ntopic_prefix = "{db}"\n'
            f'[registry]\nurl = "{registry}"\n[capture]\nsnapshot = "never"\n'
        )
        t0 = time.monotonic()
        with open(work / "cdc.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cdc.cli", "run", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        peak = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                row = conn.execute(
                    "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots "
                    "WHERE slot_name = 'bench_cdc'"
                ).fetchone()
                peak = max(peak, _peak_rss_kb(proc.pid))
                if row and row[0] is not None and int(row[0]) >= end:
                    break
                if proc.poll() is not None:
                    print((work / "cdc.log").read_text()[-3000:], file=sys.stderr)
                    return 1
                time.sleep(0.05)
        cdc_s = time.monotonic() - t0
        peak = max(peak, _peak_rss_kb(proc.pid))
        proc.terminate()
        proc.wait(60)
        result.update(
            pg_recvlogical_s=round(ref_s, 2),
            pg_recvlogical_rows_per_s=round(args.rows / ref_s),
            cdc_s=round(cdc_s, 2),
            cdc_rows_per_s=round(args.rows / cdc_s),
            ratio_vs_pg_recvlogical=round(ref_s / cdc_s, 3),
            cdc_peak_rss_mb=round(peak / 1024, 1),
        )
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            for slot in ("bench_ref", "bench_cdc"):
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "capture_throughput" if args.txn_rows < args.rows else "capture_one_transaction"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
