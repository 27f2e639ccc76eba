"""Charts of the benchmark results (PNG, matplotlib's Agg backend) for bench/results/ and the README.

    ratios.png   every measure that has a ratio: a bar per measure, its target as a marker across the bar
    limits.png   the absolute measures (latency ms, RSS MB, freshness s) against their limits, one panel per unit
    latency.png  the distribution (CDF) of the latency samples that results keep in ``series``

Input is the result documents of ``_report.write_result`` (JSON dicts), so charts can be redrawn from the files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only (before pyplot is imported)

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from pgcdc_dev.bench.report import percentile

RATIOS = "ratios.png"
LIMITS = "limits.png"
LATENCY = "latency.png"
CHARTS = (RATIOS, LIMITS, LATENCY)
TITLES = {
    RATIOS: "pgcdc against each same-run reference (bigger is better; marker: target)",
    LIMITS: "absolute measures against their limits",
    LATENCY: "latency distribution (CDF)",
}

TIMES = "\N{MULTIPLICATION SIGN}"
_MET = {True: "#2e7d32", False: "#c62828", None: "#757575"}
_SERIES_WORDS = ("latency", "freshness")
_NOT_SAMPLES = {"t", "t_s", "t_ms", "ts", "ts_ms", "time", "count", "counts"}


def _label(doc: dict[str, Any], m: dict[str, Any]) -> str:
    return f"{doc['scenario']}: {m['name']}"


def ratio_bars(docs: Sequence[dict[str, Any]]) -> list[tuple[str, float, float | None, bool | None]]:
    """(label, ratio, target ratio, met) for every measure that has a ratio."""
    return [
        (f"{_label(doc, m)}\nvs {m['reference_name']}", float(m["ratio"]), m.get("target_ratio"), m.get("met"))
        for doc in docs
        for m in doc["measures"]
        if m.get("ratio") is not None
    ]


def limit_bars(docs: Sequence[dict[str, Any]]) -> dict[str, list[tuple[str, float, float, bool | None]]]:
    """unit -> (label, ours, limit, met) for every absolute measure (a limit and no reference)."""
    out: dict[str, list[tuple[str, float, float, bool | None]]] = {}
    for doc in docs:
        for m in doc["measures"]:
            if m.get("limit") is not None and m.get("reference") is None:
                out.setdefault(m["unit"], []).append((_label(doc, m), float(m["ours"]), float(m["limit"]), m["met"]))
    return out


def _numbers(value: Any) -> list[float] | None:
    if isinstance(value, list) and value and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None


def _unit(keys: Sequence[str]) -> str:
    """The unit named by the nearest key's suffix (``latency_ms`` -> ms), leaf first."""
    for key in reversed(keys):
        for suffix, unit in (("_ms", "ms"), ("_us", "µs"), ("_seconds", "s"), ("_s", "s")):
            if key.endswith(suffix):
                return unit
    return ""


def latency_series(docs: Sequence[dict[str, Any]]) -> dict[str, list[tuple[str, list[float]]]]:
    """unit -> (label, samples) for the latency samples the results keep in ``series``.

    Mappings are walked; a list of numbers counts when a key on its path names a latency or a freshness
    (``series["latency_ms"] = [...]``, ``series["samples"]["latency_ms"]``, ``series["freshness_ms"]["cache"]``),
    except timestamps and counts beside them (``t_s``, ``count``) and histograms (a key naming ``histogram``:
    already binned, not samples). The unit comes from the nearest key's suffix (``_ms``, ``_s``).
    """
    out: dict[str, list[tuple[str, list[float]]]] = {}

    def walk(scenario: str, keys: list[str], value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                if "histogram" not in str(key).lower():
                    walk(scenario, [*keys, str(key)], sub)
            return
        samples = _numbers(value)
        if samples is None or keys[-1].lower() in _NOT_SAMPLES:
            return
        if any(word in key.lower() for key in keys for word in _SERIES_WORDS):
            out.setdefault(_unit(keys), []).append((f"{scenario}: {' '.join(keys)}", samples))

    for doc in docs:
        walk(str(doc["scenario"]), [], doc.get("series") or {})
    return out


def _bar_colours(met: Iterable[bool | None]) -> list[str]:
    return [_MET[m] for m in met]


def _ratios(docs: Sequence[dict[str, Any]]) -> Figure | None:
    bars = ratio_bars(docs)
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars) + 2), 5.5), layout="constrained")
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=_bar_colours(b[3] for b in bars), width=0.6)
    for x, (_, ratio, target, _met) in zip(xs, bars, strict=True):
        if target is not None:
            ax.hlines(target, x - 0.4, x + 0.4, colors="black", linewidth=2.5, zorder=3)
        ax.annotate(
            f"{ratio:.2f}{TIMES}",
            (x, ratio),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.axhline(1.0, color="#9e9e9e", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs), [b[0] for b in bars], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"ratio to reference ({TIMES}, log scale)")
    ax.set_yscale("log")  # ratios span 0.04 to 36: a linear axis hides every bar but one
    ax.set_title(TITLES[RATIOS], fontsize=10)
    return fig


def _limits(docs: Sequence[dict[str, Any]]) -> Figure | None:
    groups = limit_bars(docs)
    if not groups:
        return None
    width = max(6.0, sum(0.9 * len(bars) + 1.5 for bars in groups.values()))
    fig, axes = plt.subplots(1, len(groups), figsize=(width, 5.5), layout="constrained", squeeze=False)
    for ax, (unit, bars) in zip(axes[0], sorted(groups.items()), strict=True):
        _limit_panel(ax, unit, bars)
    fig.suptitle(TITLES[LIMITS], fontsize=10)
    return fig


def _limit_panel(ax: Axes, unit: str, bars: list[tuple[str, float, float, bool | None]]) -> None:
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=_bar_colours(b[3] for b in bars), width=0.6)
    for x, (_, ours, limit, _met) in zip(xs, bars, strict=True):
        ax.hlines(limit, x - 0.4, x + 0.4, colors="black", linewidth=2.5, zorder=3)
        ax.annotate(
            f"{ours:.3g}", (x, ours), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points"
        )
    ax.set_xticks(list(xs), [b[0] for b in bars], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(unit)


def _latency(docs: Sequence[dict[str, Any]]) -> Figure | None:
    groups = latency_series(docs)
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.5), layout="constrained", squeeze=False)
    for ax, (unit, series) in zip(axes[0], sorted(groups.items()), strict=True):
        positive = True
        for label, samples in series:
            xs = sorted(samples)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            p50, p99 = percentile(xs, 50), percentile(xs, 99)
            ax.step(xs, ys, where="post", label=f"{label} (p50 {p50:.3g}, p99 {p99:.3g}, n={len(xs)})")
            positive = positive and xs[0] > 0
        lo = min(min(s) for _, s in series)
        hi = max(max(s) for _, s in series)
        if positive and lo > 0 and hi / lo > 50:
            ax.set_xscale("log")
        for q in (0.5, 0.99):
            ax.axhline(q, color="#bdbdbd", linestyle=":", linewidth=1)
        ax.set_xlabel(unit or "value")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(TITLES[LATENCY], fontsize=10)
    return fig


def render_charts(docs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Draw the charts the documents have data for into ``out_dir``; returns their paths.

    A chart with nothing to show is not drawn, and its file from an earlier run is removed (the README links
    only what exists).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw in ((RATIOS, _ratios), (LIMITS, _limits), (LATENCY, _latency)):
        path = out_dir / name
        fig = draw(docs)
        if fig is None:
            path.unlink(missing_ok=True)
            continue
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
