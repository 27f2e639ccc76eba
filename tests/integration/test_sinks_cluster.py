"""The sinks on a Spark standalone cluster (a master and two workers, separate JVMs), run as docs/sinks.md says:
spark-submit in client mode, pgcdc shipped to the executors as a PEX file whose interpreter does not have pgcdc
installed (the workers run this machine's plain ``python3.11``).

The checkpoints, the status files and the warehouse are in a bucket of the local S3-compatible server (s3proxy),
reached through Hadoop's S3A connector on the JVMs' classpath; nothing of them lands on the local disk. The
pipeline's workload streams through the capture to the submitted application; in the long profile the application is
SIGKILLed once and submitted again, and the warehouse is then rebuilt beside the served copy (by a local `cdc sinks
rebuild` on the same bucket: local Spark on S3A too) and the application follows the swap and drops what its last
batch left in the replaced copy. Every store then verifies without drift, the poison record reached the dead-letter
topic from each sink, and Spark's REST API shows the writing stages' tasks on both executors. Readers that are not
Spark then read the bucket: ``cdc status`` with pyspark made unimportable, and delta-rs reading the served table as
docs/sinks.md tells readers to.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from pgcdc_dev import discovery
from pgcdc_dev.cluster import ObjectStore, pgcdc_pex
from pgcdc_dev.services import CACHE

from tests.integration._capture_helpers import scratch_database, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    SPARK_WORKER,
    PipelineWorkload,
    Stack,
    SubmittedSinks,
    assert_no_drift,
    cdc,
    create_pipeline_tables,
    dead_letters,
)

pytestmark = [pytest.mark.timeout(1500), SPARK_WORKER]

# `cdc status` as the capture's host runs it: the sinks' progress read with pyspark impossible to import.
_STATUS_WITHOUT_PYSPARK = """
import sys
sys.modules["pyspark"] = None  # any import of it raises ImportError
from pgcdc.cli import main
sys.exit(main(["status", "--json", "--config", sys.argv[1]]))
"""


@pytest.fixture(scope="module")
def spark_master() -> str:
    return discovery.find_or_skip("spark-cluster")


@pytest.fixture(scope="module")
def executor_env() -> Path:
    return pgcdc_pex(CACHE)  # `./dev test` builds it while the services start


@pytest.fixture
def source(pg_dsn: str, unique: str):  # type: ignore[no-untyped-def]
    with scratch_database(pg_dsn, f"cluster_{unique}") as dsn:
        yield dsn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - an http:// URL built here
        return json.load(resp)


def _write_tasks_by_executor(api: str) -> tuple[Counter[str], dict[str, str]]:
    """Successful tasks of the stages that write to the stores, per executor id; executor id -> host:port."""
    app = _get(f"{api}/applications")[0]["id"]
    executors = {e["id"]: e["hostPort"] for e in _get(f"{api}/applications/{app}/executors") if e["id"] != "driver"}
    tasks: Counter[str] = Counter()
    for stage in _get(f"{api}/applications/{app}/stages?status=complete&details=true"):
        # The one action per batch of search and cache (sinks/_write.py), and the warehouse's MERGE jobs.
        if "_write.py" not in stage["name"] and "merge" not in stage.get("description", "").lower():
            continue
        for task in stage.get("tasks", {}).values():
            if task["status"] == "SUCCESS":
                tasks[task["executorId"]] += 1
    return tasks, executors


@pytest.mark.parametrize(
    "faults",
    # A SIGKILL and a restart from the bucket's checkpoints, then a rebuild in the bucket while the cluster serves
    # it: in the long profile (~8 minutes more on two cores, where the warehouse's first batches on the cluster
    # take minutes). The default suite kills and rebuilds under a serving app in test_sinks_pipeline.py, on the
    # local disk.
    [pytest.param(False, id="run"), pytest.param(True, id="kill-and-rebuild", marks=pytest.mark.long)],
)
def test_sinks_on_a_standalone_cluster_keep_the_stores_in_a_bucket_with_no_drift(
    *,
    faults: bool,
    source: str,
    stack: Stack,
    object_store: ObjectStore,
    spark_master: str,
    executor_env: Path,
    unique: str,
    tmp_path: Path,
) -> None:
    create_pipeline_tables(source)
    bucket = object_store.bucket(f"cluster-{unique}")
    cfg = stack.config(source, PIPELINE_TABLES, prefix=f"k{unique}", unique=unique, workdir=tmp_path, bucket=bucket)
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    log = tmp_path / "sinks.log"
    sinks = SubmittedSinks(
        config,
        log,
        master=spark_master,
        pex=executor_env,
        jars=stack.spark_jars,
        ui_port=_free_port(),
        classpath=object_store.classpath,
    )
    workload = PipelineWorkload(source, 11)
    topic = f"k{unique}.public.items"
    try:
        capture.wait_streaming(180)
        producer = Producer({"bootstrap.servers": stack.kafka})
        producer.produce(topic, key=b"not avro", value=b"\x00\x00\x00\x00\x07garbage")  # for the dead letters
        producer.flush(30)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 3, 420, "the first batches on the cluster", None)
        workload.start()
        time.sleep(8)
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ADD COLUMN note text")
            conn.execute("UPDATE items SET note = 'after alter' WHERE id % 3 = 0")
        before = sinks.batches()
        wait_for(lambda: sinks.batches() > before + 2, 300, "batches after the ALTER", None)
        if faults:
            sinks.kill()
            sinks.start()
            before = sinks.batches()
            wait_for(lambda: sinks.batches() > before + 3, 420, "batches after the restart", None)
        workload.finish()
        if faults:
            # Rebuilt while the cluster's application serves it: a one-shot `cdc sinks rebuild` on another Spark
            # (local) and the same bucket; the application then follows the swap to generation 2.
            rebuilt = cdc("sinks", "rebuild", "warehouse", "--config", str(config), timeout=900)
            assert rebuilt.returncode == 0, f"{rebuilt.stdout}\n{rebuilt.stderr}"
            assert "generation 2 is now served" in rebuilt.stdout
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("UPDATE items SET note = 'after the rebuild' WHERE id % 5 = 0")
        assert_no_drift(config, sinks)
        tasks, executors = _write_tasks_by_executor(sinks.ui)
        assert len(executors) == 2, executors
        assert all(tasks[e] > 0 for e in executors), (tasks, executors)
        assert "run by spark-submit" in sinks.log.read_text()
        if faults:
            left = "sink warehouse: generation 1's query stopped; what it left was dropped"
            wait_for(lambda: left in sinks.log.read_text(), 120, "generation 1's leftovers dropped", sinks)
        _assert_state_in_the_bucket(object_store, bucket.name, 2 if faults else 1)
        assert not list(tmp_path.glob("state")), "nothing of the state may land on the local disk"
        _assert_read_without_spark(config, object_store, bucket.name, source)
        poison = [d for d in dead_letters(stack.kafka, f"k{unique}.dead-letter") if "garbage" in d["value"]]
        assert {d["pgcdc.sink"] for d in poison} == {"search", "cache", "warehouse"}, poison
        assert sinks.stop() in (0, 143), sinks.tail()
    finally:
        workload.close()
        if sinks.alive():
            sinks.kill()
        capture.stop()


def _assert_state_in_the_bucket(store: ObjectStore, bucket: str, warehouse: int) -> None:
    """The warehouse serves generation ``warehouse`` (any replaced one is gone); every query's checkpoint is in
    the bucket."""
    fs = store.filesystem()
    keys = store.keys(bucket)
    with fs.open_input_stream(f"{bucket}/warehouse/_cdc_current") as f:
        assert f.read() == f"{warehouse}\n".encode()
    served = [k for k in keys if k.startswith(f"{bucket}/warehouse/g{warehouse}/")]
    assert served
    for old in range(1, warehouse):
        assert not [k for k in keys if k.startswith(f"{bucket}/warehouse/g{old}/")], "a replaced generation is dropped"
    for name, generation in (("search", 1), ("cache", 1), ("warehouse", warehouse)):
        commits = f"{bucket}/state/{name}/g{generation}/checkpoint/commits/"
        assert any(k.startswith(commits) for k in keys), commits


def test_executors_without_pgcdc_stop_the_app_saying_how_to_ship_it(
    *, source: str, stack: Stack, spark_master: str, unique: str, tmp_path: Path
) -> None:
    """Submitted without the PEX, the executors' Python cannot import the sinks' code. The app finds it as it
    starts, before any batch (the driver applies small batches itself, so the first batch to fail could come
    much later), stops (exit 2) and says what to pass to spark-submit."""
    create_pipeline_tables(source)
    cfg = stack.config(source, PIPELINE_TABLES, prefix=f"n{unique}", unique=unique, workdir=tmp_path)
    capture = cfg.start(tmp_path)
    config, log = tmp_path / "cdc.toml", tmp_path / "sinks.log"
    sinks = SubmittedSinks(
        config, log, master=spark_master, pex=None, jars=stack.spark_jars, ui_port=_free_port(), names=["cache"]
    )
    try:
        capture.wait_streaming(180)
        sinks.start()
        assert sinks.proc is not None
        assert sinks.proc.wait(300) == 2, sinks.tail()
        text = log.read_text()
        assert "the executors' Python cannot import 'sinks'" in text, sinks.tail()
        assert "--files pgcdc.pex --conf spark.pyspark.python=./pgcdc.pex" in text
    finally:
        if sinks.alive():
            sinks.kill()
        capture.stop()


def _assert_read_without_spark(config: Path, store: ObjectStore, bucket: str, source: str) -> None:
    status = _status_without_pyspark(config)
    assert {s["name"] for s in status["sinks"]} == {"search", "cache", "warehouse"}, status
    caught_up = lambda: all(s["lag_records"] == 0 for s in _status_without_pyspark(config)["sinks"])  # noqa: E731
    wait_for(caught_up, 60, "a lag of 0 in cdc status", None)
    with psycopg.connect(source) as conn:
        expected = {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items")}
    _delta_rs_reads_the_served_table(store, bucket, expected)


def _status_without_pyspark(config: Path) -> dict:  # type: ignore[type-arg]
    command = [sys.executable, "-c", _STATUS_WITHOUT_PYSPARK, str(config)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(proc.stdout)
    assert "sinks_error" not in data, data["sinks_error"]
    data["sinks"].sort(key=lambda s: s["name"])
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
