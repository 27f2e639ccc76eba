"""A primary failover (PostgreSQL 17+ failover slots): the capture resumes on the promoted standby from what it
committed to Kafka, with nothing lost and nothing doubled; a missing slot is never replaced silently.

The primary and the standby are the test's own (PostgreSQL 18, tests/integration/_failover_helpers.py): the
primary is killed, so it cannot be a shared server."""

from __future__ import annotations

import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from tests.integration._capture_helpers import CdcConfig, CdcProcess, read_topic, scratch_database, wait_for
from tests.integration._failover_helpers import Server, pg18_binaries, primary_and_standby
from tests.integration._sinks_helpers import (
    SINKS,
    SPARK_WORKER,
    InProcessSinks,
    Stack,
    assert_verified,
    cdc,
    cdc_here,
    wait_caught_up,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PHYSICAL_SLOT = "standby1"


@pytest.fixture(scope="module")
def pg18() -> tuple[Path, str | None]:
    return pg18_binaries("failover slots need PostgreSQL 17+")


def _slot_copied(dsn: str, slot: str) -> bool:
    """Whether the standby holds a copy of ``slot`` that a promotion keeps: synchronized, and no longer the
    temporary one slot synchronization starts with until the standby has caught up with the slot."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return row is not None and bool(row[0])


def _failover_slot(dsn: str, slot: str) -> bool | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None else bool(row[0])


def _slots(dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT slot_name, restart_lsn, confirmed_flush_lsn, catalog_xmin, xmin FROM pg_replication_slots"
        ).fetchall()


def _items(dsn: str) -> dict[int, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items")}


def _topic_state(kafka: str, registry: str, topic: str) -> tuple[dict[int, tuple[str, int]], Counter[int], int]:
    """What a consumer replaying the topic sees: the rows, the update events per key, and how many streamed
    changes share a source position with another (a change written twice)."""
    rows: dict[int, tuple[str, int]] = {}
    updates: Counter[int] = Counter()
    positions: Counter[tuple[int, str, int]] = Counter()
    for ev in read_topic(kafka, registry, topic):
        if ev.value is None or ev.key is None:
            continue
        key, op = ev.key["id"], ev.value["op"]
        if op != "r":
            positions[(ev.value["source"]["lsn"], op, key)] += 1
        if op == "u":
            updates[key] += 1
        if op == "d":
            rows.pop(key, None)
        else:
            rows[key] = (ev.value["after"]["name"], ev.value["after"]["qty"])
    return rows, updates, sum(n - 1 for n in positions.values())


class _Workload:
    """Updates of random rows (each adds 1 to qty) on whichever host accepts writes, through the outage: a
    statement that fails while there is no primary is retried on a new connection (whether it committed, the
    table says: a key's qty is how many of its updates happened)."""

    def __init__(self, dsn: str) -> None:
        self.dsn, self.stop, self.done = dsn, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Workload:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def _run(self) -> None:
        rng = random.Random(7)
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    while not self.stop.wait(0.01):
                        conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (rng.randint(1, 100),))
                        self.done += 1
            except psycopg.OperationalError:
                self.stop.wait(0.2)


@dataclass(frozen=True)
class _Env:
    pg18: tuple[Path, str | None]
    kafka: str
    registry: str
    unique: str
    tmp_path: Path


@pytest.fixture
def env(pg18: tuple[Path, str | None], kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path) -> _Env:
    return _Env(pg18, kafka_bootstrap, registry_url, unique, tmp_path)


def _pair_and_capture(
    env: _Env, *, failover: bool, inherited: bool = False
) -> Iterator[tuple[Server, Server, Path, str]]:
    bindir, user = env.pg18
    kafka, registry, unique, tmp_path = env.kafka, env.registry, env.unique, env.tmp_path
    with primary_and_standby(bindir, user, PHYSICAL_SLOT, inherited=inherited) as (primary, standby):
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, 100) g")
        # Both hosts; libpq takes the one that accepts writes: the primary, then the promoted standby.
        both = (
            f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
            "?target_session_attrs=read-write"
        )
        cfg = CdcConfig(both, kafka, registry, f"t{unique}", ["public.items"], f"s_{unique}", f"p_{unique}")
        cfg.source_extra = f"failover = {str(failover).lower()}"
        yield primary, standby, cfg.write(tmp_path / "cdc.toml"), both


_pair = contextmanager(_pair_and_capture)
ROUNDS = 5 if os.environ.get("CDC_TEST_LONG", "") not in ("", "0") else 1  # the long profile: 5 in a row


def _sinks_verify_clean(env: _Env, stack: Stack, spark: SparkSession, both: str) -> None:
    """The three sinks apply the topic and `cdc verify` finds each of them equal to the promoted standby."""
    config = stack.config(both, ["public.items"], prefix=f"t{env.unique}", unique=env.unique, workdir=env.tmp_path)
    path = config.write(env.tmp_path / "sinks.toml")
    sinks = InProcessSinks(spark, path, env.tmp_path / "sinks.log")
    sinks.start()
    try:
        wait_caught_up(path, sinks)
        result = cdc_here("verify", *SINKS, "--config", str(path), "--wait", "240")
        assert_verified(result, SINKS, sinks.tail())
    finally:
        sinks.stop()


@SPARK_WORKER
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_promoted_standby_resumes_the_capture_with_nothing_lost_or_doubled(
    round_: int, env: _Env, stack: Stack, spark: SparkSession
) -> None:
    """The capture is SIGKILLed, the primary stopped at once and the standby promoted while a workload runs;
    the capture, restarted on the two-host DSN, resumes from the standby's copy of its slot. After the last
    round the sinks, run on the topic, verify clean against the promoted standby."""
    slot, topic = f"s_{env.unique}", f"t{env.unique}.public.items"
    with _pair(env, failover=True) as (
        primary,
        standby,
        config,
        both,
    ):
        if round_ == 0:
            not_a_standby = cdc("attach", "--config", str(config), "--standby", primary.dsn)
            assert not_a_standby.returncode == 3, not_a_standby.stdout + not_a_standby.stderr
            assert "it is not a standby" in not_a_standby.stderr, not_a_standby.stderr
            ready = cdc("attach", "--config", str(config), "--standby", standby.dsn)
            assert ready.returncode == 0, ready.stdout + ready.stderr
            assert "is set up to take over slot" in ready.stdout, ready.stdout
            # A slot made without failover (source.failover = false) is made a failover slot at the next start.
            text = config.read_text()
            config.write_text(text.replace("failover = true", "failover = false"))
            first = CdcProcess(config, env.tmp_path / "cdc0.log")
            first.start()
            first.wait_streaming(180)
            first.stop()
            assert _failover_slot(primary.dsn, slot) is False
            config.write_text(text)

        proc = CdcProcess(config, env.tmp_path / "cdc.log")
        proc.start()
        again = CdcProcess(config, env.tmp_path / "cdc2.log")
        try:
            proc.wait_streaming(180)
            assert _failover_slot(primary.dsn, slot) is True
            if round_ == 0:
                assert f"replication slot {slot}: failover = true" in proc.tail(200), proc.tail(200)
            with _Workload(both) as work:
                wait_for(lambda: work.done >= 200 and _slot_copied(standby.dsn, slot), 180,
                         "a workload under way and the standby's lasting copy of the slot", proc)  # fmt: skip
                proc.kill()
                primary.kill()
                standby.promote()
                again.start()
                again.wait_streaming(180)
                before = work.done
                wait_for(lambda: work.done >= before + 200, 120, "the workload on the promoted standby", again)
            with psycopg.connect(standby.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, 'after ' || g, 0 FROM generate_series(101, 150) g")
                conn.execute("DELETE FROM items WHERE id % 10 = 0")
            source = _items(standby.dsn)
            wait_for(lambda: _topic_state(env.kafka, env.registry, topic)[0] == source, 300,
                     "the topic to equal the promoted standby", again)  # fmt: skip
        finally:
            if proc.alive():
                proc.kill()
            again.stop()
        rows, updates, doubled = _topic_state(env.kafka, env.registry, topic)
        assert rows == source
        assert doubled == 0, "a change was written twice"
        # Nothing lost, nothing doubled: each surviving row's update events are exactly its qty.
        assert {k: updates[k] for k in source} == {k: qty for k, (_name, qty) in source.items()}
        assert "created replication slot" not in again.tail(400), again.tail(400)  # the copy, not a new slot

        status = cdc("status", "--json", "--config", str(config))  # what 17+ says of the slot, now idle
        slot_seen = json.loads(status.stdout)["source"]
        assert slot_seen["failover"] is True, slot_seen
        assert slot_seen["invalidated"] is None, slot_seen
        assert slot_seen["inactive_since"], slot_seen
        if round_ == ROUNDS - 1:
            _sinks_verify_clean(env, stack, spark, both)


def test_without_failover_slots_a_promoted_standby_stops_the_capture_clearly(env: _Env) -> None:
    """The control: a slot that is not a failover slot has no copy on the standby, and the capture restarted
    after the promotion stops with the way out instead of starting a new slot past the changes it missed."""
    with _pair(env, failover=False) as (primary, standby, config, _):
        proc = CdcProcess(config, env.tmp_path / "cdc.log")
        proc.start()
        try:
            proc.wait_streaming(180)
            with psycopg.connect(primary.dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = qty + 1")
            wait_for(lambda: _topic_state(env.kafka, env.registry, f"t{env.unique}.public.items")[1].total() == 100,
                     120, "the updates in Kafka", proc)  # fmt: skip
        finally:
            proc.kill()
        primary.kill()
        standby.promote()
        refused = cdc("run", "--config", str(config), timeout=300)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"replication slot 's_{env.unique}' does not exist" in refused.stderr, refused.stderr
        assert "cdc run --new-slot" in refused.stderr, refused.stderr
        with psycopg.connect(standby.dsn) as conn:  # nothing was created behind the operator's back
            assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'").fetchone() == (
                0,
            )


def test_a_promoted_standby_that_inherited_synchronized_standby_slots_says_what_holds_the_capture_back(
    env: _Env,
) -> None:
    """The standby was copied from a primary whose synchronized_standby_slots was in its configuration, so it
    names, once promoted, the slot it was fed through on the old primary: PostgreSQL would hold the capture's
    decoding back for ever. The running capture stops, after the failover, saying so and how to fix it; fixed,
    the capture resumes with the change made meanwhile."""
    topic = f"t{env.unique}.public.items"
    with _pair(env, failover=True, inherited=True) as (primary, standby, config, _):
        proc = CdcProcess(config, env.tmp_path / "cdc.log")
        proc.start()
        try:
            proc.wait_streaming(180)
            wait_for(lambda: _slot_copied(standby.dsn, f"s_{env.unique}"), 120, "the slot's copy on the standby", proc)
            primary.kill()
            standby.promote()
            with psycopg.connect(standby.dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = 7 WHERE id = 1")
            assert proc.proc is not None
            assert proc.proc.wait(300) == 3, proc.tail()
        finally:
            proc.kill()
        assert f"synchronized_standby_slots on this server lists '{PHYSICAL_SLOT}'" in proc.tail(), proc.tail()
        assert "ALTER SYSTEM RESET synchronized_standby_slots" in proc.tail()
        with psycopg.connect(standby.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET synchronized_standby_slots")
            conn.execute("SELECT pg_reload_conf()")
        proc.start()
        try:
            wait_for(lambda: _qty(env, topic, 1) == 7, 180, "the change made after the failover", proc)
        finally:
            proc.kill()


def _qty(env: _Env, topic: str, key: int) -> int | None:
    rows = [e.value["after"] for e in read_topic(env.kafka, env.registry, topic) if e.value and e.key == {"id": key}]
    return int(rows[-1]["qty"]) if rows and rows[-1] else None


def test_a_missing_slot_stops_the_capture_until_a_new_one_is_asked_for(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    slot, topic = f"s_{unique}", f"t{unique}.public.items"
    with scratch_database(pg_dsn, f"miss_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, 20) g")
        cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], slot, f"p_{unique}")
        proc = cfg.start(tmp_path)
        try:
            proc.wait_streaming(180)
        finally:
            proc.stop()
        with psycopg.connect(dsn, autocommit=True) as conn:  # as if the server had no copy of it
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute("UPDATE items SET qty = 1 WHERE id = 1")  # no slot keeps this change
        refused = cdc("run", "--config", str(tmp_path / "cdc.toml"), timeout=180)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"replication slot '{slot}' does not exist" in refused.stderr, refused.stderr
        assert "cdc run --new-slot" in refused.stderr, refused.stderr
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() is None

        again = CdcProcess(tmp_path / "cdc.toml", tmp_path / "cdc2.log", new_slot=True)
        again.start()
        try:  # a new slot and snapshot: the change no slot kept arrives as a snapshot read
            wait_for(lambda: _topic_state(kafka_bootstrap, registry_url, topic)[0] == _items(dsn), 180,
                     "the re-snapshot", again)  # fmt: skip
        finally:
            again.stop()
