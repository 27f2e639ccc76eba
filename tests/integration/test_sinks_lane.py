"""Search's and cache's lane (sinks._lane) applies changes as they arrive; the micro-batches apply the rest.

After the sinks' first batch, changes reach both stores through the lane (its metric counts them). A poison
record in the middle of the stream stops the lane: the query's batch writes exactly one dead letter for it
per sink, the changes after it still arrive, and the stores verify clean against PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import redis
from confluent_kafka import Producer
from opensearchpy import OpenSearch

from tests.integration._capture_helpers import wait_for
from tests.integration._observe_helpers import free_port, metric, scrape
from tests.integration._sinks_helpers import (
    SPARK_WORKER,
    InProcessSinks,
    Stack,
    assert_verified,
    cached_row,
    captured,
    cdc_here,
    dead_letters,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, SPARK_WORKER]


def _lane_records(port: int, sink: str) -> float:
    return metric(scrape(port), "pgcdc_sink_lane_records_total", sink=sink) or 0


def test_the_lane_applies_changes_and_leaves_a_poison_record_to_the_batches(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sinks_port = free_port()
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="lane",
        setup=["CREATE TABLE t (k int PRIMARY KEY, v int)", "INSERT INTO t SELECT g, 0 FROM generate_series(1, 10) g"],
        tables=["t"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["search", "cache"]),
    ) as run:
        dsn, config, prefix, sinks, topic = run.dsn, run.config, run.prefix, run.sinks, run.topic("t")
        cache = redis.Redis.from_url(stack.redis)
        search = OpenSearch(stack.opensearch)

        def cached(k: int, v: int) -> bool:
            return (cached_row(cache, prefix, f"[{k}]") or {}).get("v") == v

        def indexed(k: int, v: int) -> bool:
            found = search.get(index=f"{prefix}-public.t", id=f"[{k}]", ignore=[404])
            return bool(found.get("found")) and found["_source"]["v"] == v

        sinks.start()
        # The stores may hold the snapshot before Spark is up (sinks._bridge): the lanes run once each query has
        # committed its first batch.
        first = lambda: cached(10, 0) and indexed(10, 0) and sinks.batches() >= 2  # noqa: E731
        wait_for(first, 300, "the first batch in both stores", sinks)
        # Changes after the first batch: the lane applies them as they arrive.
        with psycopg.connect(dsn, autocommit=True) as conn:
            for k in range(1, 6):
                conn.execute("UPDATE t SET v = 1 WHERE k = %s", (k,))
        wait_for(lambda: all(cached(k, 1) and indexed(k, 1) for k in range(1, 6)), 120, "the updates", sinks)
        wait_for(
            lambda: _lane_records(sinks_port, "cache") >= 1 and _lane_records(sinks_port, "search") >= 1,
            60,
            "the lanes to count what they applied",
            sinks,
        )
        # A record nobody can read, then more changes: the batch writes its dead letter, once per sink.
        producer = Producer({"bootstrap.servers": stack.kafka})
        producer.produce(topic, key=b"not avro", value=b"\x00\x00\x00\x00\x07garbage")
        producer.flush(30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = 2 WHERE k = 7")
            conn.execute("DELETE FROM t WHERE k = 8")
        wait_for(lambda: cached(7, 2) and indexed(7, 2), 120, "the changes after the poison record", sinks)
        dead_topic = f"{prefix}.dead-letter"

        def poison() -> list[str]:
            return [d["pgcdc.sink"] for d in dead_letters(stack.kafka, dead_topic) if "garbage" in d["value"]]

        wait_for(lambda: sorted(poison()) == ["cache", "search"], 120, "a dead letter per sink", sinks)
        result = cdc_here("verify", "search", "cache", "--config", str(config), "--wait", "120")
        assert_verified(result, ("search", "cache"), sinks.tail())
        assert sorted(poison()) == ["cache", "search"], "a dead letter written twice"
        assert cache.hget(f"{prefix}:g1:public.t:[8]", "row") is None
        assert sinks.stop() == 0, sinks.tail()
