#!/usr/bin/env python3
"""insert-heavy: small rows in transactions of random size, captured against pg_recvlogical and Debezium.

    ./dev python -m bench.insert_heavy [--rows 1000000] [--max-txn-rows 5000] [--seed 1]
                                                         [--no-debezium]

A scratch database with one 5-column table (incl. numeric and jsonb); its publication (and Debezium's); three
pgoutput slots created at the same point (ours, the reference's, Debezium's); then ``--rows`` rows INSERTed in
transactions of a random size between 1 and ``--max-txn-rows`` (seeded). The same WAL is then read, one reader
at a time:
1. pg_recvlogical to the end LSN — the reference (target: ours ≥ 0.8x its rows/s);
2. ``cdc run`` (default configuration, snapshot off) until its slot's confirmed_flush_lsn reaches the end LSN;
3. Debezium Server (bench/_debezium.py: PostgreSQL connector, Avro in the Confluent framing, Kafka sink) from
   its own slot until its topic holds every row (target: ours ≥ 2x its rows/s), unless ``--no-debezium``.
Measures: rows/s against both, and peak RSS and CPU seconds against Debezium's.

The server is the one the tests use (``CDC_TEST_PG``, default 15). On another major version the scenario is
named ``insert-heavy-pg<N>`` (``CDC_TEST_PG=18 ./dev bench --only insert-heavy``), so each version's run keeps
its own result beside 15's.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

import psycopg
from pgcdc_dev import discovery
from pgcdc_dev.bench.report import Measure, Result, write_result
from psycopg import sql

from bench import _capture_bench as cb
from bench import _debezium as dbz

SCENARIO = "insert-heavy"
TABLE = "events"
PUBLICATION = "bench"
DBZ_PUBLICATION = "bench_debezium"
SLOT_CDC, SLOT_REF, SLOT_DBZ, SLOT_CLUSTER = "bench_cdc", "bench_ref", "bench_debezium", "bench_cluster"

_CREATE = (
    "CREATE TABLE {} (id bigint PRIMARY KEY, kind text NOT NULL, amount numeric(12,2), payload jsonb, "
    "at timestamptz NOT NULL DEFAULT now())"
)
_INSERT = (
    "INSERT INTO {} (id, kind, amount, payload) SELECT g, 'kind-' || (g %% 10), g * 0.01, "
    "jsonb_build_object('n', g, 'tag', 'x') FROM generate_series(%s::bigint, %s::bigint) g"
)


def txn_sizes(rows: int, max_txn_rows: int, seed: int) -> list[int]:
    """Transaction sizes, uniform in [1, max_txn_rows], seeded, summing to rows."""
    rng = random.Random(seed)  # noqa: S311 - a seeded workload, not secrets
    sizes: list[int] = []
    left = rows
    while left > 0:
        n = min(left, rng.randint(1, max_txn_rows))
        sizes.append(n)
        left -= n
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="insert_heavy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--max-txn-rows", type=int, default=5_000, help="transactions hold 1..this many rows")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-debezium", action="store_true", help="leave Debezium out (pg_recvlogical only)")
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="also `cdc run` on the three-broker cluster (./dev services up kafka-cluster registry-cluster) from a "
        "slot of its own on the same WAL, against the single broker's run (scenario insert-heavy-cluster)",
    )
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    sizes = txn_sizes(args.rows, args.max_txn_rows, args.seed)
    debezium = not args.no_debezium
    result = _result(args, sizes, debezium)
    if debezium:
        dbz.install()  # before any timing: a first run downloads it
    with cb.scratch("bench_insert") as s:
        qualified, end_lsn = _write(s, args, sizes, result)
        readers = cb.Readers(SLOT_REF, SLOT_CDC, PUBLICATION, (qualified,))
        ours, ref = cb.time_readers(s, readers, end_lsn, result, count=args.rows, unit="row")
        result.measures += cb.rate_measures(
            "capture rows/s", "rows/s", args.rows, ours, ref, note="same WAL, read one after the other"
        )
        if args.cluster:
            result.measures.append(_on_cluster(s, qualified, end_lsn, args.rows, ours))
        if debezium:
            _against_debezium(s, qualified, args.rows, ours, result)
    result.notes.append(
        "Readers run one at a time on the same WAL (a 2-core machine): pg_recvlogical, then `cdc run`, then "
        "Debezium; walsender CPU of each is in series.*.walsender_cpu_s."
    )
    return result


def _result(args: argparse.Namespace, sizes: list[int], debezium: bool) -> Result:
    """The result, named for the server's major version (and the cluster variant), with the run's parameters."""
    major = cb.server_major()
    name = SCENARIO if str(major) == discovery.DEFAULT_PG_VERSION else f"{SCENARIO}-pg{major}"
    return Result(
        f"{name}-cluster" if args.cluster else name,
        params={
            "postgres": major,
            "rows": args.rows,
            "max_txn_rows": args.max_txn_rows,
            "transactions": len(sizes),
            "seed": args.seed,
            "debezium": dbz.DEBEZIUM_VERSION if debezium else None,
            "load_avg_1m_at_start": cb.load_avg(),
        },
    )


def _write(s: cb.Scratch, args: argparse.Namespace, sizes: list[int], result: Result) -> tuple[str, int]:
    """The table, the publications and every reader's slot at one point, then the workload: the table's
    qualified name and the end LSN."""
    table = sql.Identifier(TABLE)
    with s.connect() as conn:
        conn.execute(sql.SQL(_CREATE).format(table))
    qualified = f"public.{TABLE}"
    s.create_publication(PUBLICATION, [qualified])
    slots = [SLOT_REF, SLOT_CDC, *([SLOT_CLUSTER] if args.cluster else [])]
    if not args.no_debezium:
        # Debezium's own publication (its "filtered" autocreate mode finds it as it would have made it),
        # created before the slots like ours, so its slot decodes the very same transactions.
        s.create_publication(DBZ_PUBLICATION, [qualified])
        slots.append(SLOT_DBZ)
    start_lsn = s.create_slots(slots)
    end_lsn, _ = cb.timed_write(s, result, start_lsn, lambda conn: _insert(conn, table, sizes), [SLOT_CDC])
    return qualified, end_lsn


def _insert(conn: psycopg.Connection[Any], table: sql.Identifier, sizes: list[int]) -> None:
    """The rows, ids from 1, one transaction of each size in turn."""
    first = 1
    for n in sizes:
        conn.execute(sql.SQL(_INSERT).format(table), (first, first + n - 1))
        first += n


def _against_debezium(s: cb.Scratch, qualified: str, rows: int, ours: cb.Usage, result: Result) -> None:
    """Debezium on its own slot of the same WAL: its rows/s, peak RSS and CPU against ours."""
    d = _time_debezium(s, qualified, rows)
    result.series["debezium"] = d
    result.measures += [
        Measure(
            "capture rows/s",
            "rows/s",
            round(rows / ours.streaming_seconds),
            reference=d["rows_per_s"],
            reference_name="Debezium",
            target_ratio=2.0,
            note="both timed from when they stream (start-up excluded) to the last record acknowledged "
            "in Kafka (ours: the Kafka transaction holding it committed)",
        ),
        Measure(
            "peak RSS",
            "MB",
            ours.peak_rss_mb,
            reference=d["peak_rss_mb"],
            reference_name="Debezium",
            higher_is_better=False,
            note="VmHWM of the process (Debezium: the JVM with its default heap ergonomics)",
        ),
        Measure(
            "CPU seconds",
            "s",
            round(ours.cpu_s, 2),
            reference=d["cpu_s"],
            reference_name="Debezium",
            higher_is_better=False,
            note="utime+stime of the process; ours from the launch, Debezium from when it streams "
            "(its start-up and a part of its JIT excluded)",
        ),
    ]
    result.notes.append(
        "Debezium writes without Kafka transactions (idempotent producer, acks=all; offsets to a local "
        "file every second): it does less per event than `cdc run`, which commits each batch with its "
        "resume position in one Kafka transaction."
    )


def _on_cluster(s: cb.Scratch, qualified: str, end_lsn: int, rows: int, single: cb.Usage) -> Measure:
    """`cdc run` of the same WAL (its own slot) on the three-broker cluster, against the single broker's run."""
    cluster = dataclasses.replace(s, ep=cb.cluster_endpoints())
    try:
        usage = cluster.time_cdc(SLOT_CLUSTER, PUBLICATION, [qualified], end_lsn, name="cdc-cluster")
    finally:
        cb.drop_topics(cluster.ep, s.topic_prefix)
    return Measure(
        "capture rows/s on a 3-broker cluster",
        "rows/s",
        round(rows / usage.streaming_seconds),
        reference=round(rows / single.streaming_seconds),
        reference_name="the single broker",
        note="replication factor 3, min.insync.replicas 2, acks=all; the same WAL, read after the single broker's "
        "run; all three brokers on the same 2 cores",
    )


def _time_debezium(s: cb.Scratch, qualified: str, rows: int) -> dict[str, float]:
    """Debezium streaming its slot's backlog: launch, wait until it streams, then until every row is in Kafka."""
    options = dbz.RunOptions(
        topic_prefix=f"{s.topic_prefix}_dbz",
        slot=SLOT_DBZ,
        publication=DBZ_PUBLICATION,
        snapshot="no_data",
        work=s.work / "debezium",
    )
    with dbz.running(s.dsn, [qualified], options) as d:
        startup_s = d.wait_streaming(timeout=600)
        streaming_at = time.monotonic()
        cpu0 = d.cpu_seconds()
        arrival = dbz.wait_for_records(s.ep.kafka, d.topics[qualified], rows, streaming_at, timeout=3600)
        cpu = d.cpu_seconds() - cpu0
        threads = d.thread_cpu()
        out = {
            "startup_s": round(startup_s, 2),
            "seconds": round(arrival.last_s, 2),
            "first_record_s": round(arrival.first_s, 2),
            "rows_per_s": round(rows / arrival.last_s),
            "cpu_s": round(cpu, 2),
            "cpu_s_total": round(d.cpu_seconds(), 2),
            "jit_cpu_s_total": round(threads["jit"], 2),
            "peak_rss_mb": d.peak_rss_mb(),
        }
    return out


if __name__ == "__main__":
    write_result(run())
