"""The initial snapshot: every row of the captured tables as ``op=r`` events, in chunks, resumable.

Rows are read with ``COPY (SELECT …) TO STDOUT (FORMAT binary)``: binary COPY carries each value in the
same send format pgoutput uses with ``binary 'true'``, so the stream's converters serve both paths. Tables are
read by several connections in parallel, a large table in several ranges at once, in one of two ways:

- **Block ranges** (the slot's exported snapshot, plain tables up to ``snapshot_scan_max_mb``, the C build):
  each range is one unordered COPY of a range of heap blocks (``ctid >= '(lo,0)' AND ctid < '(hi,0)'``, a TID
  range scan, PostgreSQL 14+; one range before), handed on in chunks of ``snapshot_chunk_rows`` rows or ~8 MB.
  It costs PostgreSQL what a plain sequential COPY does; the key order below costs it ~15 % more per row (an
  index scan), the largest single part of the box's CPU. Block positions mean nothing outside the snapshot
  they were read in, so a table interrupted while read this way starts again from its first row, in key
  order, with the fresh snapshot of the restart: the size limit bounds that redo. A table rewritten between
  the reads of its ranges (its file changes) is restarted the same way.
- **Key order** (larger tables, a restart, partitioned tables, no C build): ``COPY (SELECT … ORDER BY key
  LIMIT n)`` keyset chunks, the table split into key ranges where a sample of its keys says (the split only
  balances the work, each range reads all the keys between its bounds). It resumes after the last committed
  key with any snapshot.

The chunks are written to Kafka in transactions together with the snapshot's progress (per table and range:
the last key read, or that a block range is done), committed every ``snapshot_commit_interval_s``.

The hot loops are in C when the C build is there (cdc/_native.pyx): the COPY is read through libpq without
the GIL (CopyReader), a chunk is encoded in one call into one bytes object (TuplePlan.encode_copy_packed) and
produced in one call without the GIL (DirectProducer), so the reader thread and the main thread run at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from cdc._catalog import TableInfo
from cdc._deadletter import CaptureDeadLetters, Refused
from cdc._encoder import COPY_SIGNATURE, CopyRowRefused, copy_body_start, copy_row_fields, native_module, packed_rows
from cdc._events import ColumnSpec, Position, TableCodec
from cdc._fastpaths import LIBPQ_FUNCTIONS
from cdc._libs import libpq_addresses
from cdc._metrics import DEAD_LETTER_OP
from cdc._offsets import CaptureState, RangeProgress, SnapshotState, TableProgress
from cdc._resnapshot import GapDeletes, Reconciler
from cdc.errors import StreamError, TransientError

if TYPE_CHECKING:
    from cdc._attach import Attached, CaptureContext
    from cdc._batch import BatchWriter

log = logging.getLogger(__name__)

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_B, _T, _NULL = ord("b"), ord("t"), ord("n")


@dataclass
class _Chunk:
    table: str
    part: int  # which of the table's key ranges
    rows: int  # how many rows the chunk holds
    packed: bytes  # the rows as RowEncoder.encode_copy_packed packs them
    last_key: list[str] | None
    done: bool  # the range is read to its end
    refused: list[CopyRowRefused] = field(default_factory=list)  # rows no encoder takes


@dataclass(frozen=True)
class _Range:
    """One key range of a table to read: the keys after ``after`` up to ``upto`` (None: no bound)."""

    table: TableInfo
    part: int  # its index in the table's progress["ranges"]
    after: list[str] | None
    upto: list[str] | None
    blocks: list[int | None] | None = None  # a block range instead: [first block, block after the last or None]
    filenode: int | None = None  # the table's file when its block ranges were made: a rewrite changes it


# A table is split into ranges of at least this many chunks: fewer would spend more on the split (a sample, a
# connection per range) than the ranges save.
_MIN_RANGE_CHUNKS = 8
# The split points come from the keys of about this many heap pages, sampled (TABLESAMPLE SYSTEM: whole pages).
_SAMPLE_PAGES = 256
# A table is read in as many block ranges as there are workers when each gets at least this many blocks (8 MB).
_MIN_RANGE_BLOCKS = 1024
# A chunk's COPY output is kept near this size: rows per chunk are snapshot_chunk_rows at most, fewer for wide
# rows (TOASTed values arrive whole), so memory stays bounded whatever the table. A table's first chunk is
# small until its row size is known.
_CHUNK_BYTES = 8 << 20
_FIRST_CHUNK_ROWS = 100
# The most tuples a heap page holds (MaxHeapTuplesPerPage for 8 kB pages): a table with fewer pages than the
# split needs rows for cannot be worth sampling.
_MAX_TUPLES_PER_PAGE = 291


# int8, int2, int4, text, varchar, uuid: their converters give int, str, UUID, whose str() is PostgreSQL's text form.
_KEYS_PRINTED_AS_POSTGRESQL = frozenset({20, 21, 23, 25, 1043, 2950})


def _copy_reader() -> Any | None:
    """cdc._native.CopyReader on the libpq psycopg runs, or None (psycopg's Copy reads the chunks)."""
    _native = native_module()
    if _native is None:
        return None
    try:
        return _native.CopyReader(libpq_addresses(LIBPQ_FUNCTIONS))
    except (OSError, AttributeError) as exc:
        log.info("the snapshot reads through psycopg's Copy: %s", exc)
        return None


def _copy_error(sqlstate: str | None, message: str) -> psycopg.Error:
    """The psycopg exception for a failed COPY, as psycopg itself would raise it (its class from SQLSTATE; for a
    code psycopg does not know, from the code's class, e.g. 08xxx a connection exception)."""
    if sqlstate:
        for code in (sqlstate, sqlstate[:2] + "000"):
            with contextlib.suppress(KeyError):
                return psycopg.errors.lookup(code)(message)
        return psycopg.DatabaseError(message)
    return psycopg.OperationalError(message)  # no result: the connection failed


def _rows_and_last(data: bytes) -> tuple[int, list[bytes | None] | None]:
    """How many rows a ``COPY … (FORMAT binary)`` output has, and its last row's raw fields (None without rows):
    what the next chunk's query needs, known before the chunk is encoded."""
    native = native_module()
    if native is not None:
        return native.copy_rows_and_last(data)  # type: ignore[no-any-return]
    rows = parse_binary_copy(data)
    return len(rows), (rows[-1] if rows else None)


def _packed_keys(packed: bytes) -> list[bytes]:
    """The keys of a chunk's packed rows (RowEncoder.encode_copy_packed)."""
    return packed_rows(packed, records=False)[0]


class _PsycopgCopies:
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


class _LibpqCopies:
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
            raise _copy_error(failed[1], failed[2])

    def receive(self) -> bytes:
        data, sqlstate, message = self._reader.receive(self._pgconn)
        if data is None:
            raise _copy_error(sqlstate, message)
        return data  # type: ignore[no-any-return]

    def abandon(self) -> None:
        """Reads a sent COPY to its end and drops it (before the connection is closed: libpq stays sane)."""
        self._reader.receive(self._pgconn)

    def receive_part(self, rows: int) -> tuple[bytes, bool]:
        """The sent COPY's next ``rows`` rows, or fewer in ~8 MB, as a COPY output of their own (the header
        repeated, a trailer added), and whether the COPY is done. :meth:`abandon_stream` stops it early."""
        data, done, sqlstate, message = self._part(rows)
        if data is None:
            raise _copy_error(sqlstate, message)
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


def _copies(conn: psycopg.Connection[Any]) -> _PsycopgCopies | _LibpqCopies:
    reader = _copy_reader()
    return _PsycopgCopies(conn) if reader is None else _LibpqCopies(reader, conn)


def block_cuts(blocks: int, parts: int) -> list[list[int | None]]:
    """``parts`` ranges of about ``blocks / parts`` blocks each, [first, after the last]: from block 0, each
    starting where the one before ends, the last open-ended (it also takes blocks added meanwhile, which hold
    no row of the snapshot, and a table grown since its size was read)."""
    cuts: list[int | None] = [blocks * i // parts for i in range(parts)]
    return [[low, high] for low, high in zip(cuts, [*cuts[1:], None], strict=True)]


def _encode_chunk(codec: TableCodec, table: str, data: bytes, kinds: bytes) -> tuple[int, bytes, list[CopyRowRefused]]:
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


def _where(conditions: list[sql.Composable]) -> sql.Composable:
    """``WHERE`` and the conditions joined with AND; nothing without conditions."""
    return sql.SQL("WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")


@dataclass
class _RangeJob:
    """One range being read: what every chunk of it is encoded with."""

    work: _Range
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

    def chunk(self, data: bytes, last_key: list[str] | None, done: bool) -> _Chunk:
        """``data`` (COPY output, whole rows) encoded as the range's next chunk."""
        table = self.work.table.qualified
        rows, packed, refused = _encode_chunk(self.codec, table, data, self.kinds)
        return _Chunk(table, self.work.part, rows, packed, last_key, done, refused)


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


class _Keyset:
    """A table read in key order: chunk after chunk, each starting after the last key of the one before."""

    def __init__(self, job: _RangeJob, key_names: Sequence[str], key_types: list[str]) -> None:
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
    def of(cls, conn: psycopg.Connection[Any], job: _RangeJob, key_names: Sequence[str]) -> _Keyset:
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
        return sql.SQL("COPY (SELECT {} FROM {} AS src {} ORDER BY {} LIMIT {}) TO STDOUT (FORMAT binary)").format(
            sql.SQL(", ").join(self.select_cols),
            self.job.work.table.ident(),
            _where(conditions),
            self.order,
            sql.Literal(limit),
        )

    def resume_key(self, fields: list[bytes | None]) -> list[str]:
        if self.key_by_value:  # the key columns' values as the events carry them, printed
            return [str(self.job.codec.binary_value(i, fields[i] or b"")) for i in self.positions]
        return [(v or b"").decode() for v in fields[self.columns :]]  # the key::text columns


def _read_keyset(
    conn: psycopg.Connection[Any],
    job: _RangeJob,
    keyset: _Keyset,
    out: queue.Queue[_Chunk | BaseException],
    cancel: threading.Event,
) -> None:
    """The range in key order, in chunks: the next chunk's COPY is sent before this one is encoded, so
    PostgreSQL reads it meanwhile."""
    after, table = job.work.after, job.work.table.qualified
    limit = min(job.most_rows, _FIRST_CHUNK_ROWS)
    copies = _copies(conn)
    if cancel.is_set():
        return
    copies.send(keyset.query_for(after, limit))
    while True:
        data = copies.receive()
        try:
            rows, last_fields = _rows_and_last(data)
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


class Snapshotter:
    def __init__(self, ctx: CaptureContext, attached: Attached, writer: BatchWriter, state: CaptureState) -> None:
        self.ctx = ctx
        self.attached = attached
        self.writer = writer
        self.state = state
        assert state.snapshot is not None
        self.snap: SnapshotState = state.snapshot
        self.settings = ctx.settings
        self._gaps: dict[str, GapDeletes] = {}  # tables whose topics held live keys before this snapshot
        self._done_tables = 0

    def run(self, snapshot_name: str | None) -> None:
        tables = [t for t in self.attached.report.tables if not self.snap.table_done(t.qualified)]
        consistent = self.snap.consistent_lsn
        codecs = {t.qualified: self._codec(t) for t in tables}
        # Before anything is written: the keys live in each table's topic, to delete those the source no
        # longer has when the table's snapshot ends (cdc/_resnapshot.py; nothing is read for an empty topic).
        reconciler = Reconciler(self.ctx.settings)
        try:
            for t in tables:
                gaps = reconciler.prepare(t.qualified, codecs[t.qualified], self.snap.table(t.qualified))
                if gaps is not None:
                    self._gaps[t.qualified] = gaps
            self._run(tables, codecs, consistent, snapshot_name)
        finally:
            reconciler.close()

    def _run(
        self, tables: list[TableInfo], codecs: dict[str, TableCodec], consistent: int, snapshot_name: str | None
    ) -> None:
        chunks: queue.Queue[_Chunk | BaseException] = queue.Queue(maxsize=4)
        cancel = threading.Event()
        progress, tasks = self._display(tables)
        log.info(
            "snapshot of %d table(s) at %X%s; COPY read through %s, events produced through %s",
            len(tables),
            consistent,
            "" if snapshot_name else " (resumed with a fresh snapshot)",
            "libpq from C" if _copy_reader() is not None else "psycopg",
            "librdkafka from C" if self.writer.produces_from_c else "Producer.produce()",
        )

        def worker(r: _Range) -> None:
            try:
                self._read_range(r, codecs[r.table.qualified], snapshot_name, chunks, cancel)
            except BaseException as exc:
                chunks.put(exc)
                raise

        left, work = self._plan(tables, exported=snapshot_name is not None)
        with (
            progress,
            ThreadPoolExecutor(self.settings.capture.snapshot_workers, "snapshot") as pool,
            contextlib.ExitStack() as finish,
        ):
            finish.callback(self.ctx.metrics.snapshot_finished)
            # Tables with every range read but not finished (a stop during their gap deletes) first: while the
            # topic is scanned the workers would hold their snapshots open, blocked on the full queue.
            for t in tables:
                if not left[t.qualified]:
                    self._end_table(t.qualified, consistent)
                    self._table_done(t.qualified, 0)
            futures = [pool.submit(worker, w) for w in work]
            try:
                while any(left.values()):
                    item = chunks.get()
                    if isinstance(item, BaseException):
                        raise item
                    self._take(item, left, codecs[item.table], consistent)
                    progress.advance(tasks[item.table], item.rows)
            except BaseException:
                cancel.set()
                while not all(f.done() for f in futures):  # unblock workers waiting on a full queue
                    with contextlib.suppress(queue.Empty):
                        chunks.get(timeout=0.1)
                raise
        self.snap.status = "done"
        self.writer.commit(self.state)
        log.info("snapshot done")

    def _display(self, tables: list[TableInfo]) -> tuple[Progress, dict[str, TaskID]]:
        """A progress bar per table (on a terminal), from the tables' estimated rows, which the metrics get too."""
        progress = Progress(
            TextColumn("snapshot {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            disable=not sys.stderr.isatty(),
            transient=False,
        )
        estimates = {t.qualified: self._estimate(t) for t in tables}
        self.ctx.metrics.snapshot_started(estimates)
        return progress, {t.qualified: progress.add_task(t.qualified, total=estimates[t.qualified]) for t in tables}

    def _plan(self, tables: list[TableInfo], *, exported: bool) -> tuple[dict[str, set[int]], list[_Range]]:
        """The ranges still to read, table by table (each table's parts left, and the work in the order the workers
        take it: the ranges of one large table are read at once)."""
        left: dict[str, set[int]] = {}
        work: list[_Range] = []
        for t in tables:
            ranges = self._ranges(t, exported=exported)
            left[t.qualified] = {i for i, r in enumerate(ranges) if not r.done}
            work += [_Range(t, i, r.after, r.upto, r.blocks, r.filenode) for i, r in enumerate(ranges) if not r.done]
        return left, work

    def _take(self, chunk: _Chunk, left: dict[str, set[int]], codec: TableCodec, consistent: int) -> None:
        """A chunk read by a worker: written (and committed when due), counted; a stop request commits what is
        written and stops the snapshot."""
        table_done = False
        if chunk.done:
            left[chunk.table].discard(chunk.part)
            table_done = not left[chunk.table]
        self._write_chunk(chunk, codec, consistent, table_done=table_done)
        if table_done:
            self._table_done(chunk.table, chunk.rows)
        else:
            self.ctx.metrics.snapshot_rows(chunk.table, chunk.rows, table_done=False, done_tables=self._done_tables)
        if self.ctx.stop.is_set():
            if self.writer.in_batch:  # the stop came after _write_chunk looked: commit
                self.writer.commit(self.state)
            log.info("stop requested during the snapshot; it resumes on the next start")
            raise SnapshotStoppedError

    def _table_done(self, table: str, rows: int) -> None:
        self._done_tables += 1
        self.ctx.metrics.snapshot_rows(table, rows, table_done=True, done_tables=self._done_tables)

    def _codec(self, table: TableInfo) -> TableCodec:
        key = set(self.attached.report.key_columns[table.qualified])
        cols = [ColumnSpec(c.name, c.type_oid, c.typmod) for c in table.columns]
        return self.attached.codecs.for_table(table.schema, table.name, cols, [c.name in key for c in cols])

    def _estimate(self, table: TableInfo) -> int | None:
        row = self.attached.sql.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = %s", (table.oid,)
        ).fetchone()
        return int(row[0]) if row and row[0] and row[0] > 0 else None

    def _ranges(self, table: TableInfo, *, exported: bool) -> list[RangeProgress]:
        """The table's ranges in its progress (``after``: the last key read, ``upto``: the range's last key,
        None for no bound; ``done``; ``blocks`` for a block range), split when the table is new to this
        snapshot. ``exported``: this snapshot is the slot's own, so the table may be read in block ranges."""
        progress = self.snap.table(table.qualified)
        ranges = progress.ranges
        if ranges is not None and any(r.blocks is not None for r in ranges) and not all(r.done for r in ranges):
            # Its block ranges were read in the snapshot that ended with the last run; in this one rows may
            # have moved between blocks (an update writes a new version elsewhere), so what was read says
            # nothing about what is left. From the first row, in key order, which resumes with any snapshot.
            log.info(
                "snapshot of %s starts again from its first row, in key order: it was interrupted while read in "
                "block ranges, which hold only in the snapshot they began in",
                table.qualified,
            )
            ranges = None
        if ranges is None and exported and progress.legacy_after is None:
            found = self._block_ranges(table)
            if found is not None:
                filenode, blocks = found
                ranges = [RangeProgress(blocks=b, filenode=filenode) for b in blocks]
                progress.ranges = ranges
        if ranges is None:
            # A table begun by a version that read each table in one range has its last key here.
            bounds = [] if progress.legacy_after is not None else self._split(table)
            lows: list[list[str] | None] = [progress.legacy_after, *bounds]
            highs: list[list[str] | None] = [*bounds, None]
            ranges = [RangeProgress(after=lo, upto=hi) for lo, hi in zip(lows, highs, strict=True)]
            progress.ranges = ranges
            progress.legacy_after = None  # one place for the position: the range
        return ranges

    def _block_ranges(self, table: TableInfo) -> tuple[int, list[list[int | None]]] | None:
        """The table's file now, and block ranges that cover every block of ``table`` (the last one open-ended),
        one per worker for a table large enough; or None when it is to be read in key order: over
        ``snapshot_scan_max_mb``, partitioned (its blocks are its partitions'), without the C build (which
        streams a COPY in parts), or when its size cannot be read."""
        most_mb = self.settings.capture.snapshot_scan_max_mb
        if most_mb <= 0 or table.relkind != "r" or _copy_reader() is None:
            return None
        conn = self.attached.sql
        try:
            row = conn.execute(
                "SELECT pg_table_size(%(t)s::oid), pg_relation_size(%(t)s::oid) / current_setting('block_size')::int,"
                " pg_relation_filenode(%(t)s::oid)",
                {"t": table.oid},
            ).fetchone()
        except psycopg.Error as exc:
            log.info("snapshot of %s in key order: its size could not be read: %s", table.qualified, exc)
            return None
        if row is None or row[2] is None:
            return None
        size, blocks, filenode = int(row[0] or 0), int(row[1] or 0), int(row[2])
        if size > most_mb << 20:
            log.info(
                "snapshot of %s in key order: its %d MB are over capture.snapshot_scan_max_mb (%d), so that an "
                "interruption does not read it again from its first row",
                table.qualified,
                size >> 20,
                most_mb,
            )
            return None
        # A TID range scan (PostgreSQL 14+) reads only its blocks; before, a ctid condition scans the whole table.
        workers = self.settings.capture.snapshot_workers
        enough = conn.info.server_version >= 140000 and blocks >= workers * _MIN_RANGE_BLOCKS
        parts = workers if enough else 1
        log.info(
            "snapshot of %s: %d block range(s) of the slot's snapshot read at once (%d MB; if interrupted, the "
            "table is read again)",
            table.qualified,
            parts,
            size >> 20,
        )
        return filenode, block_cuts(blocks, parts)

    def _split(self, table: TableInfo) -> list[list[str]]:
        """Keys (as text) that split ``table`` into up to ``snapshot_workers`` ranges of about the same number of
        rows, from the keys of a sample of its pages; none for a table too small to be worth it. Balance is all
        they are for: the ranges cover every key whatever they are, and a failed sample costs only the split."""
        workers = self.settings.capture.snapshot_workers
        range_rows = _MIN_RANGE_CHUNKS * self.settings.capture.snapshot_chunk_rows  # the least a range may hold
        if workers < 2:
            return []
        conn = self.attached.sql
        keys = self.attached.report.key_columns[table.qualified]
        try:
            # A partitioned table's pages are its partitions' (pg_partition_tree, PostgreSQL 12+, lists nothing
            # for a plain table and a partition itself for a partition; before 12 a partitioned one is not split).
            own = "pg_relation_size(%(t)s::oid)"
            tree = "(SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree(%(t)s::oid::regclass))"
            size = f"coalesce({tree}, {own})" if conn.info.server_version >= 120000 else own
            row = conn.execute(f"SELECT {size} / current_setting('block_size')::int", {"t": table.oid}).fetchone()
            pages = int(row[0]) if row and row[0] else 0
            if pages * _MAX_TUPLES_PER_PAGE < 2 * range_rows:
                return []
            percent = min(100.0, 100.0 * _SAMPLE_PAGES / pages)
            order = sql.SQL(", ").join(sql.SQL("src.{}").format(sql.Identifier(k)) for k in keys)
            sample = conn.execute(
                sql.SQL("SELECT {} FROM {} AS src TABLESAMPLE SYSTEM ({}) ORDER BY {}").format(
                    sql.SQL(", ").join(sql.SQL("src.{}::text").format(sql.Identifier(k)) for k in keys),
                    table.ident(),
                    sql.Literal(percent),
                    order,
                )
            ).fetchall()
        except psycopg.Error as exc:
            log.info("snapshot of %s reads it in one range: its keys could not be sampled: %s", table.qualified, exc)
            return []
        estimated_rows = int(len(sample) * 100.0 / percent)
        parts = min(workers, estimated_rows // range_rows)
        if parts < 2:
            return []
        # Keys are unique and sorted, so the bounds are distinct and ascending.
        bounds = [[str(v) for v in sample[i * len(sample) // parts]] for i in range(1, parts)]
        # The bounds are row values: not logged (a key can be personal data).
        log.info(
            "snapshot of %s: %d key ranges read at once (split by %d sampled keys)", table.qualified, parts, len(sample)
        )
        return bounds

    def _read_range(
        self,
        work: _Range,
        codec: TableCodec,
        snapshot_name: str | None,
        out: queue.Queue[_Chunk | BaseException],
        cancel: threading.Event,
    ) -> None:
        if cancel.is_set():  # stopped before this range began: no connection, no snapshot to import
            return
        with psycopg.connect(self.settings.source.conninfo(), autocommit=False) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if snapshot_name:
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
            job = _RangeJob(
                work,
                codec,
                most_rows=self.settings.capture.snapshot_chunk_rows,
            )
            if work.blocks is not None:
                copies = _copies(conn)
                assert isinstance(copies, _LibpqCopies)  # block ranges are made only with the C build
                self._stream_blocks(conn, job, copies, out, cancel)
                return
            keyset = _Keyset.of(conn, job, self.attached.report.key_columns[work.table.qualified])
            _read_keyset(conn, job, keyset, out, cancel)

    @staticmethod
    def _stream_blocks(
        conn: psycopg.Connection[Any],
        job: _RangeJob,
        copies: _LibpqCopies,
        out: queue.Queue[_Chunk | BaseException],
        cancel: threading.Event,
    ) -> None:
        """A block range in one COPY, unordered (what a sequential scan finds), handed on in chunks of up to
        ``most_rows`` rows and ~8 MB. The chunks carry no resume position: the range is done with its last."""
        work = job.work
        assert work.blocks is not None
        table = work.table
        low, high = work.blocks
        # A table rewritten between the reads of two of its ranges (VACUUM FULL, CLUSTER, TRUNCATE, a column
        # type change) keeps every row the snapshot sees, in other blocks: a range read after it would miss rows
        # that moved into a range read before. Its file tells; held under this lock until this range is read.
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(table.ident()))
        row = conn.execute("SELECT pg_relation_filenode(%s::oid)", (table.oid,)).fetchone()
        if work.filenode is not None and (row is None or row[0] != work.filenode):
            raise TableRewrittenError(
                f"snapshot of {table.qualified}: the table was rewritten (VACUUM FULL, CLUSTER, TRUNCATE or an "
                "ALTER TABLE) while it was read in block ranges; after the restart it is read again from its "
                "first row, in key order"
            )
        conditions: list[sql.Composable] = []
        if low:
            conditions.append(sql.SQL("src.ctid >= {}::tid").format(sql.Literal(f"({low},0)")))
        if high is not None:
            conditions.append(sql.SQL("src.ctid < {}::tid").format(sql.Literal(f"({high},0)")))
        copies.send(
            sql.SQL("COPY (SELECT {} FROM {} AS src {}) TO STDOUT (FORMAT binary)").format(
                sql.SQL(", ").join(job.select_cols), table.ident(), _where(conditions)
            )
        )
        done = False
        try:
            while not done and not cancel.is_set():
                data, done = copies.receive_part(job.most_rows)
                # No resume key to find first, as key order must: the encoder counts the rows.
                out.put(job.chunk(data, None, done))
        finally:
            if not done:
                copies.abandon_stream()

    def _write_chunk(self, chunk: _Chunk, codec: TableCodec, consistent: int, *, table_done: bool) -> None:
        gaps = self._gaps.get(chunk.table)
        pos = Position(consistent, consistent, time.time_ns() // 1000, None, "true")
        now_us = time.time_ns() // 1000
        prefix, suffix = codec.read_event_frame(pos, now_us)
        for row in chunk.refused:  # first: under the "stop" policy nothing of the chunk is written
            self._refuse(codec, row, consistent)
        self.writer.produce_packed(codec.topic, chunk.packed, chunk.rows, prefix, suffix)
        if gaps is not None:
            gaps.seen(_packed_keys(chunk.packed))
        self.ctx.metrics.count(codec.topic, "r", chunk.rows)
        # The range's entry is updated in place: the table's entry also holds the re-snapshot's start offsets
        # ("since"), kept until the table is done.
        ranges = self.snap.tables[chunk.table].ranges
        assert ranges is not None  # made by _ranges before any chunk is read
        ranges[chunk.part].after, ranges[chunk.part].done = chunk.last_key, chunk.done
        if table_done and gaps is None:
            self._forget(chunk.table)
        # The rows and the progress that covers them are committed together, every interval rather than every
        # chunk: a commit waits until Kafka has every event of its transaction, and nothing is sent meanwhile.
        interval = self.settings.capture.snapshot_commit_interval_s
        if table_done or self.writer.batch_age(time.monotonic()) >= interval or self.ctx.stop.is_set():
            self.writer.commit(self.state)
        if table_done and gaps is not None:
            self._end_table(chunk.table, consistent)

    def _refuse(self, codec: TableCodec, row: CopyRowRefused, consistent: int) -> None:
        """A snapshot row no encoder takes, to capture.on_unencodable (a stop naming it, or its dead letter)."""
        refuse_read(self.attached.dead_letters, codec, row, consistent, writer=self.writer, metrics=self.ctx.metrics)

    def _end_table(self, table: str, consistent: int) -> None:
        """Every range of ``table`` is read and committed: the keys the snapshot did not find are deleted, if its
        topic held any before, and the table is done."""
        gaps = self._gaps.get(table)
        if gaps is not None:
            self._delete_gaps(table, gaps, consistent)
        self._forget(table)
        self.writer.commit(self.state)

    def _forget(self, table: str) -> None:
        """``table`` is done: its entry keeps no more than that. The state is written with every commit while
        streaming, and its ranges hold key values."""
        self.snap.tables[table] = TableProgress(done=True)

    def _delete_gaps(self, table: str, gaps: GapDeletes, consistent: int) -> None:
        """The keys live in the topic that the snapshot did not find: deleted, in transactions that carry the
        snapshot's progress (the table still not done), so a crash leaves whole batches and the rerun, which
        reads the topic again, deletes only what is left."""

        def commit(deleted: int) -> None:
            self.ctx.metrics.count(gaps.codec.topic, "d", deleted)  # counted when committed, as streamed ones
            self.writer.commit(self.state)

        deleted = gaps.emit(
            produce=self.writer.produce,
            commit=commit,
            consistent_lsn=consistent,
            batch=self.settings.capture.snapshot_chunk_rows,
        )
        del self._gaps[table]
        log.info(
            "re-snapshot of %s: %d row(s) deleted while nothing streamed (a lost slot, a detach) were tombstoned",
            table,
            deleted,
        )


class TableRewrittenError(TransientError):
    """A table was rewritten while it was read in block ranges: the capture restarts, and reads it in key order."""


class SnapshotStoppedError(Exception):
    """The snapshot was interrupted on request; its progress is committed."""
