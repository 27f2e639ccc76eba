"""Which rows of a backfill chunk may be written: the watermark rule, as pure logic.

A backfill reads a table in keyset chunks while the stream goes on (the DBLog idea: Andreakis &
Papapanagiotou, 2020). A chunk is read in one MVCC snapshot S; then a high watermark H is written through the
WAL (a non-transactional logical message, so it arrives in the stream at its place in the WAL). The chunk's
rows are written to Kafka when the stream reaches H, as snapshot reads positioned at H. For every key of the
chunk that must be right:

- a transaction S sees committed before S, so its commit record is in the WAL before H: its events are written
  before the chunk's rows, and the row already holds its effect (the row is at least as new);
- a transaction S does not see that the stream writes before H (it committed after S, or committed in the WAL
  before S was taken but was not yet visible: PostgreSQL's visibility order is not its commit order) changed
  the row after the version read: its keys are **dropped** from the chunk (the stream's event is the newer);
- a transaction whose commit is after H in the WAL is written after the chunk's rows, and supersedes them.

So the rule needs the keys each transaction changed between the moment the chunk's read started and H, with
the transaction's id, and S itself (``pg_current_snapshot()`` in the reading transaction). A transaction the
stream wrote *before* the read started must be visible in S (else the row would be older than an event already
written, and placed after it): :meth:`ChunkWindow.stale` checks the ones it saw recently, and the chunk is read
again if one is not (it becomes visible microseconds after its commit is flushed). A truncate or a schema change
of the table inside the window makes the chunk read again too.

On a hot standby ``pg_current_snapshot()`` cannot serve: PostgreSQL keeps the transactions running on the primary
in the snapshot's subtransaction array there, which it does not print, so its ``xip`` is always empty. But a
standby makes a transaction visible as it replays its commit record, in WAL order, so a snapshot taken there sees
exactly the commits before some replay position: :class:`ReplaySnapshot` takes ``pg_last_wal_replay_lsn()`` read
just before the snapshot, and counts a commit at or after it as unseen (some of those were seen; dropping their
keys is safe, the stream's events of them being at least as new as the chunk's row).

Transaction ids: pgoutput gives 32-bit xids, ``pg_current_snapshot()`` 64-bit ones (epoch and xid); a 32-bit
xid is taken as the 64-bit one nearest the snapshot's xmax (xids in flight are within 2^31 of each other).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

_XID_SPAN = 1 << 32
_HALF = 1 << 31


@dataclass(frozen=True)
class XidSnapshot:
    """An MVCC snapshot as ``pg_current_snapshot()`` prints it (``xmin:xmax:xip,…``), in 64-bit xids."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> XidSnapshot:
        try:
            xmin, xmax, xip = text.split(":")
            return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))
        except ValueError as exc:
            raise ValueError(f"not a snapshot (xmin:xmax:xip): {text!r}") from exc

    def full_xid(self, xid: int) -> int:
        """The 64-bit xid of a 32-bit one, taken as the nearest to ``xmax``."""
        full = (self.xmax & ~(_XID_SPAN - 1)) | (xid & (_XID_SPAN - 1))
        if full > self.xmax + _HALF:
            full -= _XID_SPAN
        elif full < self.xmax - _HALF:
            full += _XID_SPAN
        return full

    def sees(self, xid: int, commit_lsn: int = 0) -> bool:
        """Whether a committed transaction ``xid`` (32-bit, as pgoutput gives it) is visible in this snapshot."""
        del commit_lsn  # a primary's visibility order is not its WAL order
        full = self.full_xid(xid)
        return full < self.xmin or (full < self.xmax and full not in self.xip)


@dataclass(frozen=True)
class ReplaySnapshot:
    """A snapshot taken on a hot standby, by the replay position read just before it (``replayed``)."""

    replayed: int

    def sees(self, xid: int, commit_lsn: int) -> bool:
        """Whether the transaction whose commit record is at ``commit_lsn`` is surely visible in this snapshot."""
        del xid
        return commit_lsn < self.replayed


class ChunkSnapshot(Protocol):
    """What a chunk's read saw: which committed transactions (by xid and commit LSN) it surely sees."""

    def sees(self, xid: int, commit_lsn: int) -> bool: ...


@dataclass
class ChunkWindow:
    """One chunk from the moment its read starts until the stream reaches its high watermark.

    ``before``: the transactions (xid, commit LSN) the stream wrote recently before the read started (they must
    all be visible in the chunk's snapshot). The stream reports each change of the table (:meth:`changed`) with
    its transaction's xid and commit LSN, and a truncate or schema change (:meth:`disturbed`)."""

    before: tuple[tuple[int, int], ...] = ()
    changes: list[tuple[int, int, bytes]] = field(default_factory=list)  # (xid, commit LSN, key) in stream order
    disturbed_by: str | None = None  # why the chunk must be read again

    def changed(self, xid: int, commit_lsn: int, key: bytes) -> None:
        self.changes.append((xid, commit_lsn, key))

    def disturbed(self, why: str) -> None:
        if self.disturbed_by is None:
            self.disturbed_by = why

    def stale(self, snapshot: ChunkSnapshot) -> str | None:
        """Why the chunk read in ``snapshot`` cannot be used (it must be read again), or None."""
        if self.disturbed_by is not None:
            return self.disturbed_by
        xmin = snapshot.xmin & (_XID_SPAN - 1) if isinstance(snapshot, XidSnapshot) else None
        for xid, commit_lsn in self.before:
            # Below xmin (modulo 2^32): visible without looking further; most are, and there are thousands.
            if xmin is not None and (xid - xmin) & (_XID_SPAN - 1) >= _HALF:
                continue
            if not snapshot.sees(xid, commit_lsn):
                return f"transaction {xid}, already written, was not yet visible to the chunk's snapshot"
        return None

    def dropped(self, snapshot: ChunkSnapshot) -> set[bytes]:
        """The keys whose rows the chunk must not write: changed by a transaction ``snapshot`` does not surely
        see."""
        return {key for xid, commit_lsn, key in self.changes if not snapshot.sees(xid, commit_lsn)}


def keep_rows(keys: Iterable[bytes], dropped: set[bytes]) -> list[int]:
    """The indexes of the chunk's rows to write (``keys``: each row's key, in order)."""
    return [i for i, key in enumerate(keys) if key not in dropped]


__all__ = ["ChunkSnapshot", "ChunkWindow", "ReplaySnapshot", "XidSnapshot", "keep_rows"]
