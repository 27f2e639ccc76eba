"""pgcdc_dev.bench.cpu: CPU per part of the machine from /proc, which the benchmarks' notes explain misses with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pgcdc_dev.bench import cpu as _cpu

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")

_BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_child_that_has_ended_still_counts_in_its_parents_tree() -> None:
    """PostgreSQL's backends end during a run (a snapshot's COPY connections): the postmaster's reaped
    children's CPU (cutime/cstime) must keep them in its total."""
    before = _cpu.tree_cpu(os.getpid())
    subprocess.run([sys.executable, "-c", _BURN.format(s=0.4)], check=True)  # waited for: reaped
    assert _cpu.tree_cpu(os.getpid()) - before >= 0.35


def test_a_live_child_counts_in_its_parents_tree() -> None:
    # A parent of its own: this test process's tree also holds whatever other tests left running, whose
    # exits move their CPU out of it while we measure.
    burner = _BURN.format(s=0.4) + "time.sleep(30)\n"
    spawn = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burner!r}])\ntime.sleep(30)\n"
    parent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while _cpu.tree_cpu(parent.pid) < 0.35 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = _cpu.stat(Path(f"/proc/{parent.pid}/stat"))
        assert found is not None
        assert _cpu.own_cpu(found[1]) < 0.3  # the burn is the child's, not yet reaped...
        assert _cpu.tree_cpu(parent.pid) >= 0.35  # ...and counts in its parent's tree
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait()


def test_a_child_started_by_another_thread_counts_in_its_parents_tree() -> None:
    """A JVM starts its children (Spark's Python workers) from threads other than its main one; Linux lists a
    child under the thread that started it for as long as that thread lives."""
    burner = _BURN.format(s=0.4) + "time.sleep(30)\n"
    spawn = (
        "import subprocess, sys, threading, time\n"
        "def start():\n"
        f"    subprocess.Popen([sys.executable, '-c', {burner!r}])\n"
        "    time.sleep(30)\n"
        "threading.Thread(target=start).start()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not _cpu.children(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_cpu.children(parent.pid)) == 1
        while _cpu.tree_cpu(parent.pid) < 0.35 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu.tree_cpu(parent.pid) >= 0.35
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_threads_split_into_main_librdkafka_and_the_rest_which_keeps_ended_threads() -> None:
    start = _cpu.thread_cpu(os.getpid())
    worker = threading.Thread(target=_burn, args=(0.3,))
    worker.start()
    worker.join()  # ended: no longer under /proc/<pid>/task, still in the process's total
    _burn(0.2)
    end = _cpu.thread_cpu(os.getpid())
    assert set(end) == {"main", "librdkafka", "other"}
    assert end["other"] - start["other"] >= 0.25
    assert end["main"] - start["main"] >= 0.15
    # Not == 0: in the full suite the session's Kafka fixtures keep librdkafka threads (rdk:*) alive in this
    # process, idling at a few ms of CPU; what must hold is that none of the burn above is booked to them.
    assert end["librdkafka"] - start["librdkafka"] < 0.1


def test_a_split_reports_parts_the_rest_and_idle_since_its_start() -> None:
    split = _cpu.CpuSplit({"self": os.getpid(), "gone": None}, {"me": os.getpid()})
    split.start()
    _burn(0.3)
    parts = split.now()
    assert "gone" not in parts  # a part that does not run here is left out, not zero
    assert parts["self"] >= 0.25
    assert parts["me main"] >= 0.25
    assert all(v >= 0 for v in parts.values())
    assert parts["busy"] >= parts["self"] - 0.05  # the machine was at least as busy as this process


def test_the_note_is_per_unit_largest_first_with_idle_last_and_no_empty_parts() -> None:
    split = {"busy": 3.0, "idle": 1.0, "PostgreSQL": 2.0, "broker": 0.5, "rest": 0.5, "nothing": 0.0}
    note = _cpu.CpuSplit.per_unit_note(split, 1_000_000, "row")
    assert note == "CPU-µs per row: PostgreSQL 2.00, broker 0.50, rest 0.50, idle 1.00"


def test_the_snapshot_bound_says_what_the_rest_allows_and_what_ours_may_cost() -> None:
    # 1M rows in 1 s on this machine's CPUs: the capture's threads 0.5 CPU-s, everything else 1.0 CPU-s.
    ncpu = os.cpu_count() or 1
    parts = {"busy": 1.5, "idle": 0.5, "capture main": 0.3, "capture other": 0.2, "PostgreSQL": 1.0}
    note = _cpu.cpu_bound_note(parts, 1_000_000, 1.0, ref_rate=2_000_000, target=0.7)
    best = ncpu * 1_000_000 / 1.0
    assert f"took 1.00 CPU-µs per row; on {ncpu} CPUs that alone allows {best:,.0f} rows/s" in note
    allowed = (ncpu / (0.7 * 2_000_000) - 1.0 / 1_000_000) * 1e6
    assert f"needs them at {max(allowed, 0.0):.2f} CPU-µs per row" in note
    assert "(they took 0.50;" in note


def test_settle_waits_for_a_quiet_machine_and_says_what_it_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_all.settle: a busy machine is waited out, a failed CHECKPOINT is said, not raised."""
    from pgcdc_dev.bench import run_all

    cpus = os.cpu_count() or 1
    window = run_all.QUIET_WINDOW_S
    # busy CPU-seconds read before and after each window: 90 %, 50 %, then 1 % of the machine
    busy = iter([0.0, cpus * 0.9 * window, 10.0, 10.0 + cpus * 0.5 * window, 20.0, 20.0 + cpus * 0.01 * window])
    monkeypatch.setattr(_cpu, "box", lambda: (next(busy), 0.0))
    monkeypatch.setattr(time, "sleep", lambda _s: None)

    def refused() -> None:
        raise ConnectionError("no PostgreSQL")

    said = run_all.settle(refused)
    assert said.startswith("no CHECKPOINT (ConnectionError); quiet after")
    assert said.endswith("(1% busy)")
    assert next(busy, None) is None  # three windows were looked at: two busy, one quiet

    ticks = iter(range(10**6))
    monkeypatch.setattr(run_all, "QUIET_MAX_WAIT_S", 0.0)
    monkeypatch.setattr(_cpu, "box", lambda: (next(ticks) * cpus * window, 0.0))  # always fully busy
    assert "still busy" in run_all.settle(None)


def test_the_machine_sampler_counts_a_process_from_its_start_under_its_kind() -> None:
    """A process's CPU counts from the window's start, under the kind its classifier gives it (asked once for
    it), and the others' CPU is not given to it."""
    asked: list[int] = []
    burner = subprocess.Popen(
        [sys.executable, "-c", "import sys\n" + _BURN.format(s=0.4) + "print('done', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def kind(pid: int, comm: str) -> str:
        if pid == burner.pid:
            asked.append(pid)
            return "burner"
        return "rest"

    sampler = _cpu.MachineCpu(kind, every_s=0.05)  # opened after the burner started: it counts from here
    sampler.start()
    try:
        assert burner.stdout is not None
        assert burner.stdout.readline() == "done\n"
        seconds, spent, busy = sampler.stop()
    finally:
        burner.communicate("")
    assert asked == [burner.pid]
    assert 0.0 < spent["burner"] <= 0.6  # its 0.4 s burn and part of its start
    assert seconds > 0
    assert busy >= spent["burner"]
