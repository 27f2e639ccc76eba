"""Whether a standby is ready to take over the capture's slot when it is promoted (PostgreSQL 17+ failover slots).

A failover slot (``source.failover``, created so by ``cdc run``) is copied to every standby that synchronizes
slots; a promoted standby then holds the slot at a position no further than what the capture confirmed, and
``cdc run`` against it resumes from the position committed to Kafka: nothing lost, nothing doubled. That needs,
on the standby, ``wal_level = logical``, ``sync_replication_slots`` and ``hot_standby_feedback`` on, a physical
``primary_slot_name`` and a ``dbname`` in ``primary_conninfo``; on the primary, that physical slot listed in
``synchronized_standby_slots``, so that no change reaches the capture before the standby has it (else a promoted
standby's copy could be behind what Kafka holds). ``cdc attach --standby DSN`` runs these checks.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr

from cdc._config import Settings
from cdc._source import translate_pg_error
from cdc.errors import SourceCheckError

FAILOVER_SINCE = 170000  # failover slots and their synchronization: PostgreSQL 17


def check_standby(primary: psycopg.Connection[Any], settings: Settings, standby_dsn: str) -> list[str]:
    """What the standby at ``standby_dsn`` and the primary lack for the capture's slot to survive a promotion;
    raises SourceCheckError listing every gap, returns notes (the slot not synchronized yet, say)."""
    source = settings.source.model_copy(update={"dsn": SecretStr(standby_dsn)})
    where = source.display_dsn()
    try:
        standby = psycopg.connect(source.conninfo(), autocommit=True)
    except psycopg.Error as exc:
        raise translate_pg_error(exc, where) from exc
    with standby:
        missing, notes = _gaps(primary, standby, settings)
    if missing:
        raise SourceCheckError(
            f"standby {where} cannot take over replication slot {settings.source.slot!r} at a failover: "
            + "; ".join(missing),
            check="failover-standby",
        )
    return notes


def _gaps(
    primary: psycopg.Connection[Any], standby: psycopg.Connection[Any], settings: Settings
) -> tuple[list[str], list[str]]:
    slot = settings.source.slot
    version = primary.info.server_version
    if version < FAILOVER_SINCE:
        return [f"failover slots need PostgreSQL 17 or later; the primary runs {version // 10000}"], []
    missing: list[str] = []
    if not settings.source.failover:
        missing.append("source.failover is false: set it to true (the slot is altered at the next `cdc run`)")
    if _setting(standby, "SELECT pg_is_in_recovery()::text") != "true":
        return [*missing, "it is not a standby (pg_is_in_recovery() is false)"], []
    if _setting(standby, "SELECT current_setting('wal_level')") != "logical":
        missing.append("set wal_level = logical on the standby (slot synchronization needs it) and restart it")
    for name, why in (
        ("sync_replication_slots", "so that it keeps a copy of the slot"),
        ("hot_standby_feedback", "so that the primary keeps the catalog rows the copy needs"),
    ):
        if _setting(standby, "SELECT current_setting(%s)", (name,)) != "on":
            missing.append(f"set {name} = on on the standby ({why}) and reload it")
    physical = _setting(standby, "SELECT current_setting('primary_slot_name')")
    if not physical:
        missing.append("set primary_slot_name on the standby to a physical slot of the primary")
    notes = []
    conninfo = _setting(standby, "SELECT current_setting('primary_conninfo', true)")
    if conninfo is None:
        notes.append(
            "this role may not read the standby's primary_conninfo (pg_read_all_settings): check by hand that it "
            "names the captured database (dbname=…), which slot synchronization needs"
        )
    elif "dbname" not in conninfo_to_dict(conninfo):
        missing.append("add dbname=<the captured database> to the standby's primary_conninfo (slot sync needs it)")
    listed = _setting(primary, "SELECT current_setting('synchronized_standby_slots')") or ""
    if physical and physical not in [s.strip().strip('"') for s in listed.split(",")]:
        missing.append(
            f"list the standby's slot {physical!r} in synchronized_standby_slots on the primary, so that no change "
            "reaches the capture before the standby has it"
        )
    notes.insert(
        0, f"standby {standby.info.host}:{standby.info.port} is set up to take over slot {slot!r} at a failover"
    )
    # A copy stays temporary (and a promotion drops it) until the standby has caught up with the slot.
    row = standby.execute(
        "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    if row is None or not row[0]:
        notes.append(
            f"the standby holds no lasting copy of slot {slot!r} yet: one is made once the slot exists and the "
            "standby has caught up with it (a failover before that leaves the capture without its slot)"
        )
    return missing, notes


def _setting(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> str | None:
    """One value; None when the role may not read it (primary_conninfo needs pg_read_all_settings)."""
    try:
        row = conn.execute(query, params).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return None
    return None if row is None or row[0] is None else str(row[0])
