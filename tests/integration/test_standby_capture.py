"""Capture from a hot standby (PostgreSQL 16+): the slot and the decoding on the standby, the writes (heartbeats,
backfill watermarks, the publication, the signal table) on the primary through source.primary_dsn. The topic
equals the primary's table after a workload and a backfill, and the standby's slot keeps up while the captured
table is idle (2 minutes in the long profile).

The primary and the standby are the test's own (PostgreSQL 18, tests/integration/_failover_helpers.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg
import pytest
from pgcdc_dev import discovery

from tests.integration._capture_helpers import CdcConfig, topic_items, wait_for
from tests.integration._failover_helpers import primary_and_standby
from tests.integration._sinks_helpers import cdc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

IDLE_S = 120 if os.environ.get("CDC_TEST_LONG", "") not in ("", "0") else 20
LAG_BOUND = 1 << 20  # bytes of WAL the standby's slot may trail what the standby has replayed


@pytest.fixture(scope="module")
def pg18() -> tuple[Path, str | None]:
    try:
        record = discovery.deploy_record("postgres-18")
    except discovery.ServiceUnavailableError as exc:
        if discovery.require_services():
            pytest.fail(f"required service missing (CDC_TEST_REQUIRE_SERVICES is set): {exc}")
        pytest.skip(f"capture from a standby needs PostgreSQL 16+, from the postgres-18 local service: {exc}")
    return Path(record["bindir"]), record.get("service_user")


def _items(dsn: str) -> dict[int, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items")}


def _slot_lag(standby: str, slot: str) -> tuple[int, int]:
    """The standby's replay position and how far its logical slot's confirmed position trails it (bytes)."""
    with psycopg.connect(standby) as conn:
        row = conn.execute(
            "SELECT pg_last_wal_replay_lsn() - '0/0'::pg_lsn, pg_last_wal_replay_lsn() - confirmed_flush_lsn "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None, f"no slot {slot} on the standby"
    return int(row[0]), int(row[1])


def test_a_capture_reads_a_standby_and_writes_only_on_its_primary(
    pg18: tuple[Path, str | None], kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    bindir, user = pg18
    with primary_and_standby(bindir, user, "standby1") as (primary, standby):
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int NOT NULL)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, 100) g")
        slot, topic = f"s_{unique}", f"t{unique}.public.items"
        cfg = CdcConfig(standby.dsn, kafka_bootstrap, registry_url, f"t{unique}", ["public.items"], slot, f"p_{unique}")
        config = cfg.write(tmp_path / "cdc.toml")

        refused = cdc("attach", "--dry-run", "--config", str(config))
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "source.primary_dsn" in refused.stderr, refused.stderr

        cfg.source_extra = f'primary_dsn = "{standby.dsn}"'
        cfg.write(config)
        refused = cdc("attach", "--dry-run", "--config", str(config))
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "names a standby too" in refused.stderr, refused.stderr

        cfg.source_extra = f'primary_dsn = "{primary.dsn}"'
        cfg.write(config)
        checked = cdc("attach", "--dry-run", "--config", str(config))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        proc = cfg.start(tmp_path)
        try:
            proc.wait_streaming(180)
            with psycopg.connect(primary.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(101, 150) g")
                conn.execute("UPDATE items SET qty = qty + 1000 WHERE id % 3 = 0")
                conn.execute("DELETE FROM items WHERE id % 10 = 0")
            asked = cdc("snapshot", "public.items", "--config", str(config))
            assert asked.returncode == 0, asked.stdout + asked.stderr
            backfill = asked.stdout.split()[1].rstrip(":")
            wait_for(
                lambda: any(
                    line.startswith(f"{backfill}\t") and "\tdone\t" in line
                    for line in cdc("snapshot", "--list", "--config", str(config)).stdout.splitlines()
                ),
                300,
                "the backfill on the standby",
                proc,
            )
            want = _items(primary.dsn)
            wait_for(lambda: topic_items(kafka_bootstrap, registry_url, topic) == want, 120, "the topic", proc)

            # Idle: the captured table takes no change; the heartbeats written on the primary move the slot.
            start, _ = _slot_lag(standby.dsn, slot)
            lags = []
            deadline = time.monotonic() + IDLE_S
            while time.monotonic() < deadline:
                lags.append(_slot_lag(standby.dsn, slot)[1])
                time.sleep(1)
            wait_for(lambda: _slot_lag(standby.dsn, slot)[1] < LAG_BOUND, 60, "the slot to catch up", proc)
            assert max(lags[len(lags) // 2 :]) < LAG_BOUND, lags
            end, _ = _slot_lag(standby.dsn, slot)
            assert end > start, "the standby replayed nothing while idle: no heartbeat reached it"
        finally:
            proc.stop()
        with psycopg.connect(primary.dsn) as conn:
            logical = conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical'").fetchall()
        assert logical == [], "the capture made a slot on the primary"
