"""``cdc sinks …`` and ``cdc verify``: the derived views' commands (the ``cdc`` front door hands them over).

    cdc sinks list                               every sink found (built-ins and plugins), where it came from
    cdc sinks run [NAME …] --config cdc.toml     one streaming query per sink until SIGTERM/SIGINT
    cdc sinks rebuild NAME … --config cdc.toml   rebuild from offset zero beside the served copies, verify, swap
                                                 (several sinks in one Spark application; all swapped or none)
    cdc sinks spark-app                          the file spark-submit runs: spark-submit … FILE sinks run …
    cdc verify [NAME …] --config cdc.toml        compare stores (default: sinks.enabled) with PostgreSQL key by key
    cdc verify [NAME …] --repair --config …      … and have the running capture re-emit the keys that differ

Exit codes: 0 fine; 1 unexpected; 2 configuration; 8 plugin failed to load; 9 drift found; 11 the disk under
sinks.state_dir is full (free space or move it, then run again: nothing is lost).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pgcdc_common.errors import CDCError, DriftError, SinkConfigError
from sinks.config import load_sink_settings

log = logging.getLogger("cdc.sinks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc", description="Derived views of the change topics.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sinks = sub.add_parser("sinks", help="list, run or rebuild sinks")
    ssub = sinks.add_subparsers(dest="action", metavar="ACTION", required=True)
    ssub.add_parser("list", help="every sink found, with where it came from")
    ssub.add_parser("spark-app", help="the file to hand spark-submit (its arguments are cdc's)")
    p = ssub.add_parser("run", help="keep the sinks in sync until stopped")
    p.add_argument("names", nargs="*", metavar="NAME", help="default: sinks.enabled")
    p.add_argument("--config", "-c", type=Path)
    p = ssub.add_parser("rebuild", help="rebuild stores from offset zero, verify them, swap them in")
    p.add_argument("names", nargs="+", metavar="NAME", help="the sinks to rebuild, side by side in one application")
    p.add_argument("--config", "-c", type=Path)
    p.add_argument("--verify-wait", type=float, default=120.0, help="seconds to wait for the copy to converge")
    p = sub.add_parser("verify", help="compare stores with PostgreSQL key by key")
    p.add_argument("names", nargs="*", metavar="NAME", help="default: sinks.enabled")
    p.add_argument("--config", "-c", type=Path)
    p.add_argument("--wait", type=float, default=0.0, help="keep comparing this long while there is drift")
    p.add_argument(
        "--repair",
        action="store_true",
        help="have the running capture re-emit exactly the keys that differ, then compare again",
    )
    p.add_argument(
        "--repair-wait", type=float, default=600.0, help="seconds to wait for the repair's backfills to finish"
    )
    return parser


def _list() -> int:
    from sinks.plugins import discover  # noqa: PLC0415 - entry points are read only when listed

    found = discover()
    width = max((len(n) for n in found), default=4)
    for name, entry in sorted(found.items()):
        if entry.error:
            print(f"{name:<{width}}  BROKEN  {entry.target}  ({entry.origin}): {entry.error}")
        else:
            caps = "rebuild, verify" if entry.rebuildable else "-"
            print(f"{name:<{width}}  ok      {entry.target}  ({entry.origin})  [{caps}]")
    return 0


def _source_tables(config: Path | None) -> Any:
    def read() -> Any:
        import cdc  # noqa: PLC0415 - lazily: listing and running sinks never load the capture

        return cdc.source_tables(config)

    return read


def _print_drift(name: str, drifts: list[Any]) -> bool:
    clean = True
    for d in drifts:
        if d.clean:
            print(f"{name} {d.table}: no drift")
            continue
        clean = False
        n = d.counts
        print(
            f"{name} {d.table}: DRIFT missing {n['missing']}, extra {n['extra']}, different {n['different']}"
            + (f", cannot be encoded {n['unencodable']}" if n["unencodable"] else "")
        )
        for key, error in d.unencodable[:10]:
            print(f"  cannot be encoded  {key}: {error} (capture.on_unencodable; docs/types.md)")
        for key in d.missing[:10]:
            print(f"  missing  {key}")
        for key in d.extra[:10]:
            print(f"  extra    {key}")
        for key, want, got in d.different[:10]:
            cols = [c for c in want if want[c] != got.get(c)]
            print(f"  differs  {key}: " + ", ".join(f"{c}: source {want[c]!r} store {got.get(c)!r}" for c in cols))
        if d.report:
            print(f"  every key: {d.report}")
    return clean


def _repair(args: argparse.Namespace, drifted: dict[str, list[Any]]) -> None:
    """Asks the running capture to re-emit every key the drifted sinks' reports list, each table's keys once
    whichever stores miss them (one event mends them all), and waits until it has."""
    import cdc  # noqa: PLC0415 - lazily, as _source_tables

    wanted: dict[str, list[Any]] = {}
    for name, drifts in drifted.items():
        for d in drifts:
            if d.clean or d.location is None:
                continue
            keys, without = cdc.report_keys((d.location.read_text() or "").splitlines(), d.report)
            if without:
                print(
                    f"{name} {d.table}: {without} key(s) cannot be re-emitted by key: PostgreSQL cannot read them "
                    f"back from the store's form (`cdc sinks rebuild {name}` mends those)"
                )
            wanted.setdefault(d.table, []).extend(keys)
    ids: list[str] = []
    for table, keys in wanted.items():
        if not keys:
            continue
        asked = cdc.request_keys(args.config, table, keys)  # each key once
        backfills = ", ".join(i for i, _ in asked)
        print(f"{table}: repair: {sum(n for _, n in asked)} key(s) to re-emit, backfill {backfills}")
        ids += [i for i, _ in asked]
    for b in cdc.wait_for_backfills(args.config, ids, args.repair_wait):
        print(f"backfill {b.id} of {b.table}: {b.status}: {b.rows} row(s) re-read, {b.deleted} key(s) deleted")
        if b.status != "done":
            raise DriftError(f"the repair's backfill {b.id} of {b.table} is {b.status}: {b.error or 'see cdc run'}")


def _verify(args: argparse.Namespace, settings: Any) -> int:
    """``cdc verify``: every named sink in one Spark session, and with --repair the comparisons after it (a
    process can start Spark's JVM only once, and starting it is most of a small comparison's time)."""
    from sinks.app import never_ran, spark_session, stop_session, verify  # noqa: PLC0415 - Spark's side, when needed

    names = list(dict.fromkeys(args.names or settings.sinks.enabled))
    if not names:
        raise SinkConfigError("no sink to verify: name one, or enable some in sinks.enabled")
    if not args.wait:
        for name in names:
            if (error := never_ran(settings, name)) is not None:
                raise error  # said before Spark starts: nothing of it is needed to know
    spark = spark_session(settings, "pgcdc-verify")
    try:
        drifted: dict[str, list[Any]] = {}
        for name in names:
            drifts = verify(settings, name, _source_tables(args.config), wait_s=args.wait, spark=spark)
            if not _print_drift(name, drifts):
                drifted[name] = drifts
        if not drifted:
            return 0
        listed = ", ".join(drifted)
        if not args.repair:
            raise DriftError(f"{listed} differ(s) from the source (details above; --repair re-emits those keys)")
        _repair(args, drifted)
        # The stores converge as their queries apply the re-emitted events.
        wait = max(args.wait, 120.0)
        still = [
            name
            for name in drifted
            if not _print_drift(name, verify(settings, name, _source_tables(args.config), wait_s=wait, spark=spark))
        ]
        if still:
            raise DriftError(f"{', '.join(still)} still differ(s) from the source after the repair (details above)")
        return 0
    finally:
        stop_session(spark)


def _rebuild(args: argparse.Namespace, settings: Any) -> int:
    """``cdc sinks rebuild``: every named sink side by side in one application, swapped in all together."""
    from sinks.app import rebuild  # noqa: PLC0415 - Spark's side loads only when a command needs it

    names = list(dict.fromkeys(args.names))
    results = rebuild(settings, names, _source_tables(args.config), verify_wait_s=args.verify_wait)
    drifted = [r for r in results if not _print_drift(r.name, r.drifts)]
    if drifted:
        listed = ", ".join(f"generation {r.generation} of {r.name}" for r in drifted)
        raise DriftError(
            f"{listed} differ(s) from the source; nothing was swapped in (every served copy stays as it was)"
        )
    return 0


def _exit_when_stuck(stop: threading.Event, stopped: threading.Event, timeout_s: float) -> None:
    """Once ``stop`` is set (SIGTERM), the app has ``timeout_s`` to stop; past it (a store or Kafka that does not
    answer holds a batch, or Spark's own stop) Spark's processes are killed and the process exits 0: nothing is
    lost, as every store write is idempotent and the next run resumes from the last checkpoint."""

    def watch() -> None:
        stop.wait()
        if stopped.wait(timeout_s):
            return
        log.error(
            "the sinks did not stop within %gs of the signal (sinks.shutdown_timeout_s; a store or Kafka not "
            "answering): exiting now; the next run resumes from the last checkpoint",
            timeout_s,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        from sinks.app import kill_started  # noqa: PLC0415 - loaded with the supervisor already

        kill_started()
        os._exit(0)

    threading.Thread(target=watch, name="pgcdc-stop-deadline", daemon=True).start()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sinks" and args.action == "list":
            return _list()
        if args.command == "sinks" and args.action == "spark-app":
            # Its path, not the module: spark_app runs the whole command line, which loads this module.
            print(Path(__file__).with_name("spark_app.py"))
            return 0
        settings = load_sink_settings(args.config)
        if args.command == "verify":
            return _verify(args, settings)
        if args.action == "rebuild":
            return _rebuild(args, settings)
        from sinks.app import run  # noqa: PLC0415 - loads the sinks' Spark side only when a query runs

        names = args.names or list(settings.sinks.enabled)
        stop, stopped = threading.Event(), threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        _exit_when_stuck(stop, stopped, settings.sinks.shutdown_timeout_s)
        try:
            return run(settings, names, stop, _source_tables(args.config))
        finally:
            stopped.set()
    except CDCError as exc:  # the sinks' errors, and the capture's when verify reads the source
        print(f"cdc: error: {exc}", file=sys.stderr)
        return exc.exit_code
