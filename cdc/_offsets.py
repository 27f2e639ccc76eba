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

Format 1 is the same record without ``version``; a table begun when each table was read in one range keeps its
last key in the table's own ``after``. Both are read and resumed as they are. Format 2 keeps format 1's keys
and meanings, so a release that reads format 1 also reads what this one writes; a newer format than this
release knows is refused rather than half-understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cdc.errors import StreamError

STATE_VERSION = 2

SnapshotStatus = Literal["running", "done"]


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
class CaptureState:
    """The committed position: streaming resumes after ``lsn`` (None until the capture first knows one)."""

    lsn: int | None = None
    snapshot: SnapshotState | None = None

    @property
    def snapshot_running(self) -> bool:
        return self.snapshot is not None and self.snapshot.running

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": STATE_VERSION}
        if self.lsn is not None:
            out["lsn"] = self.lsn
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CaptureState:
        """A state of format 1 (no ``version``) or 2; anything else raises OffsetsStateError."""
        raw = _mapping(raw, "the offsets record")
        version = raw.get("version", 1)
        if not _is_int(version) or not 1 <= version <= STATE_VERSION:
            raise NewerStateError(
                f"the offsets record has format {version!r}; this release of pgcdc reads formats 1 to "
                f"{STATE_VERSION}. It was written by a newer release: run that release, or upgrade this one"
            )
        lsn = raw.get("lsn")
        snapshot = raw.get("snapshot")
        return cls(
            lsn=_optional_int(lsn, "lsn"),
            snapshot=None if snapshot is None else SnapshotState.from_json(snapshot),
        )


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


def _key(value: Any, name: str) -> list[str] | None:
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise OffsetsStateError(f"{name} is not a key (a list of column values as text): {value!r}")
    return value


__all__ = [
    "STATE_VERSION",
    "CaptureState",
    "NewerStateError",
    "OffsetsStateError",
    "RangeProgress",
    "SnapshotState",
    "TableProgress",
]
