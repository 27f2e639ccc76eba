"""The capture service end to end: PostgreSQL → `cdc run` → Kafka, read back as a plain Avro consumer would."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    read_topic,
    scratch_database,
    source_items,
    stop_workload_and_converge,
    topic_items,
    wait_for,
)

pytestmark = pytest.mark.pg_matrix  # `./dev test` runs it on PostgreSQL 18 too


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


def _config(source: str, kafka: str, registry: str, unique: str, tables: list[str]) -> CdcConfig:
    return CdcConfig(
        dsn=source,
        kafka=kafka,
        registry=registry,
        prefix=f"t{unique}",
        tables=tables,
        slot=f"s_{unique}",
        publication=f"p_{unique}",
    )


def test_snapshot_then_stream_reaches_the_source_state(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(10,2), "
            "at timestamptz DEFAULT '2026-01-02 03:04:05.123456+00')"
        )
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g, g * 1.5 FROM generate_series(1, 500) g")
    cfg = _config(source, kafka_bootstrap, registry_url, unique, ["public.items"])
    proc = cfg.start(tmp_path)
    topic = f"t{unique}.public.items"
    try:
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 500, 180, "the snapshot", proc)
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("UPDATE items SET qty = qty + 1000 WHERE id % 7 = 0")
            conn.execute("DELETE FROM items WHERE id % 11 = 0")
            conn.execute("INSERT INTO items SELECT g, 'new ' || g, g, 0 FROM generate_series(501, 600) g")
        expected = source_items(source)
        wait_for(
            lambda: topic_items(kafka_bootstrap, registry_url, topic) == expected, 120, "the stream to converge", proc
        )
        events = read_topic(kafka_bootstrap, registry_url, topic)
        ops = Counter(e.value["op"] if e.value else "tombstone" for e in events)
        assert ops == {"r": 500, "u": 71, "d": 45, "tombstone": 45, "c": 100}

        first = next(e for e in events if e.value and e.value["op"] == "r" and e.key == {"id": 3})
        assert first.value is not None
        row = first.value["after"]
        assert (row["name"], row["qty"], row["price"]) == ("item 3", 3, Decimal("4.50"))
        assert row["at"].isoformat() == "2026-01-02T03:04:05.123456+00:00"
        src = first.value["source"]
        assert (src["connector"], src["schema"], src["table"], src["snapshot"]) == (
            "postgresql",
            "public",
            "items",
            "true",
        )

        update = next(e for e in events if e.value and e.value["op"] == "u" and e.key == {"id": 7})
        assert update.value is not None
        assert update.value["after"]["qty"] == 1007
        assert update.value["source"]["txId"] is not None
        assert update.value["source"]["commit_lsn"] >= update.value["source"]["lsn"]
    finally:
        proc.stop()


@pytest.mark.slow
def test_sigkill_during_a_write_workload_loses_and_duplicates_nothing(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    kills = 10
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int)")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, 200) g")
    cfg = _config(source, kafka_bootstrap, registry_url, unique, ["public.items"])
    proc = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc.log")
    topic = f"t{unique}.public.items"

    # The workload: every statement is its own transaction and changes exactly one row, so the number of
    # events it must produce is known exactly.
    done = threading.Event()
    counts: Counter[str] = Counter()

    def workload() -> None:
        rnd = random.Random(7)
        next_id = 201
        with psycopg.connect(source, autocommit=True) as conn:
            while not done.is_set():
                choice = rnd.random()
                if choice < 0.5:
                    cur = conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (rnd.randint(1, next_id - 1),))
                    counts["u"] += cur.rowcount
                elif choice < 0.8:
                    conn.execute("INSERT INTO items VALUES (%s, %s, 0)", (next_id, f"item {next_id}"))
                    counts["c"] += 1
                    next_id += 1
                else:
                    cur = conn.execute("DELETE FROM items WHERE id = %s", (rnd.randint(1, next_id - 1),))
                    counts["d"] += cur.rowcount
                time.sleep(0.002)

    writer = threading.Thread(target=workload, daemon=True)
    proc.start()
    try:
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 200, 180, "the snapshot", proc)
        writer.start()
        rnd = random.Random(11)
        for _ in range(kills):
            time.sleep(rnd.uniform(1.0, 4.0))
            assert proc.alive(), proc.tail()
            proc.kill()
            proc.start()
        stop_workload_and_converge(
            done, writer, dsn=source, kafka=kafka_bootstrap, registry=registry_url, topic=topic, proc=proc
        )
    finally:
        done.set()
        proc.stop()

    events = read_topic(kafka_bootstrap, registry_url, topic)
    changes = [e for e in events if e.value is not None]
    # No duplicates: each change is identified by its commit LSN, its own LSN and its operation.
    ids = Counter(
        (e.value["source"]["commit_lsn"], e.value["source"]["lsn"], e.value["op"], e.key["id"] if e.key else None)
        for e in changes
        if e.value is not None and e.value["op"] != "r"
    )
    dupes = {k: n for k, n in ids.items() if n > 1}
    assert not dupes, f"{len(dupes)} duplicated events, e.g. {list(dupes)[:3]}"
    # Nothing lost, nothing doubled: every statement the workload committed is in the topic exactly once.
    ops = Counter(e.value["op"] if e.value else "tombstone" for e in events)
    assert ops["r"] == 200
    assert {op: ops[op] for op in ("c", "u", "d")} == dict(counts), ops
    assert ops["tombstone"] == counts["d"]
    assert sum(counts.values()) > 500, counts  # the workload really ran while the service was killed
