"""`cdc sinks rebuild A B`: the sinks rebuild side by side in one application and are swapped in together, or,
when any new copy differs from the source, none is.

The rebuilds here take the larger batches' path (the thresholds of the driver's and the one task's paths set
to nothing): one task per Kafka partition folds and writes its records (search, cache) or hands them to
Spark's MERGE as frames (the warehouse), a truncate follows every task, and a table whose key column changed
type (its key in two partitions) is folded in one task."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pytest
import redis
from deltalake import DeltaTable

import sinks._frames
import sinks._query
import sinks._write
from tests.integration._capture_helpers import read_topic, wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, captured, cdc_here, wait_caught_up

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), SPARK_WORKER]

SINKS = ("search", "cache", "warehouse")

# A history for a rebuild to fold: updates, deletes, a truncate, inserts after it (k = 3 keeps v = 3).
HISTORY = [
    "UPDATE t SET v = v + 100 WHERE k % 4 = 0",
    "DELETE FROM t WHERE k % 5 = 0",
    "TRUNCATE t",
    "INSERT INTO t SELECT g, g FROM generate_series(1, 30) g",
    "UPDATE t SET v = v + 100 WHERE k % 4 = 0",
    "DELETE FROM t WHERE k % 7 = 0",
]
# After the live sinks stopped: u's key column widens. Its topic is one an earlier release made, whose key
# schema held an int4 key as an Avro int and took the long as a second version when the column widened: the
# later events carry the new key schema (and land in other partitions), as such topics hold them.
KEY_MOVES = [
    "ALTER TABLE u ALTER COLUMN k TYPE bigint",
    "UPDATE u SET v = v || '!' WHERE k > 5",
    "DELETE FROM u WHERE k = 9",
    "INSERT INTO u VALUES (11, 'last')",
]


def _key_versions(registry: str, topic: str, types: list[str]) -> None:
    """Registers ``topic``'s key schema (a record of its key column ``k``) with ``k`` of each of ``types``."""
    for typ in types:
        key = {
            "type": "record",
            "name": "Key",
            "namespace": topic,
            "fields": [{"name": "k", "type": ["null", typ], "default": None}],
        }
        request = urllib.request.Request(  # noqa: S310
            f"{registry}/subjects/{topic}-key/versions",
            data=json.dumps({"schema": json.dumps(key)}).encode(),
            method="POST",
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        urllib.request.urlopen(request).close()  # noqa: S310


@pytest.fixture
def larger_batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[tuple[str, int]]]]:
    """Every batch of search and cache through sinks._write.in_tasks, of the warehouse through
    sinks._frames.in_frames; each batch's sink, and its topics with their key schema versions."""
    taken: list[tuple[str, list[tuple[str, int]]]] = []

    def spy(real: Any) -> Any:
        def spied(sink, folds, *args, **kwargs):  # type: ignore[no-untyped-def]
            taken.append((sink.name, sorted((f.schemas.topic, len(f.schemas.key_writers)) for f in folds)))
            return real(sink, folds, *args, **kwargs)

        return spied

    monkeypatch.setattr(sinks._query, "DRIVER_RECORDS", 0)
    monkeypatch.setattr(sinks._query, "ONE_TASK_RECORDS", 0)
    monkeypatch.setattr(sinks._query, "DRIVER_FOLD_RECORDS", 0)
    monkeypatch.setattr("sinks._query.in_tasks", spy(sinks._write.in_tasks))
    monkeypatch.setattr("sinks._query.in_frames", spy(sinks._frames.in_frames))
    return taken


def test_a_rebuild_that_differs_from_the_source_swaps_in_none_of_its_sinks(
    *,
    pg_dsn: str,
    stack: Stack,
    spark: SparkSession,
    unique: str,
    tmp_path: Path,
    larger_batches: list[tuple[str, list[tuple[str, int]]]],
) -> None:
    _key_versions(stack.registry, f"rebuild{unique}.public.u", ["int"])
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="rebuild",
        setup=[
            "CREATE TABLE t (k int PRIMARY KEY, v int)",
            "INSERT INTO t SELECT g, g FROM generate_series(1, 20) g",
            "CREATE TABLE u (k int PRIMARY KEY, v text)",
            "INSERT INTO u SELECT g, 'u' || g FROM generate_series(1, 10) g",
        ],
        tables=["t", "u"],
        sinks=lambda config, log: InProcessSinks(spark, config, log, ["search", "cache"]),
    ) as run:
        dsn, config, prefix, sinks = run.dsn, run.config, run.prefix, run.sinks
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in HISTORY:
                conn.execute(statement.encode())
        sinks.start()
        wait_caught_up(config, sinks, ["search", "cache"])
        assert sinks.stop() == 0, sinks.tail()
        u = f"{prefix}.public.u"
        run.capture.stop()  # the earlier release's capture registered the long key itself
        _key_versions(stack.registry, u, ["long"])
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in KEY_MOVES:
                conn.execute(statement.encode())
        run.capture.start()

        def arrived() -> bool:
            events = read_topic(stack.kafka, stack.registry, u)
            return any(e.value and (e.value["after"] or {}).get("v") == "last" for e in events)

        wait_for(arrived, 120, "u's last insert in its topic", None)
        run.capture.stop()
        larger_batches.clear()  # the live sinks' batches: the rebuilds' are what is checked
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
        larger_batches.clear()
        # The warehouse, never run before, is built in the clean rebuild only.
        again = cdc_here("sinks", "rebuild", *SINKS, "--config", str(config))
        assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
        assert "search: generation 2 is now served" in again.stdout
        assert "cache: generation 2 is now served" in again.stdout
        assert "warehouse: generation 2 is now served" in again.stdout
        assert redis.Redis.from_url(stack.redis).get(f"{prefix}:current") == b"2"
        # Each rebuild's batch went one task per partition: t's key schema has one version, u's two.
        assert {name for name, _ in larger_batches} == set(SINKS), larger_batches
        versions = {topic: n for _, batch in larger_batches for topic, n in batch}
        assert versions == {f"{prefix}.public.t": 1, u: 2}, larger_batches
        # The rebuilt warehouse as delta-rs reads it: PostgreSQL's rows, the key widened to bigint.
        with psycopg.connect(dsn, autocommit=True) as conn:
            for table in ("t", "u"):
                want = sorted(conn.execute(f"SELECT k, v FROM {table}").fetchall())
                delta = DeltaTable(str(tmp_path / "warehouse" / "current" / f"public.{table}")).to_pyarrow_table()
                got = zip(delta.column("k").to_pylist(), delta.column("v").to_pylist(), strict=True)
                assert sorted(got) == want, table
                if table == "u":
                    assert delta.schema.field("k").type == pa.int64()
