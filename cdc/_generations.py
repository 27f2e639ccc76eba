"""Topic generations: where a table's events go once its topic cannot take its new schema.

A column's type change the key or value subject cannot take — the registry refuses the new value schema
under the subject's compatibility level (``int`` to ``text``), a decimal's scale changes (which the registry
takes, though earlier events would read wrong), or the key would get a new schema and so every key new bytes
(a key column's decimal scale, an ``int`` key field that must now hold ``bigint``) — cannot go
into the table's topic without breaking its readers or its compaction. With ``capture.on_type_change =
"new-topic"`` the table moves to its next generation: ``<prefix>.<schema>.<table>.g2`` (then ``.g3``…), with
subjects of its own. Its changes from the ALTER on are written there, and a backfill (cdc/_backfill.py) reads
the whole table into it while the stream goes on, so the new generation alone holds the table. The old
generation keeps every event written before, readable from offset zero with its own schemas; nothing more is
written to it. Other tables are not held up. The generation of each table is part of the committed state
(CaptureState.generations), written in the Kafka transaction of the first event in the new topic, with the
backfill's request: a crash before that commit finds the type change again in the replayed stream.

With ``"stop"`` the capture stops (exit 5) and says what changed and the ways on.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cdc._config import Settings
from cdc._kafka import SchemaRefusedError
from cdc._offsets import BackfillProgress, CaptureState
from pgcdc_common.errors import SchemaRegistryError
from pgcdc_common.topics import generation_topic
from schemas import ColumnShape


class KeyChangeError(SchemaRefusedError):
    """A table's key schema would change, and with it the bytes of every framed key (schemas._keys): the
    capture refuses it itself, as a registry refuses an incompatible schema."""

    def __init__(self, table: str, subject: str, before: Sequence[str] = (), after: Sequence[str] = ()) -> None:
        """``before``, ``after``: the key's fields, when they are other ones (a key column renamed, another key)."""
        what = (
            f"its key columns would change from ({', '.join(before)}) to ({', '.join(after)})"
            if list(before) != list(after)
            else "its key schema would change"
        )
        reason = f"{what}, and with it the bytes and partition of every key"
        super().__init__(f"table {table}: {reason}", subject=subject, reason=reason)


class ScaleChangeError(SchemaRefusedError):
    """A decimal column's scale would change in a table's value schema: a registry takes that as compatible
    (Avro's resolution of bytes ignores the logical type), but a reader of the topic from offset zero would
    read the events written before with the new scale, a hundredfold off or more; the capture refuses it."""

    def __init__(self, table: str, subject: str, columns: Sequence[str]) -> None:
        reason = f"the decimal scale of {', '.join(columns)} would change, and older events would read wrong"
        super().__init__(f"table {table}: {reason}", subject=subject, reason=reason)


def scale_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The columns whose decimal scale differs between two value schemas (envelopes) of a table."""
    was, new = registered_columns(before), registered_columns(now)
    out = []
    for name, (_, avro) in new.items():
        b, n = _DECIMAL.search(was.get(name, (None, ""))[1]), _DECIMAL.search(avro)
        if b is not None and n is not None and b.group(2) != n.group(2):
            out.append(name)
    return out


@dataclass(frozen=True)
class TypeChange:
    """What a table's new schema changed that its topic cannot take: the columns whose types differ (name,
    type before, type now; before is None when not known) and the refusal. ``base``: the table's first
    generation's topic; ``generation``: the one it writes to."""

    table: str
    base: str
    generation: int
    columns: tuple[tuple[str, str | None, str], ...]
    subject: str
    reason: str

    def what(self) -> str:
        changed = ", ".join(f"column {name} {before or '?'} → {now}" for name, before, now in self.columns)
        return f"table {self.table}: {changed or 'its columns changed'}"

    @property
    def next_topic(self) -> str:
        return generation_topic(self.base, self.generation + 1)


Known = dict[str, tuple[str | None, str]]  # by column: its PostgreSQL type (None when unknown), its Avro type


def known_columns(columns: Sequence[ColumnShape]) -> Known:
    """The columns' types as a table's codec writes them."""
    return {c.name: (type_text(c), avro_text(c.schema)) for c in columns}


def registered_columns(envelope: Mapping[str, Any]) -> Known:
    """The columns' Avro types in a value schema the capture registered (their PostgreSQL types unknown)."""
    record: Mapping[str, Any] = {}
    for f in envelope.get("fields", ()):
        if f.get("name") == "before" and isinstance(f.get("type"), list):
            record = next((b for b in f["type"] if isinstance(b, dict) and b.get("type") == "record"), {})
    return {f.get("pgcdc.column", f["name"]): (None, avro_text(f["type"])) for f in record.get("fields", ())}


def changed_columns(before: Known, now: Known) -> tuple[tuple[str, str | None, str], ...]:
    """(name, type before, type now) of each column of ``now`` whose Avro type differs from ``before``'s; a
    type before is its PostgreSQL type when known, else ``Avro <type>``."""
    out = []
    for name, (pg, avro) in now.items():
        if name in before and before[name][1] != avro:
            was_pg, was_avro = before[name]
            out.append((name, was_pg or f"Avro {was_avro}", pg or avro))
    return tuple(out)


_DECIMAL = re.compile(r"decimal\((\d+),(\d+)\)")


def rewritten(before: Known, now: Known) -> list[str]:
    """The columns whose values are written otherwise since a type change (a timestamp's zone, a decimal's
    scale, another kind): every store's copy of a row not changed since holds the old form. ``int`` → ``long``
    and a decimal's precision leave every value's form as it was."""
    out = []
    for name, (_, avro) in now.items():
        was = before.get(name, (None, avro))[1]
        if was != avro and not (was == "int" and avro == "long") and not _precision_only(was, avro):
            out.append(name)
    return out


def _precision_only(before: str, now: str) -> bool:
    b, n = _DECIMAL.search(before), _DECIMAL.search(now)
    if b is None or n is None or b.group(2) != n.group(2):
        return False
    return _DECIMAL.sub("", before) == _DECIMAL.sub("", now)


def type_text(col: ColumnShape) -> str:
    """A column's type as PostgreSQL prints it, with its length or precision."""
    name, typmod = col.pgtype.name, col.typmod
    if typmod >= 4 and name == "numeric":
        return f"numeric({(typmod - 4) >> 16},{(typmod - 4) & 0xFFFF})"
    if typmod >= 4 and name in ("varchar", "bpchar"):
        return f"{name}({typmod - 4})"
    return name


def avro_text(schema: Any) -> str:
    """An Avro type in brief: ``int``, ``decimal(10,2)|string``; null branches left out."""
    if isinstance(schema, list):
        return "|".join(avro_text(s) for s in schema if s != "null")
    if isinstance(schema, dict):
        if schema.get("logicalType") == "decimal":
            return f"decimal({schema.get('precision')},{schema.get('scale', 0)})"
        named = schema.get("name")  # a named type by its short name, as a later reference to it may be full
        return str(
            schema.get("logicalType") or (named and str(named).rsplit(".", 1)[-1]) or avro_text(schema.get("type"))
        )
    return str(schema).rsplit(".", 1)[-1]


class Generations:
    """Each table's topic generation, read from and recorded in the committed state; owns the moves."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._state: CaptureState | None = None
        self._lock = threading.Lock()

    def bind(self, state: CaptureState) -> None:
        """The state the capture commits: generations are read from it and moves recorded in it."""
        self._state = state

    def of(self, qualified: str) -> int:
        state = self._state
        return state.generations.get(qualified, 1) if state is not None else 1

    def move(self, change: TypeChange) -> str:
        """Record the table's next generation and the backfill that fills it; the new generation's topic."""
        with self._lock:
            state = self._state
            if state is None:  # codecs are built once the state is loaded: a bug, not a user's error
                raise RuntimeError(f"{change.what()}: no committed state to record a new topic generation in")
            generation = change.generation + 1
            state.generations[change.table] = generation
            state.backfills.append(
                BackfillProgress(f"{change.table}.g{generation}", change.table, reason="type-change")
            )
            return generation_topic(change.base, generation)

    def refill(self, table: str, columns: Sequence[str]) -> str | None:
        """Queue a backfill of ``table`` (written to its topic as it is), so that the rows not changed since
        ``columns`` changed their form reach every store in the new one; its id, None when one is queued or
        running already."""
        with self._lock:
            state = self._state
            if state is None:
                raise RuntimeError(f"table {table}: no committed state to record a backfill in")
            mine = [b for b in state.backfills if b.table == table and b.reason == "type-change"]
            if any(not b.finished for b in mine):
                return None
            backfill = BackfillProgress(f"{table}.type-change.{len(mine) + 1}", table, reason="type-change")
            state.backfills.append(backfill)
            return backfill.id

    def stop_error(self, change: TypeChange) -> SchemaRegistryError:
        """Why ``capture.on_type_change = "stop"`` stops, and the ways on."""
        config = f"{_without_credentials(self._settings.registry.url)}/config/{change.subject}"
        return SchemaRegistryError(
            f"{change.what()}, which subject {change.subject!r} cannot take ({change.reason}). Nothing after the "
            "last commit was acknowledged to PostgreSQL, so no change is lost. Ways on: set "
            f'capture.on_type_change = "new-topic" and run again: the table moves to topic {change.next_topic!r}, '
            "which a backfill fills while the other tables go on; or relax the subject's compatibility (curl -X "
            "PUT -H 'Content-Type: application/vnd.schemaregistry.v1+json' -d '{\"compatibility\": \"NONE\"}' "
            f"{config}) and run again, after which events written before the change no longer read with the "
            "newest schema (docs/events.md, Type changes)"
        )


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")
