"""Column lists, row filters and masks (source.columns, source.row_filters, source.masks): a column not listed
and a row outside the filter never reach Kafka, in the snapshot, the stream and a backfill alike; a row that
leaves the filter is deleted downstream; a masked column arrives as its keyed hash (or null) in the topic and in
every store; `cdc verify` compares what is published; a publication pgcdc created follows a changed
configuration."""

from __future__ import annotations

import hashlib
import hmac
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastavro
import psycopg
import pytest

from tests.integration._capture_helpers import (
    latest_value_fields,
    read_topic,
    records_to_end,
    scratch_database,
    wait_for,
)
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, assert_verified, cdc, cdc_here

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PUBLISHED = "SELECT id, name, qty, email, note FROM people WHERE id % 2 = 0 ORDER BY id"
FILTERS = """
columns = { "public.people" = ["id", "name", "qty"] }
row_filters = { "public.people" = "id % 2 = 0" }
"""
MASK_KEY = "not-a-real-key-7f3a"
MASKS = f"""
columns = {{ "public.people" = ["id", "name", "qty", "email", "note"] }}
row_filters = {{ "public.people" = "id % 2 = 0" }}
masks = {{ "public.people" = {{ email = "hash", note = "null" }} }}
mask_key = "{MASK_KEY}"
"""


def _hashed(value: str | None) -> str | None:
    """What a hash mask makes of a text value: HMAC-SHA256 of its Avro encoding, computed here with fastavro."""
    if value is None:
        return None
    encoded = io.BytesIO()
    fastavro.schemaless_writer(encoded, "string", value)
    return hmac.new(MASK_KEY.encode(), encoded.getvalue(), hashlib.sha256).hexdigest()


def _raw_values(bootstrap: str, topic: str) -> list[bytes]:
    """Every record value of the topic as bytes, read with a plain consumer."""
    return [msg.value() or b"" for msg in records_to_end(bootstrap, topic)]


def _latest(events: list[Any]) -> dict[int, dict[str, Any] | None]:
    """Each key's state after the topic: its last event's row (None after a delete)."""
    state: dict[int, dict[str, Any] | None] = {}
    for e in events:
        if e.key is None or e.key.get("id") is None:
            continue
        state[e.key["id"]] = None if e.value is None or e.value["op"] == "d" else e.value["after"]
    return state


@SPARK_WORKER
def test_unpublished_columns_and_rows_never_reach_kafka_and_verify_compares_what_is_published(
    *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    prefix = f"f{unique}"
    with scratch_database(pg_dsn, f"filters_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE people (id int PRIMARY KEY, name text, ssn text, qty int, email text, note text)"
            )
            conn.execute(
                "INSERT INTO people SELECT g, 'p' || g, 'ssn-' || g, g, 'p' || g || '@example.com', "
                "CASE WHEN g % 4 = 0 THEN 'private' END FROM generate_series(1, 100) g"
            )
        cfg = stack.config(dsn, ["public.people"], prefix=prefix, unique=unique, workdir=tmp_path)
        cfg.source_extra = MASKS
        capture = cfg.start(tmp_path)
        config = tmp_path / "cdc.toml"
        sinks = InProcessSinks(spark, config, tmp_path / "sinks.log")
        topic = f"{prefix}.public.people"
        try:
            capture.wait_streaming(180)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO people SELECT g, 'p' || g, 'ssn-' || g, g, 'p' || g || '@example.com', 'x' "
                    "FROM generate_series(101, 110) g"
                )
                conn.execute("UPDATE people SET qty = qty + 1000, ssn = 'changed', email = NULL WHERE id <= 10")
                conn.execute("UPDATE people SET id = 301 WHERE id = 4")  # leaves the filter: a delete downstream
                conn.execute("UPDATE people SET id = 302 WHERE id = 5")  # enters it: an insert downstream
                conn.execute("DELETE FROM people WHERE id IN (6, 7)")
                conn.execute("UPDATE people SET name = 'last' WHERE id = 8")  # the event the test waits for
            wait_for(
                lambda: (_latest(read_topic(stack.kafka, stack.registry, topic)).get(8) or {}).get("name") == "last",
                120,
                "the changes",
                capture,
            )
            events = read_topic(stack.kafka, stack.registry, topic)
            assert "ssn" not in [f["name"] for f in latest_value_fields(stack.registry, topic)]
            assert all("ssn" not in (e.value[side] or {}) for e in events if e.value for side in ("before", "after")), (
                "an unpublished column reached Kafka"
            )
            assert all(e.key["id"] % 2 == 0 for e in events if e.key and e.key.get("id") is not None), [
                e.key for e in events if e.key and e.key["id"] % 2
            ]
            assert not any(b"@example.com" in raw or b"private" in raw for raw in _raw_values(stack.kafka, topic))
            live = {k: v for k, v in _latest(events).items() if v is not None}
            with psycopg.connect(dsn) as conn:
                want = {
                    r[0]: {"id": r[0], "name": r[1], "qty": r[2], "email": _hashed(r[3]), "note": None}
                    for r in conn.execute(PUBLISHED)
                }
            assert any(v["email"] is not None for v in want.values())
            assert live == want

            # A backfill reads the table as the stream publishes it.
            asked = cdc("snapshot", "public.people", "--config", str(config))
            assert asked.returncode == 0, asked.stderr
            backfill = asked.stdout.split()[1].rstrip(":")
            wait_for(
                lambda: any(
                    line.startswith(f"{backfill}\t") and "\tdone\t" in line
                    for line in cdc("snapshot", "--list", "--config", str(config)).stdout.splitlines()
                ),
                300,
                "the backfill",
                capture,
            )
            events = read_topic(stack.kafka, stack.registry, topic)
            assert all(e.key["id"] % 2 == 0 for e in events if e.key and e.key.get("id") is not None)
            assert {k: v for k, v in _latest(events).items() if v is not None} == want

            # Every store holds what is published, masked, and verify compares that.
            sinks.start()
            result = cdc_here("verify", "search", "cache", "warehouse", "--config", str(config), "--wait", "300")
            assert_verified(result, ("search", "cache", "warehouse"), sinks.tail())
            assert sinks.stop() == 0, sinks.tail()
        finally:
            if sinks.alive():
                sinks.kill()
            capture.stop()


def test_a_publication_pgcdc_created_follows_a_changed_configuration(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    with scratch_database(pg_dsn, f"filters2_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE people (id int PRIMARY KEY, name text, ssn text, qty int)")
        cfg = stack.config(dsn, ["public.people"], prefix=f"g{unique}", unique=unique, workdir=tmp_path)
        config = cfg.write(tmp_path / "cdc.toml")
        attached = cdc("attach", "--config", str(config))
        assert attached.returncode == 0, attached.stdout + attached.stderr
        cfg.source_extra = FILTERS
        config = cfg.write(tmp_path / "cdc.toml")
        attached = cdc("attach", "--config", str(config))
        assert attached.returncode == 0, attached.stdout + attached.stderr
        assert "cdc snapshot public.people" in attached.stdout + attached.stderr
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT attnames, rowfilter FROM pg_publication_tables WHERE pubname = %s", (cfg.publication,)
            ).fetchone()
        assert row is not None
        assert sorted(row[0]) == ["id", "name", "qty"]
        assert row[1] == "((id % 2) = 0)"
