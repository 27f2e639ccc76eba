"""The sinks with their state and the warehouse on an S3-compatible server (pgcdc_dev.services's s3proxy).

``cdc sinks run`` (local Spark) keeps checkpoints, status files and the Delta tables in a bucket, survives a
SIGKILL from there, and converges; then readers that are not Spark read what it wrote: ``cdc status`` with
pyspark made unimportable, and delta-rs reading the served table as docs/sinks.md tells readers to.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from pgcdc_dev.cluster import ObjectStore

from tests.integration._capture_helpers import scratch_database, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    SinksProcess,
    Stack,
    assert_verified,
    cdc,
    create_pipeline_tables,
    delta_rs_reads_the_served_table,
    source_items_names,
    status_without_pyspark,
)

# The cluster test (test_sinks_cluster.py) keeps its state and warehouse in a bucket too, is SIGKILLed, and ends
# with the same outside readers (cdc status without pyspark, delta-rs on the served table): this local-Spark
# run of the same paths is in the long profile.
pytestmark = [pytest.mark.timeout(900), pytest.mark.long]


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"s3_{unique}") as dsn:
        yield dsn


def _workload(dsn: str, round_: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE items SET qty = qty + %s WHERE id %% 4 = %s", (round_, round_ % 4))
        conn.execute("DELETE FROM items WHERE id %% 50 = %s", (round_,))
        conn.execute(
            "INSERT INTO items (id, name, qty) SELECT g, 'new ' || g, g FROM generate_series(%s::int, %s::int) g",
            (1000 + 10 * round_, 1009 + 10 * round_),
        )


def test_state_and_warehouse_in_a_bucket_survive_a_kill_and_read_without_spark(
    *, source: str, stack: Stack, object_store: ObjectStore, unique: str, tmp_path: Path
) -> None:
    create_pipeline_tables(source)
    bucket = object_store.bucket(f"pgcdc-{unique}")
    cfg = stack.config(source, PIPELINE_TABLES, prefix=f"o{unique}", unique=unique, workdir=tmp_path, bucket=bucket)
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    sinks = SinksProcess(config, tmp_path / "sinks.log", ["warehouse", "cache"])
    try:
        capture.wait_streaming(180)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 2, 300, "the first batches", None)
        _workload(source, 1)
        before = sinks.batches()
        wait_for(lambda: sinks.batches() > before + 1, 120, "batches before the kill", None)
        sinks.kill()
        _workload(source, 2)  # written while the sinks are down: the checkpoint in the bucket says where to go on
        sinks.start()
        before = sinks.batches()
        wait_for(lambda: sinks.batches() >= before + 2, 300, "a batch of each sink after the restart", None)
        result = cdc("verify", "warehouse", "cache", "--config", str(config), "--wait", "120", timeout=600)
        assert_verified(result, ("warehouse", "cache"))

        keys = object_store.keys(bucket.name)
        assert f"{bucket.name}/state/warehouse/status.json" in keys
        assert any(k.startswith(f"{bucket.name}/state/warehouse/g1/checkpoint/commits/") for k in keys)
        assert not list(tmp_path.glob("state")), "nothing of the state may land on the local disk"

        status = status_without_pyspark(config)
        by_name = {s["name"]: s for s in status["sinks"]}
        assert set(by_name) == {"warehouse", "cache"}, status
        caught_up = lambda: all(s["lag_records"] == 0 for s in status_without_pyspark(config)["sinks"])  # noqa: E731
        wait_for(caught_up, 60, "a lag of 0 in cdc status", None)

        delta_rs_reads_the_served_table(object_store, bucket.name, source_items_names(source))
        assert sinks.stop() in (0, 143), sinks.tail()
    finally:
        if sinks.alive():
            sinks.kill()
        capture.stop()
