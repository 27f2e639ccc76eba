"""Capture from a hot standby (PostgreSQL 16+): the slot and the stream on the standby, so the capture's reading
and decoding load the standby, not the primary.

A standby is read-only, so what the capture writes goes to the primary (``source.primary_dsn``) and reaches the
standby's stream through replication: the heartbeats that move an idle slot, the backfill watermarks, the
publication, the signal table. What it reads (the catalogs, the snapshot's and backfills' chunks, the signal
table's rows) it reads on the standby. A chunk read on the standby sees the primary as of the standby's replay
position, a consistent prefix of the primary's commits; its watermark, written on the primary afterwards, reaches
the stream after everything the chunk saw, which is what the backfill's window needs (cdc/_window.py).

PostgreSQL's own requirements, checked by :func:`check_standby_source` (and by ``cdc attach``): ``wal_level =
logical`` on both servers, ``hot_standby_feedback = on`` on the standby (else the primary may vacuum away the
catalog rows the slot needs and PostgreSQL invalidates the slot), best with a physical slot between them
(``primary_slot_name``), which keeps that feedback while the standby is disconnected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg

from cdc._config import Settings
from cdc._source import connect, translate_pg_error
from cdc.errors import CDCError, SourceCheckError, TransientError

log = logging.getLogger(__name__)

STANDBY_SINCE = 160000  # logical decoding on a standby
_NUDGE_S = 0.5


def in_recovery(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def connect_primary(settings: Settings) -> psycopg.Connection[Any] | None:
    """A connection to source.primary_dsn (autocommit), None when it is not set."""
    info = settings.source.primary_conninfo()
    if info is None:
        return None
    try:
        return psycopg.connect(info, autocommit=True)
    except psycopg.Error as exc:
        raise translate_pg_error(exc, settings.source.display_dsn(primary=True)) from exc


@contextmanager
def source_connections(
    settings: Settings, notes: list[str] | None = None, *, checked: bool = True
) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any] | None]]:
    """source.dsn's connection, and its primary's when it is a standby: where the capture reads, and where it
    writes when that is elsewhere. Chosen by what source.dsn is now, so a standby since promoted is read and
    written alone. ``checked``: the standby and its primary pass :func:`check_standby_source` (whose notes go to
    ``notes``, or to the log), and the standby has replayed what the primary had written (a table just created
    there is seen); else the primary is connected only when source.primary_dsn is set and answers. Both are
    closed on the way out."""
    conn = connect(settings)
    primary = None
    try:
        if in_recovery(conn):
            if checked:
                primary = connect_primary(settings)
                said = check_standby_source(conn, primary, settings)
                if notes is not None:
                    notes += said
                for note in said if notes is None else ():
                    log.warning("%s", note)
                assert primary is not None  # check_standby_source refuses without it
                wait_replayed(conn, primary)
            else:
                with suppress(CDCError):
                    primary = connect_primary(settings)
        yield conn, primary
    finally:
        conn.close()
        if primary is not None:
            primary.close()


def check_standby_source(
    standby: psycopg.Connection[Any], primary: psycopg.Connection[Any] | None, settings: Settings
) -> list[str]:
    """What a capture reading from the standby needs of it and of its primary; SourceCheckError naming every gap,
    else notes."""
    version = standby.info.server_version
    if version < STANDBY_SINCE:
        raise SourceCheckError(
            f"source.dsn names a standby of PostgreSQL {version // 10000}; logical decoding on a standby needs 16 "
            "or later: point source.dsn at the primary, or upgrade",
            check="standby-source",
        )
    gaps: list[str] = []
    notes: list[str] = []
    if _setting(standby, "wal_level") != "logical":
        gaps.append("set wal_level = logical on the standby and restart it")
    if _setting(standby, "hot_standby_feedback") != "on":
        gaps.append(
            "set hot_standby_feedback = on on the standby and reload it (without it the primary may remove catalog "
            "rows the slot needs, and PostgreSQL invalidates the slot)"
        )
    delay = _setting(standby, "recovery_min_apply_delay")
    if delay not in ("", "0"):
        notes.append(
            f"the standby applies the primary's WAL {delay} late (recovery_min_apply_delay): every change reaches "
            "the topics that much later"
        )
    if not _setting(standby, "primary_slot_name"):
        notes.append(
            "the standby streams without a physical slot (primary_slot_name): hot_standby_feedback protects the "
            "slot's catalog rows only while it is connected to the primary"
        )
    if primary is None:
        gaps.append(
            "set source.primary_dsn to its primary: a standby is read-only, and the capture writes heartbeats, "
            "backfill watermarks, the publication and the signal table there"
        )
    else:
        gaps += _primary_gaps(standby, primary)
    if gaps:
        raise SourceCheckError(
            f"source.dsn names a standby ({settings.source.display_dsn()}) that cannot be captured from yet: "
            + "; ".join(gaps),
            check="standby-source",
        )
    return notes


def _primary_gaps(standby: psycopg.Connection[Any], primary: psycopg.Connection[Any]) -> list[str]:
    if in_recovery(primary):
        return ["source.primary_dsn names a standby too: name the primary"]
    gaps = []
    if _system(primary) != _system(standby):
        gaps.append("source.primary_dsn names another cluster than the standby's primary (system identifiers differ)")
    elif primary.info.dbname != standby.info.dbname:
        # A slot decodes one database: heartbeats and watermarks written in another never reach the stream.
        gaps.append(
            f"source.primary_dsn names database {primary.info.dbname!r}, the standby's is {standby.info.dbname!r}: "
            "name the same database on both"
        )
    if _setting(primary, "wal_level") != "logical":
        gaps.append("set wal_level = logical on the primary and restart it")
    return gaps


def wait_replayed(standby: psycopg.Connection[Any], primary: psycopg.Connection[Any], timeout_s: float = 60) -> None:
    """Until the standby has replayed what the primary has written so far (a publication just made there, say);
    TransientError after ``timeout_s`` more than the standby's recovery_min_apply_delay."""
    row = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    target = str(row[0])
    delay = standby.execute(
        "SELECT extract(epoch FROM current_setting('recovery_min_apply_delay')::interval)::float8"
    ).fetchone()
    timeout_s += float(delay[0]) if delay is not None and delay[0] is not None else 0.0
    deadline = time.monotonic() + timeout_s
    while True:
        done = standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
        if done is not None and done[0]:
            return
        if time.monotonic() > deadline:
            raise TransientError(
                f"the standby has not replayed the primary's WAL up to {target} in {timeout_s:.0f} s: is it "
                "streaming from source.primary_dsn's server (pg_stat_wal_receiver on the standby)?"
            )
        time.sleep(0.1)


@contextmanager
def nudging(settings: Settings) -> Iterator[None]:
    """While the body runs (a slot being created on the standby), the primary logs its running transactions
    every 0.5 s: the slot's creation waits for such a record, which an idle primary writes only every 15 s."""
    stop = threading.Event()

    def nudge() -> None:
        try:
            conn = connect_primary(settings)
            if conn is None:
                return
            with conn:
                while not stop.wait(_NUDGE_S):
                    conn.execute("SELECT pg_log_standby_snapshot()")
        except (psycopg.Error, CDCError) as exc:  # the slot then waits for the primary
            log.warning(
                "cannot nudge the primary while the slot is created on the standby (%s): the slot waits for the "
                "primary's next record of running transactions (up to 15 s when idle); GRANT EXECUTE ON FUNCTION "
                "pg_log_standby_snapshot() to the capture's user makes it prompt",
                str(exc).strip(),
            )

    thread = threading.Thread(target=nudge, name="pgcdc-standby-nudge", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _setting(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()
    return str(row[0]) if row is not None and row[0] is not None else ""


def _system(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()
    return int(row[0]) if row is not None else 0


__all__ = [
    "STANDBY_SINCE",
    "check_standby_source",
    "connect_primary",
    "in_recovery",
    "nudging",
    "source_connections",
    "wait_replayed",
]
