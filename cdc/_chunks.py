"""Reading a table in chunks with binary COPY: what the snapshot, a backfill and a repair share.

A chunk is ``COPY (SELECT … ORDER BY key LIMIT n)`` after a key (a keyset, ``Keyset``), or a range of heap
blocks (``RangeJob``), read through libpq without the GIL where the C build is there (``open_copies``), and
encoded into the capture's Avro records in one call (``encode_chunk``). The chunks' order, progress and commits
are the callers' (cdc/_snapshot.py, cdc/_backfill.py, cdc/_repair.py, cdc/_expected.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from cdc._catalog import TableInfo
from cdc._deadletter import CaptureDeadLetters, Refused
from cdc._encoder import COPY_SIGNATURE, CopyRowRefused, copy_body_start, copy_row_fields, native_module, packed_rows
from cdc._events import TableCodec
from cdc._fastpaths import LIBPQ_FUNCTIONS
from cdc._libs import libpq_addresses
from cdc._metrics import DEAD_LETTER_OP
from cdc._published import filter_condition
from cdc.errors import StreamError

if TYPE_CHECKING:
    from cdc._batch import BatchWriter

log = logging.getLogger(__name__)

_I16 = struct.Struct(">h")
_B, _T, _NULL = ord("b"), ord("t"), ord("n")


@dataclass
class Chunk:
    table: str
    part: int  # which of the table's key ranges
    rows: int  # how many rows the chunk holds
    packed: bytes  # the rows as RowEncoder.encode_copy_packed packs them
    last_key: list[str] | None
    done: bool  # the range is read to its end
    refused: list[CopyRowRefused] = field(default_factory=list)  # rows no encoder takes


@dataclass(frozen=True)
class ReadRange:
    """One key range of a table to read: the keys after ``after`` up to ``upto`` (None: no bound)."""

    table: TableInfo
    part: int  # its index in the table's progress["ranges"]
    after: list[str] | None
    upto: list[str] | None
    blocks: list[int | None] | None = None  # a block range instead: [first block, block after the last or None]
    filenode: int | None = None  # the table's file when its block ranges were made: a rewrite changes it


# A chunk's COPY output is kept near this size: rows per chunk are snapshot_chunk_rows at most, fewer for wide
# rows (TOASTed values arrive whole), so memory stays bounded whatever the table. A table's first chunk is
# small until its row size is known.
_CHUNK_BYTES = 8 << 20
_FIRST_CHUNK_ROWS = 100
# int8, int2, int4, text, varchar, uuid: their converters give int, str, UUID, whose str() is PostgreSQL's text form.
_KEYS_PRINTED_AS_POSTGRESQL = frozenset({20, 21, 23, 25, 1043, 2950})


def copy_reader() -> Any | None:
    """cdc._native.CopyReader on the libpq psycopg runs, or None (psycopg's Copy reads the chunks)."""
    _native = native_module()
    if _native is None:
        return None
    try:
        return _native.CopyReader(libpq_addresses(LIBPQ_FUNCTIONS))
    except (OSError, AttributeError) as exc:
        log.info("the snapshot reads through psycopg's Copy: %s", exc)
        return None


def copy_error(sqlstate: str | None, message: str) -> psycopg.Error:
    """The psycopg exception for a failed COPY, as psycopg itself would raise it (its class from SQLSTATE; for a
    code psycopg does not know, from the code's class, e.g. 08xxx a connection exception)."""
    if sqlstate:
        for code in (sqlstate, sqlstate[:2] + "000"):
            with contextlib.suppress(KeyError):
                return psycopg.errors.lookup(code)(message)
        return psycopg.DatabaseError(message)
    return psycopg.OperationalError(message)  # no result: the connection failed


def rows_and_last(data: bytes) -> tuple[int, list[bytes | None] | None]:
    """How many rows a ``COPY … (FORMAT binary)`` output has, and its last row's raw fields (None without rows):
    what the next chunk's query needs, known before the chunk is encoded."""
    native = native_module()
    if native is not None:
        return native.copy_rows_and_last(data)  # type: ignore[no-any-return]
    rows = parse_binary_copy(data)
    return len(rows), (rows[-1] if rows else None)


def packed_keys(packed: bytes) -> list[bytes]:
    """The keys of a chunk's packed rows (RowEncoder.encode_copy_packed)."""
    return packed_rows(packed, records=False)[0]


class PsycopgCopies:
    """Chunks read by psycopg's Copy: the COPY runs when its output is asked for (nothing is read ahead)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._query: sql.SQL | sql.Composed | None = None

    def send(self, query: sql.SQL | sql.Composed) -> None:
        self._query = query

    def receive(self) -> bytes:
        assert self._query is not None, "receive() without send()"
        buf = bytearray()
        with self._conn.cursor() as cur, cur.copy(self._query) as copy:
            for block in copy:
                buf += block
        self._query = None
        return bytes(buf)

    def abandon(self) -> None:
        self._query = None


class LibpqCopies:
    """Chunks read through libpq from C, without the GIL (cdc._native.CopyReader): :meth:`send` starts the COPY
    and returns, so PostgreSQL reads a chunk while the previous one is encoded. Failures are psycopg's errors."""

    def __init__(self, reader: Any, conn: psycopg.Connection[Any]) -> None:
        self._header: bytes | None = None  # the streamed COPY's binary header, which only its first part has
        self._reader = reader
        self._conn = conn
        self._pgconn: int = conn.pgconn.pgconn_ptr  # type: ignore[attr-defined]  # public, not in the Protocol

    def send(self, query: sql.SQL | sql.Composed) -> None:
        self._header = None
        failed = self._reader.send(self._pgconn, query.as_bytes(self._conn))
        if failed is not None:
            raise copy_error(failed[1], failed[2])

    def receive(self) -> bytes:
        data, sqlstate, message = self._reader.receive(self._pgconn)
        if data is None:
            raise copy_error(sqlstate, message)
        return data  # type: ignore[no-any-return]

    def abandon(self) -> None:
        """Reads a sent COPY to its end and drops it (before the connection is closed: libpq stays sane)."""
        self._reader.receive(self._pgconn)

    def receive_part(self, rows: int) -> tuple[bytes, bool]:
        """The sent COPY's next ``rows`` rows, or fewer in ~8 MB, as a COPY output of their own (the header
        repeated, a trailer added), and whether the COPY is done. :meth:`abandon_stream` stops it early."""
        data, done, sqlstate, message = self._part(rows)
        if data is None:
            raise copy_error(sqlstate, message)
        return data, done

    def abandon_stream(self) -> None:
        """Stops a COPY that :meth:`receive_part` has not read to its end: the server is asked to cancel it and
        what it sent meanwhile is read and dropped (libpq must leave the COPY state), so a table is not read to
        its end to be thrown away, unless the cancel request itself fails."""
        with contextlib.suppress(psycopg.Error):
            self._conn.cancel_safe(timeout=10)
        done = False
        while not done:  # ends with the cancel's error, or the COPY's end if that came first
            done = self._part(1 << 30)[1]

    def _part(self, rows: int) -> tuple[bytes | None, bool, str | None, str]:
        first = self._header is None
        prefix = self._header or b""
        data, done, sqlstate, message = self._reader.receive_part(self._pgconn, prefix, _CHUNK_BYTES, rows, first)
        if first and data is not None:
            self._header = data[: len(COPY_SIGNATURE) + 8]  # signature, flags, header extension length (0)
        return data, done, sqlstate, message


def open_copies(conn: psycopg.Connection[Any]) -> PsycopgCopies | LibpqCopies:
    reader = copy_reader()
    return PsycopgCopies(conn) if reader is None else LibpqCopies(reader, conn)


def block_cuts(blocks: int, parts: int) -> list[list[int | None]]:
    """``parts`` ranges of about ``blocks / parts`` blocks each, [first, after the last]: from block 0, each
    starting where the one before ends, the last open-ended (it also takes blocks added meanwhile, which hold
    no row of the snapshot, and a table grown since its size was read)."""
    cuts: list[int | None] = [blocks * i // parts for i in range(parts)]
    return [[low, high] for low, high in zip(cuts, [*cuts[1:], None], strict=True)]


def encode_chunk(codec: TableCodec, table: str, data: bytes, kinds: bytes) -> tuple[int, bytes, list[CopyRowRefused]]:
    """A COPY chunk's rows as events packed in one bytes object (RowEncoder.encode_copy_packed), how many, and
    the rows no encoder takes (capture.on_unencodable decides about those when the chunk is written). What the
    table's encoder refuses goes to the Python encoder, which takes it (the C encoder refuses a few rare forms)
    or sets the row aside with what is wrong; output that is malformed or cut short raises StreamError."""
    try:
        packed, rows = codec.encoder.encode_copy_packed(data, kinds)
        return rows, packed, []
    except Exception:  # the Python encoder decides, and names the error
        try:
            packed, rows, refused = codec.python_encoder.encode_copy_rows(data, kinds)
        except (ValueError, IndexError, struct.error) as exc:
            raise StreamError(f"cannot snapshot a row of {table}: {exc}") from exc
    return rows, packed, refused


def refuse_read(
    dead: CaptureDeadLetters, codec: TableCodec, row: CopyRowRefused, lsn: int, *, writer: BatchWriter, metrics: Any
) -> None:
    """A row read by a snapshot or a backfill (at ``lsn``) that no encoder takes, to capture.on_unencodable: a
    stop naming it, or its dead letter through ``writer``, counted for its table."""
    kinds = [_B if b else _T for b in codec.binary_capable]
    values = [(_NULL if raw is None else kind, raw) for kind, raw in zip(kinds, row.fields, strict=False)]
    refused = Refused(codec.described, "r", lsn, lsn, row.error, values)
    dead.refuse(refused, writer.produce, partial(metrics.count, codec.topic, DEAD_LETTER_OP))


def where_all(conditions: list[sql.Composable]) -> sql.Composable:
    """``WHERE`` and the conditions joined with AND; nothing without conditions."""
    return sql.SQL("WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")


@dataclass
class RangeJob:
    """One range being read: what every chunk of it is encoded with."""

    work: ReadRange
    codec: TableCodec
    most_rows: int  # rows per chunk at most (capture.snapshot_chunk_rows)
    select_cols: list[sql.Composable] = field(init=False)  # binary where the column has a binary reader
    kinds: bytes = field(init=False)  # per column, how COPY sends it (_B or _T)

    def __post_init__(self) -> None:
        binary = self.codec.binary_capable
        self.select_cols = [
            sql.SQL("src.{}").format(sql.Identifier(c.name))
            if b
            else sql.SQL("src.{}::text").format(sql.Identifier(c.name))
            for c, b in zip(self.work.table.columns, binary, strict=True)
        ]
        self.kinds = bytes(_B if b else _T for b in binary)

    def chunk(self, data: bytes, last_key: list[str] | None, done: bool) -> Chunk:
        """``data`` (COPY output, whole rows) encoded as the range's next chunk."""
        table = self.work.table.qualified
        rows, packed, refused = encode_chunk(self.codec, table, data, self.kinds)
        return Chunk(table, self.work.part, rows, packed, last_key, done, refused)


def key_types(conn: psycopg.Connection[Any], oid: int, names: Sequence[str]) -> list[str]:
    """The types of table ``oid``'s columns ``names`` as SQL writes them (format_type: typmods included)."""
    types = []
    for name in names:
        row = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s AND attname = %s",
            (oid, name),
        ).fetchone()
        assert row is not None
        types.append(str(row[0]))
    return types


def typed_columns(names: Sequence[str], types: Sequence[str]) -> sql.Composed:
    """``"name" type, …``: a record's column definitions (``AS k(…)`` of jsonb_to_recordset)."""
    return sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in zip(names, types, strict=True)
    )


class Keyset:
    """A table read in key order: chunk after chunk, each starting after the last key of the one before."""

    def __init__(self, job: RangeJob, key_names: Sequence[str], key_types: list[str]) -> None:
        table = job.work.table
        self.job = job
        self.key_types = key_types
        # The next chunk starts after the last key, written as a literal. For integer, text and uuid keys it is
        # the last row's values, printed; for other types, whose values do not print as PostgreSQL's text form,
        # the key is selected again as text (a ::text per row costs the COPY ~15 %). Aliased so no output name
        # shadows a column, and ORDER BY qualified so it sorts by the column.
        types = {c.name: c.type_oid for c in table.columns}
        self.key_by_value = all(types[k] in _KEYS_PRINTED_AS_POSTGRESQL for k in key_names)
        self.select_cols = list(job.select_cols)
        if not self.key_by_value:
            self.select_cols += [
                sql.SQL("src.{}::text AS {}").format(sql.Identifier(k), sql.Identifier(f"__pgcdc_key_{i}"))
                for i, k in enumerate(key_names)
            ]
        self.order = sql.SQL(", ").join(sql.SQL("src.{}").format(sql.Identifier(k)) for k in key_names)
        self.columns = len(table.columns)
        names = [c.name for c in table.columns]
        self.positions = [names.index(k) for k in key_names]
        self.where: str | None = None  # a backfill's filter (SQL): it runs in a READ ONLY transaction

    @classmethod
    def of(cls, conn: psycopg.Connection[Any], job: RangeJob, key_names: Sequence[str]) -> Keyset:
        return cls(job, key_names, key_types(conn, job.work.table.oid, key_names))

    def literal(self, key: list[str]) -> sql.Composed:
        # The key as literals, not as %s parameters: with parameters psycopg parses the whole query for
        # placeholders, the quoted identifiers included, so a column named "a %s b" broke every resumed
        # chunk ("the query has 2 placeholders but 1 parameters were passed").
        return sql.SQL(", ").join(
            sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t))  # t: format_type output
            for v, t in zip(key, self.key_types, strict=True)
        )

    def query_for(self, after: list[str] | None, limit: int) -> sql.Composed:
        conditions: list[sql.Composable] = []
        if after is not None:
            conditions.append(sql.SQL("({}) > ({})").format(self.order, self.literal(after)))
        upto = self.job.work.upto
        if upto is not None:
            conditions.append(sql.SQL("({}) <= ({})").format(self.order, self.literal(upto)))
        if self.where is not None:
            conditions.append(sql.SQL("({})").format(sql.SQL(self.where)))
        conditions += filter_condition(self.job.work.table)
        return sql.SQL("COPY (SELECT {} FROM {} AS src {} ORDER BY {} LIMIT {}) TO STDOUT (FORMAT binary)").format(
            sql.SQL(", ").join(self.select_cols),
            self.job.work.table.ident(),
            where_all(conditions),
            self.order,
            sql.Literal(limit),
        )

    def resume_key(self, fields: list[bytes | None]) -> list[str]:
        if self.key_by_value:  # the key columns' values as the events carry them, printed
            return [str(self.job.codec.binary_value(i, fields[i] or b"")) for i in self.positions]
        return [(v or b"").decode() for v in fields[self.columns :]]  # the key::text columns


def read_keyset(
    conn: psycopg.Connection[Any],
    job: RangeJob,
    keyset: Keyset,
    out: queue.Queue[Chunk | BaseException],
    cancel: threading.Event,
) -> None:
    """The range in key order, in chunks: the next chunk's COPY is sent before this one is encoded, so
    PostgreSQL reads it meanwhile."""
    after, table = job.work.after, job.work.table.qualified
    limit = min(job.most_rows, _FIRST_CHUNK_ROWS)
    copies = open_copies(conn)
    if cancel.is_set():
        return
    copies.send(keyset.query_for(after, limit))
    while True:
        data = copies.receive()
        try:
            rows, last_fields = rows_and_last(data)
        except (ValueError, IndexError, struct.error) as exc:
            raise StreamError(f"cannot snapshot {table}: malformed COPY output: {exc}") from exc
        done = rows < limit
        if not done:
            assert last_fields is not None
            after = keyset.resume_key(last_fields)
            if cancel.is_set():
                return
            limit = next_chunk_rows(job.most_rows, len(data), rows)
            copies.send(keyset.query_for(after, limit))  # read ahead: PostgreSQL reads it while this one is encoded
        try:
            chunk = job.chunk(data, after, done)
        except BaseException:
            if not done:
                copies.abandon()
            raise
        out.put(chunk)
        if done:
            return


def next_chunk_rows(most: int, size: int, rows: int) -> int:
    """Rows for the next chunk of a table whose last chunk was ``rows`` rows in ``size`` bytes of COPY output:
    as many as fit _CHUNK_BYTES, at least one, at most ``most`` (snapshot_chunk_rows)."""
    per_row = max(1, size // max(rows, 1))
    return max(1, min(most, _CHUNK_BYTES // per_row))


def parse_binary_copy(data: bytes | bytearray | memoryview) -> list[list[bytes | None]]:
    """Rows of a ``COPY … (FORMAT binary)`` stream, each a list of raw field values (None for NULL); output that
    is not binary COPY or is cut short raises StreamError."""
    data = bytes(data)
    try:
        pos = copy_body_start(data)
    except ValueError as exc:
        raise StreamError(str(exc)) from exc
    rows: list[list[bytes | None]] = []
    while True:
        if pos + 2 > len(data):
            raise StreamError("the COPY output ends before its end marker (malformed or cut short)")
        if _I16.unpack_from(data, pos)[0] == -1:
            return rows
        row, end = copy_row_fields(data, pos)
        if end is None:
            raise StreamError("the COPY output ends inside a row (malformed or cut short)")
        rows.append(row)
        pos = end
