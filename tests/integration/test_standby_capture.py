"""Capture from a hot standby (PostgreSQL 16+): the slot and the decoding on the standby, the writes (heartbeats,
backfill watermarks, the publication, the signal table) on the primary through source.primary_dsn. The topic
equals the primary's table after a workload and after backfills, one of them read while a transaction that changes
its rows is open on the primary and commits inside the chunk's window; the heartbeats written on the primary reach
the standby's stream and keep its slot up while the captured table is idle (2 minutes in the long profile);
`cdc detach` drops the slot on the standby and the publication on the primary.

The primary and the standby are the test's own (PostgreSQL 18, tests/integration/_failover_helpers.py)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import psycopg
import pytest

from cdc.config import load_settings
from cdc.kafka import OffsetStore
from decoders import parse_lsn
from tests.integration._capture_helpers import CdcConfig, CdcProcess, topic_items, wait_for
from tests.integration._failover_helpers import pg18_binaries, primary_and_standby
from tests.integration._sinks_helpers import cdc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

IDLE_S = 120 if os.environ.get("CDC_TEST_LONG", "") not in ("", "0") else 20
LAG_BOUND = 1 << 20  # bytes of WAL the standby's slot may trail what the standby has replayed


@pytest.fixture(scope="module")
def pg18() -> tuple[Path, str | None]:
    return pg18_binaries("capture from a standby needs PostgreSQL 16+")


def _items(dsn: str) -> dict[int, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, name, qty FROM items")}


def _backfill(config: Path, proc: CdcProcess, *, then: object = None, held: int = 0) -> str:
    """`cdc snapshot public.items`, until the capture lists it done (its id); ``then`` is called once the capture
    holds the first chunk's window open (its ``held``-th such log line and one more)."""
    asked = cdc("snapshot", "public.items", "--config", str(config))
    assert asked.returncode == 0, asked.stdout + asked.stderr
    backfill = asked.stdout.split()[1].rstrip(":")
    if callable(then):
        wait_for(lambda: proc.tail(10_000).count("window held open") > held, 120, "a chunk's window", proc)
        then()
    wait_for(
        lambda: any(
            line.startswith(f"{backfill}\t") and "\tdone\t" in line
            for line in cdc("snapshot", "--list", "--config", str(config)).stdout.splitlines()
        ),
        300,
        "the backfill on the standby",
        proc,
    )
    return backfill


def _committed_lsn(config: Path) -> int:
    """The position the capture last committed to Kafka (its own heartbeat commits one when idle)."""
    settings = load_settings(config)
    state = OffsetStore(settings.kafka.client_conf(), settings.offsets_topic, settings.source.slot).load()
    return state.lsn if state is not None and state.lsn is not None else 0


def _primary_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return parse_lsn(str(row[0]))


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

        cfg.source_extra = f'primary_dsn = "{primary.dsn.removesuffix("/postgres")}/template1"'
        cfg.write(config)
        refused = cdc("attach", "--dry-run", "--config", str(config))
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "name the same database on both" in refused.stderr, refused.stderr

        cfg.source_extra = f'primary_dsn = "{primary.dsn}"'
        cfg.write(config)
        checked = cdc("attach", "--dry-run", "--config", str(config))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        proc = CdcProcess(config, tmp_path / "cdc.log")
        proc.env["CDC_TEST_CHUNK_HOLD_S"] = "4"  # each backfill chunk's window stays open 4 s after its snapshot
        proc.start()
        try:
            proc.wait_streaming(180)
            with psycopg.connect(primary.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(101, 150) g")
                conn.execute("UPDATE items SET qty = qty + 1000 WHERE id % 3 = 0")
                conn.execute("DELETE FROM items WHERE id % 10 = 0")
            _backfill(config, proc)
            want = _items(primary.dsn)
            wait_for(lambda: topic_items(kafka_bootstrap, registry_url, topic) == want, 120, "the topic", proc)

            # A transaction open on the primary when a chunk's snapshot is taken on the standby, committed inside
            # the chunk's window. A later transaction has committed first, so the standby's snapshot has the open
            # one's xid below its xmax, and PostgreSQL does not list it as running there: only the replay position
            # tells that the chunk did not see it (cdc._window.ReplaySnapshot). Its rows must end as it wrote them.
            with psycopg.connect(primary.dsn) as open_tx, psycopg.connect(primary.dsn, autocommit=True) as other:
                open_tx.execute("UPDATE items SET qty = -qty - 1 WHERE id <= 5")
                other.execute("UPDATE items SET name = name || '!' WHERE id = 150")
                held = proc.tail(10_000).count("window held open")
                backfill = _backfill(config, proc, then=open_tx.commit, held=held)
            want = _items(primary.dsn)
            assert all(qty < 0 for _, qty in (want[i] for i in range(1, 6)))
            # The rule fired: the chunk left out the rows the open transaction changed (its events are newer).
            written = re.search(rf"backfill {backfill} of public\.items done: (\d+) row", proc.tail(10_000))
            assert written is not None, proc.tail()
            assert int(written.group(1)) <= len(want) - 5, written.group(0)
            wait_for(lambda: topic_items(kafka_bootstrap, registry_url, topic) == want, 120, "the topic", proc)

            # Idle: the captured table takes no change; the heartbeats written on the primary move the slot, and
            # reach the stream (the capture commits its position on its own heartbeat, and only then when idle).
            idle_from = _primary_lsn(primary.dsn)
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
            assert _committed_lsn(config) > idle_from, "no heartbeat from the primary reached the stream"
        finally:
            proc.stop()
        with psycopg.connect(primary.dsn) as conn:
            logical = conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical'").fetchall()
        assert logical == [], "the capture made a slot on the primary"

        detached = cdc("detach", "--yes", "--config", str(config))
        assert detached.returncode == 0, detached.stdout + detached.stderr
        with psycopg.connect(standby.dsn) as conn:
            slots = conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchall()
        with psycopg.connect(primary.dsn) as conn:
            pubs = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (f"p_{unique}",)).fetchall()
        assert (slots, pubs) == ([], []), detached.stdout

        # The standby is promoted under a running capture: it goes on, now writing on the promoted server (the old
        # primary, still up here, takes nothing more), and the topic follows the promoted server's table.
        cfg.slot = f"s2_{unique}"
        workdir = tmp_path / "promotion"  # a log of its own: the first capture's says "streaming" too
        workdir.mkdir()
        proc = cfg.start(workdir)
        try:
            proc.wait_streaming(180)
            standby.promote()
            with psycopg.connect(standby.dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, 'after ' || g, g FROM generate_series(201, 230) g")
                conn.execute("UPDATE items SET qty = qty + 7 WHERE id % 4 = 0")
            want = _items(standby.dsn)
            wait_for(lambda: topic_items(kafka_bootstrap, registry_url, topic) == want, 180, "the topic", proc)
            # It notices on its next heartbeat, attaches again, and its heartbeats go to the promoted server: an idle
            # capture commits positions past that server's WAL.
            wait_for(lambda: "has been promoted" in proc.tail(10_000), 60, "the capture to see the promotion", proc)
            idle_from = _primary_lsn(standby.dsn)
            wait_for(lambda: _committed_lsn(proc.config) > idle_from, 60, "a heartbeat on the promoted server", proc)
        finally:
            proc.stop()
