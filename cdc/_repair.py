"""Repair of drift: backfills of only the keys that differ (``cdc verify NAME --repair``, ``cdc snapshot TABLE
--keys FILE``).

`cdc verify` lists every key it finds missing, extra or different, with the key's columns as PostgreSQL prints
them. A repair hands those keys to the running capture as backfill requests (cdc/_signals.py); the capture reads
each again through the watermark mechanism (cdc/_backfill.py: KeyList): a key the table has is written as a
fresh read, one it no longer has as a delete and a tombstone, both positioned after every event the topic holds
of it, so the topic and every store that replays it converge on the source. Nothing else is re-emitted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from cdc._backfill import parse_keys
from cdc._chunks import key_types, typed_columns
from cdc._config import Settings, load_settings
from cdc._kafka import OffsetStore
from cdc._offsets import BackfillProgress
from cdc._signals import SignalTable
from cdc._source import check_and_prepare
from cdc._standby import source_connections
from pgcdc_common.errors import ConfigError, SourceCheckError, TransientError
from pgcdc_common.topics import split_table_name

# Keys per request: each request is one backfill, its keys kept in its signal row (a few MB of JSON at most).
KEYS_PER_REQUEST = 50_000
REPAIRED_KINDS = ("missing", "extra", "different")


def report_keys(lines: Iterable[str], where: str) -> tuple[list[dict[str, Any]], int]:
    """The keys a `cdc verify` report (``where``) lists as missing, extra or different (each line's
    ``columns``), and how many such lines have none (a key PostgreSQL cannot read back from the store's form, or
    a report from before keys were listed so): a repair cannot re-emit those. Rows that cannot be encoded are
    left out: no event can carry them (capture.on_unencodable)."""
    keys: list[dict[str, Any]] = []
    without = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            raise ConfigError(f"line {number} of {where} is not JSON: {line[:200]!r}") from None
        if not isinstance(item, dict) or item.get("kind") not in (*REPAIRED_KINDS, "unencodable"):
            raise ConfigError(f"line {number} of {where} is not a line of a `cdc verify` report: {line[:200]!r}")
        if item["kind"] == "unencodable":
            continue
        columns = item.get("columns")
        if isinstance(columns, dict):
            keys.append(columns)
        else:
            without += 1
    return keys, without


def request_keys(config: Path | Settings | None, table: str, keys: Sequence[Any]) -> list[tuple[str, int]]:
    """Asks the running capture to backfill ``keys`` of ``table``: checked here (the table captured, each key
    a value of its key columns' types), each key once, sent in requests of :data:`KEYS_PER_REQUEST`. Their
    backfills' ids, and how many keys each has."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    signals = SignalTable(settings.source.signal_table, settings.source.slot)
    # Checks and reads on source.dsn; requests written where they can be: on its primary when it is a standby.
    with source_connections(settings) as (conn, primary):
        writer = primary or conn
        note = signals.ensure(writer)
        if note is not None:
            raise SourceCheckError(note, check="signal-table")
        report = check_and_prepare(conn, settings, dry_run=True, allow_active_slot=True, writer=primary)
        captured = {(t.schema, t.name): t for t in report.tables}
        try:
            info = captured[split_table_name(table)]
        except (KeyError, ValueError):
            known = ", ".join(sorted(t.qualified for t in report.tables))
            raise ConfigError(f"table {table} is not captured: repair one of {known}") from None
        try:
            checked = parse_keys(list(keys), report.key_columns[info.qualified], info.qualified)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        names = report.key_columns[info.qualified]
        types = key_types(conn, info.oid, names)
        _check_values(conn, names, types, checked, settings.capture.backfill_statement_timeout_s)
        batches = [checked[i : i + KEYS_PER_REQUEST] for i in range(0, len(checked), KEYS_PER_REQUEST)]
        return [
            (str(signals.send(writer, "backfill", {"tables": [info.qualified], "keys": batch})), len(batch))
            for batch in batches
        ]


def _check_values(
    conn: psycopg.Connection[Any],
    names: Sequence[str],
    types: Sequence[str],
    keys: list[dict[str, str]],
    timeout_s: float,
) -> None:
    """ConfigError naming the first key PostgreSQL cannot read as its columns' types (in a READ ONLY
    transaction with a statement timeout, rolled back)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET TRANSACTION READ ONLY")
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_s * 1000))))
            conn.execute(
                # A literal, not %s: a quoted identifier may hold a "%s" (see cdc._chunks).
                sql.SQL("SELECT count(*) FROM jsonb_to_recordset({}::jsonb) AS k({})").format(
                    sql.Literal(json.dumps(keys)), typed_columns(names, types)
                )
            )
    except psycopg.Error as exc:
        raise ConfigError(f"a key to repair is not a value of its column's type: {str(exc).strip()}") from None


def wait_for_backfills(config: Path | Settings | None, ids: Sequence[str], timeout_s: float) -> list[BackfillProgress]:
    """The backfills ``ids`` once all are finished (as the capture's committed state says); TransientError when
    ``timeout_s`` passes first (is `cdc run` running?)."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    store = OffsetStore(settings.kafka.client_conf(), settings.offsets_topic, settings.source.slot)
    deadline = time.monotonic() + timeout_s
    finished: dict[str, BackfillProgress] = {}  # kept: the state keeps only the last finished backfills
    while True:
        state = store.load()
        for b in state.backfills if state is not None else []:
            if b.id in ids and b.finished:
                finished[b.id] = b
        if all(i in finished for i in ids):
            return [finished[i] for i in ids]
        if time.monotonic() >= deadline:
            waiting = [i for i in ids if i not in finished]
            raise TransientError(
                f"backfill(s) {', '.join(waiting)} not finished after {timeout_s:g} s: is `cdc run` running? "
                f"(cdc snapshot --list shows them; they go on without this command)"
            )
        time.sleep(1.0)


__all__ = ["KEYS_PER_REQUEST", "REPAIRED_KINDS", "report_keys", "request_keys", "wait_for_backfills"]
