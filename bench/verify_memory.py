#!/usr/bin/env python3
"""`cdc verify`'s peak memory against table size: the driver's RSS at 5M rows within 20 % of 1M rows.

    ./dev python -m bench.verify_memory [--rows 1000000,5000000]

For each size: the sinks benchmark's table (numeric, timestamptz, jsonb, a 2.2 kB out-of-line text in one row
of 20) is snapshotted into Kafka with its updates and deletes by `cdc run`, the warehouse sink applies the topic
(`cdc sinks run warehouse` until its checkpoint reaches the topic's end), then `cdc verify warehouse` runs with
``spark.driver.memory=1g``. The warehouse is the store whose verify holds a JVM (it reads the Delta table back
through Spark); its peak RSS and that of the Python process are sampled from /proc (each process's VmHWM, the
kernel's own high-water mark) and added up. The target compares the largest size with the smallest, same run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.report import Measure, Result, write_result

from bench import _debezium as dbz
from bench import sinks_bench as sb
from sinks._config import load_sink_settings
from sinks._progress import TopicEnds, checkpoint_location, checkpoint_offsets, reached

SCENARIO = "verify-memory"
DRIVER_MEMORY = "1g"
LIMIT = 1.2  # the largest size's peak within 20 % of the smallest's


class _PeakRss(threading.Thread):
    """The highest VmHWM (MiB) seen of a process and of each of its descendants, by kind, every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss", daemon=True)
        self.pid = pid
        self.peaks: dict[int, tuple[str, float]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for pid in _cpu.tree(self.pid):
                found = _cpu.stat(Path(f"/proc/{pid}/stat"))
                if found is not None:
                    kind = "jvm" if found[0] == "java" else "python"
                    self.peaks[pid] = (kind, max(self.peaks.get(pid, (kind, 0.0))[1], dbz.peak_rss_mb(pid)))
            self.halt.wait(0.2)

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, peak in self.peaks.values():
            out[kind] = out.get(kind, 0.0) + peak
        return out


def _fill(env: sb.Env, config: Path) -> float:
    """`cdc sinks run warehouse` until its checkpoint reaches the topic's end; seconds it took."""
    settings = load_sink_settings(config)
    ends = TopicEnds(settings)
    try:
        marks = ends.read()
    finally:
        ends.close()
    checkpoint = checkpoint_location(settings.state(), "warehouse", 1)
    started = time.monotonic()
    with open(env.work / "sinks.log", "ab") as log:
        proc = sb._cdc(["sinks", "run", "warehouse", "--config", str(config)], log)
        try:
            sb._wait(lambda: reached(checkpoint_offsets(checkpoint) or {}, marks), proc, "the warehouse's replay")
        finally:
            sb._stop(proc, 180)
    return time.monotonic() - started


def _verify(config: Path, log: Path) -> tuple[float, dict[str, float]]:
    """`cdc verify warehouse`: seconds and peak RSS (MiB) by process kind."""
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgcdc", "verify", "warehouse", "--config", str(config)], stdout=out, stderr=out
        )
        rss = _PeakRss(proc.pid)
        rss.start()
        code = proc.wait()
        rss.halt.set()
        rss.join()
    if code != 0:  # the work directory goes with the cleanup: its account goes to stderr first
        tail = log.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"cdc verify warehouse exited {code}")
    return time.monotonic() - started, rss.by_kind()


def _one(rows: int) -> tuple[float, dict[str, float]]:
    env = sb._env()
    try:
        sb._create(env, rows)
        config = env.config("state", spark_conf={"spark.driver.memory": DRIVER_MEMORY})
        with open(env.work / "capture.log", "ab") as log:
            sb._capture(env, rows, config, log)
        filled = _fill(env, config)
        seconds, peaks = _verify(config, env.work / "verify.log")
        print(f"{rows:,} rows: warehouse filled in {filled:.0f} s, verify {seconds:.0f} s, peak RSS (MiB) {peaks}")
        return seconds, peaks
    finally:
        sb._cleanup(env)


def run(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1000000,5000000", help="table sizes, comma-separated, smallest first")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.rows.split(",")]
    result = Result(SCENARIO, params={"rows": sizes, "spark.driver.memory": DRIVER_MEMORY, "sink": "warehouse"})
    runs = {rows: _one(rows) for rows in sizes}
    base = sum(runs[sizes[0]][1].values())
    for rows, (seconds, peaks) in runs.items():
        total = sum(peaks.values())
        result.measures.append(
            Measure(
                f"cdc verify warehouse peak RSS, {rows:,} rows",
                "MiB",
                round(total),
                higher_is_better=False,
                limit=None if rows == sizes[0] else round(LIMIT * base),
                note=f"Python {peaks.get('python', 0):,.0f} MiB + JVM {peaks.get('jvm', 0):,.0f} "
                f"MiB (each one's VmHWM); verify took {seconds:.0f} s ({rows / seconds:,.0f} rows/s)"
                + ("" if rows == sizes[0] else f"; limit: {LIMIT:g}x the {sizes[0]:,}-row run"),
            )
        )
    return result


if __name__ == "__main__":
    write_result(run())
