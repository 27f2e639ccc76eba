"""`cdc sinks rebuild A B`: the sinks rebuild side by side in one application and are swapped in together, or,
when any new copy differs from the source, none is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import redis

from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, captured, cdc_here, wait_caught_up

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), SPARK_WORKER]


def test_a_rebuild_that_differs_from_the_source_swaps_in_none_of_its_sinks(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="rebuild",
        setup=["CREATE TABLE t (k int PRIMARY KEY, v int)", "INSERT INTO t SELECT g, g FROM generate_series(1, 20) g"],
        tables=["t"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["search", "cache"]),
    ) as run:
        dsn, config, prefix, sinks = run.dsn, run.config, run.prefix, run.sinks
        sinks.start()
        wait_caught_up(config, sinks, ["search", "cache"])
        assert sinks.stop() == 0, sinks.tail()
        run.capture.stop()
        # Behind the capture's back (it is stopped): the topics, and so every rebuilt copy, no longer match.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = -1 WHERE k = 3")
        result = cdc_here("sinks", "rebuild", "search", "cache", "--config", str(config), "--verify-wait", "0")
        assert result.returncode == 9, f"{result.stdout}\n{result.stderr}"
        assert "nothing was swapped in" in result.stderr, result.stderr
        assert "is now served" not in result.stdout, result.stdout
        for name in ("search", "cache"):
            progress = json.loads((tmp_path / "state" / name / "rebuild.json").read_text())
            assert progress["state"] == "drift", progress
            assert progress["generation"] == 2, progress
        # Both stores still serve generation 1, as their plain clients see it.
        assert redis.Redis.from_url(stack.redis).get(f"{prefix}:current") == b"1"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE t SET v = 3 WHERE k = 3")  # the source as the topics say again
        again = cdc_here("sinks", "rebuild", "search", "cache", "--config", str(config))
        assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
        assert "search: generation 2 is now served" in again.stdout
        assert "cache: generation 2 is now served" in again.stdout
        assert redis.Redis.from_url(stack.redis).get(f"{prefix}:current") == b"2"
