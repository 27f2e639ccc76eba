"""A primary failover (PostgreSQL 17+ failover slots): the capture resumes on the promoted standby from what it
committed to Kafka, with nothing lost and nothing doubled; a missing slot is never replaced silently.

The primary and the standby are the test's own (PostgreSQL 18, tests/integration/_failover_helpers.py): the
primary is killed, so it cannot be a shared server."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from pgcdc_dev import discovery

from tests.integration._capture_helpers import CdcConfig, CdcProcess, read_topic, scratch_database, wait_for
from tests.integration._failover_helpers import primary_and_standby
from tests.integration._sinks_helpers import cdc

PHYSICAL_SLOT = "standby1"


@pytest.fixture(scope="module")
def pg18() -> tuple[Path, str | None]:
    """PostgreSQL 18's binaries (the postgres-18 local service installs them) and the user servers run as."""
    try:
        record = discovery.deploy_record("postgres-18")
    except discovery.ServiceUnavailableError as exc:
        if discovery.require_services():
            pytest.fail(f"required service missing (CDC_TEST_REQUIRE_SERVICES is set): {exc}")
        pytest.skip(f"failover slots need PostgreSQL 17+, from the postgres-18 local service: {exc}")
    return Path(record["bindir"]), record.get("service_user")


def _slot_copied(dsn: str, slot: str) -> bool:
    """Whether the standby holds a copy of ``slot`` that a promotion keeps: synchronized, and no longer the
    temporary one slot synchronization starts with until the standby has caught up with the slot."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return row is not None and bool(row[0])


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


def test_a_promoted_standby_resumes_the_capture_with_nothing_lost_or_doubled(
    pg18: tuple[Path, str | None], kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    bindir, user = pg18
    slot, topic = f"s_{unique}", f"t{unique}.public.items"
    with primary_and_standby(bindir, user, PHYSICAL_SLOT) as (primary, standby):
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, 100) g")
        # Both hosts; libpq takes the one that accepts writes: the primary, then the promoted standby.
        both = (
            f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
            "?target_session_attrs=read-write"
        )
        cfg = CdcConfig(both, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], slot, f"p_{unique}")
        config = cfg.write(tmp_path / "cdc.toml")

        not_a_standby = cdc("attach", "--config", str(config), "--standby", primary.dsn)
        assert not_a_standby.returncode == 3, not_a_standby.stdout + not_a_standby.stderr
        assert "it is not a standby" in not_a_standby.stderr, not_a_standby.stderr
        ready = cdc("attach", "--config", str(config), "--standby", standby.dsn)
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert "is set up to take over slot" in ready.stdout, ready.stdout

        proc = CdcProcess(config, tmp_path / "cdc.log")
        proc.start()
        try:
            proc.wait_streaming(180)
            with psycopg.connect(primary.dsn, autocommit=True) as conn:
                for i in range(200):  # each update adds 1: a key's qty is how many of its updates happened
                    conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (i % 100 + 1,))
            wait_for(lambda: _topic_state(kafka_bootstrap, registry_url, topic)[0] == _items(primary.dsn), 120,
                     "the changes before the failover in Kafka", proc)  # fmt: skip
            try:
                wait_for(lambda: _slot_copied(standby.dsn, slot), 180, "the standby's copy of the slot")
            except AssertionError as exc:
                synced = "\n".join(line for line in standby.log().splitlines() if "slot" in line)
                raise AssertionError(f"{exc}\nstandby's log:\n{synced}\n{_slots(primary.dsn)}") from None

            with psycopg.connect(primary.dsn, autocommit=True) as conn:  # in flight when the primary dies
                for i in range(100):
                    conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (i % 50 + 1,))
            primary.kill()
            standby.promote()
            with psycopg.connect(standby.dsn, autocommit=True) as conn:  # the new primary goes on
                conn.execute("INSERT INTO items SELECT g, 'after ' || g, 0 FROM generate_series(101, 150) g")
                conn.execute("UPDATE items SET qty = qty + 1 WHERE id % 3 = 0")
                conn.execute("DELETE FROM items WHERE id % 10 = 0")
            source = _items(standby.dsn)
            wait_for(lambda: _topic_state(kafka_bootstrap, registry_url, topic)[0] == source, 300,
                     "the topic to equal the promoted standby", proc)  # fmt: skip
        finally:
            proc.stop()
        rows, updates, doubled = _topic_state(kafka_bootstrap, registry_url, topic)
        assert rows == source
        assert doubled == 0, "a change was written twice"
        # Nothing lost, nothing doubled: each surviving row's update events are exactly its qty.
        assert {k: updates[k] for k in source} == {k: qty for k, (_name, qty) in source.items()}
        log = proc.tail(400)
        assert log.count("streaming from slot") >= 2, log  # it resumed, on the promoted standby's copy
        assert log.count("created replication slot") == 1, log  # the copy was used: no new slot

        status = cdc("status", "--json", "--config", str(config))  # what 17+ says of the slot, now idle
        slot_seen = json.loads(status.stdout)["source"]
        assert slot_seen["failover"] is True, slot_seen
        assert slot_seen["invalidated"] is None, slot_seen
        assert slot_seen["inactive_since"], slot_seen


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
