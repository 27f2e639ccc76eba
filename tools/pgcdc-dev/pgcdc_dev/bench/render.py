"""Rebuild bench/results/summary.md, the charts, docs/benchmarks.md's results and the README's summary of them from
the JSON files, running nothing.

    ./dev bench --render-only [--results DIR] [--no-readme]

Reads every result document in ``bench/results/`` (``<scenario>.json`` in ``_report``'s format; older files in
other formats are skipped) and ``summary.json``, the record of the last ``./dev bench`` run. A scenario that
failed in that run is shown as failed, unless its JSON was written after that run (it was re-run on its own).
docs/benchmarks.md's text between ``<!-- bench:results:start -->`` and ``<!-- bench:results:end -->`` is replaced
by a "Measured … on …" line, the results table and links to the charts; the README's between
``<!-- bench:summary:start -->`` and ``<!-- bench:summary:end -->`` by one line per scenario (targets met, and
what missed them). ``pgcdc_dev/bench/run_all.py`` calls this at the
end of a run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgcdc_dev import CHECKOUT
from pgcdc_dev.bench import charts as _charts
from pgcdc_dev.bench.report import RESULTS, fmt_number, markdown_rows

PAGE = CHECKOUT / "docs" / "benchmarks.md"  # the full results
README = CHECKOUT / "README.md"  # a line per scenario
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
START = "<!-- bench:results:start -->"
END = "<!-- bench:results:end -->"
FRONT_START = "<!-- bench:summary:start -->"
FRONT_END = "<!-- bench:summary:end -->"
DASH = "\N{EN DASH}"  # what _report.markdown_rows prints for "none"
_MEASURE_KEYS = {"name", "unit", "ours", "reference", "reference_name", "ratio", "target", "met"}


class MarkersError(ValueError):
    """The README lacks the results markers (or has them twice, or in the wrong order)."""


def replace_between_markers(text: str, content: str, start: str = START, end: str = END) -> str:
    """``text`` with what lies between the ``start`` and ``end`` marker lines replaced by ``content``.

    Idempotent: replacing with the same content again gives the same text. Raises ``MarkersError`` when a
    marker is missing or repeated, or the end comes before the start, and then nothing should be written.
    """
    counts = {marker: text.count(marker) for marker in (start, end)}
    problems = [
        f"{marker!r} is missing" if n == 0 else f"{marker!r} occurs {n} times (expected once)"
        for marker, n in counts.items()
        if n != 1
    ]
    if problems:
        raise MarkersError(
            "cannot place the benchmark results: " + "; ".join(problems) + f". Put the lines {start} and "
            f"{end} where the results belong (docs/benchmarks.md; README.md's '## Benchmarks' for the summary)."
        )
    i, j = text.index(start), text.index(end)
    if j < i:
        raise MarkersError(f"cannot place the benchmark results: {end!r} comes before {start!r}")
    head, tail = text[:i], text[j + len(end) :]
    return f"{head}{start}\n\n{content.strip()}\n\n{end}{tail}"


def is_result_doc(doc: Any) -> bool:
    """Whether a parsed JSON file is a result document of ``_report.write_result``."""
    return (
        isinstance(doc, dict)
        and isinstance(doc.get("scenario"), str)
        and isinstance(doc.get("measures"), list)
        and all(isinstance(m, dict) and m.keys() >= _MEASURE_KEYS for m in doc["measures"])
    )


def load_documents(results_dir: Path, order: Sequence[str] = ()) -> dict[str, tuple[Path, dict[str, Any]]]:
    """scenario -> (path, document) for the result documents in ``results_dir``, in ``order`` then by name."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        if path.name == SUMMARY_JSON:
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"render: skipping {path}: {exc}", file=sys.stderr)
            continue
        if is_result_doc(doc):
            found[doc["scenario"]] = (path, doc)
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def load_summary(results_dir: Path) -> dict[str, Any] | None:
    path = results_dir / SUMMARY_JSON
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"render: ignoring {path}: {exc}", file=sys.stderr)
        return None
    return summary if isinstance(summary, dict) else None


@dataclass
class Current:
    """What the results directory says now: the documents to show and the scenarios that failed."""

    docs: list[dict[str, Any]]
    failed: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None


def current(results_dir: Path, order: Sequence[str] = ()) -> Current:
    """The documents to show, leaving out those of scenarios that failed in the last run (they are stale)."""
    summary = load_summary(results_dir)
    found = load_documents(results_dir, order)
    failed: list[str] = []
    if summary is not None:
        started = float(summary.get("started_epoch", 0))
        for entry in summary.get("scenarios", []):
            name = entry.get("scenario")
            if entry.get("status") != "failed" or not isinstance(name, str):
                continue
            if name in found and found[name][0].stat().st_mtime > started:
                continue  # re-run on its own since that run
            found.pop(name, None)
            failed.append(name)
    return Current([doc for _, doc in found.values()], failed, summary)


def describe_machine(machine: dict[str, Any]) -> str:
    """``2 CPUs (Intel Xeon …), 7.8 GB memory``, from ``_report.machine()``."""
    cpus = machine.get("cpus")
    text = f"{cpus} CPU{'s' if cpus != 1 else ''}" if cpus else "? CPUs"
    if machine.get("cpu"):
        text += f" ({machine['cpu']})"
    if machine.get("memory_gb"):
        text += f", {machine['memory_gb']:g} GB memory"
    return text


def warmup_sentence(warmup: dict[str, Any] | None, scenarios: Sequence[dict[str, Any]] = ()) -> str:
    """`` Before the latest run (insert-heavy, …) the Kafka broker was warmed for 60 s …``, from the summary's
    ``broker_warmup`` and ``scenarios``: the table's other rows may come from earlier runs, not warmed."""
    if not warmup or not warmup.get("seconds"):
        return ""
    names = ", ".join(str(s.get("scenario")) for s in scenarios if s.get("scenario"))
    text = f" Before the latest run{f' ({names})' if names else ''} the Kafka broker was warmed for"
    text += f" {float(warmup['seconds']):.0f} s"
    text += f" ({int(warmup.get('records', 0)):,} records produced"
    costs = [w["broker_us_per_record"] for w in warmup.get("windows", []) if w.get("broker_us_per_record") is not None]
    if len(costs) >= 2:
        text += f"; its CPU per record {costs[0]:.2f} µs in the first seconds, {costs[-1]:.2f} in the last"
    return text + ")."


def measured_line(docs: Sequence[dict[str, Any]], summary: dict[str, Any] | None) -> str:
    """The README's first line: when, on what, by which command."""
    days = sorted({str(doc.get("date", ""))[:10] for doc in docs} - {""})
    if not days and summary is not None:
        days = [str(summary.get("date", ""))[:10]]
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "(no results yet)"
    machines = list(dict.fromkeys(describe_machine(doc.get("machine") or {}) for doc in docs))
    if not machines and summary is not None:
        machines = [describe_machine(summary.get("machine") or {})]
    command = str(summary.get("command", "./dev bench")) if summary is not None else "./dev bench"
    quick = " — quick sizes, to check the scenarios run, not figures to quote" if "--quick" in command else ""
    if "--only" in command or "--skip" in command:
        # The table shows each scenario's latest result, so it may come from several partial runs.
        command, quick = "./dev bench", " (each scenario's latest run; its time is in its JSON)" + quick
    repeats = sorted({int((doc.get("params") or {}).get("repeat", 1)) for doc in docs} - {1})
    medians = (
        f" A scenario run {' or '.join(map(str, repeats))} times (`--repeat`) shows medians, each ratio the median of"
        " the runs' own ratios, and the runs' range in brackets (none where they agree to the digits shown)."
        if repeats
        else ""
    )
    warmed = warmup_sentence((summary or {}).get("broker_warmup"), (summary or {}).get("scenarios") or [])
    return (
        f"Measured {when} on {'; '.join(machines) or 'an unknown machine'} by `{command}`{quick}. Every ratio is "
        f"against a reference measured in the same run, bigger is better; JSON in `bench/results/`.{medians}"
        f"{warmed}"
    )


def results_table(docs: Sequence[dict[str, Any]], failed: Sequence[str]) -> str:
    """``_report.markdown_rows`` plus a row for each failed scenario."""
    rows = [markdown_rows(list(docs))]
    rows += [
        f"| {name} | **failed** (no result; see the run's log) | {DASH} | {DASH} | {DASH} | | **failed** |"
        for name in failed
    ]
    return "\n".join(rows)


def _image_links(charts: Sequence[Path], base: Path) -> str:
    return "\n\n".join(f"![{_charts.TITLES.get(p.name, p.stem)}]({os.path.relpath(p, base)})" for p in charts)


def readme_block(state: Current, charts: Sequence[Path], readme_dir: Path) -> str:
    parts = [measured_line(state.docs, state.summary), results_table(state.docs, state.failed)]
    if charts:
        parts.append(_image_links(charts, readme_dir))
    return "\n\n".join(parts)


# The README's headline figures: (scenario, measure, what a reader is told it is). A measure with a reference
# shows it beside ours; one without shows its target.
HEADLINES = (
    ("insert-heavy", "capture rows/s", "Capture, insert-heavy WAL"),
    ("update-heavy", "capture changes/s", "Capture, update-heavy WAL"),
    ("latency", "p99 latency", "Commit to Kafka, p99 at 2,000 txn/s"),
    ("snapshot", "snapshot rows/s", "Initial snapshot"),
    ("sinks-live", "search freshness p99, light load", "Search index: commit to searchable, p99 at 200 txn/s"),
    ("sinks-live", "cache freshness p99, light load", "Cache: commit to readable, p99 at 200 txn/s"),
    ("sinks-live", "warehouse freshness p99, light load", "Warehouse: commit to readable, p99 at 200 txn/s"),
    ("sinks", "search replay events/s", "Search index rebuilt from offset zero"),
    ("sinks", "sql replay vs Kafka Connect", "SQL database rebuilt from offset zero"),
)


def _headline_row(label: str, m: dict[str, Any]) -> str:
    ours = f"{fmt_number(m['ours'])} {m['unit']}"
    if m.get("reference") is not None:
        times = "\N{MULTIPLICATION SIGN}"
        against = f"{fmt_number(m['reference'])} {m['unit']} ({m['reference_name']}): {m['ratio']:.2f}{times}"
    else:
        against = f"target {m['target']}" if m.get("target") else DASH
    return f"| {label} | {ours} | {against} |"


def _headline_rows(state: Current) -> list[str]:
    """A row per headline measure found (one per reference: the capture's against pg_recvlogical and Debezium)."""
    return [
        _headline_row(label, m)
        for scenario, name, label in HEADLINES
        for doc in state.docs
        if doc["scenario"] == scenario
        for m in doc["measures"]
        if m["name"] == name
    ]


def front_summary(state: Current, page: str) -> str:
    """The README's block: the headline figures, each beside its same-run reference (or its target)."""
    rows = _headline_rows(state)
    lines = ["| what | pgcdc | against |", "|---|---|---|", *rows] if rows else ["No results yet: `./dev bench`."]
    if state.failed:
        lines.append(f"\nFailed in the last run (no result): {', '.join(state.failed)}.")
    lines.append(f"\nEvery figure, with its same-run reference, its target and what it measures: [{page}]({page}).")
    return "\n".join(lines)


def summary_markdown(state: Current, charts: Sequence[Path], results_dir: Path) -> str:
    summary = state.summary or {}
    lines = ["# Benchmark results", "", measured_line(state.docs, state.summary)]
    if summary.get("total_seconds") is not None:
        lines[-1] += f" The run took {float(summary['total_seconds']):.0f} s."
    lines += ["", results_table(state.docs, state.failed)]
    missed = [
        f"- {doc['scenario']}: {m['name']} {m['ours']:g} {m['unit']}, target {m['target']}"
        for doc in state.docs
        for m in doc["measures"]
        if m["met"] is False
    ]
    if missed:
        lines += ["", "Missed targets:", "", *missed]
    if state.failed:
        lines += ["", "Failed scenarios (no result): " + ", ".join(state.failed)]
    notes = [f"- {doc['scenario']}: {note}" for doc in state.docs for note in doc.get("notes") or []]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if charts:
        lines += ["", _image_links(charts, results_dir)]
    return "\n".join(lines) + "\n"


@dataclass
class Rendered:
    summary_md: Path
    charts: list[Path]
    readme: Path | None


def render(
    results_dir: Path = RESULTS,
    readme: Path | None = PAGE,
    order: Sequence[str] = (),
    *,
    quiet: bool = False,
    front: Path | None = None,
) -> Rendered:
    """Write summary.md and the charts from the JSON in ``results_dir``, the results block of ``readme`` (the
    benchmarks page) and, with ``front``, its summary lines.

    The files are checked for their markers before anything is written, so one without them fails fast.
    """
    readme_text = readme.read_text() if readme is not None else None
    if readme_text is not None:
        replace_between_markers(readme_text, "")  # raises MarkersError before any file is touched
    front_text = front.read_text() if front is not None else None
    if front_text is not None:
        replace_between_markers(front_text, "", FRONT_START, FRONT_END)
    state = current(results_dir, order)
    charts = _charts.render_charts(state.docs, results_dir)
    summary_md = results_dir / SUMMARY_MD
    summary_md.write_text(summary_markdown(state, charts, results_dir))
    written = [summary_md, *charts]
    if readme is not None and readme_text is not None:
        new = replace_between_markers(readme_text, readme_block(state, charts, readme.parent))
        if new != readme_text:
            readme.write_text(new)
        written.append(readme)
    if front is not None and front_text is not None:
        page = os.path.relpath(readme, front.parent) if readme is not None else "bench/results/summary.md"
        new = replace_between_markers(front_text, front_summary(state, page), FRONT_START, FRONT_END)
        if new != front_text:
            front.write_text(new)
        written.append(front)
    if not quiet:
        for path in written:
            print(f"render: wrote {path}")
    return Rendered(summary_md, charts, readme)
