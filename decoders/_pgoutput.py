"""The pgoutput decoder: the bytes of one logical replication message in, one typed message out.

Layouts: PostgreSQL's "Logical Replication Message Formats" and ``proto.c`` (``logicalrep_write_*``).
This is the capture service's hot path, so fields are read with precompiled ``struct`` unpackers at
known offsets, tuple values are sliced straight out of the payload, and the only per-column Python work
is one branch on the value's kind.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from decoders._messages import (
    PG_EPOCH_OFFSET_US,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    TypeInfo,
    Update,
)

__all__ = ["PgOutputDecoder", "fill_unchanged_from_old"]

_U16: Final = struct.Struct(">H").unpack_from
_U32: Final = struct.Struct(">I").unpack_from
_U32_U32: Final = struct.Struct(">II").unpack_from
_U64: Final = struct.Struct(">Q").unpack_from
_BEGIN: Final = struct.Struct(">QqI")  # final LSN, commit time, xid
_COMMIT: Final = struct.Struct(">BQQq")  # flags, commit LSN, end LSN, commit time
_COLUMN_TYPE: Final = struct.Struct(">Ii").unpack_from  # type OID, type modifier (-1 = none)
_TRUNCATE: Final = struct.Struct(">IB").unpack_from  # number of relations, option bits
_MESSAGE: Final = struct.Struct(">BQ").unpack_from  # flags, LSN
_STREAM_START: Final = struct.Struct(">IB")  # xid, first-segment flag
_STREAM_COMMIT: Final = struct.Struct(">IBQQq")  # xid, flags, commit LSN, end LSN, commit time
_STREAM_ABORT: Final = struct.Struct(">II")  # xid, subxid
_STREAM_ABORT_PARALLEL: Final = struct.Struct(">IIQq")  # xid, subxid, abort LSN, abort time
_BEGIN_PREPARE: Final = struct.Struct(">QQqI")  # prepare LSN, end LSN, prepare time, xid
_PREPARE: Final = struct.Struct(">BQQqI")  # flags, LSN, end LSN, time, xid (also commit prepared)
_ROLLBACK_PREPARED: Final = struct.Struct(">BQQqqI")  # flags, prepare end, rollback end, 2 times, xid

_TRUNCATE_CASCADE: Final = 1
_TRUNCATE_RESTART_IDENTITY: Final = 2
_MESSAGE_TRANSACTIONAL: Final = 1
_REPLICA_IDENTITIES: Final = b"dnfi"
_PG_CATALOG: Final = "pg_catalog"

# Tuple value kinds and tuple markers, as the integers that indexing bytes yields.
_VALUE_KINDS: Final = (ord("t"), ord("b"))  # text, binary: Int32 length and the bytes follow
_NO_VALUE_KINDS: Final = (ord("n"), ord("u"))  # null, unchanged TOAST: nothing follows
_UNCHANGED_KIND: Final = ord("u")
_NEW_TUPLE: Final = ord("N")
_OLD_MARKERS: Final = (ord("K"), ord("O"))  # old key, whole old row

NAMES: Final = {
    ord("B"): "Begin",
    ord("C"): "Commit",
    ord("O"): "Origin",
    ord("R"): "Relation",
    ord("Y"): "Type",
    ord("I"): "Insert",
    ord("U"): "Update",
    ord("D"): "Delete",
    ord("T"): "Truncate",
    ord("M"): "Message",
    ord("S"): "Stream Start",
    ord("E"): "Stream Stop",
    ord("c"): "Stream Commit",
    ord("A"): "Stream Abort",
    ord("b"): "Begin Prepare",
    ord("P"): "Prepare",
    ord("K"): "Commit Prepared",
    ord("r"): "Rollback Prepared",
    ord("p"): "Stream Prepare",
}
"""Message type byte -> the name PostgreSQL's documentation gives the message."""

_STREAMING_KINDS: Final = frozenset(map(ord, "SEcAp"))
_TWO_PHASE_KINDS: Final = frozenset(map(ord, "bPKrp"))

_Handler = Callable[[bytes], Message]


def _cstring(data: bytes, pos: int, kind: int, what: str) -> tuple[str, int]:
    end = data.find(b"\0", pos)
    if end < 0:
        raise DecodeError(f"{NAMES[kind]} message: the {what} has no terminating NUL byte", offset=pos, kind=chr(kind))
    try:
        return data[pos:end].decode(), end + 1
    except UnicodeDecodeError as exc:
        raise DecodeError(
            f"{NAMES[kind]} message: the {what} is not valid UTF-8", offset=pos + exc.start, kind=chr(kind)
        ) from exc


def _read_tuple(data: bytes, pos: int, kind: int) -> tuple[TupleData, int]:
    """TupleData at ``pos``: Int16 column count, then per column a kind byte and, for t/b, Int32 + bytes."""
    (ncols,) = _U16(data, pos)
    pos += 2
    size = len(data)
    kinds = bytearray()
    values: list[bytes | None] = []
    append = values.append
    for _ in range(ncols):
        value_kind = data[pos]
        pos += 1
        if value_kind in _VALUE_KINDS:
            (length,) = _U32(data, pos)
            pos += 4
            end = pos + length
            if end > size:
                raise DecodeError(
                    f"{NAMES[kind]} message: column {len(values)} says {length} bytes follow, only {size - pos} do",
                    offset=pos - 4,
                    kind=chr(kind),
                )
            append(data[pos:end])
            pos = end
        elif value_kind in _NO_VALUE_KINDS:
            append(None)
        else:
            raise DecodeError(
                f"{NAMES[kind]} message: column {len(values)} has unknown value kind {value_kind:#04x} "
                "(expected one of n, u, t, b)",
                offset=pos - 1,
                kind=chr(kind),
            )
        kinds.append(value_kind)
    return TupleData(bytes(kinds), tuple(values)), pos


def _column_spans(data: bytes, pos: int) -> tuple[list[tuple[int, int]], int]:
    """Each column's bytes (kind byte, and length and value for t/b) in the TupleData at ``pos``, as (start, end)
    spans; and the position after the tuple. Raises ValueError on a malformed tuple."""
    (ncols,) = _U16(data, pos)
    pos += 2
    spans = []
    for _ in range(ncols):
        start = pos
        value_kind = data[pos]
        pos += 1
        if value_kind in _VALUE_KINDS:
            pos += 4 + _U32(data, pos)[0]
        elif value_kind not in _NO_VALUE_KINDS:
            raise ValueError(f"unknown value kind {value_kind:#04x}")
        spans.append((start, pos))
    if pos > len(data):
        raise ValueError("truncated tuple")
    return spans, pos


def fill_unchanged_from_old(data: bytes, at: int) -> bytes | None:
    """The Update message ``data`` whose old row ('O', sent under REPLICA IDENTITY FULL) starts at ``at``, with
    each unchanged TOAST value ('u') of its new row replaced by the old row's value of that column: the update
    did not change it, so the old value is the new one. None when nothing is filled (no 'u', or the old row
    lacks those values too). Raises ValueError on a malformed message.

    Why: PostgreSQL sends no value for an out-of-line column an update left alone, and a consumer that does not
    read ``unchanged_toast`` (Flink, Debezium's JDBC sink) would store null; under FULL the value is at hand."""
    if data[at] != ord("O"):
        raise ValueError("the old row is not a full row ('O')")
    old, new_at = _column_spans(data, at + 1)
    if data[new_at] != ord("N"):
        raise ValueError("no new row ('N') after the old row")
    new, end = _column_spans(data, new_at + 1)
    if len(old) != len(new):
        raise ValueError("the old and new rows have different column counts")
    parts = [data[: new_at + 3]]  # up to the new row's column count
    filled = False
    for (old_start, old_end), (start, stop) in zip(old, new, strict=True):
        if data[start] == _UNCHANGED_KIND and data[old_start] in _VALUE_KINDS:
            parts.append(data[old_start:old_end])
            filled = True
        else:
            parts.append(data[start:stop])
    if not filled:
        return None
    parts.append(data[end:])
    return b"".join(parts)


def _check_end(data: bytes, pos: int, kind: int) -> None:
    """The message must end exactly at ``pos``: shorter is truncated, longer means we misread it."""
    if pos != len(data):
        if pos > len(data):
            raise DecodeError(
                f"{NAMES[kind]} message truncated: {len(data)} bytes, its fields need {pos}",
                offset=len(data),
                kind=chr(kind),
            )
        raise DecodeError(
            f"{NAMES[kind]} message: {len(data) - pos} unexpected bytes after its last field "
            "(do the decoder's protocol_version/streaming/parallel match the START_REPLICATION options?)",
            offset=pos,
            kind=chr(kind),
        )


class PgOutputDecoder:
    """Decodes pgoutput messages, one XLogData payload at a time, in stream order.

    Construct it with the options given to ``START_REPLICATION``: ``protocol_version`` (``proto_version``,
    1 to 4), ``streaming`` (``streaming 'on'`` or ``'parallel'``, protocol 2+) and ``parallel``
    (``streaming 'parallel'``, protocol 4+: Stream Abort then carries the abort LSN and time).

    The decoder is stateful: between Stream Start and Stream Stop, the Relation, Type, Insert, Update,
    Delete, Truncate and Message messages carry an xid after their type byte, and the decoder has to know
    whether it is inside such a block. Feed it every message of the stream, in order; use one decoder per
    replication connection. That xid is the one of the (sub)transaction that made the change, so it can
    differ from the Stream Start's: a Stream Abort whose ``subxid`` differs from its ``xid`` discards
    exactly the changes that carried that ``subxid``.
    """

    __slots__ = ("_handlers", "_in_stream", "parallel", "protocol_version", "streaming")

    def __init__(self, protocol_version: int = 1, *, streaming: bool = False, parallel: bool = False) -> None:
        if protocol_version not in (1, 2, 3, 4):
            raise ValueError(
                f"pgoutput protocol_version must be 1, 2, 3 or 4 (PostgreSQL 10+, 14+, 15+, 16+), "
                f"got {protocol_version!r}"
            )
        if streaming and protocol_version < 2:
            raise ValueError("streaming needs pgoutput protocol_version 2 or later (PostgreSQL 14+)")
        if parallel and not (streaming and protocol_version >= 4):
            raise ValueError("parallel streaming needs streaming=True and protocol_version 4 or later (PostgreSQL 16+)")
        self.protocol_version = protocol_version
        self.streaming = streaming
        self.parallel = parallel
        self._in_stream = False
        handlers: dict[int, _Handler] = {
            ord("B"): self._begin,
            ord("C"): self._commit,
            ord("O"): self._origin,
            ord("R"): self._relation,
            ord("Y"): self._type,
            ord("I"): self._insert,
            ord("U"): self._update,
            ord("D"): self._delete,
            ord("T"): self._truncate,
            ord("M"): self._message,
            ord("S"): self._stream_start,
            ord("E"): self._stream_stop,
            ord("c"): self._stream_commit,
            ord("A"): self._stream_abort,
            ord("b"): self._begin_prepare,
            ord("P"): self._prepare,
            ord("K"): self._commit_prepared,
            ord("r"): self._rollback_prepared,
            ord("p"): self._stream_prepare,
        }
        # Messages the negotiated options rule out are refused up front, with the reason: decoding them
        # anyway would misread every later message (the xid prefix depends on the stream state).
        if not streaming:
            for kind in _STREAMING_KINDS:
                handlers[kind] = _refuse(kind, "streaming was not enabled (streaming=True, protocol 2+)")
        if protocol_version < 3:
            for kind in _TWO_PHASE_KINDS:
                handlers[kind] = _refuse(kind, "two-phase messages need protocol_version 3 or later")
        self._handlers = handlers

    @property
    def in_stream(self) -> bool:
        """Whether the last message opened a block of streamed changes (Stream Start without its Stop)."""
        return self._in_stream

    def decode(self, payload: bytes | memoryview) -> Message:
        """Decode one pgoutput message (an XLogData payload); raises :class:`DecodeError` if malformed."""
        data = payload if type(payload) is bytes else bytes(payload)
        if not data:
            raise DecodeError("empty pgoutput message", offset=0, kind=None)
        kind = data[0]
        handler = self._handlers.get(kind)
        if handler is None:
            raise DecodeError(f"unknown pgoutput message type {chr(kind)!r} ({kind:#04x})", offset=0, kind=chr(kind))
        try:
            return handler(data)
        except (struct.error, IndexError) as exc:
            # Every read past the end lands here: struct.error from unpack_from, IndexError from data[pos].
            raise DecodeError(
                f"{NAMES[kind]} message truncated: its {len(data)} bytes end inside a field",
                offset=len(data),
                kind=chr(kind),
            ) from exc

    # -- transactions ------------------------------------------------------------------------------

    def _begin(self, data: bytes) -> Message:
        _check_end(data, 21, 66)
        final_lsn, commit_time, xid = _BEGIN.unpack_from(data, 1)
        return Begin(final_lsn, commit_time + PG_EPOCH_OFFSET_US, xid)

    def _commit(self, data: bytes) -> Message:
        _check_end(data, 26, 67)
        flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(data, 1)
        return Commit(flags, commit_lsn, end_lsn, commit_time + PG_EPOCH_OFFSET_US)

    def _origin(self, data: bytes) -> Message:
        (commit_lsn,) = _U64(data, 1)
        name, pos = _cstring(data, 9, 79, "origin name")
        _check_end(data, pos, 79)
        return Origin(commit_lsn, name)

    # -- schema ------------------------------------------------------------------------------------

    def _xid_and_oid(self, data: bytes) -> tuple[int | None, int, int]:
        """(xid, relation or type oid, position after them): the xid is only sent inside a streamed block."""
        if self._in_stream:
            xid, oid = _U32_U32(data, 1)
            return xid, oid, 9
        (oid,) = _U32(data, 1)
        return None, oid, 5

    def _xid(self, data: bytes) -> tuple[int | None, int]:
        """(xid, position after it) for messages whose streamed form starts with the xid."""
        if self._in_stream:
            (xid,) = _U32(data, 1)
            return xid, 5
        return None, 1

    def _relation(self, data: bytes) -> Message:
        xid, relid, pos = self._xid_and_oid(data)
        namespace, pos = _cstring(data, pos, 82, "namespace")
        name, pos = _cstring(data, pos, 82, "relation name")
        identity = data[pos]
        if identity not in _REPLICA_IDENTITIES:
            raise DecodeError(
                f"Relation message: unknown replica identity {identity:#04x} (expected d, n, f or i)",
                offset=pos,
                kind="R",
            )
        (ncols,) = _U16(data, pos + 1)
        pos += 3
        columns = []
        for _ in range(ncols):
            flags = data[pos]
            column_name, pos = _cstring(data, pos + 1, 82, "column name")
            type_oid, type_modifier = _COLUMN_TYPE(data, pos)
            pos += 8
            columns.append(Column(flags, column_name, type_oid, type_modifier))
        _check_end(data, pos, 82)
        return Relation(xid, relid, namespace or _PG_CATALOG, name, chr(identity), tuple(columns))

    def _type(self, data: bytes) -> Message:
        xid, oid, pos = self._xid_and_oid(data)
        namespace, pos = _cstring(data, pos, 89, "namespace")
        name, pos = _cstring(data, pos, 89, "type name")
        _check_end(data, pos, 89)
        return TypeInfo(xid, oid, namespace or _PG_CATALOG, name)

    # -- row changes -------------------------------------------------------------------------------

    def _insert(self, data: bytes) -> Message:
        xid, relid, pos = self._xid_and_oid(data)
        if data[pos] != _NEW_TUPLE:
            raise DecodeError(f"Insert message: expected 'N' (new tuple), got {data[pos]:#04x}", offset=pos, kind="I")
        new, pos = _read_tuple(data, pos + 1, 73)
        if pos != len(data):  # tested inline: Insert is the hottest message, this saves a call
            _check_end(data, pos, 73)
        return Insert(xid, relid, new)

    def _update(self, data: bytes) -> Message:
        xid, relid, pos = self._xid_and_oid(data)
        marker = data[pos]
        old: TupleData | None = None
        old_kind: str | None = None
        if marker in _OLD_MARKERS:
            old_kind = chr(marker)
            old, pos = _read_tuple(data, pos + 1, 85)
            marker = data[pos]
        if marker != _NEW_TUPLE:
            expected = "'N' (new tuple)" if old_kind else "'K' (old key), 'O' (old tuple) or 'N' (new tuple)"
            raise DecodeError(f"Update message: expected {expected}, got {marker:#04x}", offset=pos, kind="U")
        new, pos = _read_tuple(data, pos + 1, 85)
        _check_end(data, pos, 85)
        return Update(xid, relid, old, old_kind, new)

    def _delete(self, data: bytes) -> Message:
        xid, relid, pos = self._xid_and_oid(data)
        marker = data[pos]
        if marker not in _OLD_MARKERS:
            raise DecodeError(
                f"Delete message: expected 'K' (old key) or 'O' (old tuple), got {marker:#04x}",
                offset=pos,
                kind="D",
            )
        old, pos = _read_tuple(data, pos + 1, 68)
        _check_end(data, pos, 68)
        return Delete(xid, relid, old, chr(marker))

    def _truncate(self, data: bytes) -> Message:
        xid, pos = self._xid(data)
        count, options = _TRUNCATE(data, pos)
        pos += 5
        end = pos + 4 * count
        if end != len(data):
            raise DecodeError(
                f"Truncate message: {count} relation ids need {4 * count} bytes, {len(data) - pos} follow",
                offset=pos,
                kind="T",
            )
        relids = struct.unpack_from(f">{count}I", data, pos)
        return Truncate(xid, relids, bool(options & _TRUNCATE_CASCADE), bool(options & _TRUNCATE_RESTART_IDENTITY))

    def _message(self, data: bytes) -> Message:
        xid, pos = self._xid(data)
        flags, lsn = _MESSAGE(data, pos)
        prefix, pos = _cstring(data, pos + 9, 77, "prefix")
        (length,) = _U32(data, pos)
        pos += 4
        if pos + length != len(data):
            raise DecodeError(
                f"Message message: content length says {length} bytes, {len(data) - pos} follow",
                offset=pos - 4,
                kind="M",
            )
        return LogicalMessage(xid, bool(flags & _MESSAGE_TRANSACTIONAL), lsn, prefix, data[pos:])

    # -- streamed transactions (protocol 2+) -------------------------------------------------------

    def _stream_start(self, data: bytes) -> Message:
        if self._in_stream:
            raise DecodeError("Stream Start inside a streamed block (no Stream Stop before it)", offset=0, kind="S")
        _check_end(data, 6, 83)
        xid, first = _STREAM_START.unpack_from(data, 1)
        self._in_stream = True
        return StreamStart(xid, first == 1)

    def _stream_stop(self, data: bytes) -> Message:
        if not self._in_stream:
            raise DecodeError("Stream Stop outside a streamed block (no Stream Start before it)", offset=0, kind="E")
        _check_end(data, 1, 69)
        self._in_stream = False
        return StreamStop()

    def _outside_stream(self, kind: int) -> None:
        if self._in_stream:
            raise DecodeError(
                f"{NAMES[kind]} inside a streamed block (PostgreSQL sends it after Stream Stop)",
                offset=0,
                kind=chr(kind),
            )

    def _stream_commit(self, data: bytes) -> Message:
        self._outside_stream(99)
        _check_end(data, 30, 99)
        xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(data, 1)
        return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time + PG_EPOCH_OFFSET_US)

    def _stream_abort(self, data: bytes) -> Message:
        self._outside_stream(65)
        if self.parallel:
            _check_end(data, 25, 65)
            xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_PARALLEL.unpack_from(data, 1)
            return StreamAbort(xid, subxid, abort_lsn, abort_time + PG_EPOCH_OFFSET_US)
        _check_end(data, 9, 65)
        xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
        return StreamAbort(xid, subxid, None, None)

    # -- two-phase commit (protocol 3+) ------------------------------------------------------------

    def _begin_prepare(self, data: bytes) -> Message:
        prepare_lsn, end_lsn, prepare_time, xid = _BEGIN_PREPARE.unpack_from(data, 1)
        gid, pos = _cstring(data, 29, 98, "gid")
        _check_end(data, pos, 98)
        return BeginPrepare(prepare_lsn, end_lsn, prepare_time + PG_EPOCH_OFFSET_US, xid, gid)

    def _prepare(self, data: bytes) -> Message:
        flags, prepare_lsn, end_lsn, prepare_time, xid = _PREPARE.unpack_from(data, 1)
        gid, pos = _cstring(data, 30, 80, "gid")
        _check_end(data, pos, 80)
        return Prepare(flags, prepare_lsn, end_lsn, prepare_time + PG_EPOCH_OFFSET_US, xid, gid)

    def _commit_prepared(self, data: bytes) -> Message:
        flags, commit_lsn, end_lsn, commit_time, xid = _PREPARE.unpack_from(data, 1)
        gid, pos = _cstring(data, 30, 75, "gid")
        _check_end(data, pos, 75)
        return CommitPrepared(flags, commit_lsn, end_lsn, commit_time + PG_EPOCH_OFFSET_US, xid, gid)

    def _rollback_prepared(self, data: bytes) -> Message:
        flags, prepare_end, rollback_end, prepare_time, rollback_time, xid = _ROLLBACK_PREPARED.unpack_from(data, 1)
        gid, pos = _cstring(data, 38, 114, "gid")
        _check_end(data, pos, 114)
        return RollbackPrepared(
            flags,
            prepare_end,
            rollback_end,
            prepare_time + PG_EPOCH_OFFSET_US,
            rollback_time + PG_EPOCH_OFFSET_US,
            xid,
            gid,
        )

    def _stream_prepare(self, data: bytes) -> Message:
        self._outside_stream(112)
        flags, prepare_lsn, end_lsn, prepare_time, xid = _PREPARE.unpack_from(data, 1)
        gid, pos = _cstring(data, 30, 112, "gid")
        _check_end(data, pos, 112)
        return StreamPrepare(flags, prepare_lsn, end_lsn, prepare_time + PG_EPOCH_OFFSET_US, xid, gid)


def _refuse(kind: int, reason: str) -> _Handler:
    def refuse(data: bytes) -> Message:
        raise DecodeError(f"unexpected {NAMES[kind]} message: {reason}", offset=0, kind=chr(kind))

    return refuse
