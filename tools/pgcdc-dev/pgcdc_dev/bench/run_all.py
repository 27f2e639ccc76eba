#!/usr/bin/env python3
"""Every benchmark scenario in sequence, then the summary, the charts, docs/benchmarks.md's results table and the
README's summary of it.

    ./dev bench                                   every scenario at its full size (the services are started first)
    ./dev bench --quick                           smaller sizes (QUICK_ARGV below): checks that everything runs
    ./dev bench --only insert-heavy,latency       or --skip snapshot,sinks; names or module names
    ./dev bench --args 'insert-heavy=--rows 2000000'   extra arguments for one scenario (repeatable)
    ./dev bench --repeat 3                        each scenario 3 times: medians, with the runs' range in brackets
    ./dev bench --list                            the scenarios and the arguments each would get
    ./dev bench --warm-broker 0                   skip the broker's warm-up (default: 60 s, 0 with --quick)
    ./dev bench --render-only                     redraw summary.md, charts, docs/benchmarks.md and README (= render.py)

Each scenario is a module ``bench/<module>.py`` whose ``run(argv) -> _report.Result`` is imported only when its
turn comes; its result goes to ``bench/results/<scenario>.json`` (``_report.write_result``). A scenario that
raises is recorded as failed (traceback on stderr) and the others still run. At the end: ``summary.json`` (the
run: date, machine, total time, each scenario's status, all documents), ``summary.md``, the charts and the
docs/benchmarks.md's block between ``<!-- bench:results:start -->`` and ``<!-- bench:results:end -->`` (see render.py).
Exit status 1 when a scenario failed; a missed target does not fail the run, the tables show it.

Before the first scenario the Kafka broker is warmed (``_warm_broker.py``: a minute of produce, so that the
runs measure the capture and not the broker's JIT compilers); the summary and the README say how it went.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pgcdc_dev import CHECKOUT, discovery
from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench import render
from pgcdc_dev.bench import report as _report
from pgcdc_dev.bench import warm_broker as _warm_broker

# scenario name (its JSON file and table rows) -> module in bench/, in the order they run
SCENARIOS: dict[str, str] = {
    "insert-heavy": "insert_heavy",
    "update-heavy": "update_heavy",
    "pgbench": "pgbench_tpcb",
    "big-transaction": "big_transaction",
    "snapshot": "snapshot",
    "latency": "capture_latency",
    "backfill": "backfill",
    "sinks": "sinks_bench",  # not `sinks`: that is the project's package (installed, found first)
}
SCENARIO_PACKAGE = "bench"  # the checkout's bench/: run from the checkout (./dev bench does)
SCENARIO_DIR = CHECKOUT / "bench"  # where the scenario modules must come from

# --quick: the arguments each scenario gets instead of its defaults. Flags a scenario's argparse does not accept
# are dropped with a warning when it is imported, so this table may run ahead of (or behind) the scenarios.
QUICK_ARGV: dict[str, list[str]] = {
    "insert-heavy": ["--rows", "20000"],
    "update-heavy": ["--rows", "5000", "--changes", "10000"],
    "pgbench": ["--scale", "1", "--seconds", "10"],
    "big-transaction": ["--megabytes", "64"],
    "snapshot": ["--rows", "100000"],
    "latency": ["--seconds", "10", "--warmup-seconds", "2"],
    "backfill": ["--rows", "200000", "--seconds", "10"],
    "sinks": ["--rows", "10000", "--freshness-seconds", "15", "--heavy-seconds", "15", "--sustained-seconds", "15"],
}

# functions that build a module's parser, tried (without arguments) before reading the source
_PARSER_FACTORIES = ("build_parser", "make_parser", "parser", "arg_parser", "_build_parser", "_make_parser", "_parser")


def warn(message: str) -> None:
    print(f"run_all: warning: {message}", file=sys.stderr, flush=True)


# --- which flags a scenario accepts -------------------------------------------------------------------------------


def _parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def options_in_source(source: str) -> set[str] | None:
    """The option strings of every ``….add_argument("--x", …)`` call in ``source``; None when there is none."""
    tree = ast.parse(source)
    found: set[str] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            found = found if found is not None else set()
            found.update(
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-")
            )
    return found


def accepted_options(module: ModuleType) -> set[str] | None:
    """The flags ``module``'s argparse accepts: from a parser it exposes, else its source; None if unknown."""
    for value in vars(module).values():
        if isinstance(value, argparse.ArgumentParser):
            return _parser_options(value)
    for name in _PARSER_FACTORIES:
        factory = getattr(module, name, None)
        if callable(factory):
            try:
                parser = factory()
            except Exception:  # noqa: S112 - not a factory after all (needs arguments): try the next way
                continue
            if isinstance(parser, argparse.ArgumentParser):
                return _parser_options(parser)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    return options_in_source(source)


def _is_option(arg: str) -> bool:
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)  # a negative number is a value
    except ValueError:
        return True
    return False


def filter_argv(argv: list[str], accepted: set[str] | None) -> tuple[list[str], list[str]]:
    """(kept, dropped): ``argv`` without the options (and their values) that are not in ``accepted``.

    An option's values are the tokens up to the next option; ``--x=1`` is one token. With ``accepted`` None
    (unknown) everything is kept. Tokens before the first option (positionals) are kept.
    """
    if accepted is None:
        return list(argv), []
    kept: list[str] = []
    dropped: list[str] = []
    keep = True
    for token in argv:
        if _is_option(token):
            option = token.split("=", 1)[0]
            keep = option in accepted
            if not keep:
                dropped.append(option)
        if keep:
            kept.append(token)
    return kept, dropped


def quick_argv(name: str, module: ModuleType | None) -> list[str]:
    """QUICK_ARGV[name] without what ``module`` does not accept (each dropped flag is warned about)."""
    argv = QUICK_ARGV.get(name, [])
    if module is None or not argv:
        return list(argv)
    accepted = accepted_options(module)
    if accepted is None:
        warn(f"{name}: cannot tell which flags {module.__name__} accepts; passing {shlex.join(argv)} unchecked")
        return list(argv)
    kept, dropped = filter_argv(argv, accepted)
    for option in dropped:
        warn(f"{name}: {module.__name__} does not accept {option}; dropped from its --quick arguments")
    return kept


def import_scenario(module_name: str) -> ModuleType:
    """Import ``bench/<module_name>.py``; refuses a same-named module from elsewhere (an installed package)."""
    try:
        module = importlib.import_module(f"{SCENARIO_PACKAGE}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name not in (SCENARIO_PACKAGE, f"{SCENARIO_PACKAGE}.{module_name}"):
            raise
        raise ImportError(
            f"scenario {module_name!r} is not importable as {SCENARIO_PACKAGE}.{module_name}: run the benchmarks "
            f"from the checkout ({CHECKOUT}) with ./dev bench"
        ) from exc
    file = getattr(module, "__file__", None)
    if file is None or Path(file).resolve().parent != SCENARIO_DIR:
        raise ImportError(
            f"{module_name!r} was found at {file}, not in {SCENARIO_DIR}: rename the scenario module "
            "(its name clashes with another module) and its entry in SCENARIOS"
        )
    return module


# --- running ------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: str
    module: str
    status: str  # "ok" or "failed"
    seconds: float
    argv: list[str] = field(default_factory=list)
    result: str | None = None  # the JSON written
    error: str | None = None
    document: dict[str, Any] | None = None


# Before each run: the machine's busy share must fall below this over a whole window, for at most this long.
QUIET_BUSY_SHARE = 0.15
QUIET_WINDOW_S = 1.0
QUIET_MAX_WAIT_S = 30.0


def settle(checkpoint: Callable[[], None] | None = None) -> str:
    """Lets the previous run's aftermath pass before the next run starts: a CHECKPOINT (its writes then land
    here, not during the measurement; the scenarios load and drop millions of rows), then a wait until the
    machine is quiet (the broker's and PostgreSQL's background work after a heavy run). Measured: the first
    latency run after the 5M-row snapshot gave p99 72 ms, the next two 34 and 22 ms. Returns what it did."""
    start = time.monotonic()
    done = []
    if checkpoint is not None:
        try:
            checkpoint()
            done.append(f"CHECKPOINT {time.monotonic() - start:.1f} s")
        except Exception as exc:  # no PostgreSQL yet, say: the scenario reports that itself
            done.append(f"no CHECKPOINT ({type(exc).__name__})")
    waited = time.monotonic()
    cpus = os.cpu_count() or 1
    while True:
        busy0, _ = _cpu.box()
        time.sleep(QUIET_WINDOW_S)
        share = (_cpu.box()[0] - busy0) / (QUIET_WINDOW_S * cpus)
        if share < QUIET_BUSY_SHARE or time.monotonic() - waited >= QUIET_MAX_WAIT_S:
            break
    quiet = "quiet" if share < QUIET_BUSY_SHARE else "still busy"
    done.append(f"{quiet} after {time.monotonic() - waited:.0f} s ({share:.0%} busy)")
    return "; ".join(done)


DEFAULT_WARM_BROKER_S = 60.0


def warm_broker(seconds: float) -> dict[str, Any] | None:
    """The broker's warm-up (``_warm_broker.warm``), as the summary records it; None when it failed (the
    scenarios then report the missing broker themselves)."""
    print(f"\n=== warming the Kafka broker for {seconds:g} s (pgcdc_dev/bench/warm_broker.py)", flush=True)
    try:
        done = _warm_broker.warm(discovery.find("kafka").value, seconds, log=lambda line: print(line, flush=True))
    except Exception as exc:  # the services are missing, say: every scenario will say so too
        warn(f"the broker's warm-up failed ({type(exc).__name__}: {exc}); the runs start on a cold broker")
        return None
    warmup = asdict(done)
    print(render.warmup_sentence(warmup).strip(), flush=True)
    return warmup


def _checkpoint() -> None:
    """A CHECKPOINT on the services' PostgreSQL."""
    import psycopg

    with psycopg.connect(discovery.find("postgres").value, autocommit=True, connect_timeout=10) as conn:
        conn.execute("CHECKPOINT")


def run_scenario(
    name: str,
    module_name: str,
    argv_for: Callable[[str, ModuleType], list[str]],
    results_dir: Path,
    *,
    repeat: int = 1,
) -> Outcome:
    """Import ``module_name``, call its ``run`` with ``argv_for(name, module)`` and write its result; with
    ``repeat`` > 1, that many times, and the result written is their medians (``_report.combine``). One failed
    run fails the scenario: a median over the runs that happened to work would flatter it."""
    start = time.monotonic()
    argv: list[str] = []
    try:
        module = import_scenario(module_name)
        argv = argv_for(name, module)
        docs = []
        for i in range(repeat):
            of = f" (run {i + 1} of {repeat})" if repeat > 1 else ""
            print(f"\n=== {name}{of}: bench/{module_name}.py {shlex.join(argv)}".rstrip(), flush=True)
            print(f"settled: {settle(_checkpoint)}", flush=True)
            result = module.run(argv)
            if getattr(result, "scenario", name) != name:
                warn(f"{name}: {module_name}.run() reported scenario {result.scenario!r}")
            # Nothing is written before the last run: a result on disk from an unfinished repeat would be
            # shown as this run's (render keeps a failed scenario's JSON when it is newer than the run).
            docs.append(_report.document(result))
            print(_report.markdown_rows(docs[-1:]), flush=True)
        document = _report.combine(docs)
        path = _report.write_document(document, results_dir)
        if repeat > 1:
            print(f"=== {name}: medians of {repeat} runs\n{_report.markdown_rows([document])}", flush=True)
    except (Exception, SystemExit) as exc:  # SystemExit: argparse rejecting an argument
        traceback.print_exc()
        print(f"=== {name}: FAILED ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return Outcome(
            name, module_name, "failed", time.monotonic() - start, argv, error=f"{type(exc).__name__}: {exc}"
        )
    seconds = time.monotonic() - start
    print(f"=== {name}: done in {seconds:.0f} s ({path})", flush=True)
    return Outcome(name, module_name, "ok", seconds, argv, str(path), document=document)


def select(only: str | None, skip: str | None) -> list[str]:
    """The scenario names to run, in SCENARIOS order; names or module names, comma-separated."""
    by_any = {**{m: n for n, m in SCENARIOS.items()}, **{n: n for n in SCENARIOS}}

    def names(spec: str | None) -> list[str]:
        wanted = [s.strip() for s in (spec or "").split(",") if s.strip()]
        unknown = [s for s in wanted if s not in by_any]
        if unknown:
            raise SystemExit(f"run_all: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
        return [by_any[s] for s in wanted]

    chosen = set(names(only)) if only else set(SCENARIOS)
    chosen -= set(names(skip))
    return [n for n in SCENARIOS if n in chosen]


def parse_extra(specs: list[str]) -> dict[str, list[str]]:
    """``--args 'NAME=ARGS'`` -> {scenario: [args]} (NAME may be the module name)."""
    by_any = {**{m: n for n, m in SCENARIOS.items()}, **{n: n for n in SCENARIOS}}
    out: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, args = spec.partition("=")
        if not sep or key.strip() not in by_any:
            raise SystemExit(f"run_all: --args wants NAME=ARGS with NAME one of {', '.join(SCENARIOS)}: {spec!r}")
        out.setdefault(by_any[key.strip()], []).extend(shlex.split(args))
    return out


@dataclass
class Run:
    """What the summary says of the run as a whole."""

    started: float  # epoch seconds
    date: str
    total: float  # seconds
    command: str
    quick: bool
    warmup: dict[str, Any] | None = None


def write_summary(outcomes: list[Outcome], run: Run, results_dir: Path) -> Path:
    summary = {
        "date": run.date,
        "started_epoch": run.started,
        "machine": _report.machine(),
        "command": run.command,
        "quick": run.quick,
        "total_seconds": round(run.total, 1),
        "broker_warmup": run.warmup,
        "scenarios": [{k: v for k, v in asdict(o).items() if k != "document"} for o in outcomes],
        "documents": [o.document for o in outcomes if o.document is not None],
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / render.SUMMARY_JSON
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _print_outcomes(outcomes: list[Outcome], total: float) -> None:
    print(f"\n=== {len(outcomes)} scenario(s) in {total:.0f} s", flush=True)
    for o in outcomes:
        missed = [m["name"] for m in (o.document or {}).get("measures", []) if m.get("met") is False]
        extra = f"; missed targets: {', '.join(missed)}" if missed else ""
        error = f": {o.error}" if o.error else ""
        print(f"  {o.scenario:<16} {o.status:<6} {o.seconds:7.0f} s{error}{extra}", flush=True)


def _render(results_dir: Path, readme: Path | None) -> bool:
    """``readme``: docs/benchmarks.md (the results) and the README (its summary) when not None."""
    try:
        front = render.README if readme is not None else None
        render.render(results_dir, readme, list(SCENARIOS), front=front)
    except render.MarkersError as exc:
        print(f"run_all: {exc}", file=sys.stderr)
        return False
    except Exception:
        traceback.print_exc()
        print("run_all: rendering the summary, charts or README failed (the JSON results are written)", file=sys.stderr)
        return False
    return True


def _list(names: list[str], argv_for: Callable[[str, ModuleType], list[str]]) -> int:
    for name in names:
        module_name = SCENARIOS[name]
        try:
            module = import_scenario(module_name)
        except Exception as exc:
            print(f"{name:<16} bench/{module_name}.py  (cannot import: {type(exc).__name__}: {exc})")
            continue
        print(f"{name:<16} bench/{module_name}.py  {shlex.join(argv_for(name, module))}".rstrip())
    return 0


def _run_all(
    names: list[str], argv_for: Callable[[str, ModuleType], list[str]], results: Path, repeat: int
) -> tuple[list[Outcome], bool]:
    """Each scenario in turn; the outcomes, and whether an interrupt (Ctrl-C) ended the run early."""
    outcomes: list[Outcome] = []
    for name in names:
        try:
            outcomes.append(run_scenario(name, SCENARIOS[name], argv_for, results, repeat=repeat))
        except KeyboardInterrupt:
            traceback.print_exc()
            outcomes.append(Outcome(name, SCENARIOS[name], "failed", 0.0, error="interrupted"))
            return outcomes, True
    return outcomes, False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run the benchmark scenarios in sequence; write summary, charts, docs/benchmarks.md and the "
        "README's summary.",
    )
    parser.add_argument("--only", metavar="A,B", help="run only these scenarios")
    parser.add_argument("--skip", metavar="A,B", help="do not run these scenarios")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (QUICK_ARGV in pgcdc_dev/bench/run_all.py)")
    parser.add_argument("--args", action="append", default=[], metavar="NAME=ARGS", help="extra arguments")
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="N", help="run each scenario N times; report medians and ranges"
    )
    parser.add_argument(
        "--warm-broker",
        type=float,
        metavar="SECONDS",
        help="produce to the broker this long before the first scenario (default 60; 0 with --quick; 0 skips)",
    )
    parser.add_argument("--list", action="store_true", help="print the scenarios and their arguments; run nothing")
    parser.add_argument("--render-only", action="store_true", help="redraw from the JSON in the results directory")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and docs/benchmarks.md alone")
    parser.add_argument("--results", type=Path, default=_report.RESULTS, help="results directory (%(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    readme = None if args.no_readme else render.PAGE

    if args.render_only:
        return 0 if _render(args.results, readme) else 2

    if args.repeat < 1:
        parser.error(f"--repeat wants a number of runs, 1 or more (got {args.repeat})")
    names = select(args.only, args.skip)
    extra = parse_extra(args.args)

    def argv_for(name: str, module: ModuleType) -> list[str]:
        return (quick_argv(name, module) if args.quick else []) + extra.get(name, [])

    if args.list:
        return _list(names, argv_for)
    if readme is not None:  # a page without markers would fail only after the whole run: fail now
        try:
            render.replace_between_markers(readme.read_text(), "")
            render.replace_between_markers(render.README.read_text(), "", render.FRONT_START, render.FRONT_END)
        except render.MarkersError as exc:
            print(f"run_all: {exc} (or run with --no-readme)", file=sys.stderr)
            return 2

    started, date, clock = time.time(), time.strftime("%Y-%m-%d %H:%M %Z"), time.monotonic()
    warm_s = args.warm_broker if args.warm_broker is not None else 0.0 if args.quick else DEFAULT_WARM_BROKER_S
    warmup = warm_broker(warm_s) if warm_s > 0 else None
    outcomes, interrupted = _run_all(names, argv_for, args.results, args.repeat)
    total = time.monotonic() - clock
    command = shlex.join(["./dev", "bench", *(sys.argv[1:] if argv is None else argv)])
    summary = write_summary(outcomes, Run(started, date, total, command, args.quick, warmup), args.results)
    _print_outcomes(outcomes, total)
    print(f"run_all: wrote {summary}", flush=True)
    rendered = _render(args.results, readme)
    if interrupted:
        return 130
    if any(o.status == "failed" for o in outcomes):
        return 1
    return 0 if rendered else 2


if __name__ == "__main__":
    sys.exit(main())
