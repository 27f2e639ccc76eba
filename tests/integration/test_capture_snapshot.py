"""Snapshot under a concurrent write workload, a crash in the middle of it, and heartbeats on an idle table."""

from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    Event,
    committed_records,
    read_topic,
    scratch_database,
    stop_workload_and_converge,
    wait_for,
)

pytestmark = pytest.mark.pg_matrix  # `./dev test` runs it on PostgreSQL 18 too

ROWS = 100_000


def _first_committed_event(kafka: str, topic: str, timeout: float) -> None:
    """Returns as soon as ``topic`` has an event readable read_committed: a snapshot chunk was committed."""
    md = AdminClient({"bootstrap.servers": kafka}).list_topics(topic, timeout=30)
    partitions = list(md.topics[topic].partitions)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"first-{topic}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None:
                return
    finally:
        consumer.close()
    raise AssertionError(f"nothing committed in {topic} within {timeout} s")


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


def _writer(dsn: str, done: threading.Event) -> None:
    rnd = random.Random(3)
    next_id = ROWS + 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.is_set():
            choice = rnd.random()
            if choice < 0.5:
                conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (rnd.randint(1, next_id - 1),))
            elif choice < 0.8:
                conn.execute("INSERT INTO items VALUES (%s, 'new', 0)", (next_id,))
                next_id += 1
            else:
                conn.execute("DELETE FROM items WHERE id = %s", (rnd.randint(1, next_id - 1),))


@pytest.mark.parametrize(
    ("crash", "blocks", "pure_python"),
    [
        # Uninterrupted snapshots on one server: the sigkill cases run the same paths to the end on each.
        pytest.param(False, True, False, marks=pytest.mark.one_version),
        (True, True, False),
        pytest.param(False, False, False, marks=pytest.mark.one_version),
        (True, False, False),
        pytest.param(False, False, True, marks=pytest.mark.one_version),  # the server serves both paths alike
    ],
    ids=["blocks", "blocks-sigkill-mid-snapshot", "keys", "keys-sigkill-mid-snapshot", "keys-pure-python"],
)
def test_snapshot_with_concurrent_writes_ends_at_the_source_state(
    *,
    source: str,
    kafka_bootstrap: str,
    registry_url: str,
    unique: str,
    tmp_path: Path,
    crash: bool,
    blocks: bool,
    pure_python: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if pure_python:  # the fallback without the C build: psycopg's Copy, produce() per event, Python encoders
        monkeypatch.setenv("CDC_PURE_PYTHON", "1")
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int)")
        # ~2,600 heap blocks: two block ranges of at least 1,024 each.
        conn.execute(
            "INSERT INTO items SELECT g, 'item ' || g || repeat('.', 160), 0 FROM generate_series(1, %s) g", (ROWS,)
        )
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    cfg = CdcConfig(
        source,
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.items", "public.other"],
        f"s_{unique}",
        f"p_{unique}",
        extra="snapshot_chunk_rows = 500\nsnapshot_workers = 2\nsnapshot_commit_interval_s = 0\n"
        f"snapshot_scan_max_mb = {8192 if blocks else 0}",
    )
    proc = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc.log")
    topic = f"t{unique}.public.items"
    done = threading.Event()
    writer = threading.Thread(target=_writer, args=(source, done), daemon=True)
    writer.start()
    proc.start()
    try:
        if crash:
            # Kill it once some, not all, snapshot chunks are committed; the restart must finish the job. At
            # once, not after a fixed sleep: the whole snapshot can take less than a second.
            wait_for(lambda: "snapshot of" in proc.tail(), 120, "the snapshot to start", proc)
            _first_committed_event(kafka_bootstrap, topic, 60)
            proc.kill()
            assert "snapshot done" not in proc.tail(), "the snapshot finished before the kill: test proves nothing"
            proc.start()
        wait_for(lambda: "streaming from slot" in proc.this_run(), 180, "the snapshot to finish", proc)
        stop_workload_and_converge(
            done, writer, dsn=source, kafka=kafka_bootstrap, registry=registry_url, topic=topic, proc=proc
        )
    finally:
        done.set()
        proc.stop()
    # 100,000 rows in chunks of 500: split in two ranges read at once (in the crash case, both resumed; a table
    # read in block ranges starts again, in key order)
    log = proc.log.read_text()
    if blocks:
        assert "snapshot of public.items: 2 block range(s) of the slot's snapshot read at once" in log
    if crash:
        assert "resumed with a fresh snapshot" in proc.tail(200)
        restarted = "snapshot of public.items starts again from its first row, in key order" in log
        assert restarted == blocks
    if crash or not blocks:
        assert "snapshot of public.items: 2 key ranges read at once" in log


def _last_state(kafka: str, topic: str, slot: str) -> dict[str, Any]:
    """The slot's last committed record in the offsets topic, as JSON."""
    found = [v for _, k, v in committed_records(kafka, topic, 1, in_order=True) if k == slot.encode()]
    assert found, f"no committed state for {slot} in {topic}"
    assert found[-1] is not None
    state: dict[str, Any] = json.loads(found[-1])
    return state


def _commit_state(kafka: str, topic: str, slot: str, state: dict[str, Any]) -> None:
    """``state`` committed under the slot's key, as the capture commits it: in a Kafka transaction."""
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"test-rewrite-{slot}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, json.dumps(state).encode(), slot.encode(), partition=0)
    producer.commit_transaction(30)


@pytest.mark.one_version  # reading an old state of our own: no server version changes it
@pytest.mark.parametrize("shape", ["key ranges", "one range per table"])
def test_a_snapshot_resumes_from_a_state_of_format_1(
    *, source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path, shape: str
) -> None:
    """Killed mid-snapshot, its committed state rewritten as the release before format 2 wrote it (no
    ``version``; for "one range per table", the table's last key in its own ``after``): the restart reads it,
    goes on after the last key committed and reads no row twice and none of a table already done."""
    rows = 60_000
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE small (id int PRIMARY KEY)")
        conn.execute("INSERT INTO small SELECT generate_series(1, 10)")
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL)")
        conn.execute("INSERT INTO items SELECT g, repeat('.', 160) FROM generate_series(1, %s) g", (rows,))
    workers = 2 if shape == "key ranges" else 1
    cfg = CdcConfig(
        source,
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.small", "public.items"],
        f"s_{unique}",
        f"p_{unique}",
        extra=f"snapshot_chunk_rows = 200\nsnapshot_workers = {workers}\nsnapshot_commit_interval_s = 0\n"
        "snapshot_scan_max_mb = 0",
    )
    proc = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc.log")
    topic, offsets = f"t{unique}.public.items", f"t{unique}.offsets"
    proc.start()
    try:
        wait_for(lambda: "snapshot of" in proc.tail(), 120, "the snapshot to start", proc)
        # small (one chunk: its rows and its "done" commit together) and a first chunk of items. With two
        # workers they are read side by side, and an items chunk may commit before small's.
        _first_committed_event(kafka_bootstrap, f"t{unique}.public.small", 60)
        _first_committed_event(kafka_bootstrap, topic, 60)
        proc.kill()
        assert "snapshot done" not in proc.tail(), "the snapshot finished before the kill: test proves nothing"
        state = _last_state(kafka_bootstrap, offsets, cfg.slot)
        assert state.pop("version") == 3
        state.pop("tables", None)  # what format 1 did not have
        snap = state["snapshot"]
        assert snap["status"] == "running"
        assert snap["tables"]["public.small"] == {"done": True}, "the small table is read first"
        items = snap["tables"]["public.items"]
        assert len(items["ranges"]) == workers
        if shape == "one range per table":
            (only,) = items.pop("ranges")
            assert only["after"] is not None, "killed before a chunk of items was committed"
            assert not only["done"]
            items.update(after=only["after"], done=False)
        _commit_state(kafka_bootstrap, offsets, cfg.slot, state)
        proc.start()
        proc.wait_streaming(180)
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert "snapshot of public.items starts again from its first row" not in log
    assert "resumed without its start offsets" not in log
    reads = Counter(e.value["after"]["id"] for e in read_topic(kafka_bootstrap, registry_url, topic) if e.value)
    assert sorted(reads) == list(range(1, rows + 1))
    assert max(reads.values()) == 1, f"{sum(n > 1 for n in reads.values())} row(s) read twice"
    small = read_topic(kafka_bootstrap, registry_url, f"t{unique}.public.small")
    assert len(small) == 10, "a table done before the kill was read again"
    assert _last_state(kafka_bootstrap, offsets, cfg.slot)["version"] == 3


def test_key_ranges_of_a_composite_key_read_every_row_once(source: str, snapshot_of: SnapshotOf) -> None:
    """Bounds of a text key in a collation of its own and of a type whose values are not printed the way
    PostgreSQL reads them (timestamptz), under quoted names with a placeholder in them: the ranges meet exactly."""
    table = 'ranges "q" %s'
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(
            'CREATE TABLE "ranges ""q"" %s" ("k %s" text COLLATE "C", at timestamptz, n int NOT NULL, '
            'PRIMARY KEY ("k %s", at))'
        )
        # Upper and lower case interleaved: "C" orders every upper case letter first, most other collations
        # do not; each key prefix has several timestamps, so the bounds fall inside a run of equal texts.
        conn.execute(
            'INSERT INTO "ranges ""q"" %%s" SELECT substr(%s, g %% 6 + 1, 1) || (g / 60)::text, '
            "timestamptz '2026-01-01 00:00:00.123456+05:30' + (g %% 60) * interval '1.5 second', g "
            "FROM generate_series(0, 2999) g",
            ("aBcDeF",),
        )
    log, events = snapshot_of(table=f'public."{table.replace(chr(34), chr(34) * 2)}"', workers=3)
    assert "3 key ranges read at once" in log
    read = sorted(e.value["after"]["n"] for e in events if e.value and e.value["op"] == "r")
    assert read == list(range(3000)), f"{len(read)} rows read, {len(set(read))} distinct"


SnapshotOf = Callable[..., tuple[str, list[Event]]]


@pytest.fixture
def snapshot_of(source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path) -> SnapshotOf:
    """:func:`_snapshot_in_chunks` on this test's database, broker and registry."""
    return functools.partial(_snapshot_in_chunks, source, kafka_bootstrap, registry_url, unique, tmp_path)


def _snapshot_in_chunks(
    source: str,
    kafka: str,
    registry: str,
    unique: str,
    tmp_path: Path,
    *,
    table: str,
    workers: int,
    scan_max_mb: int = 0,  # key order by default: the key ranges are what most of these tests are about
    chunk_rows: int = 25,
) -> tuple[str, list[Event]]:
    """`cdc run` on ``table`` (its config name) until it streams: its log, and the events of the table's topic."""
    cfg = CdcConfig(
        source,
        kafka,
        registry,
        f"t{unique}",
        [table],
        f"s_{unique}",
        f"p_{unique}",
        extra=f"snapshot_chunk_rows = {chunk_rows}\nsnapshot_workers = {workers}\nsnapshot_commit_interval_s = 0\n"
        f"snapshot_scan_max_mb = {scan_max_mb}",
    )
    proc = cfg.start(tmp_path)
    try:
        proc.wait_streaming(180)
    finally:
        proc.stop()
    topics = AdminClient({"bootstrap.servers": kafka}).list_topics(timeout=30).topics
    (topic,) = [
        t for t in topics if t.startswith(f"t{unique}.") and not t.endswith((".offsets", ".messages", ".signals"))
    ]
    return proc.log.read_text(), read_topic(kafka, registry, topic)


def test_block_ranges_read_every_live_row_once(source: str, snapshot_of: SnapshotOf) -> None:
    """Three block ranges meet exactly: rows on the blocks either side of each cut, dead row versions (deleted
    and updated, not vacuumed) left out, TOASTed values read whole, a table of no key order at all."""
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE blocks (id int PRIMARY KEY, pad text, big text)")
        conn.execute("ALTER TABLE blocks SET (autovacuum_enabled = false)")
        # Keys in random order across the blocks; ~4,000 blocks of ~25 rows; every 500th row a TOASTed value.
        conn.execute(
            "INSERT INTO blocks SELECT g, repeat('p', 300), CASE WHEN g % 500 = 0 THEN "
            "(SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 600) i) END "
            "FROM (SELECT g FROM generate_series(1, 100000) g ORDER BY md5(g::text)) s"
        )
        conn.execute("DELETE FROM blocks WHERE id % 7 = 0")
        conn.execute("UPDATE blocks SET pad = 'moved' WHERE id % 11 = 0")  # new versions at the table's end
    log, events = snapshot_of(table="public.blocks", workers=3, scan_max_mb=8192, chunk_rows=1000)
    assert "snapshot of public.blocks: 3 block range(s) of the slot's snapshot read at once" in log
    reads = [e.value["after"] for e in events if e.value and e.value["op"] == "r"]
    ids = sorted(r["id"] for r in reads)
    assert ids == [g for g in range(1, 100001) if g % 7], f"{len(ids)} rows read, {len(set(ids))} distinct"
    by_id = {r["id"]: r for r in reads}
    assert all(by_id[g]["pad"] == "moved" for g in range(11, 100001, 11) if g % 7)
    assert all(len(by_id[g]["big"]) == 19200 for g in range(500, 100001, 500) if g % 7)


def test_heartbeats_move_the_slot_while_captured_tables_are_idle(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE busy (id bigserial PRIMARY KEY, pad text)")  # not captured
    cfg = CdcConfig(source, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], f"s_{unique}", f"p_{unique}")
    proc = cfg.start(tmp_path)

    def position(of_slot: bool = False) -> int:
        """The slot's confirmed flush LSN, or the server's current WAL position."""
        with psycopg.connect(source) as conn:
            if of_slot:
                query = "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = %s"
                row = conn.execute(query, (f"s_{unique}",)).fetchone()
            else:
                row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint").fetchone()
        assert row is not None
        return int(row[0])

    try:
        proc.wait_streaming()
        start = position()
        with psycopg.connect(source, autocommit=True) as conn:
            for _ in range(20):  # ~20 MB of WAL the slot does not care about
                conn.execute("INSERT INTO busy (pad) SELECT repeat('x', 1000) FROM generate_series(1, 1000)")
        end = position()
        assert end - start > 15_000_000, "the busy table wrote too little WAL for the test to mean anything"
        # Heartbeats every second (the test config) let the slot confirm past all of it.
        wait_for(lambda: position(of_slot=True) >= end, 30, "the slot to move past the unrelated WAL", proc)
    finally:
        proc.stop()


def test_a_partitioned_table_is_split_by_its_partitions_pages(source: str, snapshot_of: SnapshotOf) -> None:
    """The parent has no pages of its own: its size, which decides the split, is its partitions'. It is read in
    key order even where block ranges are allowed."""
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE parts (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)")
        conn.execute("CREATE TABLE parts_eu PARTITION OF parts FOR VALUES IN ('eu')")
        conn.execute("CREATE TABLE parts_us PARTITION OF parts FOR VALUES IN ('us')")
        conn.execute("INSERT INTO parts SELECT g, (ARRAY['eu', 'us'])[g % 2 + 1] FROM generate_series(0, 2999) g")
    # Block ranges allowed: a partitioned table is still read in key order (its blocks are its partitions').
    log, events = snapshot_of(table="public.parts", workers=2, scan_max_mb=8192)
    assert "snapshot of public.parts: 2 key ranges read at once" in log
    assert sorted(e.value["after"]["id"] for e in events if e.value and e.value["op"] == "r") == list(range(3000))
