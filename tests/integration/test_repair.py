"""Repair of drift on the whole pipeline: `cdc verify NAME --repair` re-emits exactly the keys that differ.

The capture and the three built-in sinks run on the pipeline tables until every store is clean. Then drift is
made by hand, with each store's own client and a producer of our own, never through pgcdc: a Redis entry
deleted and another changed, an OpenSearch document removed and one added that the source never had, a Delta
row updated (Spark SQL's UPDATE), and an event with wrong values produced into the topic carrying the key's latest
position (the stores take it: a replayed position is applied). `cdc verify` reports each; `--repair` re-emits
only those keys (the backfill's count is the report's), and every store ends clean, the topic with it.

And a table the publication gains while everything runs is backfilled into every store, `cdc verify` clean.
"""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path
from typing import Any

import fastavro
import psycopg
import pytest
import redis
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from opensearchpy import OpenSearch
from pyspark.sql import SparkSession

from tests.integration._capture_helpers import records_to_end, scratch_database, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    SPARK_WORKER,
    InProcessSinks,
    Stack,
    assert_no_drift,
    cdc_here,
    create_pipeline_tables,
    wait_caught_up,
)
from tests.integration.test_backfill import _write

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), SPARK_WORKER]


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"repair_{unique}") as dsn:
        yield dsn


def _raw_events(kafka: str, topic: str) -> list[tuple[int, bytes, bytes | None]]:
    """Every record of ``topic`` as it is stored: (partition, key bytes, value bytes)."""
    out: list[tuple[int, bytes, bytes | None]] = []
    for msg in records_to_end(kafka, topic):
        key, value = msg.key(), msg.value()
        assert isinstance(key, bytes), msg
        out.append((int(msg.partition() or 0), key, value if isinstance(value, bytes) else None))
    return out


def _plain(schema: Any) -> Any:
    """``schema`` without its logical types: values read and written back as their Avro primitives, byte for
    byte (fastavro cannot make a date of PostgreSQL's 'infinity', which the table has)."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_plain(v) for v in schema]
    return schema


class _Plain:
    """Decodes a topic's records with the registry's schemas less their logical types (``read_topic`` cannot:
    fastavro makes no date of 'infinity')."""

    def __init__(self, registry: str) -> None:
        self._client = SchemaRegistryClient({"url": registry})
        self._schemas: dict[int, Any] = {}

    def schema(self, raw: bytes) -> Any:
        sid = int.from_bytes(raw[1:5], "big")
        if sid not in self._schemas:
            text = self._client.get_schema(sid).schema_str or "null"
            self._schemas[sid] = fastavro.parse_schema(_plain(json.loads(text)))
        return self._schemas[sid]

    def read(self, raw: bytes) -> Any:
        return fastavro.schemaless_reader(io.BytesIO(raw[5:]), self.schema(raw), None)

    def events(self, kafka: str, topic: str) -> list[tuple[int, Any]]:
        """(key id, event or None for a tombstone) in each partition's order."""
        return [(self.read(k)["id"], None if v is None else self.read(v)) for _, k, v in _raw_events(kafka, topic)]


def _forge(kafka: str, plain: _Plain, topic: str, id_: int) -> None:
    """Produces, with a plain producer, a copy of key ``id_``'s latest event whose row says name = 'forged':
    same key bytes, same partition, same position."""
    latest = None
    for partition, key, value in _raw_events(kafka, topic):
        if plain.read(key)["id"] == id_:
            latest = (partition, key, value)
    assert latest is not None, f"no event of key {id_}"
    partition, key, value = latest
    assert value is not None, f"key {id_} is deleted"
    event = plain.read(value)
    event["after"]["name"] = "forged"
    out = io.BytesIO()
    fastavro.schemaless_writer(out, plain.schema(value), event)
    producer = Producer({"bootstrap.servers": kafka})
    producer.produce(topic, value=value[:5] + out.getvalue(), key=key, partition=partition)
    assert producer.flush(30) == 0


def _verify(config: Path, *names: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """`cdc verify` in the test process (the ``spark`` fixture must be set up): its exit code and output."""
    result = cdc_here("verify", *names, "--config", str(config), *extra)
    return result.returncode, result.stdout + result.stderr


def _drift_counts(out: str, name: str) -> int:
    """Keys a comparison found drifted in sink ``name`` (missing + extra + different, over every table)."""
    total = 0
    for m in re.finditer(rf"^{name} \S+: DRIFT missing (\d+), extra (\d+), different (\d+)", out, re.M):
        total += sum(int(n) for n in m.groups())
    return total


def _reemitted(out: str) -> int:
    """Keys the repair's backfills re-read or deleted."""
    return sum(
        int(read) + int(deleted)
        for read, deleted in re.findall(r"done: (\d+) row\(s\) re-read, (\d+) key\(s\) deleted", out)
    )


def test_verify_repair_re_emits_only_the_keys_that_differ(
    *, source: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    create_pipeline_tables(source)
    prefix = f"r{unique}"
    cfg = stack.config(source, PIPELINE_TABLES, prefix=prefix, unique=unique, workdir=tmp_path)
    cfg.extra = "signal_poll_s = 0.2\n" + cfg.extra
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    sinks = InProcessSinks(spark, config, tmp_path / "sinks.log")
    topic = f"{prefix}.public.items"
    try:
        capture.wait_streaming(180)
        sinks.start()
        # Every store holds what the topics hold before drift is made; the repair's exact count of re-emitted
        # keys below shows that nothing else differed.
        wait_caught_up(config, sinks)

        # Drift, made by hand with each store's own client.
        cache = redis.Redis.from_url(stack.redis)
        generation = int(cache.get(f"{prefix}:current") or 0)
        entry = f"{prefix}:g{generation}:public.items:"
        assert cache.delete(f"{entry}[10]") == 1
        row = json.loads(cache.hget(f"{entry}[11]", "row") or b"{}")
        cache.hset(f"{entry}[11]", "row", json.dumps({**row, "name": "changed in redis"}))
        search = OpenSearch(stack.opensearch)
        alias = f"{prefix}-public.items".lower()
        search.delete(index=alias, id="[12]", refresh=True)
        doc = search.get(index=alias, id="[20]")["_source"]
        index = next(iter(search.indices.get_alias(name=alias)))
        search.index(index=index, id="[5000]", body={**doc, "id": 5000}, refresh=True)  # never in the source
        # Spark SQL, not delta-rs: delta-rs cannot rewrite a file holding the date 'infinity' (its statistics
        # overflow), which the table has.
        delta = tmp_path / "warehouse" / "current" / "public.items"
        spark.sql(f"UPDATE delta.`{delta.resolve()}` SET name = 'changed in delta' WHERE id = 13")
        plain = _Plain(stack.registry)
        _forge(stack.kafka, plain, topic, 14)

        wait_for(
            lambda: json.loads(cache.hget(f"{entry}[14]", "row") or b"{}").get("name") == "forged",
            120,
            "the forged event in the cache",
            sinks,
        )
        wait_caught_up(config, sinks)  # in every store

        code, out = _verify(config, "cache")
        assert code == 9, out
        assert "missing  [10]" in out, out
        assert re.search(r"differs  \[11\]: name: source 'item 11' store 'changed in redis'", out), out
        assert re.search(r"differs  \[14\]: name: source 'item 14' store 'forged'", out), out

        before = len(plain.events(stack.kafka, topic))
        expected = {"cache": {10, 11, 14}, "search": {12, 5000}, "warehouse": {13}}
        code, out = _verify(config, *expected, extra=("--repair",))
        print(f"--- cdc verify --repair\n{out}")  # the evidence, with pytest -s
        assert code == 0, out
        found, again = out.split("repair:", maxsplit=1)
        for name, keys in expected.items():
            # The report listed the drift made in this store ...
            assert _drift_counts(found, name) >= len(keys), out
            # ... and the comparison after the repair finds none.
            assert f"{name} public.items: no drift" in again.split("re-read")[-1], out
        assert "DRIFT" not in again.split("re-read")[-1], out
        # Exactly the keys the reports listed were re-emitted, once each: the forged event reached every store,
        # so its key is in three reports.
        drifted = set().union(*expected.values())
        assert re.search(rf"public\.items: repair: {len(drifted)} key\(s\) to re-emit", out), out
        reemitted = _reemitted(out)
        assert reemitted == len(drifted), out

        events = plain.events(stack.kafka, topic)
        incremental = [(k, e) for k, e in events if e is not None and e["source"]["snapshot"] == "incremental"]
        assert len(incremental) == reemitted, "more than the drifted keys were re-emitted"
        assert {k for k, _ in incremental} <= {10, 11, 12, 13, 14, 5000}
        assert len(events) >= before + reemitted
        latest: dict[int, str] = {}
        for key, event in events:
            if event is None or event["op"] == "d":
                latest.pop(key, None)
            else:
                latest[key] = event["after"]["name"]
        with psycopg.connect(source) as conn:
            names: dict[int, str] = dict(conn.execute("SELECT id, name FROM items").fetchall())
        assert latest == names
    finally:
        sinks.stop()
        capture.stop()


# Long profile: the capture's part (the watcher, its gate, the backfill while written) runs in every suite in
# test_backfill.py, and the stores' verify after a backfill in test_verify_repair_re_emits_only_the_keys_that_differ.
@pytest.mark.long
def test_a_table_the_publication_gains_while_streaming_is_backfilled_into_every_store(
    *, source: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    """The publication decides what is captured (source.tables empty): a table with 50,000 rows added to it
    while the capture, the sinks and writes on that table run is backfilled, and `cdc verify` of the three stores
    is clean afterwards."""
    create_pipeline_tables(source)
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(f'CREATE PUBLICATION "p_{unique}" FOR TABLE items, "Notes"')
    prefix = f"r{unique}"
    cfg = stack.config(source, [], prefix=prefix, unique=unique, workdir=tmp_path)
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    sinks = InProcessSinks(spark, config, tmp_path / "sinks.log")
    done = threading.Event()
    writes: list[float] = []
    try:
        capture.wait_streaming(180)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 2, 240, "the sinks' first batches", sinks)
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("CREATE TABLE added (id int PRIMARY KEY, v int NOT NULL)")
            conn.execute("INSERT INTO added SELECT g, 0 FROM generate_series(1, 50000) g")
        writer = threading.Thread(target=_write, args=(source, "added", 50000, done, writes))
        writer.start()
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute(f'ALTER PUBLICATION "p_{unique}" ADD TABLE added')
        backfilled = re.compile(r"backfill added\.\S+ of public\.added done")
        wait_for(lambda: backfilled.search(capture.log.read_text()), 180, "the backfill", capture)
        done.set()
        writer.join(30)
        assert len(writes) > 100, "the table was hardly written while it was backfilled"
        assert "the publication gained public.added" in capture.log.read_text()
        assert_no_drift(config, sinks)
    finally:
        done.set()
        sinks.stop()
        capture.stop()
