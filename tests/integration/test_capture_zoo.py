"""The type zoo through the whole capture: every edge value, snapshot (binary COPY) and stream (pgoutput), binary
and text mode, read back from Kafka exactly as PostgreSQL holds it."""

from __future__ import annotations

import contextlib
import io
import json
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from psycopg import sql

from schemas import AvroMapping, avro_mapping
from tests.integration._capture_helpers import CdcConfig, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER
from tests.integration.test_types_zoo import Zoo, load_pgtype
from tests.integration.test_types_zoo import zoo as zoo  # noqa: PLC0414 - the fixture, re-exported for pytest
from tests.unit.test_types import same, strip_logical

pytestmark = [pytest.mark.pg_matrix, SPARK_WORKER]  # on PostgreSQL 18 too; the zoo's tests share a worker

Types = Sequence[tuple[str, list[tuple[str, Any]]]]  # (column type, [(SQL expression, expected value)…]), as ZOO


def _raw_afters(kafka: str, registry: str, topic: str) -> dict[int, dict[str, Any]]:
    """Each key's last ``after``, decoded without logical types (the exact Avro values)."""
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"zoo-{time.monotonic_ns()}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    schemas: dict[int, Any] = {}
    out: dict[int, dict[str, Any]] = {}
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        while True:
            msg = consumer.poll(10)
            assert msg is not None, "timed out reading the zoo topic"
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err
                return out
            raw = msg.value()
            assert raw is not None
            schema_id = int.from_bytes(raw[1:5], "big")
            if schema_id not in schemas:
                with urllib.request.urlopen(f"{registry}/schemas/ids/{schema_id}") as resp:  # noqa: S310
                    schemas[schema_id] = fastavro.parse_schema(strip_logical(json.loads(json.load(resp)["schema"])))
            value = fastavro.schemaless_reader(io.BytesIO(raw[5:]), schemas[schema_id], None)
            assert isinstance(value, dict)
            out[value["after"]["id"]] = value["after"]
    finally:
        consumer.close()


@pytest.fixture
def zoo_table(zoo: Zoo, unique: str) -> Iterator[tuple[str, int]]:
    with types_table(zoo, f"capture_zoo_{unique}", zoo.types) as table:
        yield table


@contextlib.contextmanager
def types_table(zoo: Zoo, table: str, types: Types) -> Iterator[tuple[str, int]]:
    """A table of an id and one column ``c<i>`` per entry of ``types``; yields its name and how many rows hold
    every case (see insert_rows)."""
    columns = ", ".join(f"c{i} {zoo.column_type(t)}" for i, (t, _) in enumerate(types))
    ident = sql.Identifier(zoo.schema, table)
    zoo.conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, {})").format(ident, sql.SQL(columns)))
    try:
        yield table, max(len(cases) for _, cases in types)
    finally:
        zoo.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))


def insert_rows(zoo: Zoo, table: str, first_id: int, rows: int, types: Types | None = None) -> None:
    """Rows ``first_id``… of a table of ``types`` (the zoo's): row j holds each type's j-th case (NULL past its
    last)."""
    types = zoo.types if types is None else types
    for j in range(rows):
        values = ", ".join(zoo.column_type(cases[j][0]) if j < len(cases) else "NULL" for _, cases in types)
        zoo.conn.execute(
            sql.SQL("INSERT INTO {} VALUES ({}, {})").format(
                sql.Identifier(zoo.schema, table), sql.Literal(first_id + j), sql.SQL(values)
            )
        )


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "text"])
def test_every_zoo_value_arrives_exactly(
    *,
    zoo: Zoo,
    zoo_table: tuple[str, int],
    pg_dsn: str,
    kafka_bootstrap: str,
    registry_url: str,
    unique: str,
    tmp_path: Path,
    binary: bool,
) -> None:
    table, rows = zoo_table
    insert_rows(zoo, table, 1, rows)  # read by the snapshot
    prefix = f"z{unique}"
    cfg = CdcConfig(
        pg_dsn,
        kafka_bootstrap,
        registry_url,
        prefix,
        [f"{zoo.schema}.{table}"],
        f"z_{unique}",
        f"z_{unique}",
        extra=f"binary = {'true' if binary else 'false'}",
    )
    proc = cfg.start(tmp_path)
    topic = f"{prefix}.{zoo.schema}.{table}"
    try:
        proc.wait_streaming()
        insert_rows(zoo, table, 1001, rows)  # read from the stream
        wait_for(lambda: len(_raw_afters(kafka_bootstrap, registry_url, topic)) >= 2 * rows, 120, "the rows", proc)
    finally:
        proc.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (f"z_{unique}",))
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(f"z_{unique}")))
    afters = _raw_afters(kafka_bootstrap, registry_url, topic)
    columns = source_columns(zoo, table)
    mismatches = []
    for i, column in enumerate(columns):
        for row_id, expected in column.values().items():
            got = afters[row_id][f"c{i}"]
            if not same(got, expected):
                path = "snapshot" if row_id < 1000 else "stream"
                mismatches.append(f"{path} row {row_id} {column.column_type}: got {got!r}, expected {expected!r}")
    assert len(afters) == len(columns[0].texts)
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:20])


@dataclass
class SourceColumn:
    """Column ``c<i>`` of a zoo table as PostgreSQL holds it."""

    column_type: str  # as ZOO spells it
    mapping: AvroMapping
    texts: dict[int, bytes | None]  # row id -> the server's text output; None only for SQL NULL

    def values(self) -> dict[int, Any]:
        """Row id -> the exact Avro value: the mapping applied to the server's text output (test_types_zoo
        proves that equals the hand-written expectation for every case)."""
        return {i: None if t is None else self.mapping.from_text(t) for i, t in self.texts.items()}


def source_columns(zoo: Zoo, table: str, types: Types | None = None) -> list[SourceColumn]:
    """Every column of ``table`` (a table of ``types``, the zoo's by default), in their order."""
    types = zoo.types if types is None else types
    ident = sql.Identifier(zoo.schema, table)
    attributes = zoo.conn.execute(
        "SELECT atttypid, atttypmod FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 1 ORDER BY attnum",
        (ident.as_string(zoo.conn),),
    ).fetchall()
    ids = [r[0] for r in zoo.conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(ident)).fetchall()]
    columns = []
    for i, ((column_type, _), (oid, typmod)) in enumerate(zip(types, attributes, strict=True)):
        # Raw text-format values (a composite of NULLs "IS NULL" too, yet is a value, not SQL NULL).
        cur = zoo.conn.cursor(binary=False)
        cur.execute(sql.SQL("SELECT {} FROM {} ORDER BY id").format(sql.Identifier(f"c{i}"), ident))
        result = cur.pgresult
        assert result is not None
        texts = [result.get_value(r, 0) for r in range(result.ntuples)]
        mapping = avro_mapping(load_pgtype(zoo.conn, oid), typmod)
        by_id = {row_id: None if t is None else bytes(t) for row_id, t in zip(ids, texts, strict=True)}
        columns.append(SourceColumn(column_type, mapping, by_id))
    return columns
