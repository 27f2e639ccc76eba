"""Small batches in every store: partial updates (unchanged TOAST values) keep the large value within one
micro-batch (the runtime fills it from the batch's earlier event) and across batches (the store keeps what it
holds); a column added and a truncate follow. The warehouse writes such batches with delta-rs on the driver
(sinks._warehouse_live), and a date beyond year 9999 sends its batch to Spark's path; each Delta commit says
which wrote it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl
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


def test_small_batches_keep_unchanged_toast_added_columns_and_truncates_in_every_store(
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
        # The warehouse's bridge merged these events before Spark was up (sinks._bridge) and left its history to
        # the first batch, which read them again: each event is in the history once.
        bridged = re.search(r"sink warehouse: applied \d+ record\(s\) before its query started", sinks.log.read_text())
        assert bridged, sinks.tail()
        history = tmp_path / "warehouse" / "current" / "public.docs.history"
        wait_for(lambda: _history_ops(history) is not None, 120, "the history's first commit", sinks)
        wait_for(lambda: len(_history_ops(history) or []) >= 4, 120, "the first batch's history", sinks)
        assert _history_ops(history) == ["c", "c", "u", "u"]
        with psycopg.connect(dsn, autocommit=True) as conn:  # now a partial update in a batch of its own
            conn.execute("UPDATE docs SET qty = 2 WHERE id = 1")
        result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
        assert_verified(result, ("search", "cache", "warehouse"), "(later batch)")
        for statements in (
            ["ALTER TABLE docs ADD COLUMN due date", "INSERT INTO docs VALUES (3, 'short', 3, '2026-12-01')"],
            ["TRUNCATE docs", "INSERT INTO docs VALUES (4, 'after', 4, '2026-12-02')"],
        ):
            with psycopg.connect(dsn, autocommit=True) as conn:
                for statement in statements:
                    conn.execute(statement.encode())
            result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
            assert_verified(result, ("search", "cache", "warehouse"), f"({statements[0]})\n{sinks.tail()}")
        table = tmp_path / "warehouse" / "current" / "public.docs"
        # Every batch so far was small: created, merged, widened and truncated by delta-rs, history too.
        assert set(_writers(table)) == {"delta-rs"}, _writers(table)
        assert set(_writers(table.with_name("public.docs.history"))) == {"delta-rs"}
        with psycopg.connect(dsn, autocommit=True) as conn:  # a date Python cannot hold: Spark's path
            conn.execute("INSERT INTO docs VALUES (5, 'far', 5, 'infinity')")
        result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
        assert_verified(result, ("search", "cache", "warehouse"), f"(infinity)\n{sinks.tail()}")
        assert _writers(table)[-1] == "spark", _writers(table)
        assert sorted(pl.read_delta(str(table))["id"].to_list()) == [4, 5]  # delta-rs reads both paths' commits
        assert sinks.stop() == 0, sinks.tail()


def _history_ops(history: Path) -> list[str] | None:
    """The ops of a history table's events, sorted; None before its first commit."""
    if not (history / "_delta_log").is_dir():
        return None
    return sorted(pl.read_delta(str(history))["__op"].to_list())


def _writers(table: Path) -> list[str]:
    """Who wrote each commit of a Delta table, in version order: "delta-rs" or "spark" (its commitInfo)."""
    out = []
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info is not None:
                client = str(info.get("clientVersion", ""))
                engine = str(info.get("engineInfo", ""))
                out.append("delta-rs" if client.startswith("delta-rs") else "spark" if "Spark" in engine else client)
    return out
