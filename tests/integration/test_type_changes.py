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

import psycopg
import pytest

from tests.integration._capture_helpers import (
    CdcConfig,
    read_topic,
    records_to_end,
    scratch_database,
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
    config = CdcConfig(
        source,
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.items"],
        f"s_{unique}",
        f"p_{unique}",
        kafka_extra=SIX,
    )
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
    config = CdcConfig(
        source,
        kafka_bootstrap,
        registry_url,
        f"t{unique}",
        ["public.items"],
        f"s_{unique}",
        f"p_{unique}",
        kafka_extra=SIX,
    )
    proc = config.start(tmp_path)
    try:
        proc.wait_streaming()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items VALUES (2, 'two')")
            conn.execute("ALTER TABLE items ALTER COLUMN id TYPE bigint")
            conn.execute("INSERT INTO items VALUES (3, 'three')")
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 3, 120, "the changes", proc)
        log = proc.this_run()
    finally:
        proc.stop()

    ids = [int.from_bytes(key[1:5], "big") for key in _framed(kafka_bootstrap, topic)]
    assert sorted(ids).count(legacy_id) == 2  # the snapshot and the insert before the ALTER: the registered key
    (widened,) = set(ids) - {legacy_id}  # an int cannot hold int8's values: the key moved to a long
    assert "table public.items: its key columns (id int8) no longer fit the key schema" in log, log[-3000:]
    assert f"now carry key schema id {widened}" in log
