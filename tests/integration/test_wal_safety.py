"""WAL safety: an idle captured table must not make the slot hold WAL back, and a lost slot is never ignored."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    Event,
    latest_by_key,
    read_topic,
    scratch_database,
    wait_for,
)
from tests.integration._sinks_helpers import cdc

# Exclusive: it sets the server-wide max_slot_wal_keep_size, which would invalidate other tests' slots.
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

_LSN = "(pg_current_wal_lsn() - '0/0')::bigint"


def _slot(dsn: str, slot: str) -> tuple[int, int, str]:
    """(bytes the slot has not confirmed, bytes it retains, wal_status); -1 where a lost slot has no position."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT {_LSN} - (confirmed_flush_lsn - '0/0')::bigint, {_LSN} - (restart_lsn - '0/0')::bigint, "
            "wal_status FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    # A heartbeat is acknowledged just past its own position: "unconfirmed" can read -1, i.e. nothing.
    unconfirmed = -1 if row[0] is None else max(0, int(row[0]))
    return unconfirmed, (-1 if row[1] is None else int(row[1])), str(row[2])


def _busy_elsewhere(dsn: str, megabytes: int) -> int:
    """Write about ``megabytes`` of WAL to a table nobody captures; return the WAL bytes written."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = conn.execute(f"SELECT {_LSN}").fetchone()
        for _ in range(megabytes):
            # ~1 MB of barely compressible text per statement (md5 hex), in its own transaction.
            conn.execute(
                "INSERT INTO busy (payload) SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 32000)"
            )
        end = conn.execute(f"SELECT {_LSN}").fetchone()
    assert start is not None
    assert end is not None
    return int(end[0]) - int(start[0])


def _capture(dsn: str, stack: tuple[str, str], slot: str, heartbeat_s: float, workdir: Path) -> CdcProcess:
    """`cdc run` capturing only the idle table ``quiet`` (not started)."""
    kafka, registry = stack
    cfg = CdcConfig(dsn, kafka, registry, f"w{slot}", ["public.quiet"], slot, f"p_{slot}")
    cfg.heartbeat_interval_s = heartbeat_s
    return CdcProcess(cfg.write(workdir / "cdc.toml"), workdir / "cdc.log")


def test_an_idle_captured_table_does_not_make_the_slot_hold_wal_back(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """The captured table stays idle while another table writes ~48 MB of WAL.

    With heartbeats (1 s here, 10 s by default) the slot's confirmed position follows the server through them;
    without any (a heartbeat interval longer than the test) it follows through the walsender's keepalives, whose
    position the capture confirms when nothing it received waits for Kafka. The WAL the slot retains on disk
    (restart_lsn) follows once PostgreSQL logs its next running-transactions record (every 15 s at most). Before
    keepalive positions were confirmed, the second case held all of that WAL back.
    """
    results = {}
    with scratch_database(pg_dsn, f"wal_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE quiet (id int PRIMARY KEY)")
            conn.execute("CREATE TABLE busy (id serial PRIMARY KEY, payload text)")
            conn.execute("INSERT INTO quiet VALUES (1)")
        for name, heartbeat in (("with heartbeats", 1.0), ("without heartbeats", 3600.0)):
            slot = f"s_{unique}_{int(heartbeat)}"
            work = tmp_path / str(int(heartbeat))
            work.mkdir()
            proc = _capture(dsn, (kafka_bootstrap, registry_url), slot, heartbeat, work)
            proc.start()
            try:
                proc.wait_streaming(180)
                time.sleep(2)
                written = _busy_elsewhere(dsn, 48)
                done = time.monotonic()
                deadline = done + 45
                # Until both settle: the retained WAL follows only at the next running-transactions record, and
                # the confirmed position only at the next heartbeat or keepalive after the last write (a read
                # between the two saw 3.3 MB still unconfirmed).
                while time.monotonic() < deadline:
                    unconfirmed, retained, _ = _slot(dsn, slot)
                    if retained <= 8 * 2**20 and 0 <= unconfirmed < 2**20:
                        break
                    time.sleep(1)
                lag, retained, _status = _slot(dsn, slot)
                results[name] = {
                    "wal_written": written,
                    "slot_unconfirmed": lag,
                    "slot_retained": retained,
                    "seconds_after_the_writes": round(time.monotonic() - done, 1),
                }
            finally:
                proc.stop()
    print(json.dumps(results, indent=2))  # the figures, shown with pytest -s
    for name, seen in results.items():
        assert seen["wal_written"] > 40 * 2**20, (name, results)
        # The slot has confirmed nearly everything, and retains little.
        assert seen["slot_unconfirmed"] < 2**20, (name, results)
        assert seen["slot_retained"] < 8 * 2**20, (name, results)


def _quiet(dsn: str) -> dict[int, dict[str, Any]]:
    """The captured table as PostgreSQL holds it."""
    with psycopg.connect(dsn) as conn:
        return {r[0]: {"id": r[0], "name": r[1], "v": r[2]} for r in conn.execute("SELECT id, name, v FROM quiet")}


def test_a_slot_invalidated_by_max_slot_wal_keep_size_is_reported_with_the_way_out(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """The capture is down while rows are deleted, updated and inserted, and its slot is lost meanwhile.

    The way out (detach, run --new-slot: a fresh slot and a re-snapshot) must leave the topic equal to the source: the
    rows deleted in the gap end with a delete event and a tombstone, and no row the source has gets either.
    """
    slot = f"s_{unique}_lost"
    topic = f"w{slot}.public.quiet"
    with scratch_database(pg_dsn, f"lost_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE quiet (id int PRIMARY KEY, name text, v int)")
            conn.execute("CREATE TABLE busy (id serial PRIMARY KEY, payload text)")
            conn.execute("INSERT INTO quiet SELECT g, 'row ' || g, 0 FROM generate_series(1, 30) g")
        proc = _capture(dsn, (kafka_bootstrap, registry_url), slot, 1.0, tmp_path)
        proc.start()
        proc.wait_streaming(180)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE quiet SET v = 1 WHERE id <= 20")  # streamed events, not only snapshot rows
        wait_for(lambda: _latest(kafka_bootstrap, registry_url, topic) == _quiet(dsn), 60, "the stream", proc)
        proc.stop()  # the capture is down: its slot stays behind while the server writes on
        last_seen = _latest(kafka_bootstrap, registry_url, topic)
        gone = [1, 2, 3, 4, 5, 25]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM quiet WHERE id = ANY(%s)", (gone,))
            conn.execute("UPDATE quiet SET v = v + 10, name = 'changed' WHERE id BETWEEN 6 AND 10")
            conn.execute("INSERT INTO quiet SELECT g, 'new ' || g, 0 FROM generate_series(31, 35) g")
            conn.execute("DELETE FROM quiet WHERE id = 11")  # deleted and inserted again: it exists
            conn.execute("INSERT INTO quiet VALUES (11, 'back', 2)")
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '32MB'")
                conn.execute("SELECT pg_reload_conf()")
            for _ in range(4):
                _busy_elsewhere(dsn, 24)
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("CHECKPOINT")  # invalidation happens at checkpoints
                if _slot(dsn, slot)[2] == "lost":
                    break
            assert _slot(dsn, slot)[2] == "lost"
        finally:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
                conn.execute("SELECT pg_reload_conf()")
        run = cdc("run", "--config", str(tmp_path / "cdc.toml"), timeout=120)
        assert run.returncode == 3, run.stdout + run.stderr
        assert "was invalidated" in run.stderr
        assert "re-snapshot" in run.stderr
        assert "tombstone" in run.stderr  # says what happens to the rows deleted meanwhile
        status = cdc("status", "--config", str(tmp_path / "cdc.toml"), "--json", timeout=120)
        assert status.returncode == 3, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["source"]["wal_status"] == "lost"
        assert any("invalidated" in p and "cdc detach" in p for p in report["problems"]), report["problems"]
        # The way out: detach, run again (a fresh slot and snapshot).
        before_resnapshot = max(e.offset for e in read_topic(kafka_bootstrap, registry_url, topic))
        detach = cdc("detach", "--yes", "--config", str(tmp_path / "cdc.toml"), timeout=120)
        assert detach.returncode == 0, detach.stdout + detach.stderr
        # Without --new-slot the missing slot stops the capture: Kafka holds a position the new one would skip.
        refused = cdc("run", "--config", str(tmp_path / "cdc.toml"), timeout=120)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "does not exist" in refused.stderr, refused.stderr
        assert "cdc run --new-slot" in refused.stderr, refused.stderr
        proc = CdcProcess(tmp_path / "cdc.toml", tmp_path / "cdc2.log", new_slot=True)
        proc.start()
        try:
            proc.wait_streaming(180)
            wait_for(lambda: _slot(dsn, slot)[2] in ("reserved", "extended"), 30, "a healthy slot")
            with psycopg.connect(dsn, autocommit=True) as conn:  # the stream goes on after the re-snapshot
                conn.execute("DELETE FROM quiet WHERE id = 12")
                conn.execute("INSERT INTO quiet VALUES (36, 'after', 0)")
            source = _quiet(dsn)
            wait_for(lambda: _latest(kafka_bootstrap, registry_url, topic) == source, 60, "the topic to converge", proc)
        finally:
            proc.stop()
    logged = "re-snapshot of public.quiet: 6 row(s) deleted while nothing streamed (a lost slot, a detach) were"
    assert logged in proc.tail(200)
    events = read_topic(kafka_bootstrap, registry_url, topic)
    by_key: dict[int, list[Event]] = {}
    for ev in events:
        assert ev.key is not None
        by_key.setdefault(ev.key["id"], []).append(ev)
    assert set(source) == set(range(6, 37)) - {12, 25}
    for key in gone:
        *_, delete, tombstone = by_key[key]
        assert tombstone.value is None, f"key {key} does not end with a tombstone"
        assert delete.value is not None
        assert delete.value["op"] == "d"
        # The before image: the row as the topic last had it.
        assert delete.value["before"] == last_seen[key], (key, delete.value["before"])
        # Exactly once, and only by the re-snapshot (nothing was deleted while streaming).
        deletes = [e for e in by_key[key] if e.value is not None and e.value["op"] == "d"]
        assert deletes == [delete]
        assert delete.offset > before_resnapshot
    for key in source:
        assert all(e.value is not None and e.value["op"] != "d" for e in by_key[key]), f"key {key} was deleted"


def _latest(kafka: str, registry: str, topic: str) -> dict[int, dict[str, Any]]:
    return latest_by_key(read_topic(kafka, registry, topic), "id")


def _first_tombstone(kafka: str, topic: str, proc: CdcProcess, timeout: float = 180) -> None:
    """Return as soon as a committed tombstone appears in ``topic`` after its current end."""
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"test-watch-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        _low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        consumer.assign([TopicPartition(topic, 0, high)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.alive(), proc.tail()
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None and msg.value() is None:
                return
        raise AssertionError(f"no tombstone in {topic} within {timeout} s:\n{proc.tail()}")
    finally:
        consumer.close()


def test_a_resnapshot_killed_while_deleting_converges_on_the_rerun(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """The deletes of a re-snapshot are committed in batches with its progress: SIGKILL after the first batch,
    and the rerun deletes the rest, each deleted row exactly once, no existing row ever.

    Any re-snapshot into a topic that holds data does this (here detach + run, no lost slot needed).
    """
    slot = f"s_{unique}_kill"
    topic = f"k{unique}.public.items"
    with scratch_database(pg_dsn, f"kill_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, v int)")
            conn.execute("INSERT INTO items SELECT g, 'row ' || g, 0 FROM generate_series(1, 8000) g")
        cfg = CdcConfig(
            dsn,
            kafka_bootstrap,
            registry_url,
            f"k{unique}",
            ["public.items"],
            slot,
            f"p_{slot}",
            extra="snapshot_chunk_rows = 100\nsnapshot_commit_interval_s = 0",
        )
        config = cfg.write(tmp_path / "cdc.toml")
        proc = CdcProcess(config, tmp_path / "cdc.log")
        proc.start()
        proc.wait_streaming(180)
        proc.stop()
        detach = cdc("detach", "--yes", "--config", str(config), timeout=120)
        assert detach.returncode == 0, detach.stdout + detach.stderr
        boundary = max(e.offset for e in read_topic(kafka_bootstrap, registry_url, topic))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM items WHERE id % 4 <> 0")  # 6,000 deleted: 60 batches of deletes
            conn.execute("UPDATE items SET v = 1 WHERE id % 8 = 0")
            conn.execute("INSERT INTO items SELECT g, 'new', 0 FROM generate_series(8001, 8100) g")
            source = {r[0]: {"id": r[0], "name": r[1], "v": r[2]} for r in conn.execute("SELECT * FROM items")}
        proc = CdcProcess(config, tmp_path / "cdc2.log", new_slot=True)
        proc.start()
        _first_tombstone(kafka_bootstrap, topic, proc)
        proc.kill()
        done = "deleted while nothing streamed (a lost slot, a detach) were tombstoned"
        assert done not in proc.tail(200), "the deletes finished before the kill: the test proves nothing"
        proc = CdcProcess(config, tmp_path / "cdc3.log")
        proc.start()
        try:
            proc.wait_streaming(180)
        finally:
            proc.stop()
        rerun = proc.tail(200)
    assert "resumed with a fresh snapshot" in rerun
    events = read_topic(kafka_bootstrap, registry_url, topic)
    assert latest_by_key(events, "id") == source
    deletes: dict[int, int] = {}
    for ev in events:
        assert ev.key is not None
        if ev.value is not None and ev.value["op"] == "d":
            assert ev.offset > boundary
            deletes[ev.key["id"]] = deletes.get(ev.key["id"], 0) + 1
    assert deletes == {i: 1 for i in range(1, 8001) if i % 4}  # each exactly once, none of the rows that exist
    # The rerun logs only what was left to delete.
    left = int(rerun.split("re-snapshot of public.items: ")[1].split(" row(s)")[0])
    assert 0 < left < 6000, rerun
