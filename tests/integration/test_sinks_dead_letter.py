"""Poison events and store rejections go to the dead-letter topic with the reason; the query keeps going."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import redis
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from opensearchpy import OpenSearch

from tests.integration._capture_helpers import wait_for
from tests.integration._observe_helpers import api_status, free_port, metric, scrape
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, cached_row, captured, dead_letters

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, SPARK_WORKER]


def test_poison_and_rejected_changes_reach_the_dead_letter_topic(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, sinks_port = free_port(), free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="dlq",
        # OpenSearch refuses ids over 512 bytes: the third row is rejected by the search index only.
        setup=[
            "CREATE TABLE t (k text PRIMARY KEY, v int)",
            "INSERT INTO t VALUES ('a', 1), ('b', 2), (repeat('x', 600), 3)",
        ],
        tables=["t"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["search", "cache"]),
    ) as run:
        dsn, prefix, sinks, capture, topic = run.dsn, run.prefix, run.sinks, run.capture, run.topic("t")
        producer = Producer({"bootstrap.servers": stack.kafka})
        producer.produce(topic, key=b"not avro", value=b"\x00\x00\x00\x00\x07garbage")  # a record nobody can read
        producer.flush(30)
        sinks.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = 20 WHERE k = 'b'")
        cache = redis.Redis.from_url(stack.redis)

        applied = lambda: (cached_row(cache, prefix, '["b"]') or {}).get("v") == 20  # noqa: E731
        wait_for(applied, 300, "the update after the poison record to reach the cache", None)
        dead_topic = f"{prefix}.dead-letter"
        wait_for(
            lambda: (
                sum("Avro" in d.get("pgcdc.error", "") for d in dead_letters(stack.kafka, dead_topic)) >= 2
                and any(
                    d.get("pgcdc.sink") == "search" and "OpenSearch" in d["pgcdc.error"]
                    for d in dead_letters(stack.kafka, dead_topic)
                )
            ),
            240,
            "the dead letters",
            None,
        )
        letters = dead_letters(stack.kafka, dead_topic)
        poison = [d for d in letters if "not Confluent-framed" in d["pgcdc.error"]]
        assert {d["pgcdc.sink"] for d in poison} == {"search", "cache"}  # each sink reports what it skipped
        assert all(d["pgcdc.topic"] == topic and d["pgcdc.offset"].isdigit() for d in poison)
        assert all("garbage" in d["value"] for d in poison)  # the original bytes, untouched
        rejected = [d for d in letters if d["pgcdc.sink"] == "search" and "OpenSearch" in d["pgcdc.error"]]
        assert len(rejected) == 1
        search = OpenSearch(stack.opensearch)
        search.indices.refresh(index=f"{prefix}-public.t")
        assert search.count(index=f"{prefix}-public.t")["count"] == 2  # a and b; the long key is dead-lettered
        # The batch records its dead letters in its status once it has written them.
        status_file = tmp_path / "state" / "search" / "status.json"
        wait_for(lambda: json.loads(status_file.read_text()).get("dead_letters", 0) >= 2, 60, "the status file", None)
        # Counted in the sinks app's metrics, and in the capture's view of the sinks (for the alert rule).
        inside = scrape(sinks_port)
        assert (metric(inside, "pgcdc_sink_dead_letters_total", sink="search") or 0) >= 2
        assert (metric(inside, "pgcdc_sink_dead_letters_total", sink="cache") or 0) >= 1
        # Where the batches' time went, per phase: Spark's (the app reads its queries' last progress once a
        # second) and pgcdc's own.
        wait_for(
            lambda: all(
                (metric(scrape(sinks_port), "pgcdc_sink_batch_phase_seconds_count", sink="cache", phase=p) or 0) >= 1
                for p in ("addBatch", "walCommit", "pgcdc_plan", "pgcdc_write")
            ),
            60,
            "the cache's batch phases in the metrics",
            None,
        )
        wait_for(
            lambda: (metric(scrape(port), "pgcdc_sink_dead_letters", sink="search") or 0) >= 2,
            30,
            "the capture to report the dead letters",
            capture,
        )
        assert sinks.stop() == 0, sinks.tail()


def test_an_unreachable_store_does_not_stop_the_other_sinks(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, sinks_port = free_port(), free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    # The search index points at a port nothing listens on: that sink retries with backoff, the cache runs.
    down = Stack(stack.kafka, stack.registry, "http://127.0.0.1:9", stack.redis, stack.spark_jars)
    with captured(
        down,
        pg_dsn,
        unique,
        tmp_path,
        name="unreach",
        setup=["CREATE TABLE t (k int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 1)"],
        tables=["t"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["search", "cache"]),
    ) as run:
        dsn, prefix, sinks, capture = run.dsn, run.prefix, run.sinks, run.capture
        sinks.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = 2 WHERE k = 1")
        cache = redis.Redis.from_url(stack.redis)

        applied = lambda: (cached_row(cache, prefix, "[1]") or {}).get("v") == 2  # noqa: E731
        wait_for(applied, 300, "the cache to apply the update while the search index is down", sinks)
        assert "sink search could not start" in sinks.tail(400)
        # What an operator sees: the sink in backoff with its error, the other one running (its query may still
        # be starting: the update was applied before Spark was up, by its bridge).
        cache_running = lambda: metric(scrape(sinks_port), "pgcdc_sink_running", sink="cache") == 1  # noqa: E731
        wait_for(cache_running, 120, "the cache's query to run", sinks)
        assert metric(scrape(sinks_port), "pgcdc_sink_running", sink="search") == 0

        def backoff_shown() -> bool:
            status = api_status(port)
            states = {s["name"]: s["state"] for s in status["sinks"]}
            errors = [e for e in status["errors"] if e["source"] == "sink search"]
            return states.get("search") == "backoff" and states.get("cache") == "running" and bool(errors)

        wait_for(backoff_shown, 60, "the dashboard to show the search sink in backoff", capture)
        assert sinks.alive()
        assert sinks.stop() == 0, sinks.tail()


def test_the_capture_s_own_topics_are_not_read_even_when_named_like_change_topics(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    prefix = f"own{unique}"
    offsets, signals = f"{prefix}.offsets.run1", f"{prefix}.signals.run1"  # both fit <prefix>.<schema>.<table>
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="own",
        setup=[
            "CREATE TABLE t (k int PRIMARY KEY, v text)",
            "INSERT INTO t SELECT g, 'v' FROM generate_series(1, 5) g",
        ],
        tables=["t"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["cache"]),
        kafka_extra=f'offsets_topic = "{offsets}"\nsignal_topic = "{signals}"',
    ) as run:
        dsn, sinks = run.dsn, run.sinks
        sinks.start()
        cache = redis.Redis.from_url(stack.redis)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for v in range(3):  # each transaction commits an offsets record too
                conn.execute("UPDATE t SET v = %s WHERE k = 1", (str(v),))
        wait_for(
            lambda: (cached_row(cache, prefix, "[1]") or {}).get("v") == "2",
            300,
            "the last update to reach the cache",
            None,
        )
        admin = AdminClient({"bootstrap.servers": stack.kafka})
        topics = admin.list_topics(timeout=30).topics
        assert offsets in topics, sorted(topics)  # there to be read, had the sinks taken it
        status_file = tmp_path / "state" / "cache" / "status.json"
        # Its figures are written just after the batch: the batch that applied the last update counted them.
        wait_for(lambda: json.loads(status_file.read_text()).get("records", 0) >= 8, 60, "the status", None)
        status = json.loads(status_file.read_text())
        assert status["dead_letters"] == 0, status
        letters = dead_letters(stack.kafka, f"{prefix}.dead-letter")
        assert not letters, letters
