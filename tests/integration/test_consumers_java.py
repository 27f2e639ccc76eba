"""A plain Java consumer with Apicurio's or Confluent's Avro deserializer reads pgcdc's change topics.

``consumers/AvroConsume.java`` is what a Java user writes: ``KafkaConsumer`` with a deserializer for key and
value, configured as docs/consumers.md says: Apicurio's ``AvroKafkaDeserializer`` on the registry's v2 API
(the 4-byte content id of the Confluent wire format, no headers), or Confluent's ``KafkaAvroDeserializer`` on
the Confluent-compatible API. It prints each decoded record; the test replays them the way a compacting
consumer would and compares the result with PostgreSQL, including the forms a Java reader gets for the types
that need care (a decimal's bytes, a timestamp's microseconds, a numeric NaN).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcdc_dev.discovery import find_or_skip

from tests.integration._capture_helpers import read_topic, scratch_database, wait_for
from tests.integration._consumers import PROGRAMS, java, start_capture

pytestmark = pytest.mark.timeout(600)

APICURIO = "io.apicurio.registry.serde.avro.AvroKafkaDeserializer"
CONFLUENT = "io.confluent.kafka.serializers.KafkaAvroDeserializer"


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


def apicurio_settings(registry: str) -> list[str]:
    return [
        f"key.deserializer={APICURIO}",
        f"value.deserializer={APICURIO}",
        f"apicurio.registry.url={registry.replace('/apis/ccompat/v7', '/apis/registry/v2')}",
        "apicurio.registry.id-handler=io.apicurio.registry.serde.Legacy4ByteIdHandler",
        "apicurio.registry.use-id=contentId",
        "apicurio.registry.headers.enabled=false",
    ]


def confluent_settings(registry: str) -> list[str]:
    return [f"key.deserializer={CONFLUENT}", f"value.deserializer={CONFLUENT}", f"schema.registry.url={registry}"]


# Per deserializer: its settings, and its folder in connect-jars (the worker's runtime gives the Kafka client).
DESERIALIZERS = {
    "apicurio": (apicurio_settings, "apicurio-converter"),
    "confluent": (confluent_settings, "confluent-avro-converter"),
}


def java_records(
    home: Path, plugin: str, kafka: str, topic: str, settings: list[str]
) -> list[tuple[int, int, Any, Any]]:
    """(partition, offset, key, value) of every record, as the Java consumer decoded them."""
    classpath = f"{home / 'runtime'}/*:{home / 'plugins' / plugin}/*"
    proc = subprocess.run(
        [java(), "-cp", classpath, str(PROGRAMS / "AvroConsume.java"), kafka, topic, *settings],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = []
    for line in proc.stdout.splitlines():
        if line.startswith("REC "):
            partition, offset, rest = line[4:].split(" ", 2)
            key, value = rest.split("\t")
            records.append((int(partition), int(offset), json.loads(key), json.loads(value)))
    return records


def replayed(records: list[tuple[int, int, Any, Any]]) -> dict[int, dict[str, Any]]:
    """The last image per key; deletes remove (tombstones carry nothing more)."""
    state: dict[int, dict[str, Any]] = {}
    for _partition, _offset, _key, value in sorted(records, key=lambda r: (r[0], r[1])):
        if value is None:
            continue
        if value["op"] == "d":
            state.pop(value["before"]["id"], None)
        else:
            state[value["after"]["id"]] = value["after"]
    return state


def decimal_from_avro_json(text: str | None, scale: int) -> str | None:
    """Avro's JSON form of a decimal is its unscaled two's-complement bytes, one character per byte."""
    if text is None or text == "NaN":  # the union's string branch
        return text
    unscaled = int.from_bytes(text.encode("latin-1"), "big", signed=True)
    return str(Decimal(unscaled).scaleb(-scale))


@pytest.mark.parametrize("deserializer", sorted(DESERIALIZERS))
def test_a_java_consumer_with_a_registry_deserializer_replays_the_table(
    deserializer: str, *, source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    home = Path(find_or_skip("connect-jars"))
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE items (id int PRIMARY KEY, name text, at timestamptz, amount numeric(10,2), doc jsonb)"
        )
        conn.execute(
            "INSERT INTO items SELECT g, 'item ' || g, "
            "'2026-01-02 03:04:05.123456+00'::timestamptz + g * interval '1 s', g * -0.75, jsonb_build_object('g', g) "
            "FROM generate_series(1, 100) g"
        )
    topic = f"t{unique}.public.items"
    capture = start_capture(
        source=source,
        kafka=kafka_bootstrap,
        registry=registry_url,
        unique=unique,
        table="public.items",
        workdir=tmp_path,
    )
    try:
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("UPDATE items SET name = name || ' (changed)', amount = 'NaN' WHERE id % 10 = 0")
            conn.execute("DELETE FROM items WHERE id % 7 = 0")
            conn.execute("UPDATE items SET at = NULL, doc = NULL WHERE id = 1")
            conn.execute("INSERT INTO items VALUES (500, 'last', now(), 12345678.99, '[1, 2]')")
        wait_for(
            lambda: any(e.key == {"id": 500} for e in read_topic(kafka_bootstrap, registry_url, topic)), 120, "id 500"
        )
    finally:
        capture.stop()

    settings, plugin = DESERIALIZERS[deserializer]
    state = replayed(java_records(home, plugin, kafka_bootstrap, topic, settings(registry_url)))
    seen = {i: (r["name"], r["at"], decimal_from_avro_json(r["amount"], 2), r["doc"]) for i, r in sorted(state.items())}
    micros = "(extract(epoch FROM at) * 1000000)::bigint"
    with psycopg.connect(source) as conn:
        expected = {
            i: (name, at, amount, doc)
            for i, name, at, amount, doc in conn.execute(
                f"SELECT id, name, {micros}, amount::text, doc::text FROM items ORDER BY id"
            )
        }
    assert seen == expected
