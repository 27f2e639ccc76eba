"""The snapshot's C loops against the real services: CopyReader (a COPY read through psycopg's libpq) gives what
psycopg's Copy gives and fails as psycopg would; DirectProducer (a chunk produced on confluent_kafka's librdkafka
handle) writes the same records, to the same partitions, in the same transaction, as Producer.produce().
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg import sql

from cdc._kafka import Topics, TransactionalProducer
from cdc._snapshot import _copy_reader, _LibpqCopies
from tests.integration._capture_helpers import scratch_database

pytestmark = pytest.mark.integration

PURE_PYTHON = os.environ.get("CDC_PURE_PYTHON", "") not in ("", "0")


@pytest.fixture
def reader() -> Any:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: the snapshot reads through psycopg's Copy")
    found = _copy_reader()
    assert found is not None, "cdc._native is built but CopyReader was not set up (see the capture's log line)"
    return found


def test_libpq_copies_give_what_psycopg_copy_gives(reader: Any, pg_dsn: str, unique: str) -> None:
    with scratch_database(pg_dsn, f"copy_{unique}") as dsn, psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, body text, n numeric)")
        conn.execute("INSERT INTO t SELECT g, repeat('x', g % 300), g / 7.0 FROM generate_series(1, 20000) g")
        query = sql.SQL("COPY (SELECT * FROM t ORDER BY id) TO STDOUT (FORMAT binary)")
        expected = bytearray()
        with conn.cursor() as cur, cur.copy(query) as copy:
            for block in copy:
                expected += block
        nonblocking = conn.pgconn.nonblocking
        copies = _LibpqCopies(reader, conn)
        copies.send(query)
        data = copies.receive()
        assert data == bytes(expected)
        assert len(data) > 1_000_000  # several of libpq's reads, and a buffer grown more than once
        # psycopg's connection is as it was: same mode, idle in the same transaction, usable.
        assert conn.pgconn.nonblocking == nonblocking
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (20000,)
        # A COPY sent ahead and then abandoned (the snapshot failed meanwhile) leaves the connection usable too.
        copies.send(query)
        copies.abandon()
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (20000,)


def test_libpq_copies_fail_as_psycopg_would(reader: Any, pg_dsn: str, unique: str) -> None:
    with scratch_database(pg_dsn, f"copyerr_{unique}") as dsn, psycopg.connect(dsn) as conn:
        copies = _LibpqCopies(reader, conn)
        copies.send(sql.SQL("COPY (SELECT * FROM missing) TO STDOUT (FORMAT binary)"))
        with pytest.raises(psycopg.errors.UndefinedTable, match='relation "missing" does not exist'):
            copies.receive()
        # A failure during the COPY (not before it): division by zero on the second row.
        conn.rollback()
        conn.execute("SELECT 1")  # in a transaction again, as the snapshot's reader always is
        copies.send(sql.SQL("COPY (SELECT 1 / (2 - g) FROM generate_series(1, 3) g) TO STDOUT (FORMAT binary)"))
        with pytest.raises(psycopg.errors.DivisionByZero):
            copies.receive()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        assert conn.execute("SELECT 1").fetchone() == (1,)


def _records(kafka: str, topic: str, partitions: int) -> list[tuple[int, bytes | None, bytes | None]]:
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{topic}", "isolation.level": "read_committed"})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        found: list[tuple[int, bytes | None, bytes | None]] = []
        idle = 0
        while idle < 5:
            msg = consumer.poll(1.0)
            if msg is None:
                idle += 1
                continue
            assert msg.error() is None, msg.error()
            partition = msg.partition()
            assert partition is not None
            found.append((partition, msg.key(), msg.value()))
        return sorted(found)
    finally:
        consumer.close()


def test_direct_producer_writes_what_produce_writes(kafka_bootstrap: str, unique: str) -> None:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: snapshot events go through produce()")
    conf = {"bootstrap.servers": kafka_bootstrap}
    topics = Topics(conf, partitions=3, replication_factor=1)
    direct, plain = f"direct{unique}", f"plain{unique}"
    for topic in (direct, plain):
        topics.ensure(topic)
    keys = [f"key-{i}".encode() for i in range(30000)]
    records = [bytes([i % 256]) * (i % 700) for i in range(30000)]
    producer = TransactionalProducer(conf, f"native-io-{unique}")
    try:
        assert producer._direct is not None, "cdc._native is built but DirectProducer was not set up"
        producer.begin()
        producer.produce_framed(direct, keys, records, b"<prefix>", b"<suffix>")
        fallback, producer._direct = producer._direct, None
        producer.produce_framed(plain, keys, records, b"<prefix>", b"<suffix>")
        producer._direct = fallback
        producer.commit()
        # An aborted transaction's events from C are not seen either.
        producer.begin()
        producer.produce_framed(direct, [b"aborted"], [b"x"], b"", b"")
        producer.abort()
    finally:
        producer.close()
    written = _records(kafka_bootstrap, direct, 3)
    assert written == _records(kafka_bootstrap, plain, 3)
    assert len(written) == 30000
    assert {p for p, _, _ in written} == {0, 1, 2}  # the partitioner ran per key
    assert sorted((k, v) for _, k, v in written) == sorted(
        (k, b"<prefix>" + r + b"<suffix>") for k, r in zip(keys, records, strict=True)
    )
