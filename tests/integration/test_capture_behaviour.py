"""Capture behaviours beyond plain inserts: schema evolution, TOAST, truncate, large and aborted transactions."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    read_topic,
    scratch_database,
    wait_for,
)

pytestmark = pytest.mark.pg_matrix  # `./dev test` runs it on PostgreSQL 18 too


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


def _start(source: str, kafka: str, registry: str, unique: str, tmp_path: Path) -> CdcProcess:
    return CdcConfig(source, kafka, registry, f"t{unique}", ["public.items"], f"s_{unique}", f"p_{unique}").start(
        tmp_path
    )


def _start_streaming(  # noqa: PLR0917 - the fixtures' values, in their order
    source: str, kafka: str, registry: str, unique: str, tmp_path: Path, tables: list[str]
) -> CdcProcess:
    """`cdc run` with a small decoding memory: PostgreSQL streams transactions while they are in progress."""
    small_mem = source + " options='-c logical_decoding_work_mem=64kB'"
    return CdcConfig(small_mem, kafka, registry, f"t{unique}", tables, f"s_{unique}", f"p_{unique}").start(tmp_path)


def _pending_inserts(dsn: str, slot: str, publication: str) -> int:
    """How many inserts the slot would hand a restarted capture again (pgoutput's Insert messages, peeked).

    Not compared with a WAL position taken before the change: the server's WAL is shared, and a keepalive may
    rightly acknowledge another database's records written between that position and the change."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s)",
            (slot, publication),
        ).fetchall()
    return sum(1 for (data,) in rows if bytes(data[:1]) == b"I")


def test_schema_evolution_registers_new_versions_that_read_old_events(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
        conn.execute("INSERT INTO items VALUES (1, 'one', 1)")
    topic = f"t{unique}.public.items"
    proc = _start(source, kafka_bootstrap, registry_url, unique, tmp_path)
    try:
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 1, 120, "the snapshot", proc)
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ADD COLUMN price numeric(8,2)")
            conn.execute("INSERT INTO items VALUES (2, 'two', 2, 9.99)")
            conn.execute("ALTER TABLE items DROP COLUMN qty")
            conn.execute("INSERT INTO items VALUES (3, 'three', 3.50)")
            conn.execute("ALTER TABLE items RENAME COLUMN name TO title")
            conn.execute("UPDATE items SET title = 'uno' WHERE id = 1")
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 4, 120, "the changes", proc)
    finally:
        proc.stop()

    events = read_topic(kafka_bootstrap, registry_url, topic)
    afters = [e.value["after"] for e in events if e.value]
    assert afters == [
        {"id": 1, "name": "one", "qty": 1},
        {"id": 2, "name": "two", "qty": 2, "price": Decimal("9.99")},
        {"id": 3, "name": "three", "price": Decimal("3.50")},
        {"id": 1, "title": "uno", "price": None},
    ]
    with urllib.request.urlopen(f"{registry_url}/subjects/{topic}-value/versions") as resp:  # noqa: S310
        versions = json.load(resp)
    assert len(versions) == 4  # initial, +price, -qty, name->title

    # A consumer on the newest schema reads every older event (all fields are nullable with defaults).
    import io

    import fastavro

    with urllib.request.urlopen(f"{registry_url}/subjects/{topic}-value/versions/latest") as resp:  # noqa: S310
        latest = fastavro.parse_schema(json.loads(json.load(resp)["schema"]))
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"evo-{unique}", "isolation.level": "read_committed"}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    read = []
    for _ in range(len(events)):
        msg = consumer.poll(10)
        assert msg is not None
        raw = msg.value()
        assert raw is not None
        schema_id = int.from_bytes(raw[1:5], "big")
        with urllib.request.urlopen(f"{registry_url}/schemas/ids/{schema_id}") as resp:  # noqa: S310
            writer = fastavro.parse_schema(json.loads(json.load(resp)["schema"]))
        decoded = fastavro.schemaless_reader(io.BytesIO(raw[5:]), writer, latest)
        assert isinstance(decoded, dict)
        read.append(decoded["after"])
    consumer.close()
    assert [r["id"] for r in read] == [1, 2, 3, 1]
    assert set(read[0]) == {"id", "title", "price"}  # old events, seen through the newest schema


def test_a_change_the_registry_rejects_stops_before_acknowledging(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, qty int)")
        conn.execute("INSERT INTO items VALUES (1, 1)")
    topic = f"t{unique}.public.items"
    config = CdcConfig(
        source, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], f"s_{unique}", f"p_{unique}"
    )
    config.extra = 'on_type_change = "stop"'  # for teams that want a person to decide
    proc = config.start(tmp_path)
    try:
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 1, 120, "the snapshot", proc)
        request = urllib.request.Request(  # noqa: S310
            f"{registry_url}/config/{topic}-value",
            data=json.dumps({"compatibility": "FULL"}).encode(),
            method="PUT",
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        urllib.request.urlopen(request).close()  # noqa: S310
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ALTER COLUMN qty TYPE text")  # int -> string: not FULL-compatible
            conn.execute("INSERT INTO items VALUES (2, 'two')")
        assert proc.proc is not None
        code = proc.proc.wait(120)
    finally:
        proc.stop()
    assert code == 5, proc.tail()
    log = proc.tail()
    # What changed, which subject refused it, and both ways on.
    assert f"table public.items: column qty int4 → text, which subject '{topic}-value' cannot take" in log, log
    assert 'capture.on_type_change = "new-topic"' in log
    assert f"/config/{topic}-value" in log
    # Nothing past the rejected change was acknowledged: the slot hands it to a restart again, not skips it.
    assert _pending_inserts(source, f"s_{unique}", f"p_{unique}") == 1
    assert [e.value["after"] for e in read_topic(kafka_bootstrap, registry_url, topic) if e.value] == [
        {"id": 1, "qty": 1}
    ]


def test_a_table_first_changed_in_a_streamed_transaction_is_captured_in_later_ones(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """pgoutput sends a table's Relation inside the first (streamed) transaction that changes it and, once that
    transaction commits, not again: later transactions' changes must decode with it. The same after a column is
    added (a new Relation, outside a stream) and a second streamed transaction."""
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text, qty int)")
    proc = _start_streaming(source, kafka_bootstrap, registry_url, unique, tmp_path, ["public.items"])
    topic = f"t{unique}.public.items"
    try:
        proc.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT g, repeat('y', 200), 0 FROM generate_series(1, 3000) g")  # streamed
            conn.execute("UPDATE items SET qty = 1 WHERE id = 1")
            conn.execute("ALTER TABLE items ADD COLUMN note text")
            conn.execute("UPDATE items SET qty = 2, note = 'a' WHERE id <= 2000")  # streamed, with the new column
            conn.execute("UPDATE items SET qty = 3, note = 'b' WHERE id = 3")
        wait_for(
            lambda: any(
                e.value and e.value["after"]["qty"] == 3 for e in read_topic(kafka_bootstrap, registry_url, topic)
            ),
            180,
            "the last update",
            proc,
        )
    finally:
        proc.stop()
    events = [e.value for e in read_topic(kafka_bootstrap, registry_url, topic) if e.value]
    assert Counter(e["op"] for e in events) == {"c": 3000, "u": 2002}
    assert [e["after"] for e in events if e["op"] == "u" and e["after"]["id"] in (1, 3) and e["after"]["qty"] != 2] == [
        {"id": 1, "body": "y" * 200, "qty": 1},
        {"id": 3, "body": "y" * 200, "qty": 3, "note": "b"},
    ]


def test_toast_truncate_and_large_transactions(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text, qty int)")
        # Under REPLICA IDENTITY FULL the old row carries the value an update left out: it is filled in.
        conn.execute("CREATE TABLE full_items (id int PRIMARY KEY, body text, qty int)")
        conn.execute("ALTER TABLE full_items REPLICA IDENTITY FULL")
    topic = f"t{unique}.public.items"
    tables = ["public.items", "public.full_items"]
    proc = _start_streaming(source, kafka_bootstrap, registry_url, unique, tmp_path, tables)
    big = secrets.token_hex(20_000)  # incompressible: stored out of line, not compressed inline
    try:
        proc.wait_streaming()
        with psycopg.connect(source) as conn:
            # Aborted after PostgreSQL began streaming it: must never reach Kafka.
            conn.execute("INSERT INTO items SELECT g, repeat('x', 200), 0 FROM generate_series(1000, 6000) g")
            conn.rollback()
            conn.execute("INSERT INTO full_items VALUES (1, %s, 0), (2, %s, 0)", (big, big))
            conn.commit()
            conn.execute("UPDATE full_items SET qty = 1 WHERE id = 1")  # a transaction decoded whole
            conn.commit()
            # Committed, streamed, with an aborted subtransaction inside.
            conn.execute("UPDATE full_items SET qty = 2 WHERE id = 2")  # ... and one streamed
            conn.execute("INSERT INTO items SELECT g, repeat('y', 200), 0 FROM generate_series(1, 3000) g")
            conn.execute("SAVEPOINT s")
            conn.execute("INSERT INTO items SELECT g, 'gone', 0 FROM generate_series(7000, 9000) g")
            conn.execute("ROLLBACK TO SAVEPOINT s")
            conn.commit()
            conn.execute("INSERT INTO items VALUES (-1, %s, 0)", (big,))
            conn.commit()
            conn.execute("UPDATE items SET qty = 5 WHERE id = -1")  # body unchanged: sent as 'u'
            conn.commit()
            conn.execute("TRUNCATE items")
            conn.commit()
        wait_for(
            lambda: any(e.value and e.value["op"] == "t" for e in read_topic(kafka_bootstrap, registry_url, topic)),
            180,
            "the truncate",
            proc,
        )
    finally:
        proc.stop()
    events = read_topic(kafka_bootstrap, registry_url, topic)
    ops = Counter(e.value["op"] for e in events if e.value)
    assert ops == {"c": 3001, "u": 1, "t": 1}
    ids = [e.key["id"] for e in events if e.key and e.value and e.value["op"] == "c"]
    assert sorted(ids) == [-1, *range(1, 3001)]  # nothing of the aborted transaction or subtransaction
    update = next(e for e in events if e.value and e.value["op"] == "u")
    assert update.value is not None
    assert update.value["after"] == {"id": -1, "body": None, "qty": 5}
    assert update.value["unchanged_toast"] == ["body"]
    inserted = next(e for e in events if e.key == {"id": -1} and e.value and e.value["op"] == "c")
    assert inserted.value is not None
    assert inserted.value["after"]["body"] == big
    full_updates = [e.value for e in read_topic(kafka_bootstrap, registry_url, f"t{unique}.public.full_items")]
    assert [
        (v["after"]["id"], v["after"]["qty"], v["after"]["body"] == big, v["unchanged_toast"])
        for v in full_updates
        if v and v["op"] == "u"
    ] == [
        (1, 1, True, []),
        (2, 2, True, []),
    ]
    truncate = next(e for e in events if e.value and e.value["op"] == "t")
    assert truncate.key == {"id": None}
    assert truncate.value is not None
    assert truncate.value["before"] is None
    assert truncate.value["after"] is None


def test_attach_dry_run_and_detach(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE nokey (a int)")
        conn.execute("CREATE TABLE otherident (id int PRIMARY KEY, code text NOT NULL UNIQUE)")
        conn.execute("ALTER TABLE otherident REPLICA IDENTITY USING INDEX otherident_code_key")
    cfg = CdcConfig(source, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], f"s_{unique}", f"p_{unique}")
    path = cfg.write(tmp_path / "cdc.toml")

    def cdc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgcdc", *args], capture_output=True, text=True, check=False)

    dry = cdc("attach", "--config", str(path), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f'would run: CREATE PUBLICATION "p_{unique}" FOR TABLE "public"."items"' in dry.stdout
    with psycopg.connect(source) as conn:
        assert conn.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)

    done = cdc("attach", "--config", str(path))
    assert done.returncode == 0, done.stderr
    assert "ran: CREATE PUBLICATION" in done.stdout
    assert "postgres:postgres" not in done.stdout + done.stderr  # the password never shows

    bad = CdcConfig(
        source, kafka_bootstrap, registry_url, f"t{unique}", ["public.nokey"], f"s2_{unique}", f"q_{unique}"
    )
    refused = cdc("attach", "--config", str(bad.write(tmp_path / "bad.toml")))
    assert refused.returncode == 3
    assert "public.nokey has no primary key" in refused.stderr
    assert "REPLICA IDENTITY" in refused.stderr

    bad = CdcConfig(
        source, kafka_bootstrap, registry_url, f"t{unique}", ["public.otherident"], f"s3_{unique}", f"r_{unique}"
    )
    refused = cdc("attach", "--config", str(bad.write(tmp_path / "bad2.toml")))
    assert refused.returncode == 3
    assert "REPLICA IDENTITY DEFAULT" in refused.stderr

    assert cdc("detach", "--config", str(path)).returncode == 2  # needs --yes
    gone = cdc("detach", "--config", str(path), "--yes")
    assert gone.returncode == 0, gone.stderr
    with psycopg.connect(source) as conn:
        assert conn.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)


def test_logical_decoding_messages_are_published(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY)")
    proc = _start(source, kafka_bootstrap, registry_url, unique, tmp_path)
    topic = f"t{unique}.messages"
    try:
        proc.wait_streaming()
        with psycopg.connect(source) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, 'app.audit', 'in a transaction')")
            conn.execute("INSERT INTO items VALUES (1)")
            conn.commit()
            conn.execute("SELECT pg_logical_emit_message(true, 'app.audit', 'rolled back')")
            conn.rollback()
            conn.execute("SELECT pg_logical_emit_message(false, 'app.audit', convert_to('alone', 'UTF8'))")
            conn.commit()
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 2, 60, "the messages", proc)
        time.sleep(2)  # a rolled-back message would have arrived by now
    finally:
        proc.stop()
    messages = [e.value["message"] for e in read_topic(kafka_bootstrap, registry_url, topic) if e.value]
    assert sorted((m["content"], m["transactional"]) for m in messages) == [
        (b"alone", False),
        (b"in a transaction", True),
    ]
    assert all(m["prefix"] == "app.audit" for m in messages)


@pytest.mark.one_version  # the demo's own commands
@pytest.mark.xdist_group("demo")  # the demo database is one: its two tests run one after the other
def test_demo_command_captures_a_live_workload(pg_dsn: str, kafka_bootstrap: str, registry_url: str) -> None:
    """The README's main job: `cdc demo` (what `./dev demo` runs after starting the services)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pgcdc",
            "demo",
            "--pg",
            pg_dsn,
            "--kafka",
            kafka_bootstrap,
            "--registry",
            registry_url,
            "--seconds",
            "6",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},  # the live table's rows on one line each
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "capture stopped (exit 0)" in proc.stdout
    # The last drawing of the live table: every table's topic shows the events read back (the orders topic is
    # created after the demo's consumer subscribes, and must be read all the same).
    for topic in ("demo.public.customers", "demo.public.orders"):
        rows = [line for line in proc.stdout.splitlines() if f" {topic} " in line]
        assert rows, f"{topic} is not in the demo's table:\n{proc.stdout[-3000:]}"
        cells = [c.strip() for c in rows[-1].split("\u2502")]  # rich's box-drawing column separator
        counts = [int(c) for c in cells[2:7]]  # r, c, u, d, tombstone
        assert sum(counts) > 0, f"no events of {topic} read back:\n{rows[-1]}"


@pytest.mark.one_version  # the demo's own commands
@pytest.mark.xdist_group("demo")
def test_the_demo_database_and_workload_run_apart_from_the_capture(pg_dsn: str) -> None:
    """What docker-compose.yml runs as services of their own: `cdc demo --setup-only` makes the demo database
    where absent and never resets it; `cdc demo --workload-only --seconds 0` writes until SIGTERM."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    cdc = [sys.executable, "-m", "pgcdc", "demo", "--pg", pg_dsn]
    demo = make_conninfo("", **{**conninfo_to_dict(pg_dsn), "dbname": "pgcdc_demo"})
    first = subprocess.run([*cdc, "--setup-only"], capture_output=True, text=True, check=False, timeout=120)
    assert first.returncode == 0, first.stderr
    with psycopg.connect(demo, autocommit=True) as conn:
        conn.execute("INSERT INTO customers (id, name) VALUES (100001, 'kept') ON CONFLICT (id) DO NOTHING")
    again = subprocess.run([*cdc, "--setup-only"], capture_output=True, text=True, check=False, timeout=120)
    assert again.returncode == 0, again.stderr

    def orders() -> int:
        with psycopg.connect(demo) as conn:
            row = conn.execute("SELECT count(*) FROM orders").fetchone()
            assert row is not None
            return int(row[0])

    with psycopg.connect(demo) as conn:
        assert conn.execute("SELECT name FROM customers WHERE id = 100001").fetchone() == ("kept",)
    before = orders()
    workload = subprocess.Popen([*cdc, "--workload-only", "--seconds", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert workload.stderr is not None
        assert "workload on database" in workload.stderr.readline()  # its SIGTERM handler is in place
        wait_for(lambda: orders() > before + 5, 120, "the workload's orders")
        assert workload.poll() is None, "the workload ended before it was stopped"
        workload.terminate()
        _, err = workload.communicate(timeout=60)
    finally:
        if workload.poll() is None:
            workload.kill()
    assert workload.returncode == 0, err
    assert "workload stopped after" in err


@pytest.mark.one_version  # fencing is Kafka's transactions: no server version changes it
def test_a_second_instance_fences_the_first_and_takes_over(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY)")
    first = _start(source, kafka_bootstrap, registry_url, unique, tmp_path)
    second = CdcProcess(first.config, tmp_path / "second.log")
    topic = f"t{unique}.public.items"
    try:
        first.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT generate_series(1, 10)")
        second.start()  # same transactional id: its init_transactions fences the first
        assert first.proc is not None
        code = first.proc.wait(60)
        assert code == 6, first.tail()
        assert "fenced" in first.tail()
        second.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT generate_series(11, 20)")
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 20, 60, "all rows", second)
    finally:
        first.stop()
        second.stop()
    keys = [e.key["id"] for e in read_topic(kafka_bootstrap, registry_url, topic) if e.key]
    assert sorted(keys) == list(range(1, 21))  # each row exactly once across the hand-over


def test_transaction_metadata_when_enabled(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, qty int)")
    cfg = CdcConfig(
        source,
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.items"],
        f"s_{unique}",
        f"p_{unique}",
        extra="emit_transactions = true",
    )
    proc = cfg.start(tmp_path)
    tx_topic = f"t{unique}.transaction"
    try:
        proc.wait_streaming()
        with psycopg.connect(source) as conn:
            conn.execute("INSERT INTO items VALUES (1, 1), (2, 2)")
            conn.execute("UPDATE items SET qty = 3 WHERE id = 1")
            conn.commit()
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, tx_topic)) >= 2, 60, "BEGIN and END", proc)
    finally:
        proc.stop()
    begin, end = (e.value for e in read_topic(kafka_bootstrap, registry_url, tx_topic))
    assert begin is not None
    assert end is not None
    assert (begin["status"], begin["event_count"]) == ("BEGIN", None)
    assert (end["status"], end["event_count"], end["id"]) == ("END", 3, begin["id"])
    assert end["data_collections"] == [{"data_collection": "public.items", "event_count": 3}]
    changes = [e.value for e in read_topic(kafka_bootstrap, registry_url, f"t{unique}.public.items") if e.value]
    assert [(c["op"], c["transaction"]["id"], c["transaction"]["total_order"]) for c in changes] == [
        ("c", begin["id"], 1),
        ("c", begin["id"], 2),
        ("u", begin["id"], 3),
    ]


def test_schema_change_inside_a_streamed_transaction_and_partitioned_tables(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("CREATE TABLE parts (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)")
        conn.execute("CREATE TABLE parts_eu PARTITION OF parts FOR VALUES IN ('eu')")
        conn.execute("CREATE TABLE parts_us PARTITION OF parts FOR VALUES IN ('us')")
        conn.execute("INSERT INTO parts VALUES (1, 'eu'), (2, 'us')")
    cfg = CdcConfig(
        source + " options='-c logical_decoding_work_mem=64kB'",
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.items", "public.parts"],
        f"s_{unique}",
        f"p_{unique}",
    )
    proc = cfg.start(tmp_path)
    items, parts = f"t{unique}.public.items", f"t{unique}.public.parts"
    try:
        proc.wait_streaming()
        with psycopg.connect(source) as conn:
            # Streamed (large), and it changes the table's schema before writing with it.
            conn.execute("ALTER TABLE items ADD COLUMN extra int")
            conn.execute("INSERT INTO items SELECT g, repeat('y', 200), 7 FROM generate_series(1, 3000) g")
            conn.commit()
            conn.execute("INSERT INTO parts VALUES (3, 'us')")
            conn.execute("DELETE FROM parts WHERE id = 1")
            conn.commit()
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, items)) >= 3000, 120, "the items", proc)
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, parts)) >= 5, 60, "the parts", proc)
    finally:
        proc.stop()
    afters = [e.value["after"] for e in read_topic(kafka_bootstrap, registry_url, items) if e.value]
    assert len(afters) == 3000
    assert all(a["extra"] == 7 for a in afters)
    # Snapshot rows and streamed changes of the partitions all land on the parent's topic.
    ops = [(e.value["op"] if e.value else "tombstone", e.key) for e in read_topic(kafka_bootstrap, registry_url, parts)]
    assert sorted(ops, key=str) == sorted(
        [
            ("r", {"id": 1, "region": "eu"}),
            ("r", {"id": 2, "region": "us"}),
            ("c", {"id": 3, "region": "us"}),
            ("d", {"id": 1, "region": "eu"}),
            ("tombstone", {"id": 1, "region": "eu"}),
        ],
        key=str,
    )
