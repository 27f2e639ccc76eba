"""`cdc sinks run` as a process an operator or a supervisor manages: a SIGTERM ends everything it started,
within ``sinks.shutdown_timeout_s`` whatever its stores do."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
from redis import Redis

from tests.integration._capture_helpers import wait_for
from tests.integration._proxy import Proxy
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, captured, wait_caught_up

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


def test_a_sigterm_ends_the_sinks_within_their_bound_while_a_store_hangs(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    """The cache's Redis stops answering with a write in flight (a proxy holds every byte, connections open):
    `cdc sinks run` exits within ``sinks.shutdown_timeout_s`` of SIGTERM, leaves no process behind, and a
    restart writes every row."""
    url = urlsplit(stack.redis)
    proxy = Proxy((url.hostname or "127.0.0.1", url.port or 6379))
    bound = 5
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="stuck",
        setup=["CREATE TABLE t (k int PRIMARY KEY, v text)", "INSERT INTO t VALUES (1, 'v')"],
        tables=["t"],
        sinks=lambda config, log: SinksProcess(config, log, ["cache"]),
    ) as run:
        sinks = run.sinks
        sinks.env["CDC_SINKS__CACHE__URL"] = url._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()
        sinks.env["CDC_SINKS__SHUTDOWN_TIMEOUT_S"] = str(bound)
        sinks.start()
        wait_caught_up(run.config, sinks, ["cache"])
        proxy.stall()
        with psycopg.connect(run.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t SELECT g, 'w' FROM generate_series(2, 50) g")
        wait_for(lambda: proxy.held > 0, 120, "a write to the stalled Redis", sinks)
        assert sinks.proc is not None
        leader, asked = sinks.proc.pid, time.monotonic()
        sinks.proc.send_signal(signal.SIGTERM)
        assert sinks.proc.wait(bound + 60) == 0, sinks.tail()
        took = time.monotonic() - asked
        assert f"the sinks did not stop within {bound}s of the signal" in sinks.tail(), sinks.tail()
        assert took < bound + 10, f"exited {took:.1f}s after SIGTERM"
        assert not _session(leader), "Spark's processes ended with it"
        proxy.flow()
        sinks.start()  # the store answers again
        wait_caught_up(run.config, sinks, ["cache"])
        assert sinks.stop() == 0, sinks.tail()
    proxy.cut()
    keys = Redis.from_url(stack.redis).keys(f"{run.prefix}*:public.t:*")
    assert len(keys) == 50, sorted(keys)[:5]
