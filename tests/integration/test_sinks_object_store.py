"""The sinks with their state and the warehouse on an S3-compatible server (pgcdc_dev.services's s3proxy).

``cdc sinks run`` (local Spark) keeps checkpoints, status files and the Delta tables in a bucket, survives a
SIGKILL from there, and converges; then readers that are not Spark read what it wrote: ``cdc status`` with
pyspark made unimportable, and delta-rs reading the served table as docs/sinks.md tells readers to.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
)

pytestmark = [pytest.mark.timeout(900)]

# `cdc status` as the capture's host runs it: the sinks' progress read with pyspark impossible to import.
_STATUS_WITHOUT_PYSPARK = """
import sys
sys.modules["pyspark"] = None  # any import of it raises ImportError
from pgcdc.cli import main
sys.exit(main(["status", "--json", "--config", sys.argv[1]]))
"""


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"s3_{unique}") as dsn:
        yield dsn


def _source_items(dsn: str) -> dict[int, tuple[str, int | None]]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items")}


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

        status = _status_without_pyspark(config)
        by_name = {s["name"]: s for s in status["sinks"]}
        assert set(by_name) == {"warehouse", "cache"}, status
        caught_up = lambda: all(s["lag_records"] == 0 for s in _status_without_pyspark(config)["sinks"])  # noqa: E731
        wait_for(caught_up, 60, "a lag of 0 in cdc status", None)

        _delta_rs_reads_the_served_table(object_store, bucket.name, _source_items(source))
        assert sinks.stop() in (0, 143), sinks.tail()
    finally:
        if sinks.alive():
            sinks.kill()
        capture.stop()


def _status_without_pyspark(config: Path) -> dict:  # type: ignore[type-arg]
    command = [sys.executable, "-c", _STATUS_WITHOUT_PYSPARK, str(config)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(proc.stdout)
    assert "sinks_error" not in data, data["sinks_error"]
    data["sinks"].sort(key=lambda s: s["name"])  # cache, warehouse
    return data  # type: ignore[no-any-return]


def _delta_rs_reads_the_served_table(
    store: ObjectStore, bucket: str, expected: dict[int, tuple[str, int | None]]
) -> None:
    """As docs/sinks.md says: ``<path>/_cdc_current`` holds N; the table is ``<path>/g<N>/<schema>.<table>``."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    options = {
        "AWS_ENDPOINT_URL": store.url,
        "AWS_ACCESS_KEY_ID": store.access_key,
        "AWS_SECRET_ACCESS_KEY": store.secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_FORCE_PATH_STYLE": "true",
    }
    fs = store.filesystem()
    with fs.open_input_stream(f"{bucket}/warehouse/_cdc_current") as f:
        generation = int(f.read().decode().strip())
    got: dict[int, tuple[str, int | None]] = {}

    def served_equals_expected() -> bool:
        nonlocal got
        served = DeltaTable(f"s3://{bucket}/warehouse/g{generation}/public.items", storage_options=options)
        # delta-rs's own engine: its pyarrow path (to_pyarrow_table) panics on this table, whose every row
        # has date 'infinity' (int32 max days) in the file statistics it turns into pyarrow expressions.
        table = QueryBuilder().register("t", served).execute("SELECT id, name, qty FROM t").read_all()
        got = {r["id"]: (r["name"], r["qty"]) for r in pa.table(table).to_pylist()}
        return got == expected

    try:
        wait_for(served_equals_expected, 60, "delta-rs to read the served table as PostgreSQL holds it")
    except AssertionError:
        assert got == expected  # the difference, not only the timeout
