"""A renamed column keeps its values in every store, including rows not changed since the rename: the capture
names the column's earlier names as Avro aliases, so events written before the rename read into the new name
(the warehouse's Spark decode, the search and cache sinks' fastavro decode), and a sink started from offset
zero after the rename verifies clean with no re-snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from tests.integration._capture_helpers import latest_value_fields, read_topic, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, assert_verified, captured, cdc_here

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), SPARK_WORKER]


def test_rows_unchanged_since_a_rename_keep_their_values_in_every_store(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="rename",
        setup=["CREATE TABLE items (id int PRIMARY KEY, name text, qty int)"],
        tables=["items"],
        sinks=lambda config, log: InProcessSinks(spark, config, log),
    ) as run:
        dsn, config, sinks, capture, topic = run.dsn, run.config, run.sinks, run.capture, run.topic("items")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 5) g")
            conn.execute("ALTER TABLE items RENAME COLUMN name TO title")
            conn.execute("UPDATE items SET qty = 10 WHERE id = 1")  # the first event under the new name
            conn.execute("INSERT INTO items VALUES (6, 'item 6', 6)")
            conn.execute("ALTER TABLE items RENAME COLUMN title TO label")  # and renamed once more
            conn.execute("UPDATE items SET qty = 20 WHERE id = 2")
        wait_for(lambda: len(read_topic(stack.kafka, stack.registry, topic)) >= 8, 120, "the events", capture)
        fields = {f["name"]: f for f in latest_value_fields(stack.registry, topic)}
        assert sorted(fields["label"].get("aliases", [])) == ["name", "title"], fields["label"]
        assert fields["label"]["pgcdc.attnum"] == 2
        # The sinks start now: their first batch holds events under all three names.
        sinks.start()
        result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
        assert_verified(result, ("search", "cache", "warehouse"), sinks.tail())
        assert sinks.stop() == 0, sinks.tail()
