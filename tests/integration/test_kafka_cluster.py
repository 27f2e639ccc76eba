"""The capture and the sinks on a replicated three-broker cluster (pgcdc_dev.services kafka-cluster: replication
factor 3, min.insync.replicas 2; its registry stores its schemas there too), under a running workload, while
brokers fail one at a time: the leader of a captured partition and the transaction coordinator's broker are
SIGKILLed, a broker is paused (SIGSTOP) for longer than the capture's transaction timeout and resumed, and the
three are restarted in turn. After each, the time from the fault to the first newly committed event is taken.
At the end: every committed change is in the topic exactly once, in each key's order (an independent
read_committed consumer: tests/integration/_workload.py), the cache equals the source (`cdc verify`), and the
capture and the sinks never stopped.

The short form (CI) has the two faults of the transaction coordinator: its broker killed, and paused past the
transaction timeout (the coordinator then aborts the open transaction and fences the capture's producer, which
starts a new one: cdc._kafka.TransactionTimedOutError). The long profile (``CDC_TEST_LONG=1``) adds the leader's
kill and the rolling restart; ``CDC_FAULTS=long`` runs each fault three times. The figures go to docs/faults.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from pgcdc_dev import discovery

from tests.integration._capture_helpers import CdcProcess, read_topic, scratch_database, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, cdc_here
from tests.integration._workload import TABLE, Workload, check_exactly_once, source_versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), SPARK_WORKER]

FAULTS = ("leader", "coordinator", "pause", "rolling")
SHORT = ("coordinator", "pause")  # the faults of CI's short form
NODES = (1, 2, 3)
TXN_TIMEOUT_S = 10  # the capture's transaction.timeout.ms here: a pause longer than it is one of the faults
PARTITIONS = 3


def _services(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", *args], capture_output=True, text=True, check=False, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _pid(node: int) -> int:
    rows = json.loads(_services("--json", "status", f"kafka-node-{node}"))
    return int(rows[0]["pid"])


def _java_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units), which Kafka places a transactional id by."""
    h = 0
    units = text.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class Cluster:
    """The cluster's metadata as the fault schedule needs it."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.admin = AdminClient({"bootstrap.servers": bootstrap})

    def leader(self, topic: str, partition: int) -> int:
        return int(self.admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader)

    def coordinator(self, transactional_id: str) -> int:
        """The broker that coordinates ``transactional_id``'s transactions: the leader of its partition of
        ``__transaction_state`` (Kafka: abs(hashCode) % 50 partitions)."""
        h = _java_hash(transactional_id)
        return self.leader("__transaction_state", (0 if h == -(1 << 31) else abs(h)) % 50)

    def in_sync(self) -> bool:
        """Every partition of every topic has all its replicas in sync (the next fault may take one away)."""
        try:
            md = self.admin.list_topics(timeout=5)
        except Exception:
            return False
        return len(md.brokers) == len(NODES) and all(
            p.leader >= 0 and len(p.isrs) == len(p.replicas) for t in md.topics.values() for p in t.partitions.values()
        )


class Committed:
    """The captured topic's committed end (read_committed: the last stable offsets), summed over partitions, as a
    new consumer sees it each time (a long-lived one can keep asking a broker that is gone)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic

    def end(self) -> int:
        """The sum; -1 while a partition's leader does not answer (it is moving)."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": "pgcdc-cluster-probe",
                "isolation.level": "read_committed",
            }
        )
        try:
            total = 0
            for p in range(PARTITIONS):
                total += consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=2, cached=False)[1]
            return total
        except Exception:
            return -1
        finally:
            consumer.close()

    def first_new_event_after(self, before: int, timeout: float) -> float:
        """Seconds until the committed end passes ``before`` (taken while every leader answered)."""
        assert before >= 0
        started = time.monotonic()
        wait_for(lambda: self.end() > before, timeout, "a new event committed after the fault")
        return time.monotonic() - started


@pytest.mark.usefixtures("spark")  # verify runs in the test process, on its Spark application
def test_the_pipeline_rides_out_broker_failures_on_a_replicated_cluster(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    try:
        bootstrap = str(discovery.deploy_record("kafka-cluster")["bootstrap"])
        registry = str(discovery.deploy_record("registry-cluster")["url"])
    except discovery.ServiceUnavailableError as exc:
        discovery.skip_unavailable(exc, "the cluster's faults kill its local brokers")
    rounds = 3 if os.environ.get("CDC_FAULTS") == "long" else 1
    kinds = FAULTS if os.environ.get("CDC_TEST_LONG", "") not in ("", "0") else SHORT
    for node in NODES:  # one an interrupted run left paused
        _resume(node)
    cluster = Cluster(bootstrap)
    wait_for(cluster.in_sync, 300, "every replica of the cluster in sync")
    with scratch_database(pg_dsn, f"cluster_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in TABLE:
                conn.execute(statement)
            conn.execute("INSERT INTO items SELECT g, 0, 'item ' || g FROM generate_series(1, 300) g")
        prefix, topic = f"k{unique}", f"k{unique}.public.items"
        cfg = stack.config(dsn, ["public.items"], prefix=prefix, unique=unique, workdir=tmp_path)
        cfg = dataclasses.replace(cfg, kafka=bootstrap, registry=registry)
        cfg.kafka_extra += (
            f'\npartitions = {PARTITIONS}\nproducer = {{ "transaction.timeout.ms" = {TXN_TIMEOUT_S * 1000} }}\n'
        )
        config = cfg.write(tmp_path / "cdc.toml")
        capture = CdcProcess(config, tmp_path / "cdc.log")
        sinks = SinksProcess(config, tmp_path / "sinks.log", ["cache"])
        workload = Workload(dsn, 301)
        recovery: dict[str, list[float]] = {}
        capture.start()
        try:
            capture.wait_streaming(180)
            sinks.start()
            workload.thread.start()
            committed = Committed(bootstrap, topic)
            wait_for(lambda: committed.end() > 300, 120, "the workload's first events", capture)
            # The faults begin once the sinks run: their start (Spark, the dead-letter topic) is not under test.
            wait_for(lambda: sinks.batches() > 0, 300, "the sinks' first batch", sinks)
            faults: dict[str, Callable[[], float]] = {
                "leader": lambda: _kill(cluster, committed, cluster.leader(topic, 0)),
                "coordinator": lambda: _kill(cluster, committed, cluster.coordinator(f"pgcdc-{cfg.slot}")),
                "pause": lambda: _pause(cluster, committed, cluster.coordinator(f"pgcdc-{cfg.slot}")),
                "rolling": lambda: _rolling(cluster, committed),
            }
            for _ in range(rounds):
                for kind in kinds:
                    recovery.setdefault(kind, []).append(faults[kind]())
                    assert capture.alive(), f"the capture exited after {kind}:\n{capture.tail()}"
                    assert sinks.alive(), f"the sinks exited after {kind}:\n{sinks.tail()}"
            workload.done.set()
            workload.thread.join(60)
            expected = source_versions(dsn)

            def converged() -> bool:
                latest: dict[int, int | None] = {}
                for e in read_topic(bootstrap, registry, topic):
                    if e.key is not None:
                        latest[e.key["id"]] = e.value["after"]["v"] if e.value and e.value["after"] else None
                return {k: v for k, v in latest.items() if v is not None} == expected

            wait_for(converged, 300, "the topic to reach the source's state", capture)
            checked = check_exactly_once(read_topic(bootstrap, registry, topic), expected)
            verify = cdc_here("verify", "cache", "--config", str(config), "--wait", "300")
            assert verify.returncode == 0, verify.stdout + verify.stderr + sinks.tail()
            report = {
                "rounds": rounds,
                "recovery_s": {k: [round(s, 1) for s in v] for k, v in recovery.items()},
                "statements": dict(workload.statements),
                **checked,
            }
            print("cluster faults:", json.dumps(report))  # the figures, shown with pytest -s
            assert sum(workload.statements.values()) > 300, workload.statements
        finally:
            workload.done.set()
            for node in NODES:  # a node left down or paused by a failed step is the next test's problem
                _resume(node)
            _services("up", "kafka-cluster")
            if sinks.alive():
                sinks.kill()
            if capture.alive():
                capture.kill()


def _resume(node: int) -> None:
    with contextlib.suppress(ProcessLookupError, AssertionError, ValueError, KeyError, TypeError, IndexError):
        os.kill(_pid(node), signal.SIGCONT)


def _kill(cluster: Cluster, committed: Committed, node: int) -> float:
    """SIGKILL ``node``; the seconds until the next committed event; the node started again and in sync."""
    before = committed.end()
    os.kill(_pid(node), signal.SIGKILL)
    took = committed.first_new_event_after(before, 180)
    _services("up", f"kafka-node-{node}")
    wait_for(cluster.in_sync, 300, f"kafka-node-{node}'s replicas back in sync")
    return took


def _pause(cluster: Cluster, committed: Committed, node: int) -> float:
    """SIGSTOP ``node`` for longer than the capture's transaction timeout, then SIGCONT it."""
    pid, before = _pid(node), committed.end()
    os.kill(pid, signal.SIGSTOP)
    try:
        took = committed.first_new_event_after(before, 180)
        time.sleep(max(0.0, TXN_TIMEOUT_S + 5 - took))  # the pause outlasts the transaction timeout
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(cluster.in_sync, 300, f"kafka-node-{node} back in sync after its pause")
    return took


def _rolling(cluster: Cluster, committed: Committed) -> float:
    """Each node stopped (SIGTERM: a controlled shutdown) and started again, in turn, each back in sync before
    the next; the longest wait for a new event after a stop."""
    longest = 0.0
    for node in NODES:
        before = committed.end()
        _services("down", f"kafka-node-{node}")
        longest = max(longest, committed.first_new_event_after(before, 180))
        _services("up", f"kafka-node-{node}")
        wait_for(cluster.in_sync, 300, f"kafka-node-{node} back in sync in the rolling restart")
    return longest
