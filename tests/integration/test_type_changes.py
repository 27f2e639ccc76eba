"""A column changes type under a running capture (docs/events.md, Type changes).

Widening a key column keeps every key's bytes, so its partition and its compaction: a row's events before
and after the ALTER share one key record in one partition, and a later delete's tombstone covers them all.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.integration._capture_helpers import (
    CdcConfig,
    latest_by_key,
    read_topic,
    records_to_end,
    scratch_database,
    set_compatibility,
    wait_for,
)

SIX = "partitions = 6"  # enough partitions that a key moved by a new key schema id would show


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


def _versions(registry: str, subject: str) -> list[int]:
    with urllib.request.urlopen(f"{registry}/subjects/{subject}/versions") as resp:  # noqa: S310
        return list(json.load(resp))


def _register(registry: str, subject: str, schema: Mapping[str, object]) -> int:
    request = urllib.request.Request(  # noqa: S310
        f"{registry}/subjects/{subject}/versions",
        data=json.dumps({"schema": json.dumps(schema)}).encode(),
        method="POST",
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
    )
    with urllib.request.urlopen(request) as resp:  # noqa: S310
        return int(json.load(resp)["id"])


def _keys(kafka: str, topic: str) -> dict[bytes, set[tuple[bytes, int]]]:
    """Each key's payload (its bytes after the framing) -> the (framed key, partition) it was written with."""
    found: dict[bytes, set[tuple[bytes, int]]] = defaultdict(set)
    for msg in records_to_end(kafka, topic):
        key, partition = msg.key(), msg.partition()
        assert key is not None
        assert partition is not None
        found[key[5:]].add((key, partition))
    return found


def _framed(kafka: str, topic: str) -> list[bytes]:
    return [key for msg in records_to_end(kafka, topic) if (key := msg.key()) is not None]


def test_widening_key_columns_keeps_each_keys_bytes_and_partition(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE items (id int, code varchar(10), price numeric(10,2), name text, "
            "PRIMARY KEY (id, code, price))"
        )
        conn.execute("INSERT INTO items SELECT i, 'c' || i, i * 1.25, 'one' FROM generate_series(1, 40) i")
    topic = f"t{unique}.public.items"
    config = _config(source, kafka_bootstrap, registry_url, unique, tables=["public.items"])
    proc = config.start(tmp_path)
    try:
        proc.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute(
                "ALTER TABLE items ALTER COLUMN id TYPE bigint, ALTER COLUMN code TYPE text, "
                "ALTER COLUMN price TYPE numeric(12,2)"
            )
            conn.execute("UPDATE items SET name = 'two'")
            conn.execute("DELETE FROM items WHERE id <= 5")
            conn.execute("INSERT INTO items VALUES (2^40, 'big', 12345678.90, 'wide')")
        wait_for(
            lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 40 + 40 + 10 + 1, 120, "the changes", proc
        )
    finally:
        proc.stop()

    assert len(_versions(registry_url, f"{topic}-value")) == 2  # the value schema did change
    assert len(_versions(registry_url, f"{topic}-key")) == 1  # the key schema did not
    keys = _keys(kafka_bootstrap, topic)
    assert len(keys) == 41
    moved = {payload: where for payload, where in keys.items() if len(where) != 1}
    assert not moved, f"keys written with other bytes or in another partition after the ALTER: {moved}"
    # A compacting reader: each row is its latest event; the deleted rows' tombstones covered their snapshot
    # records (same key bytes), so they are gone.
    events = read_topic(kafka_bootstrap, registry_url, topic)
    latest: dict[tuple[object, ...], object] = {}
    for e in sorted(events, key=lambda e: (e.partition, e.offset)):
        assert e.key is not None
        latest[(e.key["id"], e.key["code"], e.key["price"])] = e.value and e.value["after"]
    alive = {k: v for k, v in latest.items() if v is not None}
    assert len(alive) == 36
    assert {v["name"] for v in alive.values()} == {"two", "wide"}  # type: ignore[index]


def _config(source: str, kafka: str, registry: str, unique: str, *, tables: list[str], extra: str = "") -> CdcConfig:
    return CdcConfig(
        source,
        kafka,
        registry,
        f"t{unique}",
        tables,
        f"s_{unique}",
        f"p_{unique}",
        kafka_extra=SIX,
        extra=extra,
    )


NEW_TOPIC = 'on_type_change = "new-topic"'


def _rows(kafka: str, registry: str, topic: str) -> dict[int, dict[str, Any]]:
    """The rows a compacting reader of ``topic`` ends with, by id."""
    return latest_by_key(read_topic(kafka, registry, topic), "id")


def _table(dsn: str, columns: str = "id, qty, name") -> dict[int, dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=dict_row) as cur:
        return {r["id"]: r for r in cur.execute(f"SELECT {columns} FROM items").fetchall()}


def test_a_key_registered_before_keys_were_widened_is_kept_until_a_change_it_cannot_carry(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    topic = f"t{unique}.public.items"
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO items VALUES (1, 'one')")
    # The key schema an earlier pgcdc registered for this topic: an int4 key as an Avro int.
    legacy = {
        "type": "record",
        "name": "Key",
        "namespace": topic,
        "fields": [{"name": "id", "type": ["null", "int"], "default": None}],
    }
    legacy_id = _register(registry_url, f"{topic}-key", legacy)
    config = _config(source, kafka_bootstrap, registry_url, unique, tables=["public.items"], extra=NEW_TOPIC)
    proc = config.start(tmp_path)
    try:
        proc.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items VALUES (2, 'two')")
            conn.execute("ALTER TABLE items ALTER COLUMN id TYPE bigint")
            conn.execute("INSERT INTO items VALUES (2^40, 'wide')")
        # An int cannot carry int8's values: the table moves to its next generation rather than give its keys
        # new bytes in this topic.
        wait_for(lambda: len(_rows(kafka_bootstrap, registry_url, f"{topic}.g2")) == 3, 120, "the new generation", proc)
        log = proc.this_run()
    finally:
        proc.stop()

    assert "table public.items: column id int4 → int8, which subject" in log, log[-3000:]
    ids = {int.from_bytes(key[1:5], "big") for key in _framed(kafka_bootstrap, topic)}
    assert ids == {legacy_id}  # the snapshot and the insert before the ALTER, under the registered key
    assert len(_framed(kafka_bootstrap, topic)) == 2  # and nothing after it
    assert _versions(registry_url, f"{topic}-key") == [1]
    g2 = _registered(registry_url, f"{topic}.g2-key")
    assert g2["fields"][0]["type"] == ["null", "long"]


def _registered(registry: str, subject: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{registry}/subjects/{subject}/versions/latest") as resp:  # noqa: S310
        return dict(json.loads(json.load(resp)["schema"]))


def test_an_incompatible_change_moves_the_table_to_a_new_topic_while_the_others_go_on(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    topic, other = f"t{unique}.public.items", f"t{unique}.public.other"
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, qty int, name text)")
        conn.execute("CREATE TABLE other (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO items SELECT i, i, 'n' || i FROM generate_series(1, 300) i")
    tables = ["public.items", "public.other"]
    proc = _config(source, kafka_bootstrap, registry_url, unique, tables=tables, extra=NEW_TOPIC).start(tmp_path)
    try:
        proc.wait_streaming()
        set_compatibility(registry_url, f"{topic}-value", "BACKWARD")
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ALTER COLUMN qty TYPE text USING 'q' || qty")  # int -> string
            conn.execute("UPDATE items SET name = 'changed' WHERE id = 1")
            conn.execute("DELETE FROM items WHERE id = 2")
            conn.execute("INSERT INTO other VALUES (1, 'after the ALTER')")
        wait_for(lambda: len(_rows(kafka_bootstrap, registry_url, other)) == 1, 120, "the other table's row", proc)
        expected = _table(source)
        wait_for(
            lambda: _rows(kafka_bootstrap, registry_url, f"{topic}.g2") == expected,
            180,
            "the new generation to hold the table",
            proc,
        )
        log = proc.this_run()
    finally:
        proc.stop()

    assert "table public.items: column qty int4 → text, which subject" in log, log[-3000:]
    assert f"the table's changes go to topic {topic}.g2 from now on" in log
    # The first generation keeps what was written before the ALTER, readable with its own schemas.
    old = read_topic(kafka_bootstrap, registry_url, topic)
    assert len(old) == 300
    assert {e.value["after"]["qty"] for e in old if e.value} == set(range(1, 301))


def test_a_capture_killed_while_moving_a_table_finishes_the_move_when_started_again(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    topic = f"t{unique}.public.items"
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, qty int, name text)")
        conn.execute("INSERT INTO items SELECT i, i, 'n' || i FROM generate_series(1, 3000) i")
    slow = f"{NEW_TOPIC}\nbackfill_chunk_rows = 100\nbackfill_rows_per_s = 200"
    config = _config(source, kafka_bootstrap, registry_url, unique, tables=["public.items"], extra=slow)
    proc = config.start(tmp_path)
    proc.wait_streaming()
    set_compatibility(registry_url, f"{topic}-value", "BACKWARD")
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("ALTER TABLE items ALTER COLUMN qty TYPE text USING 'q' || qty")
        conn.execute("UPDATE items SET name = 'changed' WHERE id = 1")
    # Killed once the backfill has written part of the table into the new generation.
    wait_for(lambda: len(_framed(kafka_bootstrap, f"{topic}.g2")) >= 300, 120, "the backfill under way", proc)
    proc.kill()
    assert len(_framed(kafka_bootstrap, f"{topic}.g2")) < 3000  # the kill did come mid-move
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("UPDATE items SET name = 'while down' WHERE id = 2")
    proc.start()
    try:
        expected = _table(source)
        wait_for(
            lambda: _rows(kafka_bootstrap, registry_url, f"{topic}.g2") == expected,
            180,
            "the new generation to hold the table",
            proc,
        )
        log = proc.this_run()
    finally:
        proc.stop()
    assert "which subject" not in log  # the restart writes on to the second generation, no third one
    assert _versions(registry_url, f"{topic}.g2-value") == [1]


def test_a_decimals_new_scale_or_a_renamed_key_column_moves_the_table(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """numeric(10,2) → numeric(10,4): a registry finds the schemas compatible (bytes read bytes), but an event
    written at scale 2 read with scale 4 is a hundredfold off, so the table cannot stay in its topic. A key
    column renamed: a new key schema would give every key new bytes (and partition), so neither can its table."""
    topic, keyed = f"t{unique}.public.items", f"t{unique}.public.keyed"
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, price numeric(10,2))")
        conn.execute("INSERT INTO items VALUES (1, 1.50), (2, 2.25)")
        conn.execute("CREATE TABLE keyed (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO keyed VALUES (1, 'a'), (2, 'b')")
    tables = ["public.items", "public.keyed"]
    config = _config(source, kafka_bootstrap, registry_url, unique, tables=tables, extra=NEW_TOPIC)
    proc = config.start(tmp_path)
    try:
        proc.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ALTER COLUMN price TYPE numeric(10,4)")
            conn.execute("INSERT INTO items VALUES (3, 3.1234)")
            conn.execute("ALTER TABLE keyed RENAME COLUMN id TO pk")
            conn.execute("UPDATE keyed SET name = 'b2' WHERE pk = 2")
        wait_for(lambda: len(_rows(kafka_bootstrap, registry_url, f"{topic}.g2")) == 3, 120, "the new generation", proc)

        def renamed_moved() -> bool:
            rows = latest_by_key(read_topic(kafka_bootstrap, registry_url, f"{keyed}.g2"), "pk")
            return {r["pk"]: r["name"] for r in rows.values()} == {1: "a", 2: "b2"}

        wait_for(renamed_moved, 120, "the table with the renamed key in its new generation", proc)
        log = proc.this_run()
    finally:
        proc.stop()
    assert "its key columns would change from (id) to (pk)" in log, log[-3000:]
    assert _versions(registry_url, f"{keyed}-key") == [1]  # its first generation's keys keep their bytes
    assert "table public.items: column price numeric(10,2) → numeric(10,4), which subject" in log, log[-3000:]
    assert {r["id"]: str(r["price"]) for r in _rows(kafka_bootstrap, registry_url, f"{topic}.g2").values()} == {
        1: "1.5000",
        2: "2.2500",
        3: "3.1234",
    }
    assert _versions(registry_url, f"{topic}-value") == [1]  # the first generation's readers are not misled
