"""WAL safety: an idle captured table must not make the slot hold WAL back, and a lost slot is never ignored."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import CdcConfig, CdcProcess, scratch_database, wait_for
from tests.integration._sinks_helpers import cdc

pytestmark = pytest.mark.slow

_LSN = "(pg_current_wal_lsn() - '0/0')::bigint"


def _slot(dsn: str, slot: str) -> tuple[int, int, str]:
    """(bytes the slot has not confirmed, bytes it retains, wal_status); -1 where a lost slot has no position."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT {_LSN} - (confirmed_flush_lsn - '0/0')::bigint, {_LSN} - (restart_lsn - '0/0')::bigint, "
            "wal_status FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    # A heartbeat is acknowledged just past its own position: "unconfirmed" can read -1, i.e. nothing.
    unconfirmed = -1 if row[0] is None else max(0, int(row[0]))
    return unconfirmed, (-1 if row[1] is None else int(row[1])), str(row[2])


def _busy_elsewhere(dsn: str, megabytes: int) -> int:
    """Write about ``megabytes`` of WAL to a table nobody captures; return the WAL bytes written."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = conn.execute(f"SELECT {_LSN}").fetchone()
        for _ in range(megabytes):
            # ~1 MB of barely compressible text per statement (md5 hex), in its own transaction.
            conn.execute(
                "INSERT INTO busy (payload) SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 32000)"
            )
        end = conn.execute(f"SELECT {_LSN}").fetchone()
    assert start is not None
    assert end is not None
    return int(end[0]) - int(start[0])


def _capture(dsn: str, stack: tuple[str, str], slot: str, heartbeat_s: float, workdir: Path) -> CdcProcess:
    """`cdc run` capturing only the idle table ``quiet`` (not started)."""
    kafka, registry = stack
    cfg = CdcConfig(dsn, kafka, registry, f"w{slot}", ["public.quiet"], slot, f"p_{slot}")
    cfg.heartbeat_interval_s = heartbeat_s
    return CdcProcess(cfg.write(workdir / "cdc.toml"), workdir / "cdc.log")


def test_heartbeats_keep_an_idle_slot_from_holding_wal_back(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """The captured table stays idle while another table writes ~48 MB of WAL.

    With heartbeats (1 s here, 10 s by default) the slot's confirmed position follows the server, and the WAL
    it retains on disk (restart_lsn) follows once PostgreSQL logs its next running-transactions record (every
    15 s at most); without them (the control: a heartbeat interval longer than the test) the slot holds all
    of that WAL back.
    """
    results = {}
    with scratch_database(pg_dsn, f"wal_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE quiet (id int PRIMARY KEY)")
            conn.execute("CREATE TABLE busy (id serial PRIMARY KEY, payload text)")
            conn.execute("INSERT INTO quiet VALUES (1)")
        for name, heartbeat in (("with heartbeats", 1.0), ("without heartbeats", 3600.0)):
            slot = f"s_{unique}_{int(heartbeat)}"
            work = tmp_path / str(int(heartbeat))
            work.mkdir()
            proc = _capture(dsn, (kafka_bootstrap, registry_url), slot, heartbeat, work)
            proc.start()
            try:
                proc.wait_streaming(180)
                time.sleep(2)
                written = _busy_elsewhere(dsn, 48)
                done = time.monotonic()
                deadline = done + 45
                while time.monotonic() < deadline and _slot(dsn, slot)[1] > 8 * 2**20:
                    time.sleep(1)
                lag, retained, _status = _slot(dsn, slot)
                results[name] = {
                    "wal_written": written,
                    "slot_unconfirmed": lag,
                    "slot_retained": retained,
                    "seconds_after_the_writes": round(time.monotonic() - done, 1),
                }
            finally:
                proc.stop()
    print(json.dumps(results, indent=2))  # the figures, shown with pytest -s
    with_hb, without = results["with heartbeats"], results["without heartbeats"]
    assert with_hb["wal_written"] > 40 * 2**20
    # With heartbeats the slot has confirmed nearly everything; without, it holds back what was written.
    assert with_hb["slot_unconfirmed"] < 2**20, results
    assert with_hb["slot_retained"] < 8 * 2**20, results
    assert without["slot_unconfirmed"] > 0.9 * without["wal_written"], results
    assert without["slot_retained"] > 0.9 * without["wal_written"], results


def test_a_slot_invalidated_by_max_slot_wal_keep_size_is_reported_with_the_way_out(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    slot = f"s_{unique}_lost"
    with scratch_database(pg_dsn, f"lost_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE quiet (id int PRIMARY KEY)")
            conn.execute("CREATE TABLE busy (id serial PRIMARY KEY, payload text)")
        proc = _capture(dsn, (kafka_bootstrap, registry_url), slot, 1.0, tmp_path)
        proc.start()
        proc.wait_streaming(180)
        proc.stop()  # the capture is down: its slot stays behind while the server writes on
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '32MB'")
                conn.execute("SELECT pg_reload_conf()")
            for _ in range(4):
                _busy_elsewhere(dsn, 24)
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("CHECKPOINT")  # invalidation happens at checkpoints
                if _slot(dsn, slot)[2] == "lost":
                    break
            assert _slot(dsn, slot)[2] == "lost"
        finally:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
                conn.execute("SELECT pg_reload_conf()")
        run = cdc("run", "--config", str(tmp_path / "cdc.toml"), timeout=120)
        assert run.returncode == 3, run.stdout + run.stderr
        assert "was invalidated" in run.stderr
        assert "re-snapshot" in run.stderr
        status = cdc("status", "--config", str(tmp_path / "cdc.toml"), "--json", timeout=120)
        assert status.returncode == 3, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["source"]["wal_status"] == "lost"
        assert any("invalidated" in p and "cdc detach" in p for p in report["problems"]), report["problems"]
        # The way out works: detach, run again (a fresh slot and snapshot).
        detach = cdc("detach", "--yes", "--config", str(tmp_path / "cdc.toml"), timeout=120)
        assert detach.returncode == 0, detach.stdout + detach.stderr
        proc = CdcProcess(tmp_path / "cdc.toml", tmp_path / "cdc2.log")
        proc.start()
        try:
            proc.wait_streaming(180)
            wait_for(lambda: _slot(dsn, slot)[2] in ("reserved", "extended"), 30, "a healthy slot")
        finally:
            proc.stop()
