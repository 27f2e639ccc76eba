"""One result format for every benchmark scenario: measures as ratios against a same-run reference.

A scenario produces `Measure`s and writes them with `write_result` to ``bench/results/<scenario>.json``:

    {"scenario": "insert-heavy", "date": "...", "machine": {...}, "params": {...},
     "measures": [{"name": ..., "unit": ..., "ours": ..., "reference": ..., "reference_name": ...,
                   "ratio": ..., "target": ..., "met": ...}, ...],
     "series": {...}, "notes": [...]}

``ratio`` is always "how we compare, bigger is better" (ours/reference for rates, reference/ours for costs), so
every target reads "≥ x". Absolute targets (latency in ms, RSS in MB) have no reference: ``reference`` is None,
``ratio`` is None and ``met`` compares ``ours`` with ``limit``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pgcdc_dev import CHECKOUT

RESULTS = CHECKOUT / "bench" / "results"


@dataclass(frozen=True)
class Measure:
    """One figure of one scenario, with what it is compared to and what it must reach."""

    name: str  # e.g. "capture rows/s"
    unit: str  # e.g. "rows/s", "ms", "MB"
    ours: float
    reference: float | None = None
    reference_name: str = ""
    higher_is_better: bool = True
    target_ratio: float | None = None  # met when ratio >= target_ratio
    limit: float | None = None  # absolute target: met when ours < limit (or > limit if higher_is_better)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.reference is None or not self.reference or not self.ours:
            return None
        return self.ours / self.reference if self.higher_is_better else self.reference / self.ours

    @property
    def target(self) -> str:
        if self.target_ratio is not None:
            return f"\N{GREATER-THAN OR EQUAL TO} {self.target_ratio:g}\N{MULTIPLICATION SIGN} {self.reference_name}"
        if self.limit is not None:
            return f"{'>' if self.higher_is_better else '<'} {self.limit:g} {self.unit}"
        return ""

    @property
    def met(self) -> bool | None:
        if self.target_ratio is not None:
            r = self.ratio
            return None if r is None else r >= self.target_ratio
        if self.limit is not None:
            return self.ours > self.limit if self.higher_is_better else self.ours < self.limit
        return None

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ratio=None if self.ratio is None else round(self.ratio, 3), target=self.target, met=self.met)
        return out


@dataclass
class Result:
    scenario: str
    params: dict[str, Any]
    measures: list[Measure] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)  # raw samples for charts (latencies, rates over time)
    notes: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0 to 100) of ``values``, sorted here; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]


def machine() -> dict[str, Any]:
    """What the figures were measured on (the benchmarks page prints it)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def document(result: Result) -> dict[str, Any]:
    """The JSON document of a result (the module docstring shows its shape)."""
    return {
        "scenario": result.scenario,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        "params": result.params,
        "measures": [m.as_json() for m in result.measures],
        "series": result.series,
        "notes": result.notes,
    }


def write_document(doc: dict[str, Any], results_dir: Path = RESULTS) -> Path:
    """Write ``<results_dir>/<scenario>.json``; returns the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{doc['scenario']}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def write_result(result: Result, results_dir: Path = RESULTS) -> Path:
    """Write ``<results_dir>/<scenario>.json``, print the scenario's table and, on stderr, its notes (what the
    figures are read with: references, CPU per part); returns the path."""
    doc = document(result)
    path = write_document(doc, results_dir)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(markdown_rows([doc]))
    return path


def _by_measure(docs: Sequence[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Each measure's runs. A measure is its name and which of that name it is in its run: a scenario may report
    one figure against two references under the same name (insert-heavy: pg_recvlogical and Debezium)."""
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for doc in docs:
        seen: dict[str, int] = {}
        for m in doc["measures"]:
            nth = seen[m["name"]] = seen.get(m["name"], -1) + 1
            by_key.setdefault((m["name"], nth), []).append(m)
    return by_key


def _median_measure(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One measure over its runs (combine)."""
    latest = runs[-1]
    ours = [float(m["ours"]) for m in runs]
    refs = [float(m["reference"]) for m in runs if m.get("reference") is not None]
    ratios = [float(m["ratio"]) for m in runs if m.get("ratio") is not None]
    median = Measure(
        latest["name"],
        latest["unit"],
        statistics.median(ours),
        statistics.median(refs) if refs else None,
        # the snapshot takes the faster COPY of each run as its reference: name every one taken
        " or ".join(dict.fromkeys(str(m["reference_name"]) for m in runs if m.get("reference_name"))),
        latest.get("higher_is_better", True),
        latest.get("target_ratio"),
        latest.get("limit"),
        latest.get("note", ""),
    )
    out = median.as_json()
    if ratios:  # not median(ours) / median(reference): that would pair one run's figure with another's
        ratio = round(statistics.median(ratios), 3)
        out.update(ratio=ratio, ratio_range=[round(min(ratios), 3), round(max(ratios), 3)])
        if median.target_ratio is not None:
            out["met"] = ratio >= median.target_ratio
    out.update(runs=len(runs), ours_range=[min(ours), max(ours)])
    return out


def combine(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One document for repeated runs of a scenario (``./dev bench --repeat N``): each measure's ``ours`` and
    ``reference`` are the medians over the runs, its ``ratio`` the median of the runs' own ratios (each against
    the reference of its own run, never against another run's), ``met`` decided on those medians, and
    ``runs``/``ratio_range``/``ours_range`` say how many runs and how far apart they were. Params, series and
    notes are the last run's (the charts draw one run); every run's measures are kept under ``repeats``.
    A measure missing from some run (a scenario that reports one only when it applies) is combined over the
    runs that have it."""
    if not docs:
        raise ValueError("no runs to combine")
    last = docs[-1]
    if len(docs) == 1:
        return dict(last)
    scenarios = {doc["scenario"] for doc in docs}
    if len(scenarios) != 1:
        raise ValueError(f"runs of different scenarios cannot be combined: {sorted(scenarios)}")
    measures = [_median_measure(runs) for runs in _by_measure(docs).values()]
    combined = dict(last)
    combined.update(
        measures=measures,
        params={**last.get("params", {}), "repeat": len(docs)},
        notes=[
            *(last.get("notes") or []),
            f"median of {len(docs)} runs (ranges in brackets); series from the last run",
        ],
        repeats=[{"date": doc.get("date"), "measures": doc["measures"]} for doc in docs],
    )
    return combined


def _span(low: str, high: str) -> str:
    return f" [{low}\N{EN DASH}{high}]" if low != high else ""


def fmt_number(value: float | None) -> str:
    if value is None:
        return "\N{EN DASH}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def markdown_rows(docs: list[dict[str, Any]]) -> str:
    """A Markdown table of the measures of the given result documents."""
    lines = [
        "| scenario | measure | pgcdc | reference | ratio | target | met |",
        "|---|---|---:|---:|---:|---|:-:|",
    ]
    for doc in docs:
        for m in doc["measures"]:
            ref = (
                f"{fmt_number(m['reference'])} ({m['reference_name']})" if m["reference"] is not None else "\N{EN DASH}"
            )
            ratio = "\N{EN DASH}" if m["ratio"] is None else f"{m['ratio']:.2f}\N{MULTIPLICATION SIGN}"
            ours = f"{fmt_number(m['ours'])} {m['unit']}"
            # Repeated runs (combine): the spread next to the median, of the ratio where there is one.
            if m.get("ratio_range"):
                ratio += _span(*(f"{r:.2f}" for r in m["ratio_range"]))
            elif m.get("ours_range"):
                ours += _span(*(fmt_number(v) for v in m["ours_range"]))
            met = {True: "yes", False: "**no**", None: ""}[m["met"]]
            lines.append(f"| {doc['scenario']} | {m['name']} | {ours} | {ref} | {ratio} | {m['target']} | {met} |")
    return "\n".join(lines)
