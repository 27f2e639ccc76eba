"""Where a run's CPU went, by process, from /proc: the profile a missed target is read with.

A capture benchmark on one machine runs PostgreSQL, the Kafka broker, the capture and librdkafka on the same
cores; a ratio against a reference that needs fewer of them is only understood next to what each one spent.
:class:`CpuSplit` takes cumulative CPU counters at two instants and reports the difference per part:

- PostgreSQL: the postmaster and every backend, live or ended meanwhile (a parent's ``cutime``/``cstime`` hold
  its reaped children's), so a COPY backend or a walsender that exited before the second instant still counts;
- the Kafka broker (the JVM running ``kafka.Kafka``), when it runs on this machine;
- a process of ours by thread: its main thread, librdkafka's threads (``rdk:*``), the others;
- the whole machine's busy and idle time (/proc/stat), whose remainder is everything else.

:class:`MachineCpu` samples every process on the machine instead, for a window in which processes start and
end (a Spark application's Python workers): each keeps what it was last seen with.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat(path: Path) -> tuple[str, list[str]] | None:
    """A /proc stat file's command name and its fields after it (field 3 of proc(5) first), or None."""
    try:
        text = path.read_text()
    except OSError:
        return None  # the process or thread ended
    return text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()


def own_cpu(fields: list[str]) -> float:
    """CPU seconds (user + system) in the fields :func:`stat` gives: a process's or a thread's own."""
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def box() -> tuple[float, float]:
    """The machine's busy and idle CPU seconds so far, summed over its CPUs (/proc/stat; iowait is idle)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK, (idle + iowait) / _CLK_TCK


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, of its children it has reaped, and of its live descendants."""
    found = stat(Path(f"/proc/{pid}/stat"))
    if found is None:
        return 0.0
    fields = found[1]
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / _CLK_TCK  # utime, stime, cutime, cstime
    return total + sum(tree_cpu(child) for child in children(pid))


def children(pid: int) -> list[int]:
    """The live children of a process, whichever of its threads started them (a JVM starts its children, such
    as Spark's Python workers, from threads other than its main one); none once it has ended."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended
    return out


def tree(pid: int) -> list[int]:
    """A process and its live descendants."""
    return [pid, *(p for child in children(pid) for p in tree(child))]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process by thread: ``main``, ``librdkafka`` (its threads are named ``rdk:*``) and
    ``other``: the rest of the process's total, which keeps the threads that have ended."""
    found = stat(Path(f"/proc/{pid}/stat"))
    if found is None:
        return {}
    total = own_cpu(found[1])
    out = {"main": 0.0, "librdkafka": 0.0}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        thread = stat(task / "stat")
        if thread is None:
            continue
        comm, fields = thread
        if task.name == str(pid) or comm.startswith("rdk:"):
            out["main" if task.name == str(pid) else "librdkafka"] += own_cpu(fields)
    out["other"] = max(0.0, total - out["main"] - out["librdkafka"])
    return out


def java_pid(main_class: str) -> int | None:
    """The pid of the local JVM whose command line names ``main_class``, if there is one."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"java") and main_class.encode() in argv:
            return int(entry.name)
    return None


def postmaster_pid(data_directory: str) -> int | None:
    """The postmaster's pid from its data directory's postmaster.pid, when that is on this machine."""
    try:
        pid = int(Path(data_directory, "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


@dataclass
class CpuSplit:
    """CPU seconds per part since :meth:`start`, read with :meth:`now` (as often as wanted).

    ``processes``: name -> pid, counted with their descendants (PostgreSQL's postmaster, the broker);
    ``by_thread``: name -> pid, counted per thread kind (our capture: ``<name> main`` and so on)."""

    processes: Mapping[str, int | None] = field(default_factory=dict)
    by_thread: Mapping[str, int | None] = field(default_factory=dict)
    _start: dict[str, float] = field(default_factory=dict)

    def _counters(self) -> dict[str, float]:
        busy, idle = box()
        out = {"busy": busy, "idle": idle}
        for name, pid in self.processes.items():
            if pid is not None:
                out[name] = tree_cpu(pid)
        for name, pid in self.by_thread.items():
            if pid is not None:
                for kind, seconds in thread_cpu(pid).items():
                    out[f"{name} {kind}"] = seconds
        return out

    def start(self) -> None:
        self._start = self._counters()

    def now(self) -> dict[str, float]:
        """CPU seconds per part since :meth:`start`; ``rest``: the machine's busy time no part accounts for."""
        end = self._counters()
        # A thread that ended since the start drops out of its total: never below zero.
        out = {name: max(0.0, end[name] - self._start.get(name, 0.0)) for name in end}
        parts = sum(v for k, v in out.items() if k not in ("busy", "idle"))
        out["rest"] = max(0.0, out["busy"] - parts)
        return out

    @staticmethod
    def per_unit_note(split: Mapping[str, float], units: int, unit: str) -> str:
        """``split`` as CPU-µs per ``unit``, largest first, idle last: one line of a result's notes."""
        named = sorted(
            ((k, v) for k, v in split.items() if k not in ("busy", "idle") and v * 1e6 / units >= 0.005),
            key=lambda kv: -kv[1],
        )
        parts = [f"{k} {v * 1e6 / units:.2f}" for k, v in named]
        parts.append(f"idle {split['idle'] * 1e6 / units:.2f}")
        return f"CPU-µs per {unit}: " + ", ".join(parts)


def cpu_bound_note(parts: dict[str, float], rows: int, seconds: float, ref_rate: float, target: float) -> str:
    """What the CPU split says about the target: the rate the machine would allow if the capture's own threads
    (its main and reader threads; librdkafka's are the Kafka client's) cost nothing, and what they may cost for
    ``target``x of the reference on these CPUs with nothing idle."""
    ncpu = os.cpu_count() or 1
    ours = parts.get("capture main", 0.0) + parts.get("capture other", 0.0)
    others = parts["busy"] - ours  # PostgreSQL, the broker, librdkafka, the rest of the machine
    if others <= 0:
        return "bound: no CPU split measured"
    best_rate = ncpu * rows / others
    allowed_us = (ncpu / (target * ref_rate) - others / rows) * 1e6
    return (
        f"bound: without the capture's own threads the rest took {others * 1e6 / rows:.2f} CPU-µs per row; on "
        f"{ncpu} CPUs that alone allows {best_rate:,.0f} rows/s ({best_rate / ref_rate:.2f}x the reference) if "
        f"the capture's threads cost nothing; {target}x needs them at {max(allowed_us, 0.0):.2f} CPU-µs per row "
        f"with no CPU idle (they took {ours * 1e6 / rows:.2f}; {seconds:.2f} s measured)"
    )


class MachineCpu(threading.Thread):
    """CPU seconds of every process on the machine while it runs, summed by ``kind(pid, command name)`` (asked
    once per process). Each process is sampled every ``every_s`` from /proc, so one that ends between the
    start and the stop keeps what it was last seen with; one born meanwhile counts from zero."""

    def __init__(self, kind: Callable[[int, str], str], *, every_s: float = 0.5) -> None:
        super().__init__(name="machine-cpu", daemon=True)
        self._kind, self._every_s = kind, every_s
        self._halt = threading.Event()
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._began, self._busy = time.monotonic(), box()[0]
        self._sample(initial=True)

    def _sample(self, *, initial: bool = False) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            found = stat(entry / "stat")
            if found is None:
                continue
            kind = self._last[pid][0] if pid in self._last else self._kind(pid, found[0])
            cpu = own_cpu(found[1])
            self._first.setdefault(pid, cpu if initial else 0.0)
            self._last[pid] = (kind, cpu)

    def run(self) -> None:
        while not self._halt.wait(self._every_s):
            self._sample()

    def stop(self) -> tuple[float, dict[str, float], float]:
        """Seconds sampled, CPU seconds by kind (largest first), and the machine's busy CPU seconds."""
        self._halt.set()
        if self.is_alive():
            self.join(5)
        self._sample()
        out: dict[str, float] = {}
        for pid, (kind, cpu) in self._last.items():
            out[kind] = out.get(kind, 0.0) + cpu - self._first[pid]
        ranked = dict(sorted(out.items(), key=lambda kv: -kv[1]))
        return time.monotonic() - self._began, ranked, box()[0] - self._busy
