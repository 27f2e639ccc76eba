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

Transaction ids: pgoutput gives 32-bit xids, ``pg_current_snapshot()`` 64-bit ones (epoch and xid); a 32-bit
xid is taken as the 64-bit one nearest the snapshot's xmax (xids in flight are within 2^31 of each other).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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

    def sees(self, xid: int) -> bool:
        """Whether a committed transaction ``xid`` (32-bit, as pgoutput gives it) is visible in this snapshot."""
        full = self.full_xid(xid)
        return full < self.xmin or (full < self.xmax and full not in self.xip)


@dataclass
class ChunkWindow:
    """One chunk from the moment its read starts until the stream reaches its high watermark.

    ``before``: the xids of the transactions the stream wrote recently before the read started (they must all be
    visible in the chunk's snapshot). The stream reports each change of the table (:meth:`changed`) with its
    transaction's xid, and a truncate or schema change (:meth:`disturbed`)."""

    before: tuple[int, ...] = ()
    changes: list[tuple[int, bytes]] = field(default_factory=list)  # (xid, key) in stream order
    disturbed_by: str | None = None  # why the chunk must be read again

    def changed(self, xid: int, key: bytes) -> None:
        self.changes.append((xid, key))

    def disturbed(self, why: str) -> None:
        if self.disturbed_by is None:
            self.disturbed_by = why

    def stale(self, snapshot: XidSnapshot) -> str | None:
        """Why the chunk read in ``snapshot`` cannot be used (it must be read again), or None."""
        if self.disturbed_by is not None:
            return self.disturbed_by
        xmin = snapshot.xmin & (_XID_SPAN - 1)
        for xid in self.before:
            # Below xmin (modulo 2^32): visible without looking further; most are, and there are thousands.
            if (xid - xmin) & (_XID_SPAN - 1) >= _HALF:
                continue
            if not snapshot.sees(xid):
                return f"transaction {xid}, already written, was not yet visible to the chunk's snapshot"
        return None

    def dropped(self, snapshot: XidSnapshot) -> set[bytes]:
        """The keys whose rows the chunk must not write: changed by a transaction ``snapshot`` does not see."""
        return {key for xid, key in self.changes if not snapshot.sees(xid)}


def keep_rows(keys: Iterable[bytes], dropped: set[bytes]) -> list[int]:
    """The indexes of the chunk's rows to write (``keys``: each row's key, in order)."""
    return [i for i, key in enumerate(keys) if key not in dropped]


__all__ = ["ChunkWindow", "XidSnapshot", "keep_rows"]
