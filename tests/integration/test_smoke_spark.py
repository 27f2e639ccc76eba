"""Spark: Structured Streaming reads a Kafka topic through Spark's Kafka source; Delta writes and reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from tests.integration._sinks_helpers import SPARK_WORKER

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


pytestmark = SPARK_WORKER


def test_structured_streaming_reads_a_kafka_topic(
    spark: SparkSession, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    topic = f"smoke.spark.{unique}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(timeout=30)
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in range(25):
            producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode())
        assert producer.flush(30) == 0

        stream = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", kafka_bootstrap)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .load()
            .selectExpr("CAST(key AS STRING) AS k", "CAST(value AS STRING) AS v", "partition", "offset")
        )
        name = f"smoke_{unique}"
        query = (
            stream.writeStream.format("memory")
            .queryName(name)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None
        rows = {(r.k, r.v) for r in spark.sql(f"SELECT k, v FROM {name}").collect()}
        assert rows == {(f"k{i}", f"v{i}") for i in range(25)}
    finally:
        admin.delete_topics([topic])[topic].result(timeout=30)


def test_delta_table_write_merge_read(spark: SparkSession, tmp_path: Path) -> None:
    from delta.tables import DeltaTable

    path = str(tmp_path / "table")
    spark.createDataFrame([(1, "a", 10), (2, "b", 10)], "id INT, note STRING, lsn LONG").write.format("delta").save(
        path
    )
    updates = spark.createDataFrame([(1, "stale", 5), (2, "new", 20), (3, "c", 20)], "id INT, note STRING, lsn LONG")
    # The shape every warehouse write takes: apply only what is newer than what the table holds.
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(updates.alias("u"), "t.id = u.id")
        .whenMatchedUpdateAll(condition="u.lsn > t.lsn")
        .whenNotMatchedInsertAll()
        .execute()
    )
    rows = sorted(tuple(r) for r in spark.read.format("delta").load(path).collect())
    assert rows == [(1, "a", 10), (2, "new", 20), (3, "c", 20)]
    assert DeltaTable.forPath(spark, path).history().count() == 2


def test_the_sinks_borrow_a_running_session_and_leave_it_running(spark: SparkSession) -> None:
    """What every in-process sink test and an embedding application rely on: build_session finds the running
    session, and stop_session on it (as the sinks, verify and rebuild each call on their way out) leaves it
    running for whoever started it, however many borrowers came and went."""
    from sinks.app import build_session, stop_session

    first = build_session("pgcdc-borrower", [], master="local[1]")
    second = build_session("pgcdc-borrower", [], master="local[1]")
    assert first.sparkContext is spark.sparkContext
    assert second.sparkContext is spark.sparkContext
    stop_session(second)
    stop_session(first)
    assert spark.range(5).count() == 5, "the session stopped under its owner"
