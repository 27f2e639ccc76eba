"""The typed values the pgoutput decoder produces, the decode error, and the LSN helpers.

Field layouts follow PostgreSQL's "Logical Replication Message Formats" (protocol versions 1 to 4) and
``src/backend/replication/logical/proto.c``. Every timestamp is converted from PostgreSQL's epoch
(microseconds since 2000-01-01) to Unix epoch microseconds, so the rest of the system deals with one
epoch only.

The dataclasses are frozen and slotted but do no validation: they sit on the hot path, and the decoder is
the only producer that has to be trusted.

The ``xid`` of Relation, TypeInfo, Insert, Update, Delete, Truncate and LogicalMessage is ``None`` except
inside a block of streamed changes (protocol 2+), where it is the xid of the subtransaction that made the
change, or of the top-level transaction if none did (checked against PostgreSQL 15). A savepoint rolled
back after its changes were streamed produces a StreamAbort whose ``subxid`` is that subtransaction's xid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Final

PG_EPOCH_OFFSET_US: Final = 946_684_800 * 1_000_000
"""Microseconds from the Unix epoch (1970-01-01) to PostgreSQL's epoch (2000-01-01)."""

_LSN_MAX: Final = (1 << 64) - 1
_LSN_RE: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")


def format_lsn(lsn: int) -> str:
    """Write an LSN the way PostgreSQL does: two upper-case hex halves, e.g. ``16/B374D848``."""
    if not 0 <= lsn <= _LSN_MAX:
        raise ValueError(f"an LSN is an unsigned 64-bit integer, got {lsn}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """Read an LSN written as ``X/Y`` (each half 1 to 8 hex digits, either case) into an integer."""
    match = _LSN_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not an LSN (expected two hex numbers of up to 8 digits, like '16/B374D848'): {text!r}")
    return (int(match[1], 16) << 32) | int(match[2], 16)


class Unchanged:
    """The type of :data:`UNCHANGED`: a column value PostgreSQL did not send because it did not change.

    pgoutput marks an unchanged out-of-line TOAST value with kind ``u`` instead of sending it again, so
    the receiver must keep (or fetch) the previous value. Value converters return :data:`UNCHANGED` for
    such a column; there is only ever one instance, so compare with ``is``.
    """

    __slots__ = ()
    _instance: ClassVar[Unchanged | None] = None

    def __new__(cls) -> Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        # Pickle by name, so that unpickling yields the singleton rather than a second instance.
        return "UNCHANGED"


UNCHANGED: Final = Unchanged()
"""The one value that stands for an unchanged out-of-line TOAST column (tuple kind ``u``)."""


class DecodeError(ValueError):
    """Bytes that do not follow the protocol: truncated, an unknown message or tuple kind, trailing data.

    ``offset`` is the byte position in the payload where decoding failed; ``kind`` is the message's type
    byte as a one-character string (``None`` when the payload was empty).
    """

    def __init__(self, message: str, *, offset: int, kind: str | None) -> None:
        super().__init__(f"{message} (at offset {offset})")
        self.offset = offset
        self.kind = kind

    def __reduce__(self) -> tuple[object, ...]:
        # The keyword-only arguments would otherwise be lost when the error crosses a process boundary.
        return (_rebuild_decode_error, (str(self), self.offset, self.kind))


def _rebuild_decode_error(text: str, offset: int, kind: str | None) -> DecodeError:
    err = DecodeError.__new__(DecodeError)
    ValueError.__init__(err, text)
    err.offset = offset
    err.kind = kind
    return err


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a :class:`Relation`: flags (bit 0 = part of the replica identity), name, type."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """Whether the column belongs to the replica identity (all columns under REPLICA IDENTITY FULL)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class TupleData:
    """A row as pgoutput sends it, one entry per published column, in the Relation's column order.

    ``kinds[i]`` is ``ord("n")`` (null), ``ord("u")`` (unchanged TOAST), ``ord("t")`` (text) or
    ``ord("b")`` (binary send format); ``values[i]`` is the raw bytes for ``t`` and ``b``, ``None``
    for ``n`` and ``u``.
    """

    kinds: bytes
    values: tuple[bytes | None, ...]


@dataclass(frozen=True, slots=True)
class Begin:
    """Start of a (non-streamed) transaction; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: int
    commit_time_us: int
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    """End of a (non-streamed) transaction."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class Origin:
    """The replication origin the transaction came from, and the LSN of its commit on that origin."""

    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Relation:
    """A table's description, sent before its first change in a session and again after DDL.

    ``namespace`` is ``"pg_catalog"`` where the wire carries an empty string (pgoutput's abbreviation);
    ``replica_identity`` is one of ``d`` (default), ``n`` (nothing), ``f`` (full), ``i`` (index).
    """

    xid: int | None
    relid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """The name of a non-built-in data type used by a column (the ``Y`` message)."""

    xid: int | None
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    """A new row."""

    xid: int | None
    relid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    """A changed row; ``old`` is the old key (``old_kind`` ``K``) or whole old row (``O``), if sent."""

    xid: int | None
    relid: int
    old: TupleData | None
    old_kind: str | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    """A deleted row: its replica identity key (``old_kind`` ``K``) or whole old row (``O``)."""

    xid: int | None
    relid: int
    old: TupleData
    old_kind: str


@dataclass(frozen=True, slots=True)
class Truncate:
    """One TRUNCATE statement over one or more published tables."""

    xid: int | None
    relids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` payload (sent only with the ``messages`` option)."""

    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Start of a block of changes of an in-progress transaction (protocol 2+, ``streaming`` on)."""

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """End of a block of streamed changes."""


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """Commit of a streamed transaction: apply its streamed blocks now."""

    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """Abort of a streamed transaction (``subxid == xid``) or of one of its subtransactions.

    ``abort_lsn`` and ``abort_time_us`` are only sent in protocol 4 with ``streaming 'parallel'``.
    """

    xid: int
    subxid: int
    abort_lsn: int | None
    abort_time_us: int | None


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    """Start of a prepared transaction's changes (protocol 3+, ``two_phase`` on)."""

    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """End of a prepared transaction's changes: PREPARE TRANSACTION ran."""

    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    """COMMIT PREPARED of a transaction whose changes were sent at PREPARE time."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    """ROLLBACK PREPARED of a transaction whose changes were sent at PREPARE time."""

    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_time_us: int
    rollback_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    """PREPARE TRANSACTION of a transaction whose changes were streamed (protocol 3+)."""

    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str


Message = (
    Begin
    | Commit
    | Origin
    | Relation
    | TypeInfo
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
"""Every message :meth:`PgOutputDecoder.decode` can return."""
