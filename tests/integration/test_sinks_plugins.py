"""Sinks as plugins: found by entry point (the example package is installed by ./dev), a broken one is
reported without taking the others down, and a plugin receives the events like a built-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from tests.integration._capture_helpers import CdcConfig, scratch_database, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _list(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgcdc", "sinks", "list"], capture_output=True, text=True, check=False, env=env
    )


def test_list_shows_builtins_and_the_example_plugin() -> None:
    out = _list()
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    for name in ("search", "cache", "warehouse"):
        assert " ok " in lines[name]
        assert "(pgcdc " in lines[name]
        assert "[rebuild, verify]" in lines[name]
    assert "cdc_sink_jsonl:JsonlSink" in lines["jsonl"]
    assert "(cdc-sink-jsonl 0.1.0)" in lines["jsonl"]


def test_the_example_plugin_meets_the_contract_without_a_base_class() -> None:
    """The example distribution (installed by pip) follows sinks.PartitionSink by its methods alone."""
    from sinks import BaseSink, PartitionSink
    from sinks.plugins import discover

    jsonl = discover()["jsonl"].factory
    assert isinstance(jsonl, type), jsonl
    assert not issubclass(jsonl, BaseSink)
    assert isinstance(jsonl(), PartitionSink)
    out = _list()
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.split()[0] == "jsonl")
    assert " ok " in line, out.stdout


def test_a_class_meeting_no_contract_is_refused_with_what_it_lacks(tmp_path: Path) -> None:
    half = "class Half:\n    name = 'half'\n\n    def open(self, context):\n        pass\n"
    (tmp_path / "half_sink.py").write_text(half)
    dist = tmp_path / "half_sink-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: half-sink\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[cdc.sinks]\nhalf = half_sink:Half\n")
    out = _list({**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.split()[0] == "half")
    assert "BROKEN" in line, out.stdout
    assert "sinks.PartitionSink needs prepare, partition_writer, close" in line, line
    assert "sinks.Sink needs write, close" in line, line


def test_a_broken_plugin_is_reported_and_the_others_still_load(tmp_path: Path) -> None:
    dist = tmp_path / "broken_sink-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-sink\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[cdc.sinks]\nbroken = no_such_module_here:Sink\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = _list(env)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert "BROKEN" in lines["broken"], out.stdout
    assert "no_such_module_here" in lines["broken"], out.stdout
    assert all("ok" in lines[n] for n in ("search", "cache", "warehouse", "jsonl"))
    run = subprocess.run(
        [sys.executable, "-m", "pgcdc", "sinks", "run", "broken"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert run.returncode == 8, run.stderr
    assert "cannot be loaded" in run.stderr
    assert "ModuleNotFoundError" in run.stderr


@SPARK_WORKER
@pytest.mark.slow
def test_the_example_plugin_receives_the_events(
    *,
    pg_dsn: str,
    kafka_bootstrap: str,
    registry_url: str,
    spark_jars: list[str],
    spark: SparkSession,
    unique: str,
    tmp_path: Path,
) -> None:
    with scratch_database(pg_dsn, f"plug_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
            conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20) g")
        out_dir = tmp_path / "jsonl"
        extra = f"""
[sinks]
state_dir = "{tmp_path / "state"}"
spark_jars = [{", ".join(json.dumps(j) for j in spark_jars)}]

[sinks.plugins.jsonl]
path = "{out_dir}"
"""
        cfg = CdcConfig(
            dsn, kafka_bootstrap, registry_url, f"p{unique}", ["public.t"], f"s_{unique}", f"p_{unique}", extra
        )
        capture = cfg.start(tmp_path)
        sinks = InProcessSinks(spark, tmp_path / "cdc.toml", tmp_path / "sinks.log", ["jsonl"])
        try:
            capture.wait_streaming(180)
            sinks.start()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE t SET v = 'changed' WHERE id = 3")
                conn.execute("DELETE FROM t WHERE id = 4")
            target = out_dir / "public.t.jsonl"

            def received() -> list[dict[str, object]]:
                if not target.exists():
                    return []
                return [json.loads(line) for line in target.read_text().splitlines()]

            def complete() -> bool:
                # The capture streams while it snapshots, so a snapshot row can reach Kafka after the update
                # and land in a later batch: wait for every line the test asserts on.
                lines = received()
                snapshot = {x["key"]["id"] for x in lines if x["op"] == "r"}  # type: ignore[index]
                return (
                    any(x["op"] == "u" and x["key"] == {"id": 3} for x in lines)
                    and any(x["op"] == "d" and x["key"] == {"id": 4} for x in lines)
                    and snapshot >= {1, 2, 20}
                )

            wait_for(
                complete, 300, "the plugin's file to hold snapshot rows 1, 2 and 20, the update and the delete", sinks
            )
            lines = received()
            update = next(x for x in lines if x["op"] == "u")
            assert update["row"] == {"id": 3, "v": "changed"}
            assert sinks.stop() == 0, sinks.tail()
        finally:
            if sinks.alive():
                sinks.kill()
            capture.stop()
