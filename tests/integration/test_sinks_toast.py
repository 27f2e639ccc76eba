"""Partial updates (unchanged TOAST values) keep the large value in every store: within one micro-batch
(the runtime fills it from the batch's earlier event) and across batches (the store keeps what it holds)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import read_topic, scratch_database, wait_for
from tests.integration._sinks_helpers import SinksProcess, Stack, assert_verified, cdc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# 20 kB that pglz cannot shrink below the TOAST threshold: stored out of line, so an UPDATE that leaves it
# alone does not send it.
BIG = "SELECT string_agg(md5(g::text || %s), '') FROM generate_series(1, 640) g"


def test_unchanged_toast_values_survive_in_every_store(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    prefix = f"x{unique}"
    with scratch_database(pg_dsn, f"toast_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text, qty int)")
        cfg = stack.config(dsn, ["public.docs"], prefix=prefix, unique=unique, workdir=tmp_path)
        capture = cfg.start(tmp_path)
        config = tmp_path / "cdc.toml"
        sinks = SinksProcess(config, tmp_path / "sinks.log")
        try:
            capture.wait_streaming(180)
            with psycopg.connect(dsn, autocommit=True) as conn:
                for i in (1, 2):  # inserted, then updated without touching body: both in the sinks' first batch
                    conn.execute(f"INSERT INTO docs VALUES (%s, ({BIG}), 0)", (i, f"seed{i}"))
                    conn.execute("UPDATE docs SET qty = 1 WHERE id = %s", (i,))
            topic = f"{prefix}.public.docs"
            wait_for(lambda: len(read_topic(stack.kafka, stack.registry, topic)) >= 4, 120, "the events", None)
            partial = [e for e in read_topic(stack.kafka, stack.registry, topic) if e.value and e.value["op"] == "u"]
            assert partial, "no update events"
            assert all(e.value is not None and e.value["unchanged_toast"] == ["body"] for e in partial)
            sinks.start()
            result = cdc("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
            assert_verified(result, ("search", "cache", "warehouse"), f"(one batch)\n{sinks.tail()}")
            with psycopg.connect(dsn, autocommit=True) as conn:  # now a partial update in a batch of its own
                conn.execute("UPDATE docs SET qty = 2 WHERE id = 1")
            result = cdc("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
            assert_verified(result, ("search", "cache", "warehouse"), "(later batch)")
            assert sinks.stop() == 0, sinks.tail()
        finally:
            if sinks.alive():
                sinks.kill()
            capture.stop()
