#!/usr/bin/env python3
"""big-transaction: one transaction of ~1 GB of WAL, against pg_recvlogical; peak RSS under 300 MB.

    ./dev python -m bench.big_transaction [--megabytes 1024] [--pad 1000]
                                                            [--reference-streaming on|off]

A scratch database with the insert-heavy table plus a ``pad`` text column; two pgoutput slots at the same point;
then ONE INSERT of as many rows (``--pad`` bytes of padding each) as make about ``--megabytes`` MB of WAL.
pgoutput (protocol 2, streaming on: what `cdc run` asks for by default) streams the transaction while it is in
progress once it outgrows logical_decoding_work_mem; `cdc run` spills the streamed changes to a temporary file
and replays them into one Kafka transaction at Stream Commit, its producer's queue capped (cdc/_stream.py,
cdc/_changes.py, cdc/_kafka.py). The configuration is the default one (only where to read and write, snapshot off; CDC_*
environment variables are removed), so the figures are what a user gets.
1. pg_recvlogical reads the slot to the end LSN — the reference (target: ours ≥ 0.8x its rows/s);
2. ``cdc run`` until its slot's confirmed_flush_lsn reaches the end LSN: rows/s and its peak RSS (limit 300 MB).
"""

from __future__ import annotations

import argparse
import dataclasses

from pgcdc_dev.bench.report import Measure, Result, write_result
from psycopg import sql

from bench import _capture_bench as cb

SCENARIO = "big-transaction"
TABLE = "events"
PUBLICATION = "bench"
SLOT_CDC, SLOT_REF = "bench_cdc", "bench_ref"
SLOT_CDC_PLAIN, SLOT_REF_PLAIN = "bench_cdc_plain", "bench_ref_plain"  # the same two readers without TLS
WAL_BYTES_PER_ROW = 170  # the row without its padding, as measured on PostgreSQL 15 (plus the padding)
RSS_LIMIT_MB = 300.0

_CREATE = (
    "CREATE TABLE {} (id bigint PRIMARY KEY, kind text NOT NULL, amount numeric(12,2), payload jsonb, "
    "at timestamptz NOT NULL DEFAULT now(), pad text)"
)
_INSERT = (
    "INSERT INTO {} (id, kind, amount, payload, pad) SELECT g, 'kind-' || (g %% 10), g * 0.01, "
    "jsonb_build_object('n', g, 'tag', 'x'), repeat('x', %s) FROM generate_series(1, %s::bigint) g"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="big_transaction.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--megabytes", type=int, default=1024, help="WAL the one transaction should make (MB)")
    ap.add_argument("--pad", type=int, default=1000, help="bytes of padding per row")
    ap.add_argument(
        "--reference-streaming",
        choices=["on", "off"],
        default="on",
        help="pg_recvlogical asks for streaming like `cdc run` (on), or lets the server spill and send at commit",
    )
    ap.add_argument(
        "--without-tls",
        choices=["auto", "no"],
        default="auto",
        help="auto: when the connection is encrypted, also time both readers with sslmode=disable (a variant)",
    )
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    rows = max(1, args.megabytes * 2**20 // (WAL_BYTES_PER_ROW + args.pad))
    result = Result(
        SCENARIO,
        params={
            "megabytes": args.megabytes,
            "pad": args.pad,
            "rows": rows,
            "reference_streaming": args.reference_streaming,
            "load_avg_1m_at_start": cb.load_avg(),
        },
    )
    with cb.scratch("bench_bigtxn") as s:
        qualified, plain, end_lsn = _write(s, args, rows, result)
        streaming = args.reference_streaming == "on"
        readers = cb.Readers(SLOT_REF, SLOT_CDC, PUBLICATION, (qualified,), streaming=streaming)
        ours, ref = cb.time_readers(s, readers, end_lsn, result, count=rows, unit="row")
        if plain:
            result.measures.append(_without_tls(s, readers, end_lsn, rows, result))
        result.measures += [
            *cb.rate_measures("capture rows/s", "rows/s", rows, ours, ref, note="one transaction"),
            Measure(
                "peak RSS",
                "MB",
                ours.peak_rss_mb,
                higher_is_better=False,
                limit=RSS_LIMIT_MB,
                note="VmHWM of `cdc run` with the default configuration",
            ),
        ]
    result.notes.append(
        "Default configuration: pgoutput streams the in-progress transaction (protocol 2, streaming on) past "
        "logical_decoding_work_mem; `cdc run` spills it to a temporary file and replays it at Stream Commit. "
        f"pg_recvlogical asked for streaming={args.reference_streaming}."
    )
    return result


def _write(s: cb.Scratch, args: argparse.Namespace, rows: int, result: Result) -> tuple[str, bool, int]:
    """The table, the publication and the slots (a second pair for the variant without TLS when it is run),
    then the one transaction: the table's qualified name, whether the variant is run, and the end LSN."""
    with s.connect() as conn:
        conn.execute(sql.SQL(_CREATE).format(sql.Identifier(TABLE)))
        row = conn.execute("SHOW logical_decoding_work_mem").fetchone()
        result.params["logical_decoding_work_mem"] = row[0] if row else None
    qualified = f"public.{TABLE}"
    s.create_publication(PUBLICATION, [qualified])
    # TLS costs the walsender more CPU per row serving `cdc run` than serving pg_recvlogical (measured
    # 2026-11-24: 10-40 % with TLS, none without); the variant shows it on every run.
    plain = args.without_tls == "auto" and s.server_tls()
    start_lsn = s.create_slots([SLOT_REF, SLOT_CDC, *([SLOT_REF_PLAIN, SLOT_CDC_PLAIN] if plain else [])])
    end_lsn, _ = cb.timed_write(
        s,
        result,
        start_lsn,
        lambda conn: conn.execute(sql.SQL(_INSERT).format(sql.Identifier(TABLE)), (args.pad, rows)),
        [SLOT_CDC, *([SLOT_CDC_PLAIN] if plain else [])],
    )
    return qualified, plain, end_lsn


def _without_tls(s: cb.Scratch, readers: cb.Readers, end_lsn: int, rows: int, result: Result) -> Measure:
    """The variant: the same ``readers`` again, on their own slots, with sslmode=disable."""
    plain = dataclasses.replace(readers, ref_slot=SLOT_REF_PLAIN, cdc_slot=SLOT_CDC_PLAIN, variant=" without TLS")
    ours_plain, ref_plain = cb.time_readers(s.without_tls(), plain, end_lsn, result, count=rows, unit="row")
    return Measure(
        "capture rows/s, both readers without TLS",
        "rows/s",
        round(rows / ours_plain.streaming_seconds),
        reference=round(rows / ref_plain.seconds),
        reference_name="pg_recvlogical",
        note="a variant: the same WAL read again by both readers with sslmode=disable, on their own "
        "slots; the target is judged on the default connection above",
    )


if __name__ == "__main__":
    write_result(run())
