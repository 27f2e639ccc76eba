"""Rows the capture cannot encode, and what ``capture.on_unencodable`` does with them.

A few legal PostgreSQL values have no Avro form (docs/types.md: a timestamp after 294247 AD, text that is not
UTF-8 in a SQL_ASCII database, …), and a change may arrive without its key (REPLICA IDENTITY NOTHING). Such a
change is always in the WAL again after a restart, so stopping on it is a stop for good unless the user can
choose to go on: with ``"stop"`` (the default) the capture stops naming the table, the key, the column, the
LSN and the way out; with ``"dead-letter"`` the change goes to ``<topic_prefix>.capture-dead-letter`` (JSON:
its table, key, LSN, column, error and the PostgreSQL text form of the row), in the same Kafka transaction as
the events around it, and the capture goes on. docs/bad-input.md lists the cases; ``cdc verify`` names the
dead-lettered keys of a table it finds different.

The row's text form is PostgreSQL's own (a binary value is handed back to the server as a parameter of its type
and read as text), so it shows exactly the value that could not be encoded: it is the one field no encoder of
ours can produce.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import pq

from cdc._encoder import ColumnError, KeyMissingError
from cdc.errors import StreamError
from decoders import format_lsn

log = logging.getLogger(__name__)

DEAD_LETTER_TOPIC = "capture-dead-letter"  # after <topic_prefix>.
Policy = Literal["stop", "dead-letter"]
Produce = Callable[[str, bytes, bytes | None], None]
# A value as it arrived: (how: ord "b" binary, "t" text, "n" null, "u" unchanged TOAST; its bytes or None)
Value = tuple[int, bytes | None]
# Binary values and their type OIDs -> their text forms.
PrintValues = Callable[[list[bytes], list[int]], list[str]]
_BINARY, _TEXT, _UNCHANGED = ord("b"), ord("t"), ord("u")


@dataclass(frozen=True)
class TableColumns:
    """What a dead letter says of a row's table: its name, its columns' names and type OIDs, its key."""

    table: str  # schema.table
    names: tuple[str, ...]
    type_oids: tuple[int, ...]
    key: tuple[int, ...]  # indexes of the key columns


@dataclass(frozen=True)
class Refused:
    """A row change no encoder took: where it is, what it is, and why."""

    columns: TableColumns
    op: str  # c, u, d; r for a snapshot read
    lsn: int
    commit_lsn: int
    error: BaseException
    row: Sequence[Value] | None  # the new row (the old one for a delete); None when it could not be read
    before: Sequence[Value] | None = None  # an update's old row or key, when the change carries one

    @property
    def column(self) -> str | None:
        """The column whose value could not be encoded (the key columns missing, comma-separated)."""
        if isinstance(self.error, ColumnError):
            return self.error.column
        if isinstance(self.error, KeyMissingError):
            return ", ".join(self.error.missing)
        return None


class CaptureDeadLetters:
    """Decides what happens to a :class:`Refused` change and writes its dead letter (``capture.on_unencodable``).

    Owns the dead-letter topic's name and whether it was made; ``print_values`` gives binary values' text form
    (:func:`server_printer`)."""

    def __init__(
        self, policy: Policy, topic_prefix: str, print_values: PrintValues, ensure: Callable[[str], object]
    ) -> None:
        self.policy = policy
        self.topic = f"{topic_prefix}.{DEAD_LETTER_TOPIC}"
        self._print = print_values
        self._ensure = ensure
        self._made = False

    def refuse(self, change: Refused, produce: Produce, count: Callable[[], None]) -> None:
        """Stops (StreamError naming the change and the way out) or writes the dead letter through ``produce``
        and counts it for its table through ``count`` (committed with the batch, as events are)."""
        row = self._text(change.columns, change.row)
        key = _key_of(change.columns, row)
        if self.policy == "stop":
            raise StreamError(self._stop_message(change, key))
        if not self._made:
            self._ensure(self.topic)
            self._made = True
        record = {
            "table": change.columns.table,
            "op": change.op,
            "key": key,
            "lsn": format_lsn(change.lsn),
            "commit_lsn": format_lsn(change.commit_lsn),
            "column": change.column,
            "error": _error_text(change.error),
            "row": row,
            "before": self._text(change.columns, change.before) if change.before is not None else None,
            "ts_ms": time.time_ns() // 1_000_000,
        }
        # Compacted by key: the latest dead letter of each key is kept (one of a row that could not be read
        # keeps its LSN instead).
        kafka_key = json.dumps({"table": change.columns.table, "key": key if key is not None else record["lsn"]})
        produce(self.topic, kafka_key.encode(), json.dumps(record).encode())
        count()
        log.warning(
            "%s: change of key %s at LSN %s written to %s: %s",
            change.columns.table,
            _key_text(key),
            format_lsn(change.lsn),
            self.topic,
            record["error"],
        )

    def _stop_message(self, change: Refused, key: dict[str, str | None] | None) -> str:
        where = (
            f"cannot snapshot a row of {change.columns.table}"
            if change.op == "r"
            else f"cannot capture the change at LSN {format_lsn(change.lsn)}"
        )
        return (
            f"{where}: {_error_text(change.error)} (table {change.columns.table}, key {_key_text(key)}); "
            f'to write such changes to {self.topic} and go on, set capture.on_unencodable = "dead-letter" and '
            "start again (docs/types.md lists the values that cannot be encoded)"
        )

    def _text(self, columns: TableColumns, row: Sequence[Value] | None) -> dict[str, str | None] | None:
        """The row in PostgreSQL's text form, by column name (an unchanged TOAST value: ``"(unchanged)"``)."""
        if row is None:
            return None
        binary = [i for i, (how, raw) in enumerate(row) if how == _BINARY and raw is not None]
        texts = self._print([row[i][1] for i in binary], [columns.type_oids[i] for i in binary])  # type: ignore[misc]
        out: dict[str, str | None] = {}
        for i, (how, raw) in enumerate(row[: len(columns.names)]):
            if how == _TEXT and raw is not None:
                out[columns.names[i]] = raw.decode(errors="backslashreplace")
            elif how == _UNCHANGED:
                out[columns.names[i]] = "(unchanged)"
            else:
                out[columns.names[i]] = None
        for i, text in zip(binary, texts, strict=True):
            out[columns.names[i]] = text
        return out


def server_printer(sql: psycopg.Connection[Any]) -> PrintValues:
    """Binary values of the given types as PostgreSQL prints them, through ``sql`` (autocommit, used from the
    thread that produces); ``\\x…`` hex where it cannot."""

    def print_values(values: list[bytes], oids: list[int]) -> list[str]:
        if not values:
            return []
        query = "SELECT " + ", ".join(f"${i + 1}" for i in range(len(values)))
        try:
            res = sql.pgconn.exec_params(query.encode(), list(values), list(oids), [1] * len(values), pq.Format.TEXT)
            if res.status == pq.ExecStatus.TUPLES_OK:
                return [(res.get_value(0, i) or b"").decode(errors="backslashreplace") for i in range(len(values))]
            error = (res.error_message or b"").decode(errors="replace")
            log.warning("could not print a dead letter's values: %s", error)
        except psycopg.Error as exc:  # the dead letter still says what it can
            log.warning("could not print a dead letter's values: %s", exc)
        return hex_values(values, oids)

    return print_values


def hex_values(values: list[bytes], _oids: list[int]) -> list[str]:
    """Binary values as ``\\x`` and their bytes in hex (what PostgreSQL prints a bytea as)."""
    return ["\\x" + v.hex() for v in values]


def _key_of(columns: TableColumns, row: dict[str, str | None] | None) -> dict[str, str | None] | None:
    """The row's key columns in text form; None when the row could not be read."""
    if row is None:
        return None
    return {columns.names[k]: row.get(columns.names[k]) for k in columns.key}


def _key_text(key: dict[str, str | None] | None) -> str:
    if key is None:
        return "(unknown: the change could not be read)"
    return "(" + ", ".join(f"{k}={v if v is not None else 'NULL'}" for k, v in key.items()) + ")"


def _error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


__all__ = [
    "DEAD_LETTER_TOPIC",
    "CaptureDeadLetters",
    "Policy",
    "PrintValues",
    "Refused",
    "TableColumns",
    "Value",
    "hex_values",
    "server_printer",
]
