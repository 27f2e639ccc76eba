"""The whole pipeline: PostgreSQL → `cdc run` → Kafka → `cdc sinks run` → OpenSearch, Redis, Delta Lake.

A write workload (inserts, updates, deletes, a truncate, an ALTER TABLE in the middle) runs while the sinks
app is SIGKILLed mid-batch again and again; afterwards `cdc verify` finds no drift in any store. Then the
three stores are rebuilt from offset zero in one application while a reader keeps querying the served copies,
and verified again.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import redis
from opensearchpy import OpenSearch

from sinks.config import load_sink_settings
from sinks.progress import batch_offsets, checkpoint_location
from tests.integration._capture_helpers import scratch_database, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    SINKS,
    SPARK_WORKER,
    PipelineWorkload,
    SinksProcess,
    Stack,
    assert_no_drift,
    cdc_here,
    create_pipeline_tables,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), SPARK_WORKER]
# The rebuilds run with live batches this small, so that a rebuild's own, larger bound shows.
LIVE_BATCH = 1000


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"sinks_{unique}") as dsn:
        yield dsn


def _left_dropped(sinks: SinksProcess, name: str) -> bool:
    return f"sink {name}: generation 1's query stopped; what it left was dropped" in sinks.log.read_text()


@pytest.mark.parametrize(
    "kills",
    # Two kills, after the ALTER and after the TRUNCATE; more land at more points of a batch.
    [pytest.param(2, id="2 kills"), pytest.param(8, id="8 kills", marks=pytest.mark.long)],
)
def test_pipeline_survives_kills_and_rebuilds_with_no_drift(
    *, kills: int, source: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    create_pipeline_tables(source)
    prefix = f"t{unique}"
    cfg = stack.config(source, PIPELINE_TABLES, prefix=prefix, unique=unique, workdir=tmp_path)
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    sinks = SinksProcess(config, tmp_path / "sinks.log")
    workload = PipelineWorkload(source, 7)
    try:
        capture.wait_streaming(180)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 3, 240, "the sinks' first batches", None)
        workload.start()
        killed = 0
        for round_ in range(kills):
            time.sleep(random.uniform(4, 9))
            if round_ == 0:
                with psycopg.connect(source, autocommit=True) as conn:
                    conn.execute("ALTER TABLE items ADD COLUMN note text")
                    conn.execute("UPDATE items SET note = 'after alter' WHERE id % 3 = 0")
            if round_ == 1:
                with psycopg.connect(source, autocommit=True) as conn:
                    conn.execute('TRUNCATE "Notes"')
                    conn.execute(
                        """INSERT INTO "Notes" SELECT 'k' || (g % 5), g, 'again ' || g FROM generate_series(1, 30) g"""
                    )
            before = sinks.batches()
            wait_for(lambda b=before: sinks.batches() > b, 240, "a batch before the kill", None)
            # The workload keeps every query busy (a batch takes seconds here): shortly after one batch ends,
            # the next ones are running, so the kill lands mid-batch.
            time.sleep(random.uniform(0.3, 2.0))
            sinks.kill()
            killed += 1
            sinks.start()
        workload.finish()
        assert killed == kills
        # Restarted under the workload, search and cache applied what was written while they were down before
        # Spark was up (sinks._bridge); their queries' batches then read it again, to no effect on the stores.
        restarts = sinks.log.read_text()
        for name in ("search", "cache"):
            assert re.search(rf"sink {name}: applied \d+ record\(s\) before its query started", restarts)
        assert_no_drift(config, sinks, spark=spark)
        status = json.loads((tmp_path / "state" / "search" / "status.json").read_text())
        assert status["batches"] >= 1

        # Rebuild each store while reads keep being answered by the served copy.
        os_client = OpenSearch(stack.opensearch)
        cache = redis.Redis.from_url(stack.redis)
        ok_reads = [0]
        failed_reads: list[str] = []
        reading = threading.Event()

        def reader() -> None:
            while not reading.is_set():
                try:
                    hits = os_client.count(index=f"{prefix}-public.items".lower())["count"]
                    generation = int(cache.get(f"{prefix}:current") or b"0")
                    got = cache.hget(f"{prefix}:g{generation}:public.items:[1]", "row")
                    current = (tmp_path / "warehouse" / "_cdc_current").read_text().strip()
                    assert hits > 0
                    assert got is not None
                    assert current
                    ok_reads[0] += 1
                except Exception as exc:  # recorded: the test fails on any
                    failed_reads.append(repr(exc))
                time.sleep(0.05)

        read_thread = threading.Thread(target=reader)
        read_thread.start()
        try:
            # All three side by side in one application, swapped in together once each verifies clean.
            result = cdc_here(
                "sinks",
                "rebuild",
                *SINKS,
                "--config",
                str(config),
                env={"CDC_SINKS__MAX_OFFSETS_PER_TRIGGER": str(LIVE_BATCH)},
            )
            assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
            for name in SINKS:
                assert f"{name}: generation 2 is now served" in result.stdout, result.stdout
                # Its progress, as the dashboard and `cdc status` read it (the workload goes on meanwhile, so
                # the topics may have grown a little after the rebuild caught up).
                progress = json.loads((tmp_path / "state" / name / "rebuild.json").read_text())
                assert progress["state"] == "done", progress
                assert progress["generation"] == 2, progress
                assert 0.5 * progress["records_total"] <= progress["records_done"] <= progress["records_total"], (
                    progress
                )
                # It caught up in one batch (the workload had ended), larger than a live batch: a bulk load.
                checkpoint = checkpoint_location(load_sink_settings(config).state, name, 2)
                assert progress["records_total"] > LIVE_BATCH, progress
                assert batch_offsets(checkpoint, 0), name
                assert batch_offsets(checkpoint, 1) is None, name
        finally:
            reading.set()
            read_thread.join(10)
        assert not failed_reads, failed_reads[:5]
        assert ok_reads[0] > 20
        # The rebuild built its indices without refreshes or replicas; the swap gave them the served settings.
        built = os_client.indices.get_settings(index=f"{prefix}-*-g2".lower())
        assert built
        for index, info in built.items():
            assert info["settings"]["index"].get("refresh_interval", "the default") != "-1", index
            assert info["settings"]["index"]["number_of_replicas"] == "0", index
        # The running sinks app follows the swap; the store stays in sync afterwards.
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("UPDATE items SET name = 'after rebuild' WHERE id = 1")
        assert_no_drift(config, sinks, spark=spark)
        # Once generation 1's queries stopped, the app dropped what their last batches wrote after the swap.
        for name in SINKS:
            wait_for(lambda n=name: _left_dropped(sinks, n), 120, f"{name}'s generation 1 dropped", sinks)
        assert not os_client.indices.get(index=f"{prefix}-*-g1".lower(), ignore_unavailable=True)
        assert not list(cache.scan_iter(match=f"{prefix}:g1:*", count=1000))
        assert not (tmp_path / "warehouse" / "g1").exists()
        assert sinks.alive(), sinks.tail()
        assert sinks.stop() == 0, sinks.tail()
    finally:
        workload.close()
        if sinks.alive():
            sinks.kill()
        capture.stop()
