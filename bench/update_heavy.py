#!/usr/bin/env python3
"""update-heavy: updates with and without large TOASTed values, and deletes, against pg_recvlogical.

    ./dev python -m bench.update_heavy [--rows 20000] [--changes 100000] [--max-txn 500]
        [--toast-share 0.3] [--delete-share 0.1] [--min-kb 4] [--max-kb 16] [--seed 1]

A scratch database with one table whose ``body`` is 4-16 kB of text stored out of line (STORAGE EXTERNAL:
TOASTed, uncompressed) under REPLICA IDENTITY DEFAULT; ``--rows`` rows are inserted BEFORE the slots exist, so
the stream holds only the ``--changes`` that follow, in transactions of 1..``--max-txn`` changes (seeded):
- updates that leave ``body`` alone (1 - toast-share - delete-share of them): pgoutput sends the unchanged
  TOASTed column as an 'u' marker, which the capture must carry as "unchanged" rather than as a value;
- updates that rewrite ``body`` (toast-share): the whole new 4-16 kB value travels;
- deletes (delete-share): the key only.
Then pg_recvlogical (the reference) and ``cdc run`` read the same WAL, one after the other; target: ours ≥ 0.8x
the reference's changes/s.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import psycopg
from pgcdc_dev.bench.report import Measure, Result, write_result
from psycopg import sql

from bench import _capture_bench as cb

SCENARIO = "update-heavy"
TABLE = "docs"
PUBLICATION = "bench"
SLOT_CDC, SLOT_REF = "bench_cdc", "bench_ref"

_CREATE = (
    "CREATE TABLE {t} (id bigint PRIMARY KEY, version int NOT NULL DEFAULT 0, status text NOT NULL, "
    "touched timestamptz NOT NULL DEFAULT now(), body text NOT NULL)"
)
# A body of a length in [min, max] bytes, different per row and per write (salt), cheap to make: out of line and
# uncompressed (STORAGE EXTERNAL), so its repetitiveness does not shrink it.
_BODY = (
    "substr(repeat(md5(id::text || %(salt)s::text), %(reps)s::int), 1, "
    "(%(min)s::int + ((id * 7919 + %(salt)s::int) %% %(span)s::int))::int)"
)
_INSERT = "INSERT INTO {t} (id, status, body) SELECT id, 'new', " + _BODY + " FROM generate_series(1, %(rows)s) id"  # noqa: S608 - a constant; values are parameters
_UPDATE_SMALL = "UPDATE {t} SET version = version + 1, status = %(status)s, touched = now() WHERE id = ANY(%(ids)s)"
_UPDATE_BODY = "UPDATE {t} SET version = version + 1, body = " + _BODY + " WHERE id = ANY(%(ids)s)"  # noqa: S608 - constants
_DELETE = "DELETE FROM {t} WHERE id = ANY(%(ids)s)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="update_heavy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=20_000, help="rows inserted before the slots are created")
    ap.add_argument("--changes", type=int, default=100_000, help="updates and deletes captured")
    ap.add_argument("--max-txn", type=int, default=500, help="transactions hold 1..this many changes")
    ap.add_argument("--toast-share", type=float, default=0.3, help="share of changes that rewrite the body")
    ap.add_argument("--delete-share", type=float, default=0.1, help="share of changes that delete")
    ap.add_argument("--min-kb", type=int, default=4)
    ap.add_argument("--max-kb", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.changes * args.delete_share >= args.rows:
        ap.error("--changes * --delete-share must stay below --rows (deletes need live rows)")
    if not 0 <= args.toast_share + args.delete_share <= 1:
        ap.error("--toast-share + --delete-share must be within [0, 1]")
    return args


def run(argv: list[str] | None = None) -> Result:
    args = parse_args(argv)
    rng = random.Random(args.seed)  # noqa: S311 - a seeded workload, not secrets
    lo, hi = args.min_kb * 1024, args.max_kb * 1024
    body = {"min": lo, "span": hi - lo + 1, "reps": hi // 32 + 1}
    result = Result(
        SCENARIO,
        params={
            "rows_before": args.rows,
            "changes": args.changes,
            "max_txn": args.max_txn,
            "toast_share": args.toast_share,
            "delete_share": args.delete_share,
            "body_kb": [args.min_kb, args.max_kb],
            "seed": args.seed,
            "load_avg_1m_at_start": cb.load_avg(),
        },
    )
    with cb.scratch("bench_update") as s:
        _create(s, body, args.rows)
        qualified = f"public.{TABLE}"
        s.create_publication(PUBLICATION, [qualified])
        start_lsn = s.create_slots([SLOT_REF, SLOT_CDC])

        live = list(range(1, args.rows + 1))
        end_lsn, (txns, counts) = cb.timed_write(
            s, result, start_lsn, lambda conn: _changes(conn, args, rng, body, live), [SLOT_CDC]
        )
        result.params.update(transactions=txns, **counts)

        readers = cb.Readers(SLOT_REF, SLOT_CDC, PUBLICATION, (qualified,))
        ours, ref = cb.time_readers(s, readers, end_lsn, result, count=args.changes, unit="change")
        result.measures += cb.rate_measures(
            "capture changes/s",
            "changes/s",
            args.changes,
            ours,
            ref,
            note="updates (with and without the TOASTed body) and deletes; same WAL, read one after the other",
        )
        result.measures.append(
            Measure("peak RSS", "MB", ours.peak_rss_mb, higher_is_better=False, note="VmHWM of `cdc run`")
        )
    result.notes.append(
        "body is STORAGE EXTERNAL (out of line, uncompressed) under REPLICA IDENTITY DEFAULT: an update that "
        "leaves it alone reaches the capture as an 'u' (unchanged TOAST) marker."
    )
    return result


def _create(s: cb.Scratch, body: dict[str, int], rows: int) -> None:
    """The table, its body out of line and uncompressed, and its rows, written before the slots exist."""
    t = sql.Identifier(TABLE)
    with s.connect() as conn:
        conn.execute(sql.SQL(_CREATE).format(t=t))
        conn.execute(sql.SQL("ALTER TABLE {t} ALTER COLUMN body SET STORAGE EXTERNAL").format(t=t))
        conn.execute(sql.SQL("ALTER TABLE {t} REPLICA IDENTITY DEFAULT").format(t=t))
        conn.execute(sql.SQL(_INSERT).format(t=t), {**body, "salt": 0, "rows": rows})
        conn.execute(sql.SQL("VACUUM ANALYZE {t}").format(t=t))


def _changes(
    conn: psycopg.Connection[Any], args: argparse.Namespace, rng: random.Random, body: dict[str, int], live: list[int]
) -> tuple[int, dict[str, int]]:
    """``--changes`` updates and deletes of distinct ``live`` rows per transaction, in transactions of
    1..``--max-txn`` (drawn from ``rng``); the transactions and the changes by kind."""
    counts = {"update_small": 0, "update_body": 0, "delete": 0}
    txns = 0
    left = args.changes
    while left > 0:
        n = min(left, rng.randint(1, args.max_txn))
        left -= n
        kinds = rng.choices(
            ["update_small", "update_body", "delete"],
            weights=[1 - args.toast_share - args.delete_share, args.toast_share, args.delete_share],
            k=n,
        )
        ids = rng.sample(live, n)  # distinct rows: one change per row per transaction
        by_kind: dict[str, list[int]] = {k: [] for k in counts}
        for kind, row_id in zip(kinds, ids, strict=True):
            by_kind[kind].append(row_id)
        txns += 1
        _transaction(conn, by_kind, txns, body)
        for k, v in by_kind.items():
            counts[k] += len(v)
        if by_kind["delete"]:
            gone = set(by_kind["delete"])
            live = [i for i in live if i not in gone]
    return txns, counts


def _transaction(conn: psycopg.Connection[Any], by_kind: dict[str, list[int]], txn: int, body: dict[str, int]) -> None:
    """One transaction of changes: ``txn`` salts its status and its bodies."""
    t = sql.Identifier(TABLE)
    with conn.transaction():
        if by_kind["update_small"]:
            conn.execute(sql.SQL(_UPDATE_SMALL).format(t=t), {"status": f"s{txn}", "ids": by_kind["update_small"]})
        if by_kind["update_body"]:
            conn.execute(sql.SQL(_UPDATE_BODY).format(t=t), {**body, "salt": txn, "ids": by_kind["update_body"]})
        if by_kind["delete"]:
            conn.execute(sql.SQL(_DELETE).format(t=t), {"ids": by_kind["delete"]})


if __name__ == "__main__":
    write_result(run())
