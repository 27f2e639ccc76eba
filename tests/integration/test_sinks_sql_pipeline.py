"""The sql sink in the whole pipeline, on a PostgreSQL database, a SQLite file and a MariaDB database:
PostgreSQL → `cdc run` → Kafka → `cdc sinks run sql` (Spark) → the target, under a workload with schema changes
(ADD, RENAME, DROP COLUMN) and a TRUNCATE, the sinks app SIGKILLed mid-batch once; then `cdc verify sql` finds no
drift (MariaDB's run is in the long profile). On PostgreSQL (and on SQLite and MariaDB in the long profile) a
rebuild is then swapped in while a plain client (psycopg, sqlite3, PyMySQL) keeps reading the served views, and
`cdc verify sql --repair` mends a row removed behind the sink's back."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from sinks.app import sqlalchemy_url
from tests.integration._capture_helpers import mariadb_rows, scratch_database, scratch_mariadb, wait_for
from tests.integration._sinks_helpers import (
    PIPELINE_TABLES,
    SPARK_WORKER,
    PipelineWorkload,
    SinksProcess,
    Stack,
    assert_verified,
    cdc_here,
    create_pipeline_tables,
    wait_caught_up,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500), SPARK_WORKER]

Query = Callable[[str], list[tuple[Any, ...]]]


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"sqlsrc_{unique}") as dsn:
        yield dsn


# MariaDB's run is in the long profile: the store calls it makes are those test_sink_sql.py makes on MariaDB in
# every run, and the default suite's time goes to PostgreSQL and SQLite.
@pytest.fixture(params=["postgresql", "sqlite", pytest.param("mariadb", marks=pytest.mark.long)])
def target(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[tuple[str, Query]]:
    """The target's SQLAlchemy URL, and a query through its plain client."""
    if request.param == "mariadb":
        with scratch_mariadb(request.getfixturevalue("mariadb_url"), f"sqltgt_{unique}") as url:
            yield url, functools.partial(mariadb_rows, url)
        return
    if request.param == "sqlite":
        path = tmp_path / "views.db"

        def sqlite_query(text: str) -> list[tuple[Any, ...]]:
            with sqlite3.connect(path, timeout=30) as conn:
                return list(conn.execute(text).fetchall())

        yield f"sqlite:///{path}", sqlite_query
        return
    pg_dsn = request.getfixturevalue("pg_dsn")
    with scratch_database(pg_dsn, f"sqltgt_{unique}") as dsn:

        def pg_query(text: str) -> list[tuple[Any, ...]]:
            with psycopg.connect(dsn) as conn:
                cursor = conn.execute(text)
                return list(cursor.fetchall()) if cursor.description else []

        yield sqlalchemy_url(dsn), pg_query


def _schema_changes(source: str, round_: int) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        if round_ == 0:
            conn.execute("ALTER TABLE items ADD COLUMN note text")
            conn.execute("UPDATE items SET note = 'after add' WHERE id % 3 = 0")
        elif round_ == 1:
            conn.execute("ALTER TABLE items RENAME COLUMN at TO at_time")  # one the workload does not write
            conn.execute('TRUNCATE "Notes"')
            conn.execute(
                """INSERT INTO "Notes" SELECT 'k' || (g % 5), g, 'again ' || g FROM generate_series(1, 30) g"""
            )
        elif round_ == 2:
            conn.execute("ALTER TABLE items DROP COLUMN day")
            conn.execute("UPDATE items SET name = name || '!' WHERE id % 7 = 0")


def _workload_round(source: str, round_: int, sinks: SinksProcess) -> None:
    """A schema change once a batch has applied the last one, so that each batch sees one schema change (a
    rename is recognised only as the one change between the schemas two batches see: docs/sinks.md); in the
    rename's round the sinks app is SIGKILLed shortly after a batch ended (mid-batch) and started again."""
    ran = sinks.batches()  # the workload's changes flow through two batches before each schema change
    wait_for(lambda: sinks.batches() >= ran + 2, 240, "the workload's batches", sinks)
    _schema_changes(source, round_)
    before = sinks.batches()
    wait_for(lambda: sinks.batches() > before, 240, "a batch after the schema change", sinks)
    if round_ == 1:
        time.sleep(random.uniform(0.3, 1.5))
        sinks.kill()
        sinks.start()
        restarted = sinks.batches()
        wait_for(lambda: sinks.batches() > restarted, 240, "a batch after the restart", sinks)


@pytest.mark.usefixtures("spark")  # verify, rebuild and repair run in the test process, on its Spark application
def test_the_sql_sink_keeps_a_database_through_kills_schema_changes_rebuilds_and_repairs(
    *, source: str, target: tuple[str, Query], stack: Stack, unique: str, tmp_path: Path
) -> None:
    url, query = target
    create_pipeline_tables(source)
    if url.startswith("mariadb"):  # its DATE has no infinity (such a row would be a dead letter: docs/sinks.md)
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("ALTER TABLE items ALTER COLUMN day SET DEFAULT '2026-01-01'")
            conn.execute("UPDATE items SET day = '2026-01-01'")
    base = stack.config(source, PIPELINE_TABLES, prefix=f"t{unique}", unique=unique, workdir=tmp_path)
    cfg = dataclasses.replace(base, extra=base.extra + f'\n[sinks.sql]\nurl = "{url}"\n')
    capture = cfg.start(tmp_path)
    config = tmp_path / "cdc.toml"
    sinks = SinksProcess(config, tmp_path / "sinks.log", ["sql"])
    workload = PipelineWorkload(source, 11)
    try:
        capture.wait_streaming(180)
        sinks.start()
        wait_for(lambda: sinks.batches() >= 1, 240, "the sql sink's first batch", None)
        workload.start()
        for round_ in range(3):
            _workload_round(source, round_, sinks)
        workload.finish()
        wait_caught_up(config, sinks, ["sql"])
        assert_verified(cdc_here("verify", "sql", "--config", str(config), "--wait", "120"), ["sql"])
        with psycopg.connect(source) as conn:
            source_rows = conn.execute("SELECT id, name, qty, note, at_time::text FROM items ORDER BY id").fetchall()
        view = query('SELECT id, name, qty, note, at_time FROM "public.items" ORDER BY id')
        # Values kept through the rename (the rows the workload never touched still hold theirs).
        assert [r[:4] for r in view] == [r[:4] for r in source_rows]
        assert all(r[4] is not None for r in view), "the renamed column lost its values"
        assert query('SELECT count(*) FROM "public.Notes"') == [(30,)]

        if url.startswith("postgresql"):
            # A rebuild and a repair go through the same store calls (tables, views, upserts, read-back) that the
            # other runs have made above; CI runs them once, on PostgreSQL (CDC_TEST_LONG=1 on the others too).
            _rebuild_while_reading(config, query)
            _repair(config, query)
        elif os.environ.get("CDC_TEST_LONG", "") not in ("", "0"):
            _rebuild_while_reading(config, query)
            _repair(config, query)
        assert sinks.alive(), sinks.tail()
        assert sinks.stop() == 0, sinks.tail()
    finally:
        workload.close()
        if sinks.alive():
            sinks.kill()
        capture.stop()


def _assert_repaired(result: subprocess.CompletedProcess[str]) -> None:
    """`cdc verify --repair` exited 0, and after its backfill every table compared clean."""
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    after = result.stdout.rsplit(" done: ", 1)[1].splitlines()[1:]
    assert after, result.stdout
    assert all(line.endswith(": no drift") for line in after if line.startswith("sql ")), result.stdout


def _rebuild_while_reading(config: Path, query: Query) -> None:
    """`cdc sinks rebuild sql` while a plain client keeps reading the served view: never an error, never empty."""
    failed: list[str] = []
    reads = [0]
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                assert query('SELECT count(*) FROM "public.items"')[0][0] > 0
                reads[0] += 1
            except Exception as exc:  # recorded: the test fails on any
                failed.append(repr(exc))
            time.sleep(0.05)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        result = cdc_here("sinks", "rebuild", "sql", "--config", str(config))
    finally:
        done.set()
        thread.join(10)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "generation 2 is now served" in result.stdout
    assert not failed, failed[:5]
    assert reads[0] > 10


def _repair(config: Path, query: Query) -> None:
    """A row removed from the served table behind the sink's back is found and mended."""
    rows = query("SELECT table_name FROM pgcdc_sql_columns WHERE generation = 2 AND table_name = 'public.items'")
    assert rows == [("public.items",)], rows
    query("""DELETE FROM "public.items__g2" WHERE "__pgcdc_key" = '[1]'""")
    drift = cdc_here("verify", "sql", "--config", str(config))
    assert drift.returncode == 9, f"{drift.stdout}\n{drift.stderr}"
    assert "missing" in drift.stdout
    _assert_repaired(cdc_here("verify", "sql", "--repair", "--config", str(config)))
    assert query('SELECT id FROM "public.items" WHERE id = 1') == [(1,)]
