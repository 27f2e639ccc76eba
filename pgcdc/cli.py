"""The ``cdc`` command line.

    cdc attach --config cdc.toml [--dry-run]   check the source, create the publication; say what it did
    cdc run --config cdc.toml                  attach, snapshot if needed, stream until SIGTERM/SIGINT
    cdc detach --config cdc.toml --yes         drop the replication slot and the publication
    cdc status --config cdc.toml [--json]      source, slot, topics and sinks with their lags, from outside
    cdc snapshot TABLE… [--where SQL] --config cdc.toml   backfill while streaming (--list, --cancel ID, …)

Exit codes: 0 success; 1 unexpected; 2 configuration; 3 source not ready; 4 authentication; 5 schema
registry refused a schema; 6 Kafka set-up; 7 stream error; 10 a service stayed unreachable (transient faults:
`cdc run` retries them for 30 minutes, one-shot commands stop at once); 130 interrupted before start.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tenacity import (
    RetryCallState,
    before_sleep_log,
    retry,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from cdc import __version__
from cdc.config import Settings, load_settings
from cdc.metrics import CaptureMetrics
from cdc.runner import Capture, Stop, install_signal_handlers
from cdc.service import SLOT_INVALIDATED, check_and_prepare, check_standby, detach, source_connections
from pgcdc import snapshot_cli
from pgcdc._demo import DemoSinks, ensure_database, run_demo, run_workload
from pgcdc._observe import Observer, collect_status
from pgcdc_common.errors import CDCError, ConfigError, TransientError

log = logging.getLogger("cdc")

RETRY_WINDOW_S = 30 * 60.0  # give up after this long without an attempt that made progress
PROGRESS_S = 60.0  # an attempt that ran this long made progress


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
                **({"exc": self.formatException(record.exc_info)} if record.exc_info else {}),
            }
        )


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The registry's and OpenSearch's clients log every HTTP request at INFO; that is noise at our INFO level
    # (and, for the search sink's lane, a log record built per bulk request).
    for noisy in ("httpx", "httpx2", "httpcore", "opensearch"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdc",
        description=(
            "PostgreSQL change data capture into compacted Kafka topics, and the derived views kept from them."
        ),
        epilog="Configuration keys can be overridden with CDC_<SECTION>__<KEY> environment variables.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-json", action="store_true", help="structured JSON logs on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", type=Path, help="TOML configuration file")

    p = sub.add_parser("attach", help="check the source and create the publication (the slot comes with `run`)")
    with_config(p)
    p.add_argument("--dry-run", action="store_true", help="only check and print what would be done")
    p.add_argument(
        "--standby",
        action="append",
        default=[],
        metavar="DSN",
        help="also check that this standby can take over the slot at a failover (PostgreSQL 17+; repeatable)",
    )
    p = sub.add_parser("run", help="capture: snapshot if needed, then stream changes until stopped")
    with_config(p)
    p.add_argument(
        "--new-slot",
        action="store_true",
        help="create the replication slot anew when it is missing though Kafka holds a committed position "
        "(after `cdc detach`, an invalidated slot, a failover to a server without a copy of it); with "
        "capture.snapshot = 'initial' every table is snapshotted again",
    )
    p = sub.add_parser("detach", help="drop the replication slot and the publication")
    with_config(p)
    p.add_argument("--yes", action="store_true", help="confirm: the slot's position is lost for good")
    p.add_argument("--dry-run", action="store_true", help="only print what would be dropped")
    p = sub.add_parser("status", help="source, slot, topics and sinks with their lags and health")
    with_config(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    snapshot_cli.add_parser(sub)
    _add_demo_parser(sub)
    # The derived views' commands live in pgcdc/sinks_cli.py, loaded lazily: `cdc run` never loads the sinks'
    # modules, nor Spark.
    for name, text in (
        ("sinks", "list, run or rebuild the derived views (search, cache, warehouse, plugins)"),
        ("verify", "compare derived stores with PostgreSQL key by key"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _add_demo_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="a demo database with a live workload, captured and read back from Kafka")
    p.add_argument("--pg", required=True, help="DSN of a PostgreSQL server (wal_level=logical) to create the demo in")
    p.add_argument("--kafka", help="Kafka bootstrap servers")
    p.add_argument("--registry", help="Confluent-compatible schema registry URL")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the workload runs (0: until stopped)")
    only = p.add_mutually_exclusive_group()
    only.add_argument(
        "--setup-only", action="store_true", help="create the demo database where absent (never reset it), then exit"
    )
    only.add_argument(
        "--workload-only",
        action="store_true",
        help="run the workload alone (no capture, no Kafka): for a `cdc run` started elsewhere",
    )
    p.add_argument("--opensearch", help="with --redis and --spark-jars: run the whole pipeline into the stores")
    p.add_argument("--redis", help="Redis URL for the cache sink")
    p.add_argument("--spark-jars", help="comma-separated Spark jars (Kafka source, spark-avro, Delta)")


def _attach(settings: Settings, dry_run: bool, standbys: list[str] | None = None) -> int:
    notes: list[str] = []
    # Capturing from a standby, the publication is made on its primary.
    with source_connections(settings, notes) as (conn, primary):
        report = check_and_prepare(conn, settings, dry_run=dry_run, writer=primary)
        report.notes += notes
        for standby in standbys or []:
            report.notes += check_standby(conn, settings, standby)
    verb = "would run" if dry_run else "ran"
    print(f"source {settings.source.display_dsn()}: all checks passed")
    for table in report.tables:
        print(
            f"  {table.qualified}: key ({', '.join(report.key_columns[table.qualified])}) "
            f"-> topic {settings.topic_for(table.schema, table.name)}"
        )
    for action in report.actions:
        print(f"  {verb}: {action}")
    if not report.actions:
        print(f"  publication {settings.source.publication!r} already in place")
    for note in report.notes:
        print(f"  note: {note}")
    return 0


def _detach(settings: Settings, yes: bool, dry_run: bool) -> int:
    if not yes and not dry_run:
        print("detach drops the replication slot and the publication; pass --yes to confirm", file=sys.stderr)
        return 2
    # The slot on source.dsn, the publication on the primary; unchecked: detaching is what an operator does to a
    # standby that fails the capture's checks (its slot invalidated, say).
    with source_connections(settings, checked=False) as (conn, primary):
        done = detach(conn, settings, dry_run=dry_run, writer=primary)
    for action in done or ["nothing to drop"]:
        print(("would run: " if dry_run else "ran: ") + action)
    return 0


def _run(settings: Settings, config_path: Path | None, *, new_slot: bool = False) -> int:
    stop = Stop()
    install_signal_handlers(stop)
    metrics = CaptureMetrics()
    observer = Observer(settings, metrics, config_path=config_path) if settings.metrics.enabled else None
    if observer is not None:
        observer.start()
    try:
        return _run_with_retries(settings, stop, metrics, new_slot=new_slot)
    finally:
        if observer is not None:
            observer.stop()


class _Backoff:
    """tenacity's exponential backoff with jitter, its exponent counted from the last attempt that made progress
    (ran a while): a fault after days of streaming is retried as soon as the first one, not after the 30 s that
    the run's ever-growing attempt count reaches after a few faults."""

    def __init__(self) -> None:
        self._failed = 0  # attempts that failed since the last that made progress
        self._wait = wait_exponential_jitter(multiplier=0.5, max=30)

    def ended(self, *, progressed: bool) -> None:
        self._failed = 1 if progressed else self._failed + 1

    def __call__(self, state: RetryCallState) -> float:
        counted = copy.copy(state)
        counted.attempt_number = max(1, self._failed)
        return float(self._wait(counted))


def _run_with_retries(
    settings: Settings, stop: threading.Event, metrics: CaptureMetrics, *, new_slot: bool = False
) -> int:

    # Transient faults (network, broker failover) restart the capture from its committed offset, which is
    # safe by construction; terminal ones end the process with their exit code. The give-up clock counts
    # from the last attempt that made progress (ran a while), not from the process start: a blip after
    # two days of streaming is retried like one in the first minute.
    last_progress = [time.monotonic()]
    new_slot_left = [new_slot]
    backoff = _Backoff()

    def interruptible_sleep(seconds: float) -> None:
        stop.wait(seconds)  # SIGTERM ends a backoff at once

    def gave_up(state: RetryCallState) -> bool:
        return time.monotonic() - last_progress[0] > RETRY_WINDOW_S

    @retry(
        retry=retry_if_exception_type(TransientError),
        wait=backoff,
        stop=gave_up,
        sleep=interruptible_sleep,
        before_sleep=before_sleep_log(log, logging.WARNING),
        reraise=True,
    )
    def attempt() -> None:
        if stop.is_set():
            return
        started = time.monotonic()
        capture = Capture(settings, stop=stop, metrics=metrics, new_slot=new_slot_left[0])
        try:
            capture.run()
        except CDCError as exc:
            metrics.error(exc, transient=isinstance(exc, TransientError))
            metrics.set_state("error")
            raise
        finally:
            if capture.slot_created:  # --new-slot made its slot: a slot missing later stops the capture again
                new_slot_left[0] = False
            progressed = time.monotonic() - started > PROGRESS_S
            if progressed:
                last_progress[0] = time.monotonic()
            backoff.ended(progressed=progressed)

    attempt()
    return 0


def _status(settings: Settings, config_path: Path | None, *, as_json: bool) -> int:
    """Exit 0 when everything reachable is healthy, 3 when something needs attention (said in the output)."""
    from rich.console import Console  # noqa: PLC0415
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    status = collect_status(settings, config_path)
    problems = _problems(status)
    status["problems"] = problems
    if as_json:
        print(json.dumps(status, indent=2, default=str))
        return 3 if problems else 0
    table = Table(title=f"pgcdc status: slot {settings.source.slot!r}, publication {settings.source.publication!r}")
    for col in ("part", "state", "lag", "details"):
        table.add_column(col)
    _source_rows(table, status["source"])
    cap = status["capture"]
    _row(
        table,
        "capture",
        escape(str(cap.get("service", "?"))),
        "",
        f"resume LSN {cap.get('resume_lsn')}, snapshot {cap.get('snapshot')}"
        + (f"; Kafka: {cap['kafka_error']}" if "kafka_error" in cap else ""),
    )
    for name, generation in cap.get("generations", {}).items():
        _row(table, f"  table {name}", f"generation {generation}", "", "moved to a new topic by a type change")
    for b in cap.get("backfills", []):
        where = f" where {b['where']}" if b.get("where") else ""
        error = f": {b['error']}" if b.get("error") else ""
        _row(table, f"  backfill {b['id']}", b["status"], "", f"{b['table']}{where}: {b['rows']} row(s){error}")
    for t in status["topics"]:
        _row(table, f"  topic {t['topic']}", "", "", f"{t['records']} records in {t['partitions']} partition(s)")
    for sink in status["sinks"]:
        _sink_row(table, sink)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for problem in problems:
        console.print(f"[yellow]attention:[/] {escape(problem)}")
    return 3 if problems else 0


def _source_rows(table: Any, src: dict[str, Any]) -> None:
    """The source database and its slot."""
    if "error" in src:
        _row(table, "source", "[red]unreachable[/]", "", f"{src['dsn']}: {src['error']}")
    else:
        version = src.get("server_version") or 0
        _row(table, "source", "reachable", "", f"{src['dsn']} (PostgreSQL {version // 10000}.{version % 10000})")
    if not src.get("exists", True):
        _row(table, "slot", "[yellow]absent[/]", "", "created by the first `cdc run`")
    elif "error" not in src:
        active = "[green]active[/]" if src.get("active") else "[yellow]inactive[/]"
        _row(
            table,
            "slot",
            active if not src.get("invalidated") else "[red]LOST[/]",
            _bytes(src.get("lag_bytes")),
            f"confirmed {src.get('confirmed_flush_lsn')}, wal_status {src.get('wal_status')}, "
            f"holds {_bytes(src.get('retained_wal_bytes'))} of WAL" + _slot_extras(src),
        )


def _slot_extras(src: dict[str, Any]) -> str:
    """What newer servers say of the slot: why it was invalidated, since when it is idle (17+), the idle timeout
    that will invalidate it (18+), whether it is a failover slot (17+)."""
    out = ""
    if src.get("invalidated"):
        out += f", invalidated: {src['invalidated']}"
    if src.get("inactive_since") and not src.get("active"):
        out += f", inactive since {src['inactive_since']}"
        if src.get("idle_timeout_s"):
            out += f" (invalidated after {src['idle_timeout_s']} s idle: idle_replication_slot_timeout)"
    if src.get("failover"):
        out += ", failover slot" + (" (synchronized copy)" if src.get("synced") else "")
    return out


def _sink_row(table: Any, sink: dict[str, Any]) -> None:
    from rich.markup import escape  # noqa: PLC0415

    fresh = sink.get("freshness_s")
    rebuild = sink.get("rebuild")
    _row(
        table,
        f"sink {sink['name']}",
        escape(str(sink["state"])),
        "?" if sink["lag_records"] is None else f"{sink['lag_records']} records",
        f"generation {sink['generation']}, freshness {'?' if fresh is None else f'{fresh:.1f}s'}, "
        f"{sink['batches']} batches, {sink['dead_letters']} dead letters"
        + (f", last error: {sink['last_error']}" if sink.get("last_error") else "")
        + (f", rebuild g{rebuild.get('generation')} {rebuild.get('state')}" if rebuild else "")
        + (f" ({rebuild['reason']})" if rebuild and rebuild.get("reason") else ""),
    )


def _row(table: Any, part: str, state: str, lag: str, details: str) -> None:
    """A row of `cdc status`: only the state column carries markup; names, errors and DSNs are shown as is."""
    from rich.markup import escape  # noqa: PLC0415

    table.add_row(escape(part), state, escape(lag), escape(details))


def _problems(status: dict[str, Any]) -> list[str]:
    src = status["source"]
    out = []
    if "error" in src:
        out.append(f"the source is unreachable: {src['error']}")
    elif src.get("exists") and src.get("invalidated"):
        out.append(
            f"the slot was invalidated ({SLOT_INVALIDATED.get(src['invalidated'], src['invalidated'])}): "
            "`cdc detach --yes` then `cdc run --new-slot` re-snapshots"
        )
    elif src.get("exists") and not src.get("active"):
        out.append("no capture is attached to the slot: start `cdc run` (the slot holds WAL back meanwhile)")
    if "kafka_error" in status["capture"]:
        out.append(f"Kafka: {status['capture']['kafka_error']}")
    for sink in status["sinks"]:
        if sink["state"] == "not running":
            out.append(f"sink {sink['name']}: `cdc sinks run` is not running (no heartbeat); its lag grows")
        elif sink["state"] in ("backoff", "given_up"):
            out.append(f"sink {sink['name']} is {sink['state']}: {sink.get('last_error')}")
    return out


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _setup_logging(args.log_level, args.log_json)
    if args.command in ("sinks", "verify"):
        from pgcdc.sinks_cli import main as sinks_main  # noqa: PLC0415 - lazily: `cdc run` never loads sinks

        return sinks_main([args.command, *args.rest])
    try:
        if args.command == "demo":
            if args.setup_only:
                ensure_database(args.pg)
                return 0
            if args.workload_only:
                return run_workload(args.pg, args.seconds)
            if not (args.kafka and args.registry):
                raise ConfigError("cdc demo needs --kafka and --registry (or --setup-only / --workload-only)")
            sinks = None
            if args.opensearch or args.redis or args.spark_jars:
                if not (args.opensearch and args.redis and args.spark_jars):
                    raise ConfigError("the pipeline demo needs all of --opensearch, --redis and --spark-jars")
                sinks = DemoSinks(args.opensearch, args.redis, args.spark_jars)
            return run_demo(args.pg, args.kafka, args.registry, args.seconds, sinks=sinks)
        settings = load_settings(args.config)
        if args.command == "attach":
            return _attach(settings, args.dry_run, args.standby)
        if args.command == "detach":
            return _detach(settings, args.yes, args.dry_run)
        if args.command == "status":
            return _status(settings, args.config, as_json=args.json)
        if args.command == "snapshot":
            return snapshot_cli.run(settings, args)
        return _run(settings, args.config, new_slot=args.new_slot)
    except CDCError as exc:
        if args.log_json:
            log.error("%s", exc, extra={"exit_code": exc.exit_code})  # one JSON line like every other
        else:
            print(f"cdc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception:
        # A bug, not an operating condition: keep the traceback, in the log's format.
        log.exception("unexpected error; please report it with this log")
        return 1


if __name__ == "__main__":
    sys.exit(main())
