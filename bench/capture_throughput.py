#!/usr/bin/env python3
"""Capture throughput against pg_recvlogical on the same WAL, in one run.

    ./dev python -m bench.capture_throughput [--rows 1000000] [--txn-rows 5000] [--pad 0]
    ./dev python -m bench.capture_throughput --rows 1000000 --txn-rows 1000000 --pad 1000   # one ~1 GB transaction

Creates a scratch database with one 5-column table (incl. jsonb and numeric), creates two pgoutput slots at
the same point, writes ``--rows`` rows in transactions of ``--txn-rows``, then
1. times ``pg_recvlogical`` (pgoutput, same publication, to /dev/null) reading to the end LSN — the reference:
   what logical decoding itself delivers on this machine;
2. times ``cdc run`` (snapshot off) from its slot until the slot's confirmed flush LSN — which only moves after
   the Kafka transaction holding the events committed — reaches the same end LSN.
Prints rows/s for both, the ratio, and the capture process's peak RSS; writes JSON to bench/results/.
The scenarios of the benchmark harness (bench/insert_heavy.py, big_transaction.py, …) share its machinery,
bench/_capture_bench.py, and write the common result format of pgcdc_dev/bench/report.py instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from pgcdc_dev.bench.report import RESULTS
from psycopg import sql

from bench import _capture_bench as cb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--txn-rows", type=int, default=5_000)
    ap.add_argument("--pad", type=int, default=0, help="bytes of extra text per row (makes rows, and WAL, larger)")
    args = ap.parse_args()

    result: dict[str, object] = {
        "pad_bytes": args.pad,
        "rows": args.rows,
        "txn_rows": args.txn_rows,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    with cb.scratch("bench") as s:
        with s.connect() as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigint PRIMARY KEY, kind text NOT NULL, amount numeric(12,2), "
                    "payload jsonb, at timestamptz NOT NULL DEFAULT now(), pad text)"
                ).format(sql.Identifier("events"))
            )
        s.create_publication("bench", ["public.events"])
        s.create_slots(["bench_ref", "bench_cdc"])
        start = time.monotonic()
        with s.connect() as conn:
            for first in range(0, args.rows, args.txn_rows):
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (id, kind, amount, payload, pad) SELECT g, 'kind-' || (g %% 10), "
                        "g * 0.01, jsonb_build_object('n', g, 'tag', 'x'), CASE WHEN %s > 0 THEN repeat('x', %s) "
                        "END FROM generate_series(%s::bigint, %s::bigint) g"
                    ).format(sql.Identifier("events")),
                    (args.pad, args.pad, first + 1, min(first + args.txn_rows, args.rows)),
                )
            result["write_s"] = round(time.monotonic() - start, 2)
            end = s.end_lsn(conn, fence_for=["bench_cdc"])
        lag = s.slot_lag_bytes("bench_cdc")
        result["wal_to_decode_mb"] = None if lag is None else round(lag / 2**20, 1)

        ref = s.recvlogical("bench_ref", "bench", end)  # 1. the reference
        ours = s.time_cdc("bench_cdc", "bench", ["public.events"], end)  # 2. pgcdc
        result.update(
            pg_recvlogical_s=round(ref.seconds, 2),
            pg_recvlogical_rows_per_s=round(args.rows / ref.seconds),
            cdc_s=round(ours.seconds, 2),
            cdc_rows_per_s=round(args.rows / ours.seconds),
            ratio_vs_pg_recvlogical=round(ref.seconds / ours.seconds, 3),
            cdc_peak_rss_mb=round(ours.peak_rss_mb, 1),
        )
    out = RESULTS
    out.mkdir(parents=True, exist_ok=True)
    name = "capture_throughput" if args.txn_rows < args.rows else "capture_one_transaction"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
