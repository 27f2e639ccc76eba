"""``cdc snapshot``: ask the running capture for backfills, and follow them.

    cdc snapshot TABLE [TABLE…] [--where SQL]   backfill these tables (only the rows SQL selects) while streaming
    cdc snapshot TABLE --keys FILE              only the keys a `cdc verify` report lists (a repair, cdc/_repair.py)
    cdc snapshot --list                         the backfills, their progress, and the requests not yet taken
    cdc snapshot --cancel ID | --pause ID | --resume ID

Requests go through the signal table (cdc/_signals.py), so this needs database access only; the running `cdc
run` takes them within ``capture.signal_poll_s``. A table and a filter are checked here first (the table
captured, the filter planned READ ONLY), so a mistake is said at once, not in the capture's log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cdc import report_keys, request_keys
from cdc.config import Settings
from cdc.kafka import OffsetStore
from cdc.service import SignalTable, check_and_prepare, check_where, source_connections
from pgcdc_common.errors import ConfigError, SourceCheckError
from pgcdc_common.topics import split_table_name


def add_parser(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="backfill tables while `cdc run` streams; list, cancel, pause, resume")
    p.add_argument("--config", "-c", type=Path, help="TOML configuration file")
    p.add_argument("tables", nargs="*", metavar="TABLE", help="'schema.table' names to backfill")
    p.add_argument("--where", help="only the rows this SQL condition selects (it runs in a READ ONLY transaction)")
    p.add_argument(
        "--keys",
        type=Path,
        metavar="FILE",
        help="only the keys this `cdc verify` report lists (missing, extra, different): re-read, or deleted if gone",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="the backfills and the requests not yet taken")
    what.add_argument("--cancel", metavar="ID", help="stop a backfill for good")
    what.add_argument("--pause", metavar="ID", help="stop a backfill until --resume")
    what.add_argument("--resume", metavar="ID", help="go on with a paused backfill")


def run(settings: Settings, args: argparse.Namespace) -> int:
    signals = SignalTable(settings.source.signal_table, settings.source.slot)
    # Checks and reads on source.dsn; requests written where they can be: on its primary when it is a standby.
    with source_connections(settings) as (conn, primary):
        writer = primary or conn
        note = signals.ensure(writer)
        if note is not None:
            raise SourceCheckError(note, check="signal-table")
        if args.list:
            return _list(settings, signals, writer)
        for kind in ("cancel", "pause", "resume"):
            if getattr(args, kind) is not None:
                request = signals.send(writer, kind, {"id": getattr(args, kind)})
                print(f"request {request}: {kind} backfill {getattr(args, kind)}")
                return 0
        if not args.tables:
            raise ConfigError("name the tables to backfill (cdc snapshot public.orders …), or --list")
        if args.keys is not None:
            return _keys(settings, args)
        report = check_and_prepare(conn, settings, dry_run=True, allow_active_slot=True, writer=primary)
        captured = {(t.schema, t.name): t for t in report.tables}
        names = []
        for name in args.tables:
            try:
                table = captured[split_table_name(name)]
            except (KeyError, ValueError):
                known = ", ".join(sorted(t.qualified for t in report.tables))
                raise ConfigError(f"table {name} is not captured: backfill one of {known}") from None
            if args.where is not None:
                try:
                    check_where(conn, table, args.where, settings.capture.backfill_statement_timeout_s)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            names.append(table.qualified)
        request = signals.send(writer, "backfill", {"tables": names, "where": args.where})
    print(
        f"request {request}: backfill of {', '.join(names)}{f' where {args.where}' if args.where else ''} asked for; "
        f"the running capture takes it within {settings.capture.signal_poll_s:g} s (cdc snapshot --list)"
    )
    return 0


# Why a listed key may have no columns (docs/sinks.md, "Rebuild and verify").
_WITHOUT = (
    "their lines have no 'columns' (a key PostgreSQL cannot read back from the store's form, or a list from "
    "an older `cdc verify`: run it again); `cdc sinks rebuild` mends those"
)


def _keys(settings: Settings, args: argparse.Namespace) -> int:
    if len(args.tables) != 1 or args.where is not None:
        raise ConfigError("--keys backfills the keys of one table: name that table alone, without --where")
    try:
        text = args.keys.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the key list {args.keys}: {exc.strerror}") from None
    keys, without = report_keys(text.splitlines(), str(args.keys))
    if without:
        print(f"{without} key(s) of {args.keys} cannot be asked for: {_WITHOUT}", file=sys.stderr)
    if not keys:
        print(f"{args.keys} lists no key to backfill")
        return 0
    asked = request_keys(settings, args.tables[0], keys)
    ids, count = ", ".join(i for i, _ in asked), sum(n for _, n in asked)
    print(
        f"request(s) {ids}: backfill of {count} key(s) of {args.tables[0]} asked for; the running "
        f"capture takes them within {settings.capture.signal_poll_s:g} s (cdc snapshot --list)"
    )
    return 0


def _list(settings: Settings, signals: SignalTable, conn: Any) -> int:
    state = OffsetStore(settings.kafka.client_conf(), settings.offsets_topic, settings.source.slot).load()
    taken = state.signal if state is not None else 0
    backfills = state.backfills if state is not None else []
    for b in backfills:
        where = f" where {b.where}" if b.where else ""
        error = f": {b.error}" if b.error else ""
        deleted = f", {b.deleted} key(s) deleted" if b.keys is not None else ""
        print(
            f"{b.id}\t{b.table}{where}\t{b.status}{error}\t{b.rows} row(s) in {b.chunks} chunk(s){deleted}"
            f"\t({b.reason})"
        )
    for signal in signals.read(conn, taken):
        print(f"{signal.id}\t{signal.kind} {signal.data}\tasked for, not taken yet")
    if not backfills and taken == 0:
        print("no backfills")
    return 0


__all__ = ["add_parser", "run"]
