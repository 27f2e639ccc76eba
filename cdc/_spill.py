"""Streamed transactions: their changes on disk until they commit (replayed then) or abort (dropped).

PostgreSQL streams a transaction larger than its logical_decoding_work_mem before it commits (protocol 2),
interleaved with other transactions; each one's changes are spilled to a file of its own, so memory stays
bounded and an aborted transaction never reaches Kafka."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from decoders import Relation

SPILL_HEAD = struct.Struct(">QI")  # a spilled message: its LSN and length, then the pgoutput message as received


_SPILL_BLOCK = 4 << 20  # a spill is replayed in blocks of whole messages of about this size
# While a streamed transaction arrives, a read that found less than STREAM_PACE_BELOW waiting (and stopped at
# no other message) is followed by a STREAM_PACE_S pause, so that the backlog is taken in fewer, larger reads
# instead of a wake-up every few messages. The changes are invisible until the transaction commits; a small
# transaction committed meanwhile waits at most one pause more. Measured (the 1 GB transaction: the walsender and
# our reader both spend less per row, 0.69-0.73x -> 0.75-0.93x of pg_recvlogical under TLS) and what is not
# understood: docs/design/capture-hot-path.md.
STREAM_PACE_S = 0.001
STREAM_PACE_BELOW = 256 * 1024
SPILL_READ = 1 << 20  # how much of a streamed transaction's changes are read at most in one call


@dataclass
class Spill:
    """The changes of one streamed transaction, on disk until it commits or aborts: the messages as they
    arrived (they carry their subtransaction's xid after the type byte), each after its LSN and length
    (SPILL_HEAD), replayed in blocks of whole messages."""

    file: IO[bytes]
    aborted_subxids: set[int] = field(default_factory=set)
    block: int = _SPILL_BLOCK
    size: int = 0
    cuts: list[int] = field(default_factory=list)  # where a block ends: after a whole message
    # relation id -> (when it arrived, among all Relation messages of the session; the last Relation of it here)
    relations: dict[int, tuple[int, Relation]] = field(default_factory=dict)

    def add(self, lsn: int, payload: bytes | memoryview) -> None:
        self.file.write(SPILL_HEAD.pack(lsn, len(payload)))
        self.file.write(payload)
        self._grew(SPILL_HEAD.size + len(payload))

    def add_framed(self, framed: bytes) -> None:
        """Messages framed as :meth:`add` writes them (ReplicationConnection.read_changes), one after another."""
        self.file.write(framed)
        self._grew(len(framed))

    def _grew(self, written: int) -> None:
        """``written`` bytes of whole messages were added: a block ends here once it is large enough."""
        self.size += written
        if self.size - (self.cuts[-1] if self.cuts else 0) >= self.block:
            self.cuts.append(self.size)

    def blocks(self) -> Iterator[bytes]:
        self.file.flush()
        self.file.seek(0)
        done = 0
        for cut in (*self.cuts, self.size):
            if cut > done:
                yield self.file.read(cut - done)
                done = cut

    def close(self) -> None:
        self.file.close()


__all__ = ["SPILL_HEAD", "SPILL_READ", "STREAM_PACE_BELOW", "STREAM_PACE_S", "Spill"]
