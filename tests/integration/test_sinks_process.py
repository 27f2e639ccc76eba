"""`cdc sinks run` as a process an operator or a supervisor manages: a SIGTERM ends everything it started."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.integration._capture_helpers import wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, captured

pytestmark = [pytest.mark.slow, SPARK_WORKER]


def _session(leader: int) -> list[str]:
    """The processes still in the session ``leader`` started (its JVM, Spark's Python workers)."""
    out = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if p.pid != leader and os.getsid(p.pid) == leader and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def test_sigterm_ends_every_process_the_sinks_started(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="proc",
        setup=[
            "CREATE TABLE t (k int PRIMARY KEY, v text)",
            "INSERT INTO t SELECT g, 'v' FROM generate_series(1, 10) g",
        ],
        tables=["t"],
        sinks=lambda config, log: SinksProcess(config, log, ["cache"]),
    ) as run:
        sinks = run.sinks
        sinks.start()
        wait_for(lambda: sinks.batches() >= 1, 300, "the cache's first batch", None)
        assert sinks.proc is not None
        leader = sinks.proc.pid
        assert _session(leader), "Spark's JVM runs in the sinks' session"
        # The signal a supervisor sends to the main process only (systemd's KillMode=mixed, docker stop).
        sinks.proc.send_signal(signal.SIGTERM)
        assert sinks.proc.wait(120) == 0, sinks.tail()
        left = _session(leader)
        assert not left, f"still running after `cdc sinks run` exited: {left}"
