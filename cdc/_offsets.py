"""What survives a restart: the capture's committed state, typed and versioned.

The state is one JSON record per slot in the offsets topic, written in the same Kafka transaction as the
events it covers (see cdc/_batch.py). It holds the LSN to resume streaming from and, while a snapshot runs,
the snapshot's progress per table and key (or block) range:

    {"version": 2, "lsn": 23861472,
     "snapshot": {"status": "running", "consistent_lsn": 23861472,
                  "tables": {"public.orders": {"since": {"0": 120},
                                               "ranges": [{"after": ["1000"], "upto": ["2000"], "done": false},
                                                          {"after": ["2000"], "upto": null, "done": true}]},
                             "public.items": {"done": true}}}}

Format 3 adds the tables the capture knows (``tables``: a configured table not among them is new, and is
backfilled), the backfills (``backfills``: each one's table, filter, status and the last key it wrote), the
last backfill request taken from the signal table (``signal``) and, per partition of the signal topic, the
offset of the next request to take (``signal_offsets``, e.g. ``{"0": 4}``):

    {"version": 3, "lsn": 23861472, "tables": ["public.items", "public.orders"], "signal": 12,
     "backfills": [{"id": "12", "table": "public.orders", "where": "region = 'eu'", "status": "running",
                    "after": ["1000"], "rows": 1000, "chunks": 1, "reason": "requested"}]}

Format 4 adds, per table moved to another topic generation by a type change (cdc/_generations.py), its
generation (``generations``, e.g. ``{"public.items": 2}``); a state without one is written in format 3, which
releases that do not know generations read.

Format 1 is the same record without ``version``; a table begun when each table was read in one range keeps its
last key in the table's own ``after``. Both are read and resumed as they are. Formats 2 and 3 keep format 1's
keys and meanings; a newer format than this release knows is refused rather than half-understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cdc.errors import StreamError

STATE_VERSION = 4
PLAIN_STATE_VERSION = 3  # the format of a state without generations, which releases before 4 read

SnapshotStatus = Literal["running", "done"]
BackfillStatus = Literal["queued", "running", "paused", "done", "cancelled", "failed"]
BACKFILL_STATUSES = ("queued", "running", "paused", "done", "cancelled", "failed")
BACKFILLS_KEPT = 20  # finished backfills kept in the state (for `cdc snapshot --list`), newest last


class OffsetsStateError(StreamError):
    """The committed state is not one this release can resume from (a newer format, or a damaged record)."""


class NewerStateError(OffsetsStateError):
    """The committed state was written by a newer release, in a format this one does not know."""


@dataclass
class RangeProgress:
    """One range of a table's snapshot: the keys after ``after`` up to ``upto`` (None: no bound), or, for a
    block range, the heap blocks ``blocks`` = [first, after the last or None] of file ``filenode``."""

    after: list[str] | None = None
    upto: list[str] | None = None
    done: bool = False
    blocks: list[int | None] | None = None
    filenode: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"after": self.after, "upto": self.upto, "done": self.done}
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
            out["filenode"] = self.filenode
        return out

    @classmethod
    def from_json(cls, raw: Any) -> RangeProgress:
        raw = _mapping(raw, "a snapshot range")
        blocks = raw.get("blocks")
        if blocks is not None and not (
            isinstance(blocks, list) and len(blocks) == 2 and all(b is None or _is_int(b) for b in blocks)
        ):
            raise OffsetsStateError(f"a snapshot range's blocks are not [first, end]: {blocks!r}")
        return cls(
            after=_key(raw.get("after"), "after"),
            upto=_key(raw.get("upto"), "upto"),
            done=_flag(raw.get("done", False), "done"),
            blocks=None if blocks is None else list(blocks),
            filenode=_optional_int(raw.get("filenode"), "filenode"),
        )


@dataclass
class TableProgress:
    """A table's part of the snapshot. ``since``: its topic's end offsets (partition → offset) when the
    snapshot first started on it, the boundary of a re-snapshot's deletes (cdc/_resnapshot.py).
    ``legacy_after``: the last key read of a table begun in one range by a format-1 release."""

    done: bool = False
    ranges: list[RangeProgress] | None = None
    since: dict[int, int] | None = None
    legacy_after: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        if self.done:
            return {"done": True}  # a done table keeps nothing else: its ranges hold key values
        out: dict[str, Any] = {}
        if self.ranges is not None:
            out["ranges"] = [r.to_json() for r in self.ranges]
        if self.since is not None:
            out["since"] = {str(p): o for p, o in self.since.items()}
        if self.legacy_after is not None:
            out["after"] = self.legacy_after
            out["done"] = False
        return out

    @classmethod
    def from_json(cls, raw: Any) -> TableProgress:
        raw = _mapping(raw, "a table's snapshot progress")
        ranges = raw.get("ranges")
        if ranges is not None and not isinstance(ranges, list):
            raise OffsetsStateError(f"a table's snapshot ranges are not a list: {ranges!r}")
        since = raw.get("since")
        if since is not None:
            since = _mapping(since, "a table's start offsets")
            if not all(_is_int(o) and str(p).isdigit() for p, o in since.items()):
                raise OffsetsStateError(f"a table's start offsets are not partition → offset: {since!r}")
        return cls(
            done=_flag(raw.get("done", False), "done"),
            ranges=None if ranges is None else [RangeProgress.from_json(r) for r in ranges],
            since=None if since is None else {int(p): int(o) for p, o in since.items()},
            legacy_after=_key(raw.get("after"), "after"),
        )


@dataclass
class SnapshotState:
    """The snapshot's progress: ``running`` until every table is ``done``, read as of ``consistent_lsn``."""

    status: SnapshotStatus
    consistent_lsn: int
    tables: dict[str, TableProgress] = field(default_factory=dict)

    @classmethod
    def started(cls, consistent_lsn: int) -> SnapshotState:
        return cls("running", consistent_lsn)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def table(self, qualified: str) -> TableProgress:
        """``qualified``'s progress, created empty the first time the snapshot reaches it."""
        return self.tables.setdefault(qualified, TableProgress())

    def table_done(self, qualified: str) -> bool:
        progress = self.tables.get(qualified)
        return progress is not None and progress.done

    def to_json(self) -> dict[str, Any]:
        tables = {name: progress.to_json() for name, progress in self.tables.items()}
        return {"status": self.status, "consistent_lsn": self.consistent_lsn, "tables": tables}

    @classmethod
    def from_json(cls, raw: Any) -> SnapshotState:
        raw = _mapping(raw, "the snapshot's progress")
        status = raw.get("status")
        if status not in ("running", "done"):
            raise OffsetsStateError(f"the snapshot's status is neither running nor done: {status!r}")
        consistent = raw.get("consistent_lsn")
        if not _is_int(consistent):
            raise OffsetsStateError(f"the snapshot's consistent_lsn is not an LSN: {consistent!r}")
        tables = _mapping(raw.get("tables", {}), "the snapshot's tables")
        return cls(status, int(consistent), {str(n): TableProgress.from_json(t) for n, t in tables.items()})


@dataclass
class BackfillProgress:
    """One backfill: a table (or the rows of it ``where`` selects) read again in chunks while streaming.

    ``after``: the key of the last row written (None: from the first); ``rows``/``chunks``: written so far;
    ``reason``: "requested" (cdc snapshot, the signal table), "added" (a table new to the configuration),
    "keys" (only the keys a request lists: ``cdc verify --repair``, ``cdc snapshot --keys``); ``keys``: the
    signal whose data holds those keys (kept there, not here: the state stays small whatever their number), and
    ``after`` then counts the keys done; ``deleted``: keys it asked for that the table no longer has, written as
    deletes; ``error``: why it failed."""

    id: str
    table: str
    status: BackfillStatus = "queued"
    where: str | None = None
    after: list[str] | None = None
    rows: int = 0
    chunks: int = 0
    reason: str = "requested"
    error: str | None = None
    keys: int | None = None
    deleted: int = 0

    @property
    def finished(self) -> bool:
        return self.status in ("done", "cancelled", "failed")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "table": self.table, "status": self.status, "rows": self.rows}
        out.update(chunks=self.chunks, reason=self.reason)
        if self.keys is not None:
            out.update(keys=self.keys, deleted=self.deleted)
        for name in ("where", "after", "error"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_json(cls, raw: Any) -> BackfillProgress:
        raw = _mapping(raw, "a backfill")
        status = raw.get("status")
        if status not in BACKFILL_STATUSES:
            raise OffsetsStateError(f"a backfill's status is not one of {', '.join(BACKFILL_STATUSES)}: {status!r}")
        return cls(
            id=_text(raw.get("id"), "a backfill's id"),
            table=_text(raw.get("table"), "a backfill's table"),
            status=status,
            where=_optional_text(raw.get("where"), "a backfill's where"),
            after=_key(raw.get("after"), "after"),
            rows=_optional_int(raw.get("rows", 0), "a backfill's rows") or 0,
            chunks=_optional_int(raw.get("chunks", 0), "a backfill's chunks") or 0,
            reason=_text(raw.get("reason", "requested"), "a backfill's reason"),
            error=_optional_text(raw.get("error"), "a backfill's error"),
            keys=_optional_int(raw.get("keys"), "a backfill's keys"),
            deleted=_optional_int(raw.get("deleted", 0), "a backfill's deleted") or 0,
        )


@dataclass
class CaptureState:
    """The committed position: streaming resumes after ``lsn`` (None until the capture first knows one).

    ``tables``: the tables the capture knows (None: not recorded, a state of format 1 or 2); ``backfills``: in
    the order they were requested; ``signal``: the id of the last signal-table request taken;
    ``signal_offsets``: per partition of the signal topic, the offset of the next request to take."""

    lsn: int | None = None
    snapshot: SnapshotState | None = None
    tables: list[str] | None = None
    backfills: list[BackfillProgress] = field(default_factory=list)
    signal: int = 0
    signal_offsets: dict[int, int] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)

    @property
    def snapshot_running(self) -> bool:
        return self.snapshot is not None and self.snapshot.running

    def forget_finished(self) -> None:
        """Keeps only the last :data:`BACKFILLS_KEPT` finished backfills (the state is written with every
        commit)."""
        finished = [b for b in self.backfills if b.finished]
        for old in finished[: max(0, len(finished) - BACKFILLS_KEPT)]:
            self.backfills.remove(old)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": STATE_VERSION if self.generations else PLAIN_STATE_VERSION}
        if self.lsn is not None:
            out["lsn"] = self.lsn
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot.to_json()
        if self.tables is not None:
            out["tables"] = list(self.tables)
        if self.backfills:
            out["backfills"] = [b.to_json() for b in self.backfills]
        if self.signal:
            out["signal"] = self.signal
        if self.signal_offsets:
            out["signal_offsets"] = {str(p): o for p, o in sorted(self.signal_offsets.items())}
        if self.generations:
            out["generations"] = dict(sorted(self.generations.items()))
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CaptureState:
        """A state of format 1 (no ``version``) to 4; anything else raises OffsetsStateError."""
        raw = _mapping(raw, "the offsets record")
        version = raw.get("version", 1)
        if not _is_int(version) or not 1 <= version <= STATE_VERSION:
            raise NewerStateError(
                f"the offsets record has format {version!r}; this release of pgcdc reads formats 1 to "
                f"{STATE_VERSION}. It was written by a newer release: run that release, or upgrade this one"
            )
        snapshot = raw.get("snapshot")
        tables = raw.get("tables")
        if tables is not None and not (isinstance(tables, list) and all(isinstance(t, str) for t in tables)):
            raise OffsetsStateError(f"the known tables are not a list of names: {tables!r}")
        backfills = raw.get("backfills", [])
        if not isinstance(backfills, list):
            raise OffsetsStateError(f"the backfills are not a list: {backfills!r}")
        return cls(
            lsn=_optional_int(raw.get("lsn"), "lsn"),
            snapshot=None if snapshot is None else SnapshotState.from_json(snapshot),
            tables=tables,
            backfills=[BackfillProgress.from_json(b) for b in backfills],
            signal=_optional_int(raw.get("signal", 0), "signal") or 0,
            signal_offsets=_offsets(raw.get("signal_offsets", {})),
            generations=_generations(raw.get("generations", {})),
        )


def _generations(raw: Any) -> dict[str, int]:
    found = _mapping(raw, "the tables' topic generations")
    if not all(isinstance(t, str) and _is_int(g) and g >= 2 for t, g in found.items()):
        raise OffsetsStateError(f"the tables' topic generations are not table names and numbers from 2: {raw!r}")
    return dict(found)


def _offsets(raw: Any) -> dict[int, int]:
    offsets = _mapping(raw, "the signal topic's offsets")
    out = {}
    for partition, offset in offsets.items():
        if not (isinstance(partition, str) and partition.isdigit()) or not _is_int(offset):
            raise OffsetsStateError(f"the signal topic's offsets are not partition: offset pairs: {raw!r}")
        out[int(partition)] = int(offset)
    return out


def _mapping(raw: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise OffsetsStateError(f"{what} is not a JSON object: {raw!r}")
    return raw


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise OffsetsStateError(f"{name} is not a non-negative integer: {value!r}")
    return int(value)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise OffsetsStateError(f"{name} is not true or false: {value!r}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise OffsetsStateError(f"{name} is not a string: {value!r}")
    return value


def _optional_text(value: Any, name: str) -> str | None:
    return None if value is None else _text(value, name)


def _key(value: Any, name: str) -> list[str] | None:
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise OffsetsStateError(f"{name} is not a key (a list of column values as text): {value!r}")
    return value


__all__ = [
    "BACKFILLS_KEPT",
    "BACKFILL_STATUSES",
    "STATE_VERSION",
    "BackfillProgress",
    "BackfillStatus",
    "CaptureState",
    "NewerStateError",
    "OffsetsStateError",
    "RangeProgress",
    "SnapshotState",
    "TableProgress",
]
