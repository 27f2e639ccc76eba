"""The sinks on a Spark standalone cluster (a master and two workers, separate JVMs), run as docs/sinks.md
says: spark-submit in client mode, pgcdc shipped to the executors as a PEX file whose interpreter does not
have pgcdc installed (the workers run this machine's plain ``python3.11``).

The checkpoints, the status files and the warehouse are in a bucket of the local S3-compatible server
(s3proxy), reached through Hadoop's S3A connector on the JVMs' classpath. The pipeline's workload streams
through the capture while the submitted application is SIGKILLed once and submitted again; then
the warehouse is rebuilt beside the served copy (by a local `cdc sinks rebuild` on the same bucket) and the
application follows the swap; every store then verifies without drift, the poison record reached the
dead-letter topic from each sink, and Spark's REST API shows the writing stages' tasks on both executors.
"""

from __future__ import annotations

import json
import os
import socket
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

from tests.integration._capture_helpers import scratch_database, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    PipelineWorkload,
    Stack,
    SubmittedSinks,
    assert_no_drift,
    cdc,
    create_pipeline_tables,
    dead_letters,
)

pytestmark = [pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def spark_master() -> str:
    return discovery.find_or_skip("spark-cluster")


@pytest.fixture(scope="module")
def executor_env() -> Path:
    cache = Path(os.environ.get("CDC_LOCAL_CACHE", Path.home() / ".cache" / "pgcdc"))
    return pgcdc_pex(cache)


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


def test_sinks_on_a_standalone_cluster_survive_a_kill_with_no_drift(
    *,
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
        wait_for(lambda: sinks.batches() > before + 2, 300, "batches before the kill", None)
        sinks.kill()
        sinks.start()
        before = sinks.batches()
        wait_for(lambda: sinks.batches() > before + 3, 420, "batches after the restart", None)
        time.sleep(10)
        workload.finish()
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
        _assert_state_in_the_bucket(object_store, bucket.name)
        poison = [d for d in dead_letters(stack.kafka, f"k{unique}.dead-letter") if "garbage" in d["value"]]
        assert {d["pgcdc.sink"] for d in poison} == {"search", "cache", "warehouse"}, poison
        assert sinks.stop() in (0, 143), sinks.tail()
    finally:
        workload.close()
        if sinks.alive():
            sinks.kill()
        capture.stop()


def _assert_state_in_the_bucket(store: ObjectStore, bucket: str) -> None:
    fs = store.filesystem()
    keys = store.keys(bucket)
    with fs.open_input_stream(f"{bucket}/warehouse/_cdc_current") as f:
        assert f.read() == b"2\n"
    assert not [k for k in keys if k.startswith(f"{bucket}/warehouse/g1/")], "the replaced generation is dropped"
    for name, generation in (("search", 1), ("cache", 1), ("warehouse", 2)):
        commits = f"{bucket}/state/{name}/g{generation}/checkpoint/commits/"
        assert any(k.startswith(commits) for k in keys), commits


def test_executors_without_pgcdc_stop_the_app_saying_how_to_ship_it(
    *, source: str, stack: Stack, spark_master: str, unique: str, tmp_path: Path
) -> None:
    """Submitted without the PEX, the executors' Python cannot unpickle the sinks' code: each retry would fail
    alike, so the app stops (exit 2) and says what to pass to spark-submit."""
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
