"""Hostile schema, table and column names through attach, snapshot, streaming and every sink.

Names come from the strategies of ``_hostile.py`` (quotes, spaces, backslashes, ``%``, ``;``, dots, tabs,
newlines, accents, CJK, emoji up to PostgreSQL's 63 bytes, reserved words, mixed case, leading digits, names
differing only in case), for keys too (one or two columns). Every SQL identifier pgcdc builds must be quoted:
a name that is not would break the catalog queries, the publication, the snapshot's COPY or the stores.

* The capture property: each example's tables are snapshotted and streamed (inserts, updates, a key update,
  a delete); each topic, replayed, equals its table, with every column's name recoverable from the Avro
  schema exactly as docs/events.md says (the field's name, or its ``pgcdc.column`` attribute when the name
  had to be sanitised). Tables whose topic names would collide (Kafka refuses the characters, which become
  ``_``) must be refused by ``cdc attach`` with the documented error (docs/bad-input.md,
  ``tables-share-a-topic``); the example then goes on without the later table of each colliding pair.
* The sinks: Spark takes minutes per run, so every sink runs once, over a hand-picked worst case plus tables
  drawn deterministically from the same strategies (``hypothesis.find``, derandomized), and ``cdc verify``
  compares each store with PostgreSQL key by key; Redis and OpenSearch are also read directly.

Examples are derandomized (the same ones on every run); a failure prints the falsifying example.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from confluent_kafka.schema_registry import SchemaRegistryClient
from hypothesis import HealthCheck, Phase, find, given, settings
from opensearchpy import OpenSearch
from psycopg import sql

from cdc.config import load_settings
from sinks._search import column_of, index_alias
from tests.integration import _hostile as h
from tests.integration._capture_helpers import CdcConfig, Event, read_topic, scratch_database, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, assert_verified, cdc, cdc_here

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.pg_matrix]

SINKS = ("search", "cache", "warehouse")
_AVRO_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"hostile_{unique}") as dsn:
        yield dsn


# --- reading the topics back ------------------------------------------------------------------------------


def _columns_of(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(Avro field name, PostgreSQL column) of a row record: docs/events.md's way back to the original name."""
    out = []
    for field in record["fields"]:
        assert re.fullmatch(_AVRO_NAME, field["name"]), field
        out.append((field["name"], field.get("pgcdc.column", field["name"])))
    return out


def _registered(registry: str, subject: str) -> dict[str, Any]:
    client = SchemaRegistryClient({"url": registry, "timeout": 30})
    text = client.get_latest_version(subject).schema.schema_str
    assert text is not None
    schema: dict[str, Any] = json.loads(text)
    return schema


def _topic_rows(
    kafka: str, registry: str, topic: str, table: h.Table
) -> tuple[dict[tuple[Any, ...], dict[str, Any]], list[Event]]:
    """Replay the topic as a compacting consumer would; rows keyed and named by PostgreSQL's column names."""
    key_schema = _registered(registry, f"{topic}-key")
    envelope = _registered(registry, f"{topic}-value")
    value_schema = next(f for f in envelope["fields"] if f["name"] == "before")["type"][1]
    key_cols = _columns_of(key_schema)
    row_cols = _columns_of(value_schema)
    # The names round-trip: the PostgreSQL columns, exactly and in order, and distinct Avro names.
    assert [c for _, c in row_cols] == [c.name for c in table.columns]
    assert [c for _, c in key_cols] == list(table.key)
    assert len({f for f, _ in row_cols}) == len(row_cols)
    # A key column has one field name, the same in Key as in Value (consumers join them by name).
    field_of = {c: f for f, c in row_cols}
    assert [f for f, _ in key_cols] == [field_of[k] for k in table.key]
    events = read_topic(kafka, registry, topic)
    state: dict[tuple[Any, ...], dict[str, Any]] = {}
    for ev in sorted(events, key=lambda e: (e.partition, e.offset)):
        assert ev.key is not None
        key = tuple(ev.key[f] for f, _ in key_cols)
        if ev.value is None or ev.value["op"] == "d":
            state.pop(key, None)
            continue
        assert ev.value["op"] in ("r", "c", "u"), ev.value["op"]
        assert (ev.value["source"]["schema"], ev.value["source"]["table"]) == (table.schema, table.name)
        after = ev.value["after"]
        state[key] = {col: after[field] for field, col in row_cols}
    return state, events


def _topics(config: Path, tables: list[h.Table]) -> list[str]:
    settings_ = load_settings(config)
    return [settings_.topic_for(t.schema, t.name) for t in tables]


# --- the capture property -----------------------------------------------------------------------------------

_counter = iter(range(1_000_000))

# Hand-picked examples, always run first.
_WORST = [
    h.Table(
        'we"ird sch.ema',
        "select",
        (h.Column("Order", "int"), h.Column("order", "text"), h.Column("a b", "jsonb"), h.Column("a_b", "bytea")),
        ("Order", "order"),
    ),
    h.Table(
        'we"ird sch.ema',
        "Ünïcødé 表 😀'; DROP TABLE x; --",
        (h.Column("1st %s col", "numeric(12,3)"), h.Column("é" * 31 + "x", "timestamptz"), h.Column("__op", "text")),
        ("é" * 31 + "x",),
    ),
]
_KEY_SANITISED = [  # "a b" sanitises to a_b, the other column's name: a_b_2 in Value, and so in Key
    h.Table("public2", "t", (h.Column("a_b", "text"), h.Column("a b", "int")), ("a b", "a_b")),
]
_COLLIDING = [  # "a b" and "a_b" become one topic name: the documented refusal
    h.Table("Sch", "a b", (h.Column("k", "int"),), ("k",)),
    h.Table("Sch", "a_b", (h.Column("K", "text"),), ("K",)),
]


@pytest.fixture
def captured_exactly(
    source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> Callable[[list[h.Table]], None]:
    """The capture property over a set of tables, on this test's server and services."""
    return functools.partial(
        _captured_exactly,
        source=source,
        kafka_bootstrap=kafka_bootstrap,
        registry_url=registry_url,
        unique=unique,
        tmp_path=tmp_path,
    )


@pytest.mark.parametrize(
    "tables",
    [
        pytest.param(_WORST, id="worst"),
        pytest.param(_KEY_SANITISED, id="key-sanitised"),
        pytest.param(_COLLIDING, id="colliding"),
    ],
)
def test_the_worst_names_are_captured_exactly(
    *, tables: list[h.Table], captured_exactly: Callable[[list[h.Table]], None]
) -> None:
    """The hand-picked sets, on each server of the matrix (its catalog queries differ by version)."""
    captured_exactly(tables)


@pytest.mark.one_version  # drawn names exercise the quoting, which no server version changes
@settings(
    # Drawn sets beside the hand-picked ones above; the long profile draws more (CDC_TEST_LONG=1).
    max_examples=24 if os.environ.get("CDC_TEST_LONG", "") not in ("", "0") else 6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(tables=h.table_sets())
def test_hostile_names_are_captured_exactly(
    *, tables: list[h.Table], captured_exactly: Callable[[list[h.Table]], None]
) -> None:
    captured_exactly(tables)


def _captured_exactly(
    tables: list[h.Table], *, source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    n = next(_counter)
    run = f"{unique}_{n}"
    work = tmp_path / f"ex{n}"
    work.mkdir()
    print(f"example {n}: {tables!r}")
    cfg = CdcConfig(
        dsn=source,
        kafka=kafka_bootstrap,
        registry=registry_url,
        prefix=f"h{run}",
        tables=[t.config_name for t in tables],
        slot=f"s_{run}",
        publication=f"p_{run}",
        # Chunks of two rows: the snapshot resumes after a key several times (a query of its own).
        extra="snapshot_chunk_rows = 2\nsnapshot_commit_interval_s = 0",
    )
    config = cfg.write(work / "cdc.toml")
    schemas = list(dict.fromkeys(t.schema for t in tables))
    with psycopg.connect(source, autocommit=True) as conn:
        try:
            h.create(conn, tables)
            for t in tables:
                h.insert(conn, t, range(5))
            topics = _topics(config, tables)
            if len(set(topics)) < len(topics):
                result = cdc("attach", "--config", str(config))
                assert result.returncode == 3, result
                assert "would share topic" in result.stderr, result.stderr
                assert "Traceback" not in result.stderr
                kept: dict[str, h.Table] = {}
                for t, topic in zip(tables, topics, strict=True):
                    kept.setdefault(topic, t)
                tables = list(kept.values())
                cfg.tables = [t.config_name for t in tables]
                config = cfg.write(config)
                topics = _topics(config, tables)
            result = cdc("attach", "--config", str(config))
            assert result.returncode == 0, result
            proc = cfg.start(work)
            try:
                proc.wait_streaming(180)
                for t in tables:
                    h.stream_changes(conn, t, first=5, count=2)
                for t, topic in zip(tables, topics, strict=True):
                    expected = h.source_rows(conn, t)
                    assert len(expected) == 6  # 5 + 2 inserted - 1 deleted (the key update keeps the count)
                    got: list[Any] = [None]

                    def converged(t: h.Table = t, topic: str = topic, want: Any = expected, box: Any = got) -> bool:
                        box[0] = _topic_rows(kafka_bootstrap, registry_url, topic, t)
                        return bool(box[0][0] == want)

                    wait_for(converged, 120, f"topic {topic} to equal {t.schema}.{t.name}", proc)
                    ops = [e.value["op"] if e.value else None for e in got[0][1]]
                    assert ops.count("r") == 5, ops
                    assert ops.count("d") == 2, ops  # the delete and the key update's delete of the old key
                    assert tuple(h.key_of(t, 2)) not in got[0][0]
                    assert tuple(h.key_of(t, 1000)) in got[0][0]
            finally:
                proc.stop()
                result = cdc("detach", "--config", str(config), "--yes")
                assert result.returncode == 0, result
        finally:
            for schema in schemas:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# --- every sink, once -------------------------------------------------------------------------------------


def _hostile_enough(tables: list[h.Table]) -> bool:
    """What the drawn set must hold besides the hand-picked one (find() then shrinks to a small such set)."""
    names = [t.schema for t in tables] + [t.name for t in tables] + [c.name for t in tables for c in t.columns]
    text = "".join(names)
    return (
        len(tables) >= 3
        and any(len(t.key) == 2 for t in tables)
        and len({c.type for t in tables for c in t.columns}) >= 4
        and all(ch in text for ch in ('"', "'", " ", ".", "%"))
        and any(not ch.isascii() for ch in text)
        and any(c.name.swapcase() in {d.name for d in t.columns} - {c.name} for t in tables for c in t.columns)
        and len({(re.sub(r"[^A-Za-z0-9_-]", "_", t.schema), re.sub(r"[^A-Za-z0-9_-]", "_", t.name)) for t in tables})
        == len(tables)
    )


_SINK_WORST = [
    *_WORST,
    *_KEY_SANITISED,
    # Tables whose names differ only in case: distinct topics, so the stores must keep them apart too.
    h.Table("Sch", "Mixed", (h.Column("id", "int"), h.Column("v", "text")), ("id",)),
    h.Table("Sch", "mixed", (h.Column("id", "text"), h.Column("w", "int")), ("id",)),
    # A table named like another's history table in the warehouse (history = true in the stack's config).
    h.Table("Sch", "x", (h.Column("id", "int"),), ("id",)),
    h.Table("Sch", "x__history", (h.Column("id", "text"),), ("id",)),
    # Column names OpenSearch would read as object paths or metadata, and names like the stores' own.
    h.Table(
        "Sch",
        "fields",
        (
            h.Column("k", "int"),
            h.Column("a.b", "text"),
            h.Column("a", "int"),
            h.Column(".x.", "text"),
            h.Column("_id", "text"),
            h.Column("__cdc", "int"),
            h.Column(" ", "text"),
            h.Column("%2E", "text"),
            h.Column("__op", "int"),
            h.Column("__unchanged", "text"),
        ),
        ("k",),
    ),
]


# Five minutes: in the long profile. The default suite keeps the capture's test above and the sinks' naming
# rules' unit tests (tests/unit/test_sink_names.py, test_sink_values.py).
@SPARK_WORKER
@pytest.mark.long
def test_hostile_names_through_every_sink(
    *, source: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    drawn = find(
        h.table_sets(max_tables=4),
        _hostile_enough,
        settings=settings(derandomize=True, database=None, max_examples=20_000, deadline=None, phases=[Phase.generate]),
    )
    tables = _SINK_WORST + drawn
    print(f"sink tables: {tables!r}")
    assert len({(t.schema, t.name) for t in tables}) == len(tables)
    prefix = f"h{unique}"
    cfg = stack.config(source, [t.config_name for t in tables], prefix=prefix, unique=unique, workdir=tmp_path)
    config = cfg.write(tmp_path / "cdc.toml")
    topics = _topics(config, tables)
    assert len(set(topics)) == len(topics), topics
    with psycopg.connect(source, autocommit=True) as conn:
        h.create(conn, tables)
        for t in tables:
            h.insert(conn, t, range(5))
    capture = cfg.start(tmp_path)
    sinks = InProcessSinks(spark, config, tmp_path / "sinks.log")
    try:
        capture.wait_streaming(180)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 3, 600, "the sinks' first batches", sinks)
        with psycopg.connect(source, autocommit=True) as conn:
            for t in tables:
                h.stream_changes(conn, t, first=5, count=2)
        result = cdc_here("verify", *SINKS, "--config", str(config), "--wait", "300")
        assert_verified(result, SINKS, sinks.tail())

        # Directly, as a reader of each store would: every table apart, its rows named by PostgreSQL's columns.
        cache = redis.Redis.from_url(stack.redis)
        generation = int(cache.get(f"{prefix}:current") or b"0")
        search = OpenSearch(stack.opensearch)
        with psycopg.connect(source) as conn:
            for t, topic in zip(tables, topics, strict=True):
                table = topic[len(prefix) + 1 :]
                rows = list(h.source_rows(conn, t).values())
                assert len(rows) == 6
                ints = [c.name for c in t.columns if c.type == "int"]
                keys = list(cache.scan_iter(match=f"{prefix}:g{generation}:{table}:*", count=1000))
                assert len(keys) == len(rows), (t, keys)
                for key in keys:
                    stored = json.loads(cache.hget(key, "row") or b"null")
                    assert list(stored) == [c.name for c in t.columns], stored
                    assert {c: stored[c] for c in ints} in [{c: r[c] for c in ints} for r in rows]
                alias = index_alias(prefix.lower(), table)
                search.indices.refresh(index=alias)
                assert search.count(index=alias)["count"] == len(rows), alias
                mapping = next(iter(search.indices.get_mapping(index=alias).values()))["mappings"]["properties"]
                assert {column_of(f) for f in mapping if f != "__cdc"} == {c.name for c in t.columns}
                for hit in search.search(index=alias, body={"query": {"match_all": {}}, "size": 100})["hits"]["hits"]:
                    doc = {column_of(f): v for f, v in hit["_source"].items() if f != "__cdc"}
                    assert {c: doc[c] for c in ints} in [{c: r[c] for c in ints} for r in rows]
                assert (tmp_path / "warehouse" / "current" / table / "_delta_log").is_dir()
        assert sinks.alive(), sinks.tail()
        assert sinks.stop() == 0, sinks.tail()
    finally:
        if sinks.alive():
            sinks.kill()
        capture.stop()
        cdc("detach", "--config", str(config), "--yes")
