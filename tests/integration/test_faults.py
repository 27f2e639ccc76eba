"""Fault injection: a write workload runs while the capture, the sinks, PostgreSQL, Kafka and the network fail.

Profiles (``CDC_FAULTS``): ``short`` (the default, in CI) and ``long`` (by command: ``CDC_FAULTS=long ./dev test
tests/integration/test_faults.py -s``). Each run ends with the check that matters: every committed change is
in the topic exactly once, and the derived store equals the source key by key.

How "exactly once" is checked without trusting the client: tests/integration/_workload.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from pgcdc_dev import discovery
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration._capture_helpers import CdcProcess, Event, read_topic, scratch_database, wait_for
from tests.integration._proxy import Proxy, kafka_proxied
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, cdc_here
from tests.integration._workload import Workload, check_exactly_once

# On PostgreSQL 15 only (the whole suite's server): CI's time on 18 goes to the version-sensitive suites, and
# on 18 the failover test kills the capture and the primary itself (docs/operations.md, PostgreSQL versions).
pytestmark = [pytest.mark.slow]

PROFILES: dict[str, dict[str, int]] = {
    "short": {
        "capture_kill": 20, "sinks_kill": 3, "pg_fast": 2, "pg_immediate": 1, "pg_network": 3, "kafka": 1,
        "kafka_network": 2,
    },
    "long": {
        "capture_kill": 100, "sinks_kill": 15, "pg_fast": 6, "pg_immediate": 6, "pg_network": 12, "kafka": 4,
        "kafka_network": 10,
    },
}  # fmt: skip


def _deploy(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", *args], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _deploy_pid(name: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", "--json", "status", name],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = json.loads(out.stdout)
    pid = rows[0]["pid"] if rows else None
    if not pid:
        pytest.skip(f"fault injection restarts {name}: it needs the local services of pgcdc_dev.services")
    return int(pid)


def _restart_postgres(sig: int) -> None:
    """Stop PostgreSQL with ``sig`` (SIGINT fast, SIGQUIT immediate = a crash) and start it again."""
    service = discovery.PG_VERSIONS[discovery.pg_version()]  # the server this run uses (CDC_TEST_PG)
    pid = _deploy_pid(service)
    os.kill(pid, sig)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    _deploy("up", service)


def _restart_kafka() -> None:
    _deploy("down", "kafka")
    time.sleep(2)
    _deploy("up", "kafka", "registry")  # the registry keeps its schemas in Kafka: make sure it answers again


@SPARK_WORKER
@pytest.mark.exclusive  # it restarts PostgreSQL and Kafka, which every other test uses
@pytest.mark.usefixtures("spark")  # verify runs in the test process, on its Spark application
def test_nothing_is_lost_or_doubled_whatever_fails(*, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path) -> None:
    profile_name = os.environ.get("CDC_FAULTS", "short")
    profile = PROFILES[profile_name]
    seed = int(os.environ.get("CDC_FAULTS_SEED", "0")) or random.randrange(1, 10**6)
    rnd = random.Random(seed)
    print(f"fault injection: profile {profile_name}, seed {seed} (CDC_FAULTS_SEED={seed} replays the schedule)")
    with scratch_database(pg_dsn, f"faults_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL, name text)")
            conn.execute("ALTER TABLE items REPLICA IDENTITY FULL")  # deletes carry the version they delete
            conn.execute("INSERT INTO items SELECT g, 0, 'item ' || g FROM generate_series(1, 300) g")
        params = conninfo_to_dict(dsn)
        proxy = Proxy((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))
        through_proxy = make_conninfo("", **{**params, "host": "127.0.0.1", "port": str(proxy.port)})
        # Kafka is reached through a proxy too: its PROXIED listener advertises the proxy's port, so every
        # connection of the capture and the sinks (metadata, leaders, the coordinator) goes through the proxy.
        kafka_listener, kafka_advertised = kafka_proxied(stack.kafka)
        kafka_proxy = Proxy(("127.0.0.1", kafka_listener), port=kafka_advertised)
        prefix = f"f{unique}"
        cfg = stack.config(through_proxy, ["public.items"], prefix=prefix, unique=unique, workdir=tmp_path)
        cfg = dataclasses.replace(cfg, kafka=f"127.0.0.1:{kafka_advertised}")
        config = cfg.write(tmp_path / "cdc.toml")
        capture = CdcProcess(config, tmp_path / "cdc.log")
        sinks = SinksProcess(config, tmp_path / "sinks.log", ["cache"])
        topic = f"{prefix}.public.items"
        workload = Workload(dsn, 301)
        faults = [kind for kind, n in profile.items() for _ in range(n)]
        rnd.shuffle(faults)
        injected: Counter[str] = Counter()
        started = time.monotonic()
        capture.start()
        try:
            capture.wait_streaming(180)
            sinks.start()
            workload.thread.start()
            for kind in faults:
                time.sleep(rnd.uniform(0.5, 2.5))
                if kind == "capture_kill":
                    assert capture.alive(), f"the capture exited on its own:\n{capture.tail()}"
                    capture.kill()
                    capture.start()
                elif kind == "sinks_kill":
                    assert sinks.alive(), f"the sinks app exited on its own:\n{sinks.tail()}"
                    sinks.kill()
                    sinks.start()
                elif kind == "pg_fast":
                    _restart_postgres(signal.SIGINT)
                elif kind == "pg_immediate":
                    _restart_postgres(signal.SIGQUIT)
                elif kind == "pg_network":
                    proxy.cut()
                    time.sleep(rnd.uniform(1.0, 5.0))
                    proxy.restore()
                elif kind == "kafka":
                    _restart_kafka()
                elif kind == "kafka_network":
                    kafka_proxy.cut()
                    time.sleep(rnd.uniform(1.0, 5.0))
                    kafka_proxy.restore()
                injected[kind] += 1
            time.sleep(2)
            workload.done.set()
            workload.thread.join(60)
            assert capture.alive(), f"the capture exited after the faults:\n{capture.tail()}"

            def source_versions() -> dict[int, int]:
                with psycopg.connect(dsn) as conn:
                    return {r[0]: r[1] for r in conn.execute("SELECT id, v FROM items").fetchall()}

            expected = source_versions()

            def converged() -> bool:
                latest: dict[int, int | None] = {}
                for e in read_topic(stack.kafka, stack.registry, topic):
                    if e.key is not None:
                        latest[e.key["id"]] = e.value["after"]["v"] if e.value and e.value["after"] else None
                return {k: v for k, v in latest.items() if v is not None} == expected

            wait_for(converged, 600, "the topic to reach the source's state", capture)
            checked = check_exactly_once(read_topic(stack.kafka, stack.registry, topic), expected)
            verify = cdc_here("verify", "cache", "--config", str(config), "--wait", "600")
            assert verify.returncode == 0, verify.stdout + verify.stderr + sinks.tail()
            report = {
                "profile": profile_name,
                "seed": seed,
                "seconds": round(time.monotonic() - started),
                "faults": dict(injected),
                "statements": dict(workload.statements),
                **checked,
                "drift": 0,
            }
            print("fault injection:", json.dumps(report))  # the figures, shown with pytest -s
            assert sum(workload.statements.values()) > 300, workload.statements  # the workload really ran
        finally:
            workload.done.set()
            proxy.cut()
            kafka_proxy.cut()
            if sinks.alive():
                sinks.kill()
            if capture.alive():
                capture.kill()


def test_the_exactly_once_check_catches_a_lost_and_a_doubled_event() -> None:
    """The check above must be able to fail: a gap, a repeat and a missing row are each caught."""

    def ev(key: int, op: str, v: int, offset: int) -> Event:
        row = {"id": key, "v": v}
        return Event(
            {"id": key},
            {"op": op, "before": row if op == "d" else None, "after": None if op == "d" else row},
            0,
            offset,
        )

    good = [ev(1, "r", 0, 0), ev(1, "u", 1, 1), ev(1, "u", 2, 2), ev(2, "c", 0, 3), ev(2, "d", 0, 4)]
    assert check_exactly_once(good, {1: 2})["events"] == 5
    gap = [ev(1, "r", 0, 0), ev(1, "u", 2, 1)]
    with pytest.raises(AssertionError, match="lost"):
        check_exactly_once(gap, {1: 2})
    repeat = [ev(1, "r", 0, 0), ev(1, "u", 1, 1), ev(1, "u", 1, 2)]
    with pytest.raises(AssertionError, match="duplicated 1"):
        check_exactly_once(repeat, {1: 1})
    with pytest.raises(AssertionError, match="never reached the topic"):
        check_exactly_once(good, {1: 2, 3: 0})
    undeleted = [ev(2, "c", 0, 0)]
    with pytest.raises(AssertionError, match="deleted in the source"):
        check_exactly_once(undeleted, {})
