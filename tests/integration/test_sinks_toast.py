"""Partial updates (unchanged TOAST values) keep the large value in every store: within one micro-batch
(the runtime fills it from the batch's earlier event) and across batches (the store keeps what it holds)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from tests.integration._capture_helpers import read_topic, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, assert_verified, captured, cdc_here

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), SPARK_WORKER]

# 20 kB that pglz cannot shrink below the TOAST threshold: stored out of line, so an UPDATE that leaves it
# alone does not send it.
BIG = "SELECT string_agg(md5(g::text || %s), '') FROM generate_series(1, 640) g"


def test_unchanged_toast_values_survive_in_every_store(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="toast",
        setup=["CREATE TABLE docs (id int PRIMARY KEY, body text, qty int)"],
        tables=["docs"],
        sinks=lambda config, log: InProcessSinks(spark, config, log),
    ) as run:
        dsn, config, sinks, topic = run.dsn, run.config, run.sinks, run.topic("docs")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in (1, 2):  # inserted, then updated without touching body: both in the sinks' first batch
                conn.execute(f"INSERT INTO docs VALUES (%s, ({BIG}), 0)", (i, f"seed{i}"))
                conn.execute("UPDATE docs SET qty = 1 WHERE id = %s", (i,))
        wait_for(lambda: len(read_topic(stack.kafka, stack.registry, topic)) >= 4, 120, "the events", None)
        partial = [e for e in read_topic(stack.kafka, stack.registry, topic) if e.value and e.value["op"] == "u"]
        assert partial, "no update events"
        assert all(e.value is not None and e.value["unchanged_toast"] == ["body"] for e in partial)
        sinks.start()
        result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
        assert_verified(result, ("search", "cache", "warehouse"), f"(one batch)\n{sinks.tail()}")
        with psycopg.connect(dsn, autocommit=True) as conn:  # now a partial update in a batch of its own
            conn.execute("UPDATE docs SET qty = 2 WHERE id = 1")
        result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
        assert_verified(result, ("search", "cache", "warehouse"), "(later batch)")
        assert sinks.stop() == 0, sinks.tail()
