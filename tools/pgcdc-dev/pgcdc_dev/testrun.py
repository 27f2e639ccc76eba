"""What a whole test run (``./dev test``) spent: its slowest tests and the Spark applications it started.

    python -m pgcdc_dev.testrun watch-spark FILE     count Spark applications until SIGTERM, then write FILE
    python -m pgcdc_dev.testrun report XML… [--top N] [--spark FILE] [--started EPOCH]

A Spark application is one driver JVM (PySpark's, or spark-submit's): each costs a JVM start and stop, the
largest fixed cost a test can have on two cores, so the run's count is the figure to keep down. The watcher
samples the process table (an application lives for seconds at least) and tells processes apart by pid and
start time, so a reused pid is not missed. Stdlib only.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

# A Spark driver's JVM runs this class (PySpark starts it as `spark-submit … pyspark-shell`); a cluster's
# master, workers and executors run others.
_DRIVER_CLASS = b"org.apache.spark.deploy.SparkSubmit"
_LAUNCHER_CLASS = b"org.apache.spark.launcher.Main"
_SAMPLE_S = 0.5
# spark-submit and spark-class, the shell scripts between a driver JVM and what asked for it.
_LAUNCHER = b"pyspark/bin/"
_LAUNCH_DEPTH = 4


def spark_drivers(proc: Path = Path("/proc")) -> set[tuple[int, int]]:
    """(pid, start time in clock ticks) of every running Spark driver JVM."""
    found = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        # spark-class first runs a short JVM (launcher.Main) that only prints the driver's command, with the
        # driver's class among its arguments: not a driver. (spark-class itself execs into the driver: one pid.)
        if _DRIVER_CLASS in cmdline and _LAUNCHER_CLASS not in cmdline:
            # Field 22 (starttime) counted after the command's closing parenthesis: names may hold spaces.
            started = int(stat.rsplit(")", 1)[1].split()[19])
            found.add((int(entry.name), started))
    return found


def started_by(pid: int, proc: Path = Path("/proc")) -> str:
    """What started process ``pid``: the command line of its nearest ancestor that is not one of Spark's launch
    scripts (``spark-submit`` runs ``spark-class`` in a shell; a test's `cdc …` names the test's directory)."""
    command = "?"
    for _ in range(_LAUNCH_DEPTH):
        try:
            pid = int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / str(pid) / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return command
        command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
        if _LAUNCHER not in cmdline:
            return command
    return command


def watch_spark(out: Path) -> None:
    """Samples until SIGTERM or SIGINT, then writes how many distinct drivers it saw to ``out``, and what
    started each to ``out`` with the suffix ``.by``."""
    seen: dict[tuple[int, int], str] = {}
    stopping: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        for driver in spark_drivers() - seen.keys():
            seen[driver] = started_by(driver[0])
        time.sleep(_SAMPLE_S)
    out.with_suffix(".by").write_text("".join(f"{by}\n" for by in seen.values()))
    out.write_text(f"{len(seen)}\n")


_TEST_DIR = re.compile(r"/pytest-\d+/(?:popen-gw\d+/)?([^/ ]+?)\d*/")


def launchers(lines: list[str], top: int) -> list[tuple[int, str]]:
    """The commonest starters of Spark applications: a test (by its temporary directory) or a command."""
    counts: Counter[str] = Counter()
    for line in lines:
        found = _TEST_DIR.search(line)
        counts[found.group(1) if found else line[:100]] += 1
    return [(n, what) for what, n in counts.most_common(top)]


@dataclass(frozen=True)
class Timed:
    name: str
    seconds: float


def test_times(reports: list[Path]) -> list[Timed]:
    """Each test case's time in pytest's JUnit XML reports (setup, call and teardown together)."""
    times = []
    for report in reports:
        if not report.exists():
            continue
        for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314 - pytest's own report
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            times.append(Timed(f"{report.stem}: {name}", float(case.get("time") or 0)))
    return times


def report(reports: list[Path], top: int, spark: Path | None, started: float | None) -> str:
    times = sorted(test_times(reports), key=lambda t: t.seconds, reverse=True)
    lines = [f"the {min(top, len(times))} slowest of {len(times)} tests:"]
    lines += [f"  {t.seconds:8.1f}s  {t.name}" for t in times[:top]]
    if spark is not None and spark.exists():
        lines.append(f"Spark applications started: {spark.read_text().strip()}; by what started them:")
        by = spark.with_suffix(".by")
        starters = by.read_text().splitlines() if by.exists() else []
        lines += [f"  {n:4d}  {what}" for n, what in launchers(starters, 10)]
    if started is not None:
        total = time.time() - started
        lines.append(f"total: {total:.0f}s ({total / 60:.1f} min)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgcdc_dev.testrun", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("watch-spark")
    p.add_argument("out", type=Path)
    p = sub.add_parser("report")
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--spark", type=Path)
    p.add_argument("--started", type=float)
    args = parser.parse_args(argv)
    if args.command == "watch-spark":
        watch_spark(args.out)
    else:
        print(report(args.reports, args.top, args.spark, args.started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
