"""Type changes and every store (docs/events.md, Type changes): after compatible ones (``int → bigint`` on a key
and a value column, a wider ``numeric``, ``varchar → text``, ``timestamp → timestamptz``) under a running
capture and running sinks, with values only the new types hold, `cdc verify` is clean on search, cache, the
warehouse and the SQL sink; after one the registry refuses (the table moves to a new topic generation), the
running app rebuilds every store from offset zero, from the table's new generation, verifies it before the
swap, and no sink's batches fail meanwhile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from opensearchpy import OpenSearch

from sinks._search import index_alias
from tests.integration._capture_helpers import latest_by_key, read_topic, scratch_database, set_compatibility, wait_for
from tests.integration._sinks_helpers import (
    SPARK_WORKER,
    InProcessSinks,
    Stack,
    assert_verified,
    captured,
    cdc_here,
    wait_caught_up,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), SPARK_WORKER]

ALL = ("search", "cache", "warehouse", "sql")


@pytest.fixture
def target(pg_dsn: str, unique: str) -> Iterator[str]:
    from sinks.app import sqlalchemy_url

    with scratch_database(pg_dsn, f"tctgt_{unique}") as dsn:
        yield sqlalchemy_url(dsn)


def test_type_changes_reach_every_store_and_the_app_rebuilds_them_for_a_moved_table(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, target: str, unique: str, tmp_path: Path
) -> None:
    """``items`` takes compatible changes while the sinks run; ``moved`` (int → text), ``parsed`` (text → int)
    and ``scaled`` (a decimal's new scale) take ones their topics cannot take and move to their second
    generations; the app's own rebuild of every store then serves them all."""
    setup = [
        "CREATE TABLE items (id int PRIMARY KEY, qty int, price numeric(10,2), code varchar(10), at timestamp)",
        "INSERT INTO items SELECT g, g, g * 1.5, 'c' || g, '2026-01-01'::timestamp + g * interval '1 hour' "
        "FROM generate_series(1, 20) g",
        "CREATE TABLE moved (id int PRIMARY KEY, qty int, name text)",
        "INSERT INTO moved SELECT g, g, 'n' || g FROM generate_series(1, 20) g",
        "CREATE TABLE parsed (id int PRIMARY KEY, code text)",
        "INSERT INTO parsed SELECT g, (g * 7)::text FROM generate_series(1, 20) g",
        "CREATE TABLE scaled (id int PRIMARY KEY, price numeric(10,2))",
        "INSERT INTO scaled SELECT g, g * 1.25 FROM generate_series(1, 20) g",
    ]
    sql = f'\n[sinks.sql]\nurl = "{target}"\n'
    with captured(
        stack,
        pg_dsn,
        unique,
        tmp_path,
        name="tc",
        setup=setup,
        tables=["items", "moved", "parsed", "scaled"],
        sinks=lambda config, log: InProcessSinks(spark, _with(config, sql), log, list(ALL)),
    ) as run:
        dsn, config, sinks = run.dsn, run.config, run.sinks
        sinks.start()
        wait_caught_up(config, sinks, ALL)
        for table in ("moved", "parsed"):
            set_compatibility(stack.registry, f"{run.topic(table)}-value", "BACKWARD")
        with psycopg.connect(dsn, autocommit=True) as conn:
            _widen_items(conn)
        result = cdc_here("verify", *ALL, "--config", str(config), "--wait", "300")
        assert_verified(result, ALL, sinks.tail())
        assert "written in another form since their type changed" in run.capture.tail(200)  # the zone of `at`
        _stores_have_the_new_types(stack, tmp_path, target, run.prefix)
        with psycopg.connect(dsn) as conn:  # three changes no topic can take, in one transaction
            conn.execute("ALTER TABLE moved ALTER COLUMN qty TYPE text USING 'q' || qty")  # refused: int -> string
            conn.execute("ALTER TABLE parsed ALTER COLUMN code TYPE integer USING code::integer")  # string -> int
            conn.execute("ALTER TABLE scaled ALTER COLUMN price TYPE numeric(10,4)")  # old events would misread
            conn.execute("UPDATE moved SET name = 'after' WHERE id = 1")
            conn.execute("DELETE FROM moved WHERE id = 2")
            conn.execute("UPDATE parsed SET code = 2000000000 WHERE id = 3")
            conn.execute("INSERT INTO scaled VALUES (21, 0.0001)")
            conn.execute("INSERT INTO items VALUES (5000, 5, 5.5, 'during', now())")  # another table goes on
            expected = {r[0]: r for r in conn.execute("SELECT id, qty, name FROM moved").fetchall()}

        def in_its_new_topic() -> bool:
            rows = latest_by_key(read_topic(stack.kafka, stack.registry, f"{run.topic('moved')}.g2"), "id")
            return {k: (v["id"], v["qty"], v["name"]) for k, v in rows.items()} == expected

        wait_for(in_its_new_topic, 180, "the moved table in its new topic generation", run.capture)
        # The running app rebuilds every store beside the served one, from offset zero: items' events of both
        # schemas read with the newest, moved's from its second generation alone; verified before the swap.
        # (A look at the topics between two of the moves rebuilds twice: verify waits for the second swap.)
        wait_for(lambda: "now served: cache generation" in sinks.tail(400), 900, "the rebuild after the move", sinks)
        result = cdc_here("verify", *ALL, "--config", str(config), "--wait", "300")
        assert_verified(result, ALL, sinks.tail())
        log = sinks.tail(3000)
        for table in ("moved", "parsed", "scaled"):
            assert f"table public.{table} moved to topic generation 2" in log, log
        assert "restarting in" not in log, log  # no sink's query failed: the served copies never took g2's events
        for name in ALL:  # what `cdc status` and the dashboard show of the rebuild, and why it ran
            rebuilt = json.loads((tmp_path / "state" / name / "rebuild.json").read_text())
            assert rebuilt["state"] == "done", rebuilt
            assert "moved to topic generation 2" in rebuilt["reason"], rebuilt
        delta = DeltaTable(str(tmp_path / "warehouse" / "current" / "public.moved")).to_pyarrow_table()
        assert delta.schema.field("qty").type == pa.string()
        assert sorted(delta.column("qty").to_pylist()) == sorted(r[1] for r in expected.values())
        parsed = DeltaTable(str(tmp_path / "warehouse" / "current" / "public.parsed")).to_pyarrow_table()
        assert parsed.schema.field("code").type == pa.int32()
        assert sinks.stop() == 0, sinks.tail()


def _widen_items(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "ALTER TABLE items ALTER COLUMN id TYPE bigint, ALTER COLUMN qty TYPE bigint, "
        "ALTER COLUMN price TYPE numeric(14,2), ALTER COLUMN code TYPE text, "
        "ALTER COLUMN at TYPE timestamptz USING at AT TIME ZONE 'UTC'"
    )
    conn.execute(
        "INSERT INTO items VALUES (2^40, 2^50, 123456789012.25, repeat('long code ', 5), '2026-06-01 12:00:00+02')"
    )
    conn.execute("UPDATE items SET qty = 2^33, price = 99999999999.99 WHERE id = 3")
    conn.execute("DELETE FROM items WHERE id = 4")


def _stores_have_the_new_types(stack: Stack, workdir: Path, target: str, prefix: str) -> None:
    """The stores' own readers find the columns in their new types: delta-rs the warehouse's, OpenSearch's
    mapping, PostgreSQL's catalog for the SQL sink's table."""
    delta = DeltaTable(str(workdir / "warehouse" / "current" / "public.items")).to_pyarrow_table().schema
    assert delta.field("id").type == pa.int64()
    assert delta.field("at").type == pa.timestamp("us", tz="UTC")
    search = OpenSearch(stack.opensearch)
    index = next(iter(search.indices.get_alias(index=index_alias(prefix, "public.items"))))
    mapped = search.indices.get_mapping(index=index)[index]["mappings"]["properties"]
    assert (mapped["id"]["type"], mapped["qty"]["type"]) == ("long", "long")
    with psycopg.connect(target.replace("postgresql+psycopg://", "postgresql://")) as conn:
        types: dict[str, str] = dict(
            conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name LIKE 'public.items%'"
            ).fetchall()
        )
    assert (types["id"], types["qty"], types["at"]) == ("bigint", "bigint", "timestamp with time zone"), types


def _with(config: Path, extra: str) -> Path:
    """``config`` with ``extra`` appended (written once, before the sinks read it)."""
    if extra not in config.read_text():
        with config.open("a") as f:
            f.write(extra)
    return config
