"""What the parts under the sinks do on their own, on the same topic in the same run: the sinks' limits.

- read + decode: confluent-kafka and fastavro on one Python thread, every record of the topic from offset
  zero (keys and values, Confluent wire format), no Spark;
- each store's native load of the same changes, from one Python thread with the store's plain client and
  nothing else: Redis pipelined HSET/DEL, OpenSearch ``helpers.bulk`` into an index with refresh off and no
  replicas, a plain Spark Delta append of the rows, PostgreSQL's COPY of the rows (the sql sink's target);
- a plain copy of the source (COPY) and a plain scan of each store: what a rebuild's verify costs at least.

Every rate is in records of the topic per second, tombstones included (a sink reads them too), so a sink's
replay compares with them directly.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from opensearchpy import OpenSearch, helpers
from psycopg import sql


@dataclass
class Changes:
    """The topic read and decoded: per record its key string and its row (None: a delete or a tombstone)."""

    records: int = 0
    seconds: float = 0.0
    keys: list[str] = field(default_factory=list)
    rows: list[dict[str, Any] | None] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds


class _Schemas:
    """Parsed writer schemas by id, fetched once from the registry."""

    def __init__(self, url: str) -> None:
        self.client = SchemaRegistryClient({"url": url, "timeout": 30})
        self.parsed: dict[int, Any] = {}

    def decode(self, data: bytes) -> Any:
        magic, schema_id = struct.unpack(">bI", data[:5])
        if magic != 0:
            raise ValueError(f"not Confluent wire format (magic byte {magic})")
        schema = self.parsed.get(schema_id)
        if schema is None:
            text = self.client.get_schema(schema_id).schema_str
            schema = self.parsed[schema_id] = fastavro.parse_schema(json.loads(text or "null"))
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), schema, None)


def read_and_decode(kafka: str, registry: str, topic: str, partitions: int = 1) -> Changes:
    """Every record of ``topic`` from offset zero, decoded; timed from the first record to the last."""
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"pgcdc-bench-{time.time_ns()}",
            "enable.auto.commit": False,
            # the end: a transactional topic's last offset is a commit marker, never delivered
            "enable.partition.eof": True,
        }
    )
    schemas = _Schemas(registry)
    out = Changes()
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        left = {p for p, end in ends.items() if end > 0}
        started: float | None = None  # from the first record: the group's join and first fetch are not decode
        while left:
            for msg in consumer.consume(10_000, timeout=5):
                started = started or time.monotonic()
                if (error := msg.error()) is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        left.discard(msg.partition())
                    continue
                key = schemas.decode(msg.key() or b"")
                data = msg.value()
                value = schemas.decode(data) if data is not None else None
                out.keys.append("[" + ",".join(str(v) for v in key.values()) + "]")
                op = value["op"] if value else "tombstone"
                out.ops[op] = out.ops.get(op, 0) + 1
                out.rows.append(value["after"] if value else None)
                out.records += 1
        out.seconds = time.monotonic() - (started or time.monotonic())
    finally:
        consumer.close()
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    return value


def redis_native(url: str, prefix: str, changes: Changes, batch: int = 1000) -> float:
    """Seconds for Redis to take every change (HSET of the row's fields, DEL of a delete), pipelined."""
    commands: list[tuple[str, dict[Any, Any] | None]] = []
    for key, row in zip(changes.keys, changes.rows, strict=True):
        fields: dict[Any, Any] | None = None
        if row is not None:
            fields = {k: str(_plain(v)) for k, v in row.items() if v is not None}
        commands.append((f"{prefix}:{key}", fields))
    client = redis.Redis.from_url(url)
    try:
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for i, (key, fields) in enumerate(commands, 1):
            if fields is None:
                pipe.delete(key)
            else:
                pipe.hset(key, mapping=fields)
            if i % batch == 0:
                pipe.execute()
        pipe.execute()
        return time.monotonic() - started
    finally:
        for keys in chunks(client.scan_iter(match=f"{prefix}:*", count=5000), 5000):
            client.unlink(*keys)
        client.close()


def opensearch_native(url: str, index: str, changes: Changes) -> float:
    """Seconds for OpenSearch to take every change with ``helpers.bulk``, refresh off, no replicas."""

    def actions() -> Iterator[dict[str, Any]]:
        for key, row in zip(changes.keys, changes.rows, strict=True):
            if row is None:
                yield {"_op_type": "delete", "_index": index, "_id": key}
            else:
                yield {"_index": index, "_id": key, "_source": {k: _plain(v) for k, v in row.items()}}

    prepared = list(actions())
    client = OpenSearch(url, timeout=120)
    client.indices.create(index=index, body={"settings": {"refresh_interval": "-1", "number_of_replicas": 0}})
    try:
        started = time.monotonic()
        helpers.bulk(client, prepared, chunk_size=1000, raise_on_error=False, stats_only=True)
        return time.monotonic() - started
    finally:
        client.indices.delete(index=index)


def delta_append(spark: Any, changes: Changes) -> float:
    """Seconds for a plain Spark Delta append of the topic's rows (inserts and updates) into a new table."""
    rows = [r for r in changes.rows if r]  # pyarrow types them: decimal128, timestamp[us, tz=UTC], string
    with tempfile.TemporaryDirectory(prefix="pgcdc-bench-delta-") as tmp:
        source = Path(tmp, "rows.parquet")
        pq.write_table(pa.Table.from_pylist(rows), source)
        frame = spark.read.parquet(str(source))
        started = time.monotonic()
        frame.write.format("delta").mode("append").save(str(Path(tmp, "table")))
        return time.monotonic() - started


_PG_TYPES = {bool: "boolean", int: "bigint", float: "double precision", str: "text", Decimal: "numeric",
             datetime: "timestamptz", date: "date", bytes: "bytea", dict: "jsonb", list: "jsonb"}  # fmt: skip


def postgres_copy(dsn: str, changes: Changes) -> float:
    """Seconds for PostgreSQL to take the topic's rows (inserts and updates) by COPY into a new table with a
    column per field, typed from the values: the database's own bulk load, no upsert."""
    rows = [r for r in changes.rows if r]
    columns = {k: _PG_TYPES.get(type(v), "text") for r in rows[:1000] for k, v in r.items() if v is not None}
    names = sorted(columns)
    plain = [tuple(json.dumps(r.get(n)) if columns[n] == "jsonb" and r.get(n) is not None else r.get(n)
                   for n in names) for r in rows]  # fmt: skip
    table = sql.Identifier("pgcdc_native_load")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} ({})").format(
                table, sql.SQL(", ").join(sql.SQL("{} " + columns[n]).format(sql.Identifier(n)) for n in names)
            )
        )
        try:
            started = time.monotonic()
            with conn.cursor() as cur, cur.copy(sql.SQL("COPY {} FROM STDIN").format(table)) as copy:
                for row in plain:
                    copy.write_row(row)
            return time.monotonic() - started
        finally:
            conn.execute(sql.SQL("DROP TABLE {}").format(table))


def copy_source(dsn: str, table: str) -> float:
    """Seconds to COPY the source table out: the least a verify pays on the PostgreSQL side."""
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        started = time.monotonic()
        with cur.copy(sql.SQL("COPY {} TO STDOUT").format(sql.Identifier(table))) as copy:
            for _ in copy:
                pass
        return time.monotonic() - started


def scan_cache(url: str, match: str) -> float:
    """Seconds to read every hash matching ``match`` (SCAN + pipelined HGETALL)."""
    client = redis.Redis.from_url(url)
    try:
        started = time.monotonic()
        for keys in chunks(client.scan_iter(match=match, count=5000), 5000):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            pipe.execute()
        return time.monotonic() - started
    finally:
        client.close()


def scan_search(url: str, index: str) -> float:
    """Seconds to read every document of ``index`` (``helpers.scan``)."""
    client = OpenSearch(url, timeout=120)
    started = time.monotonic()
    for _ in helpers.scan(client, index=index, size=5000):
        pass
    return time.monotonic() - started


def scan_warehouse(spark: Any, path: str) -> float:
    """Seconds for Spark to read every row of a Delta table (the ``noop`` sink forces the whole scan)."""
    started = time.monotonic()
    spark.read.format("delta").load(path).write.format("noop").mode("overwrite").save()
    return time.monotonic() - started


def chunks(items: Any, size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
