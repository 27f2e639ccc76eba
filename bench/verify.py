#!/usr/bin/env python3
"""`cdc verify`: rows per second at 1M rows, and the driver's peak memory at 5M rows within 20 % of 1M rows.

    ./dev python -m bench.verify [--rows 1000000,5000000] [--sinks warehouse,cache,search] [--against REV]

For each size: the sinks benchmark's table (numeric, timestamptz, jsonb, a 2.2 kB out-of-line text in one row
of 20) is snapshotted into Kafka with its updates and deletes by `cdc run`, each sink applies the topic (`cdc
sinks run NAME` until its checkpoint reaches the topic's end), then `cdc verify NAME` runs with
``spark.driver.memory=1g``. The peak RSS of verify's processes (its Python, its JVM, which in local mode holds
the executors, and Spark's Python workers) is sampled from /proc (each process's VmHWM, the kernel's own
high-water mark) and added up; the memory target compares the largest size with the smallest, same run.

Speed: rows verified per second against, in the same run and on the same stores, ``cdc verify`` of revision
``--against`` (checked out in a temporary git worktree; e.g. the revision before verify ran on Spark).
Without it, the reference is PostgreSQL's own binary COPY of the table into /dev/null by psql (the floor of
reading the source once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.report import Measure, Result, write_result

from bench import _debezium as dbz
from bench import sinks_bench as sb
from sinks.config import load_sink_settings
from sinks.progress import TopicEnds, checkpoint_location, checkpoint_offsets, reached

SCENARIO = "verify"
DRIVER_MEMORY = "1g"
LIMIT = 1.2  # the largest size's peak within 20 % of the smallest's
SPEED = 5.0  # rows/s against the --against revision's verify


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


def _fill(env: sb.Env, config: Path, sink: str) -> float:
    """`cdc sinks run SINK` until its checkpoint reaches the topic's end; seconds it took."""
    settings = load_sink_settings(config)
    ends = TopicEnds(settings)
    try:
        marks = ends.read()
    finally:
        ends.close()
    checkpoint = checkpoint_location(settings.state, sink, 1)
    started = time.monotonic()
    with open(env.work / "sinks.log", "ab") as log:
        proc = sb.run_cdc(["sinks", "run", sink, "--config", str(config)], log)
        try:
            sb.wait_until(
                lambda: reached(checkpoint_offsets(checkpoint) or {}, marks), proc, f"the {sink} sink's replay"
            )
        finally:
            sb.stop_process(proc, 180)
    return time.monotonic() - started


def _verify(
    sink: str, config: Path, log: Path, code_dir: Path | None = None, profile: Path | None = None
) -> tuple[float, dict[str, float]]:
    """`cdc verify SINK` (of the code in ``code_dir``, else this checkout's): seconds and peak RSS (MiB) by kind.
    With ``profile``, py-spy samples it and the Spark Python workers it starts (collapsed stacks into that file;
    the sampler's own start adds to the time)."""
    env = dict(os.environ)
    if code_dir is not None:  # its modules first, for this process and the Spark workers it starts
        env["PYTHONPATH"] = os.pathsep.join([str(code_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.monotonic()
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "pgcdc", "verify", sink, "--config", str(config)]
        if profile is not None:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            cmd = [spy, "record", "--subprocesses", "--rate", "50", "--format", "raw", "-o", str(profile), "--", *cmd]
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=out,
            env=env,
            cwd=code_dir,
        )
        rss = _PeakRss(proc.pid)
        rss.start()
        code = proc.wait()
        rss.halt.set()
        rss.join()
    if code != 0:  # the work directory goes with the cleanup: its account goes to stderr first
        tail = log.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"cdc verify {sink} exited {code}")
    return time.monotonic() - started, rss.by_kind()


def _copy_seconds(env: sb.Env) -> float:
    """PostgreSQL's binary COPY of the whole table into /dev/null by psql: the floor of reading the source."""
    started = time.monotonic()
    copy = f"\\copy (SELECT * FROM {sb.TABLE}) TO '/dev/null' (FORMAT binary)"  # noqa: S608 - our own name
    subprocess.run(["psql", env.dsn, "-q", "-c", copy], check=True)
    return time.monotonic() - started


@contextlib.contextmanager
def _worktree(rev: str | None) -> Iterator[Path | None]:
    """``rev`` checked out beside this checkout (its C extension copied when its source is the same)."""
    if rev is None:
        yield None
        return
    root = Path(__file__).resolve().parent.parent
    where = Path(tempfile.mkdtemp(prefix="pgcdc-verify-ref-")) / "src"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(where), rev], check=True)
    try:
        same = subprocess.run(
            ["git", "-C", str(root), "diff", "--quiet", rev, "--", "cdc/_native.pyx", "cdc/_native_*.pxi"], check=False
        )
        if same.returncode == 0:
            for built in root.glob("cdc/_native*.so"):
                shutil.copy2(built, where / "cdc" / built.name)
        yield where
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(where)], check=False)


@dataclass
class _Run:
    rows: int
    sink: str
    seconds: float
    peaks: dict[str, float]
    reference_s: float
    reference: str


def _one(rows: int, sinks: list[str], against: Path | None, rev: str | None, profile: Path | None) -> list[_Run]:
    env = sb.make_env()
    runs = []
    try:
        sb.create_source(env, rows)
        # No sql sink: verify of the other stores does not read it, and a reference revision older than it refuses
        # its section.
        config = env.config("state", spark_conf={"spark.driver.memory": DRIVER_MEMORY}, sql_sink=False)
        with open(env.work / "capture.log", "ab") as log:
            sb.capture_changes(env, rows, config, log)
        for sink in sinks:
            filled = _fill(env, config, sink)
            where = None if profile is None else profile / f"verify-{sink}-{rows}.folded"
            seconds, peaks = _verify(sink, config, env.work / "verify.log", profile=where)
            if against is not None:
                reference_s, reference = (
                    _verify(sink, config, env.work / "verify-ref.log", against)[0],
                    f"verify of {rev}",
                )
            else:
                reference_s, reference = _copy_seconds(env), "psql binary COPY of the table"
            print(
                f"{rows:,} rows, {sink}: filled in {filled:.0f} s, verify {seconds:.0f} s, {reference} "
                f"{reference_s:.0f} s, peak RSS (MiB) {peaks}"
            )
            runs.append(_Run(rows, sink, seconds, peaks, reference_s, reference))
    finally:
        sb.cleanup(env)
    return runs


def run(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1000000,5000000", help="table sizes, comma-separated, smallest first")
    parser.add_argument("--sinks", default="warehouse", help="the stores to verify, comma-separated")
    parser.add_argument("--against", default=None, help="a git revision whose cdc verify is the speed reference")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="sample each verify with py-spy into DIR/verify-SINK-ROWS.folded"
    )
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.rows.split(",")]
    sinks = args.sinks.split(",")
    params = {"rows": sizes, "spark.driver.memory": DRIVER_MEMORY, "sinks": sinks, "against": args.against}
    result = Result(SCENARIO, params=params)
    with _worktree(args.against) as against:
        runs = [
            r
            for rows in sizes
            for r in _one(rows, sinks, against if rows == sizes[0] else None, args.against, args.profile)
        ]
    for r in runs:
        if r.rows == sizes[0]:
            result.measures.append(_speed(r))
    for sink in sinks:
        mine = [r for r in runs if r.sink == sink]
        base = sum(mine[0].peaks.values())
        result.measures.extend(_memory(r, base, sizes[0]) for r in mine)
    return result


def _speed(r: _Run) -> Measure:
    return Measure(
        f"cdc verify {r.sink}, {r.rows:,} rows",
        "rows/s",
        round(r.rows / r.seconds),
        reference=round(r.rows / r.reference_s),
        reference_name=r.reference,
        target_ratio=SPEED if r.reference.startswith("verify of") else None,
        note=f"{r.seconds:.0f} s against {r.reference_s:.0f} s",
    )


def _memory(r: _Run, base: float, smallest: int) -> Measure:
    total = sum(r.peaks.values())
    return Measure(
        f"cdc verify {r.sink} peak RSS, {r.rows:,} rows",
        "MiB",
        round(total),
        higher_is_better=False,
        limit=None if r.rows == smallest else round(LIMIT * base),
        note=f"Python {r.peaks.get('python', 0):,.0f} MiB + JVM {r.peaks.get('jvm', 0):,.0f} MiB (each one's VmHWM); "
        f"verify took {r.seconds:.0f} s ({r.rows / r.seconds:,.0f} rows/s)"
        + ("" if r.rows == smallest else f"; limit: {LIMIT:g}x the {smallest:,}-row run"),
    )


if __name__ == "__main__":
    write_result(run())
