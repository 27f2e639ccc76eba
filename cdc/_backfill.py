"""Backfills while streaming: a table, or the rows of it a filter selects, read again into its topic without
stopping the stream or locking writers out.

A backfill is read in keyset chunks (key order, ``capture.backfill_chunk_rows`` rows each) on a thread of its
own, each chunk in one REPEATABLE READ READ ONLY transaction with a statement timeout (a filter is untrusted
input), whose MVCC snapshot is recorded; then a high watermark is written through the WAL
(``pg_logical_emit_message(false, 'pgcdc.watermark', …)``). Meanwhile the stream goes on, and reports every
change of the table with its transaction id (ChangeWriter.watch). When the stream reaches the watermark, the
chunk's rows are written as snapshot reads (``op = r``, ``source.snapshot = "incremental"``) positioned at the
watermark, except the keys a transaction the chunk's snapshot did not see changed meanwhile: cdc/_window.py
says why that keeps every key's events in order. The rows and the backfill's progress (the last key read) are
committed in one Kafka transaction of their own, after the stream's batch (Streamer._between_transactions),
so a crash anywhere replays nothing twice and loses nothing: the chunk is read again.

No lock but ACCESS SHARE (a plain SELECT) is taken; the stream waits for nothing but the writing of a chunk.

Requests come from the signal table (cdc/_signals.py: `cdc snapshot`) and from the tables new to the capture
(:func:`plan_new_tables`). At most ``capture.backfills_at_once`` run, their chunks in turn; the others wait,
queued. Chunks are started no faster than ``capture.backfill_rows_per_s`` and not while the stream is more than
``capture.backfill_pause_behind_s`` behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import KafkaException
from psycopg import sql

from cdc._catalog import load_table, qualified_name
from cdc._chunks import (
    Keyset,
    RangeJob,
    ReadRange,
    encode_chunk,
    key_types,
    open_copies,
    parse_binary_copy,
    refuse_read,
    rows_and_last,
    typed_columns,
)
from cdc._encoder import PACKED_HEAD, CopyRowRefused, packed_rows
from cdc._events import ColumnSpec, Position, Stamp, TableCodec
from cdc._offsets import BackfillProgress, CaptureState
from cdc._published import filter_condition, published, restrict
from cdc._signals import Signal, SignalTable, SignalTopic
from cdc._source import check_and_prepare, connect, publication_tables
from cdc._standby import connect_primary, wait_replayed
from cdc._window import ChunkSnapshot, ChunkWindow, ReplaySnapshot, XidSnapshot
from decoders import TupleData, parse_lsn
from pgcdc_common.errors import CDCError, TerminalError, TransientError
from pgcdc_common.topics import split_table_name

if TYPE_CHECKING:
    from cdc._attach import Attached, CaptureContext
    from cdc._batch import BatchWriter
    from cdc._catalog import TableInfo
    from cdc._changes import ChangeWriter
    from cdc._config import Settings

log = logging.getLogger(__name__)

WATERMARK_PREFIX = "pgcdc.watermark"
# The transactions last written, which a chunk's snapshot must see (cdc/_window.py). One that is not yet visible
# was committed microseconds before (PostgreSQL makes a transaction visible right after its commit is flushed);
# a thousand reach half a second back at 2,000 transactions/s.
_RECENT_XIDS = 1_000
_PUBLICATION_POLL_S = 10.0  # how often the publication's tables are looked at (when it decides what is captured)
_GATE_SAID_AFTER_S = 30.0  # a backfill waiting this long for old transactions says so
_READ_AHEAD = 2  # chunks of a backfill in flight: the next is read while one waits for its watermark
_B, _T, _NULL = ord("b"), ord("t"), ord("n")


class KeyList:
    """The chunks of a backfill of listed keys (``cdc verify --repair``, ``cdc snapshot --keys``): the keys in
    the order listed, ``rows`` per chunk. Those the table has are read as rows; those it no longer has are read
    too, as their key columns alone (``jsonb_to_recordset`` makes PostgreSQL parse each key's text as its
    column's type), and written as deletes.

    A key is a JSON object of the key columns' values as PostgreSQL prints them (what `cdc verify` lists)."""

    def __init__(
        self, job: RangeJob, key_names: Sequence[str], key_types: Sequence[str], keys: list[dict[str, str]]
    ) -> None:
        self.job = job
        self.keys = keys
        self._names = list(key_names)
        self._types = list(key_types)  # format_type output
        names = [c.name for c in job.work.table.columns]
        self.positions = [names.index(k) for k in key_names]  # the key columns' places in a row

    def _listed(self, after: list[str] | None, limit: int, alias: str) -> sql.Composed:
        start = _count(after)
        listed = json.dumps(self.keys[start : start + limit])
        return sql.SQL("jsonb_to_recordset({}::jsonb) AS {}({})").format(
            sql.Literal(listed), sql.Identifier(alias), typed_columns(self._names, self._types)
        )

    def _columns(self, alias: str) -> sql.Composed:
        return sql.SQL(", ").join(
            sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(k)) for k in self._names
        )

    def query_for(self, after: list[str] | None, limit: int) -> sql.Composed:
        """The rows the table has of the chunk's keys."""
        return sql.SQL(
            "COPY (SELECT {} FROM {} AS src WHERE ({}) IN (SELECT {} FROM {}){}) TO STDOUT (FORMAT binary)"
        ).format(
            sql.SQL(", ").join(self.job.select_cols),
            self.job.work.table.ident(),
            self._columns("src"),
            self._columns("k"),
            self._listed(after, limit, "k"),
            self._published(),
        )

    def _published(self) -> sql.Composable:
        """`` AND (the row filter)``: a row outside the publication's filter is absent (its key gets a delete)."""
        return sql.SQL("").join(sql.SQL(" AND ") + c for c in filter_condition(self.job.work.table))

    def absent_for(self, after: list[str] | None, limit: int) -> sql.Composed:
        """The chunk's keys the table does not have: their key columns, read as the rows' are."""
        return sql.SQL(
            "COPY (SELECT {} FROM {} WHERE NOT EXISTS (SELECT 1 FROM {} AS x WHERE ({}) = ({}){})) "
            "TO STDOUT (FORMAT binary)"
        ).format(
            sql.SQL(", ").join(self.job.select_cols[i] for i in self.positions),
            self._listed(after, limit, "src"),
            self.job.work.table.ident(),
            self._columns("x"),
            self._columns("src"),
            self._published(),  # its columns are x's: the innermost scope
        )

    def rows_of(self, keys: list[list[bytes | None]]) -> list[list[bytes | None]]:
        """Key columns (as :meth:`absent_for` reads them) as whole rows: null but for the key."""
        width = len(self.job.work.table.columns)
        rows = []
        for fields in keys:
            row: list[bytes | None] = [None] * width
            for position, value in zip(self.positions, fields, strict=True):
                row[position] = value
            rows.append(row)
        return rows

    def end(self, after: list[str] | None, limit: int) -> tuple[list[str], bool]:
        """Where the next chunk starts (the keys done so far), and whether this chunk was the last."""
        done = min(_count(after) + limit, len(self.keys))
        return [str(done)], done >= len(self.keys)


def _count(after: list[str] | None) -> int:
    return int(after[0]) if after else 0


def parse_keys(raw: Any, key_names: Sequence[str], table: str) -> list[dict[str, str]]:
    """A request's ``keys``: a list of objects with a text value for each key column of ``table``, every one
    once (duplicates dropped, the first kept); ValueError saying what is wrong with it."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"'keys' is not a list of {table}'s keys")
    want = set(key_names)
    out: dict[str, dict[str, str]] = {}
    for i, key in enumerate(raw):
        if not isinstance(key, dict) or set(key) != want or not all(isinstance(v, str) for v in key.values()):
            raise ValueError(
                f"key {i + 1} of the request, {json.dumps(key)[:200]}, is not an object with a text value for each "
                f"of {table}'s key columns ({', '.join(key_names)})"
            )
        out.setdefault(json.dumps([key[k] for k in key_names]), {k: key[k] for k in key_names})
    return list(out.values())


@dataclass(frozen=True)
class ChunkJob:
    """What one chunk read needs: the backfill's keyset query, where it starts, how many rows, its marker.

    ``first``: the chunk starts after ``after``; otherwise after the last key of the reader's previous chunk
    (read ahead: it is not known when the job is given)."""

    keyset: Keyset | KeyList
    after: list[str] | None
    rows: int
    marker: str  # the high watermark's content: slot, backfill, chunk, and a nonce
    first: bool = True


@dataclass(frozen=True)
class ChunkRead:
    """A chunk as read: its rows encoded (packed), those no encoder takes, the listed keys the table does not
    have (a KeyList's: raw COPY fields, only the key's set), where the next chunk starts, and the snapshot it was
    read in and the high watermark's LSN."""

    packed: bytes
    rows: int
    refused: list[CopyRowRefused]
    absent: list[list[bytes | None]]
    last_key: list[str] | None
    done: bool  # fewer rows than asked for: the backfill is read to its end
    snapshot: ChunkSnapshot | None  # None: not read (the chunk before it was the table's last)
    high: int


class ChunkReader:
    """Reads chunks on a thread of its own through a connection of its own (opened on the first chunk)."""

    def __init__(self, settings: Settings, *, standby: bool = False) -> None:
        self._settings = settings
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pgcdc-backfill")
        self._conn: psycopg.Connection[Any] | None = None
        # Reading a standby, the watermarks are written on its primary (cdc._standby), through a connection of
        # this thread's own.
        self._standby = standby
        self._primary: psycopg.Connection[Any] | None = None
        self._cursor: tuple[list[str] | None, bool] = (None, False)  # the last chunk's last key, and if it was the end

    def submit(self, job: ChunkJob) -> Future[ChunkRead]:
        return self._pool.submit(self._read_next, job)

    def _read_next(self, job: ChunkJob) -> ChunkRead:
        after, done = (job.after, False) if job.first else self._cursor
        if done:
            return ChunkRead(b"", 0, [], [], after, True, None, 0)
        read = self._read(job, after)
        self._cursor = (read.last_key, read.done)
        return read

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._settings, autocommit=True)
        return self._conn

    def _replayed(self, conn: psycopg.Connection[Any]) -> int | None:
        """Reading a standby: its replay position, read before the chunk's snapshot is taken (cdc._window's
        ReplaySnapshot); None when the server reads as a primary (it has been promoted, or it always was)."""
        if not self._standby:
            return None
        row = conn.execute("SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text").fetchone()
        return parse_lsn(row[1]) if row is not None and row[0] else None

    def _watermark(self, conn: psycopg.Connection[Any], marker: str, *, on_primary: bool) -> str:
        """Ends the chunk's transaction and writes its high watermark; the watermark's LSN (text)."""
        emit = sql.SQL("SELECT pg_logical_emit_message(false, {}, {})::text").format(
            sql.Literal(WATERMARK_PREFIX), sql.Literal(marker)
        )
        if not on_primary:
            return _last_value(conn, sql.SQL("COMMIT; ") + emit)  # one round trip
        conn.execute("COMMIT")
        if self._primary is None or self._primary.closed:
            self._primary = connect_primary(self._settings)
        if self._primary is None:
            raise TerminalError(
                "the backfill reads a standby but source.primary_dsn is not set: set it to the standby's primary, "
                "where the capture writes its backfill watermarks"
            )
        return _last_value(self._primary, emit)

    def _read(self, job: ChunkJob, after: list[str] | None) -> ChunkRead:
        conn = self._connection()
        timeout_ms = int(self._settings.capture.backfill_statement_timeout_s * 1000)
        try:
            replayed = self._replayed(conn)  # before the snapshot: every commit before it is visible in it
            # One round trip for the three (a chunk costs a few milliseconds: round trips count).
            begin = sql.SQL(
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET LOCAL statement_timeout = {}; "
                "SELECT pg_current_snapshot()::text"
            ).format(sql.Literal(timeout_ms))
            xids = XidSnapshot.parse(_last_value(conn, begin))
            snapshot: ChunkSnapshot = xids if replayed is None else ReplaySnapshot(replayed)
            self._hold(job)
            copies = open_copies(conn)
            keyset = job.keyset
            copies.send(keyset.query_for(after, job.rows))
            data = copies.receive()
            absent: list[list[bytes | None]] = []
            if isinstance(keyset, KeyList):
                copies.send(keyset.absent_for(after, job.rows))
                absent = keyset.rows_of(parse_binary_copy(copies.receive()))
            count, last = rows_and_last(data)
            rows, packed, refused = encode_chunk(
                keyset.job.codec, keyset.job.work.table.qualified, data, keyset.job.kinds
            )
            last_key: list[str] | None
            if isinstance(keyset, KeyList):
                last_key, done = keyset.end(after, job.rows)
            else:
                last_key, done = (keyset.resume_key(last) if last is not None else after), count < job.rows
            # Last, and after the snapshot: every transaction the chunk does not see commits after it or is
            # reported to the window before the stream reaches this watermark.
            high = self._watermark(conn, job.marker, on_primary=replayed is not None)
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
            raise
        return ChunkRead(packed, rows, refused, absent, last_key, done, snapshot, parse_lsn(high))

    @staticmethod
    def _hold(job: ChunkJob) -> None:
        """Fault injection for the tests (CDC_TEST_CHUNK_HOLD_S): the chunk's window is held open this long after
        its snapshot is taken, while the stream goes on, so a kill can land inside it."""
        hold = float(os.environ.get("CDC_TEST_CHUNK_HOLD_S") or 0)
        if hold:
            log.info("backfill chunk %s: window held open %.1f s (CDC_TEST_CHUNK_HOLD_S)", job.marker, hold)
            time.sleep(hold)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in (self._conn, self._primary):
            if conn is not None:
                conn.close()


@dataclass
class _InFlight:
    """A chunk being read, or read and waiting for its high watermark in the stream, or for the chunks before
    it to be written. Its window stays open until its rows are written (cdc/_window.py)."""

    backfill: BackfillProgress
    codec: TableCodec
    window: ChunkWindow
    marker: str
    future: Future[ChunkRead]
    high_seen: bool = False

    def writable(self) -> bool:
        """Its rows can be written (the stream reached its watermark, or it read nothing), or its read failed."""
        if not self.future.done():
            return False
        if self.future.exception() is not None:
            return True
        return self.high_seen or self.future.result().snapshot is None


def plan_new_tables(state: CaptureState, tables: list[str], settings: Settings) -> list[str]:
    """Compares the captured ``tables`` with those the state knows: a new one gets a backfill (unless
    capture.backfill_new_tables is off or the capture never snapshots), a removed one is only logged (its topic
    is left as it is). The state then knows ``tables``. Returns the new tables."""
    known = state.tables
    if known is None:  # a state of format 1 or 2: the tables its snapshot read, if it ran one
        known = list(state.snapshot.tables) if state.snapshot is not None else list(tables)
    new = [t for t in tables if t not in known]
    for gone in (t for t in known if t not in tables):
        log.info("%s is no longer captured (not in source.tables or the publication); its topic is left as it is", gone)
    capture = settings.capture
    ids = {b.id for b in state.backfills}
    for table in new:
        if capture.backfill_new_tables and capture.snapshot == "initial":
            log.info("%s is new to the capture: its rows are backfilled while streaming", table)
            id_ = next(i for n in range(len(ids) + 1) if (i := f"added.{state.lsn or 0:X}.{n}") not in ids)
            ids.add(id_)
            state.backfills.append(BackfillProgress(id_, table, reason="added"))
        else:
            log.info("%s is new to the capture: only its changes from now on are captured", table)
    state.tables = list(tables)
    return new


class Backfills:
    """The backfills of one streaming attempt, driven by the Streamer: :meth:`ready` at transaction boundaries
    (cdc/_stream.py's BetweenTransactions) starts chunk reads and takes requests, :meth:`on_watermark` writes a
    chunk's rows into the stream's open batch when the stream reaches its watermark (they commit with it, and
    with the progress they advance), :meth:`note_commit` hears of every transaction written.

    Chunks are read ahead (up to :data:`_READ_AHEAD` of one backfill in flight), and written in order."""

    def __init__(self, ctx: CaptureContext, attached: Attached, changes: ChangeWriter, state: CaptureState) -> None:
        self._ctx, self._attached, self._changes, self._state = ctx, attached, changes, state
        s = ctx.settings
        self._signals = SignalTable(s.source.signal_table, s.source.slot)
        self._reader = self._new_reader()
        self._tables: dict[str, TableInfo] = {t.qualified: t for t in attached.report.tables}
        self._keysets: dict[str, Keyset | KeyList] = {}
        self._listed: dict[str, list[dict[str, str]]] = {}  # the keys of the backfills of listed keys, by id
        self._recent: deque[tuple[int, int]] = deque(maxlen=_RECENT_XIDS)  # (xid, commit LSN)
        self._taken: list[Signal] = []  # read from the signal table, not yet in the state
        self._inflight: deque[_InFlight] = deque()  # one backfill's chunks, in order
        self._polled = self._next_start = 0.0
        self._turn = 0  # which running backfill's chunk is next
        self._signal_error: str | None = None
        note = self._signals.ensure(attached.writer)
        if note is not None:
            log.warning("%s", note)
        elif attached.primary is not None:
            wait_replayed(attached.sql, attached.primary)  # the table is read on the standby
        self._topic = self._signal_topic(attached)
        self._published_at = time.monotonic()  # when the publication's tables were last looked at
        self._gate: tuple[list[str], int] | None = None  # tables new to the publication, and the xid gate
        self._added: list[str] = []  # tables the publication gained, not yet in the state
        # Tables new to the capture at its start were just published (cdc run aligns its publication): their
        # backfills wait, as the publication's gains do, for the transactions running now.
        new = any(b.reason == "added" and b.chunks == 0 and not b.finished for b in state.backfills)
        self._start_gate = _xmax(attached.sql) if new else None
        self._gate_checked = 0.0
        self._gate_said, self._opened = False, time.monotonic()
        ctx.metrics.backfills_changed([b.to_json() for b in state.backfills])

    def _signal_topic(self, attached: Attached) -> SignalTopic | None:
        topic = self._ctx.settings.signal_topic
        if topic is None:
            return None
        try:
            attached.topics.ensure(topic, partitions=1, policy="delete")
        except CDCError as exc:
            log.warning("the signal topic %s cannot be read (%s); the signal table still works", topic, exc)
            return None
        return SignalTopic(self._ctx.settings.kafka.client_conf(), topic, self._ctx.settings.source.slot)

    def _new_reader(self) -> ChunkReader:
        return ChunkReader(self._ctx.settings, standby=self._attached.primary is not None)

    def note_commit(self, xid: int | None, commit_lsn: int) -> None:
        """A transaction the stream has written (its xid and commit LSN): a chunk read later must see it."""
        if xid is not None:
            self._recent.append((xid, commit_lsn))

    # --- driven by the stream ---------------------------------------------------------------------------

    def ready(self, now: float) -> bool:
        """Whether requests were taken or a chunk's read failed (:meth:`run` records it, in a Kafka transaction
        of its own); starts the next chunk reads meanwhile."""
        if now - self._polled >= self._ctx.settings.capture.signal_poll_s:
            self._polled = now
            self._poll()
        if now - self._published_at >= _PUBLICATION_POLL_S and not self._ctx.settings.source.tables:
            self._published_at = now
            self._watch_publication()
        if self._taken or self._added or (self._inflight and self._inflight[0].writable()):
            return True
        self._start(now)
        return False

    def run(self, writer: BatchWriter, state: CaptureState) -> None:
        for signal in self._taken:
            self._take(signal, state)
            if signal.partition is None:
                state.signal = max(state.signal, signal.id)
            else:
                offsets = state.signal_offsets
                offsets[signal.partition] = max(offsets.get(signal.partition, 0), signal.id + 1)
        self._taken = []
        if self._added:
            plan_new_tables(state, [t.qualified for t in self._attached.report.tables], self._ctx.settings)
            self._added = []
        self.write(writer)

    def on_watermark(self, content: bytes, lsn: int) -> bool:
        """A watermark arrived in the stream; True when a chunk's rows can be written now (:meth:`write`)."""
        for inflight in self._inflight:
            if content == inflight.marker.encode():
                inflight.high_seen = True
                # The reader returns just after writing the watermark: its rows go before what follows.
                wait([inflight.future])
                log.debug("backfill %s: a chunk's watermark at %X", inflight.backfill.id, lsn)
                return self._inflight[0].writable()
        return False  # another instance's, or one written before a restart

    def write(self, writer: BatchWriter) -> None:
        """The chunks that can be written, in order, into ``writer``'s open Kafka transaction; their progress
        into the state it commits."""
        while self._inflight and self._inflight[0].writable():
            inflight = self._inflight.popleft()
            self._changes.unwatch(inflight.codec.topic, inflight.window)
            if not self._finish(inflight, writer):
                self._drop(inflight.backfill)  # the chunks after it were read from where it ended
        state = self._state
        state.forget_finished()
        self._ctx.metrics.backfills_changed([b.to_json() for b in state.backfills])
        self._start(time.monotonic())  # the next read, without waiting for the stream's next boundary

    def close(self) -> None:
        for inflight in self._inflight:
            self._changes.unwatch(inflight.codec.topic, inflight.window)
        self._inflight.clear()
        self._reader.close()
        if self._topic is not None:
            self._topic.close()

    # --- requests ---------------------------------------------------------------------------------------

    def _poll(self) -> None:
        after = max([self._state.signal, *(s.id for s in self._taken if s.partition is None)])
        try:
            self._taken += self._signals.read(self._attached.sql, after)
            if self._topic is not None:
                self._taken += self._topic.read(self._state.signal_offsets)
            self._signal_error = None
        except (psycopg.Error, KafkaException) as exc:
            error = str(exc).strip()
            if error != self._signal_error:  # said once, not every poll
                log.warning("cannot read the requests (signal table %s, topic): %s", self._signals.name, error)
            self._signal_error = error

    def _watch_publication(self) -> None:
        """Tables the publication gained while streaming (it decides what is captured: source.tables is empty)
        are backfilled, like tables added to the configuration, once every transaction that was running when
        they were seen has ended: one of those may have written a table before it was published, and pgoutput
        does not stream such changes, so a chunk read before they end could miss them."""
        conn = self._attached.sql
        try:
            if self._gate is None:
                published = [
                    qualified_name(s, t) for s, t in publication_tables(conn, self._ctx.settings.source.publication)
                ]
                new = [t for t in published if t not in self._tables]
                if not new:
                    return
                self._gate = (new, _xmax(conn))
                log.info("the publication gained %s: backfilled once the transactions running now end", ", ".join(new))
            if _xmin(conn) < self._gate[1]:
                return
            report = check_and_prepare(
                conn,
                self._ctx.settings,
                dry_run=True,
                allow_active_slot=True,
                writer=self._attached.primary,
                as_published=True,
            )
        except (psycopg.Error, CDCError) as exc:
            log.warning("cannot look at the publication's tables: %s", str(exc).strip())
            return
        gated, self._gate = self._gate[0], None
        mine = self._attached.report
        for info in report.tables:  # only those the gate waited for: a later one gets a gate of its own
            if info.qualified in gated and info.qualified not in self._tables:
                self._tables[info.qualified] = info
                mine.tables.append(info)
                mine.key_columns[info.qualified] = report.key_columns[info.qualified]
                self._added.append(info.qualified)

    def _take(self, signal: Signal, state: CaptureState) -> None:
        data, name = signal.data, signal.name
        if signal.kind == "backfill":
            tables = data.get("tables")
            where = data.get("where")
            if not isinstance(tables, list) or not tables or not all(isinstance(t, str) for t in tables):
                self._refuse(state, name, "?", f"signal {name}: 'tables' is not a list of names")
                return
            if data.get("keys") is not None:
                self._request_keys(state, signal, tables, where)
                return
            for i, table in enumerate(tables):
                self._request(state, name if len(tables) == 1 else f"{name}.{i + 1}", table, where)
        elif signal.kind in ("cancel", "pause", "resume"):
            self._control(state, signal.kind, str(data.get("id")))
        elif signal.kind != "other":  # "other": another capture's request on a shared topic
            self._refuse(state, name, "?", str(data.get("error")))

    def _request(self, state: CaptureState, id_: str, name: str, where: Any) -> None:
        try:
            table = self._table(name)
            if where is not None and not isinstance(where, str):
                raise ValueError("'where' is not SQL text")
            if where is not None:
                check_where(self._attached.sql, table, where, self._ctx.settings.capture.backfill_statement_timeout_s)
        except ValueError as exc:
            self._refuse(state, id_, name, str(exc))
            return
        state.backfills.append(BackfillProgress(id_, table.qualified, where=where))
        log.info("backfill %s of %s%s queued", id_, table.qualified, f" where {where}" if where else "")

    def _request_keys(self, state: CaptureState, signal: Signal, tables: list[str], where: Any) -> None:
        """A backfill of the keys the signal lists (they stay in the signal's row; the state names it)."""
        id_ = signal.name
        try:
            if len(tables) != 1 or where is not None:
                raise ValueError("a request for listed keys names one table and no 'where'")
            if signal.partition is not None:  # its keys are read again from its row after a restart
                raise ValueError("listed keys are asked for through the signal table (cdc snapshot --keys)")
            table = self._table(tables[0])
            keys = parse_keys(signal.data["keys"], self._attached.report.key_columns[table.qualified], table.qualified)
        except ValueError as exc:
            self._refuse(state, id_, str(tables[0]) if tables else "?", str(exc))
            return
        self._listed[id_] = keys
        state.backfills.append(BackfillProgress(id_, table.qualified, reason="keys", keys=signal.id))
        log.info("backfill %s of %d listed key(s) of %s queued", id_, len(keys), table.qualified)

    def _listed_keys(self, backfill: BackfillProgress, key_names: Sequence[str]) -> list[dict[str, str]]:
        """A backfill's listed keys: as taken, or (after a restart) read again from its signal's row."""
        keys = self._listed.get(backfill.id)
        if keys is None:
            assert backfill.keys is not None
            data = self._signals.data(self._attached.sql, backfill.keys)
            if data is None:
                raise ValueError(
                    f"its request (signal {backfill.keys}), which lists the keys, is no longer in {self._signals.name}"
                )
            keys = self._listed[backfill.id] = parse_keys(data.get("keys"), key_names, backfill.table)
        return keys

    def _table(self, name: str) -> TableInfo:
        """The captured table ``name`` ('schema.table') names; ValueError saying why not."""
        schema, table = split_table_name(name)
        for info in self._tables.values():
            if (info.schema, info.name) == (schema, table):
                return info
        raise ValueError(f"table {name} is not captured (it must be in source.tables and the publication)")

    def _refuse(self, state: CaptureState, id_: str, table: str, error: str) -> None:
        log.warning("backfill request %s refused: %s", id_, error)
        state.backfills.append(BackfillProgress(id_, table, "failed", error=error))

    def _control(self, state: CaptureState, kind: str, id_: str) -> None:
        found = next((b for b in state.backfills if b.id == id_), None)
        if found is None or found.finished:
            log.warning("%s of backfill %s: %s", kind, id_, "no such backfill" if found is None else found.status)
            return
        found.status = {"cancel": "cancelled", "pause": "paused", "resume": "queued"}[kind]  # type: ignore[assignment]
        if kind != "resume":
            self._drop(found)  # the chunks in flight are not written; their watermarks pass by
        if kind == "cancel":
            self._keysets.pop(id_, None)
            self._listed.pop(id_, None)
        log.info("backfill %s of %s: %s", id_, found.table, found.status)

    def _drop(self, backfill: BackfillProgress) -> None:
        """Forgets ``backfill``'s chunks in flight: it goes on (if it does) from its last chunk written."""
        for inflight in [i for i in self._inflight if i.backfill is backfill]:
            self._changes.unwatch(inflight.codec.topic, inflight.window)
            self._inflight.remove(inflight)

    # --- chunks -----------------------------------------------------------------------------------------

    def _start(self, now: float) -> None:
        """The next chunk read, when one may start: read ahead of the chunks waiting, within the rate."""
        capture = self._ctx.settings.capture
        if len(self._inflight) >= _READ_AHEAD or now < self._next_start:
            return  # the cheap checks first: this runs at every transaction boundary
        behind = self._ctx.metrics.behind_s
        if behind is not None and behind > capture.backfill_pause_behind_s:
            return
        backfill = self._inflight[-1].backfill if self._inflight else self._next()
        if backfill is None or (self._inflight and self._inflight[-1].future.done() and self._ended()):
            return
        if backfill.reason == "added" and backfill.chunks == 0 and not self._gate_passed(now):
            return
        info = self._tables.get(backfill.table)
        if info is None:  # removed from the configuration since it was asked for
            backfill.status, backfill.error = "failed", "the table is no longer captured"
            return
        try:
            keyset = self._keyset(backfill, info)
        except psycopg.OperationalError as exc:  # the connection: tried again at the next boundary
            log.warning("backfill %s cannot start now: %s", backfill.id, str(exc).strip())
            return
        except (ValueError, psycopg.Error) as exc:
            self._failed(backfill, exc)
            return
        codec = keyset.job.codec
        window = ChunkWindow(before=tuple(self._recent))
        self._changes.watch(codec.topic, window)
        number = backfill.chunks + len(self._inflight)
        marker = f"{self._ctx.settings.source.slot}:{backfill.id}:{number}:{uuid.uuid4().hex[:12]}"
        job = ChunkJob(keyset, backfill.after, capture.backfill_chunk_rows, marker, first=not self._inflight)
        self._inflight.append(_InFlight(backfill, codec, window, marker, self._reader.submit(job)))
        if capture.backfill_rows_per_s:
            self._next_start = now + capture.backfill_chunk_rows / capture.backfill_rows_per_s

    def _gate_passed(self, now: float) -> bool:
        """Whether every transaction that was running when the capture started has ended (looked at once per
        capture.signal_poll_s)."""
        if self._start_gate is None:
            return True
        if now - self._gate_checked < self._ctx.settings.capture.signal_poll_s:
            return False
        self._gate_checked = now
        try:
            if _xmin(self._attached.sql) < self._start_gate:
                if not self._gate_said and now - self._opened > _GATE_SAID_AFTER_S:
                    self._gate_said = True
                    log.warning(
                        "backfills of tables new to the capture wait for transactions that were running when it "
                        "started (pg_stat_activity shows them: xact_start; one may have written such a table "
                        "before it was published)"
                    )
                return False
        except psycopg.Error as exc:
            log.warning("cannot look at the running transactions: %s", str(exc).strip())
            return False
        self._start_gate = None
        return True

    def _ended(self) -> bool:
        """The last chunk in flight read the table to its end (no chunk after it)."""
        last = self._inflight[-1].future
        return last.exception() is None and last.result().done

    def _next(self) -> BackfillProgress | None:
        """The backfill whose chunks are read next: the running ones in turn, queued ones started up to
        capture.backfills_at_once."""
        running = [b for b in self._state.backfills if b.status == "running"]
        for queued in (b for b in self._state.backfills if b.status == "queued"):
            if len(running) >= self._ctx.settings.capture.backfills_at_once:
                break
            queued.status = "running"
            running.append(queued)
            log.info("backfill %s of %s started", queued.id, queued.table)
        if not running:
            return None
        self._turn += 1
        return running[self._turn % len(running)]

    def _keyset(self, backfill: BackfillProgress, info: TableInfo) -> Keyset | KeyList:
        """How the backfill's chunks are read; ValueError when its listed keys cannot be had."""
        keyset = self._keysets.get(backfill.id)
        if keyset is None:
            info = self._current(info)
            key = self._attached.report.key_columns[info.qualified]
            cols = [ColumnSpec(c.name, c.type_oid, c.typmod, c.attnum) for c in info.columns]
            flags = [c.name in key for c in cols]
            codec = self._attached.codecs.for_table(info.schema, info.name, cols, flags, info.oid)
            job = RangeJob(ReadRange(info, 0, None, None), codec, self._ctx.settings.capture.backfill_chunk_rows)
            if backfill.keys is not None:
                types = key_types(self._attached.sql, info.oid, key)
                keyset = KeyList(job, key, types, self._listed_keys(backfill, key))
            else:
                keyset = Keyset.of(self._attached.sql, job, key)
                keyset.where = backfill.where
            self._keysets[backfill.id] = keyset
        return keyset

    def _current(self, info: TableInfo) -> TableInfo:
        """The table as the catalogs describe it now: a column renamed, added or dropped since the capture
        started would otherwise be read by its old name (a repair after a rename failed so). ValueError when a
        key column is gone, which only a restarted capture can follow."""
        fresh = load_table(self._attached.sql, info.schema, info.name)
        if fresh is not None:
            publication = self._ctx.settings.source.publication
            fresh = restrict(fresh, published(self._attached.sql, publication).get((info.schema, info.name)))
        if fresh is None or (fresh.columns, fresh.row_filter) == (info.columns, info.row_filter):
            return info
        key = self._attached.report.key_columns[info.qualified]
        missing = [k for k in key if k not in {c.name for c in fresh.columns}]
        if missing:
            raise ValueError(
                f"key column(s) {', '.join(missing)} of {info.qualified} were renamed or dropped since `cdc run` "
                "started: restart it, then ask again"
            )
        self._tables[info.qualified] = fresh
        return fresh

    def _finish(self, inflight: _InFlight, writer: BatchWriter) -> bool:
        """The chunk's rows (those its window keeps) into the open Kafka transaction, and its progress; False
        when it was not written (read again: its read failed, or its window says so)."""
        backfill, codec = inflight.backfill, inflight.codec
        error = inflight.future.exception()
        if error is not None:
            self._failed(backfill, error)
            return False
        chunk = inflight.future.result()
        if chunk.snapshot is None:  # nothing read: the chunk before it ended the table
            return True
        stale = inflight.window.stale(chunk.snapshot)
        if stale is not None:
            log.info("backfill %s: chunk %d is read again: %s", backfill.id, backfill.chunks, stale)
            return False
        dropped = inflight.window.dropped(chunk.snapshot)
        packed, rows = _without(chunk.packed, chunk.rows, dropped)
        now_us = time.time_ns() // 1000
        for refused in chunk.refused:
            refuse_read(
                self._attached.dead_letters, codec, refused, chunk.high, writer=writer, metrics=self._ctx.metrics
            )
        if rows:
            prefix, suffix = codec.read_event_frame(
                Position(chunk.high, chunk.high, now_us, None, "incremental"), now_us
            )
            writer.produce_packed(codec.topic, packed, rows, prefix, suffix)
            self._ctx.metrics.count(codec.topic, "r", rows)
        if chunk.absent:
            backfill.deleted += _write_deletes(
                codec, chunk.absent, dropped, chunk.high, writer=writer, metrics=self._ctx.metrics
            )
        log.debug("backfill %s: chunk %d written (%d of %d rows)", backfill.id, backfill.chunks, rows, chunk.rows)
        backfill.after, backfill.rows, backfill.chunks = chunk.last_key, backfill.rows + rows, backfill.chunks + 1
        if chunk.done:
            backfill.status = "done"
            self._keysets.pop(backfill.id, None)
            self._listed.pop(backfill.id, None)
            deleted = f", {backfill.deleted} key(s) it no longer has deleted" if backfill.keys is not None else ""
            log.info(
                "backfill %s of %s done: %d row(s) in %d chunk(s)%s",
                backfill.id,
                backfill.table,
                backfill.rows,
                backfill.chunks,
                deleted,
            )
        return True

    def _failed(self, backfill: BackfillProgress, error: BaseException) -> None:
        self._listed.pop(backfill.id, None)
        # A lost connection, a recovery conflict on a standby (40001, 40P01), a primary out of reach for a
        # watermark: read again. A statement timeout (QueryCanceled) is the chunk's own: it would time out again.
        if isinstance(error, TransientError) or (
            isinstance(error, psycopg.OperationalError) and not isinstance(error, psycopg.errors.QueryCanceled)
        ):
            log.warning("backfill %s: reading a chunk failed (%s); it is read again", backfill.id, error)
            self._reader.close()
            self._reader = self._new_reader()
            return
        backfill.status, backfill.error = "failed", str(error).strip() or type(error).__name__
        self._keysets.pop(backfill.id, None)
        log.error("backfill %s of %s failed: %s", backfill.id, backfill.table, backfill.error)


def _write_deletes(
    codec: TableCodec,
    absent: list[list[bytes | None]],
    dropped: set[bytes],
    high: int,
    *,
    writer: BatchWriter,
    metrics: Any,
) -> int:
    """A delete and a tombstone, at the chunk's watermark, for each listed key the table does not have (rows
    with only their key: what a DELETE under REPLICA IDENTITY DEFAULT carries), but those a transaction the
    chunk did not see wrote meanwhile (``dropped``: the stream wrote them, in order). How many were written."""
    kinds = bytes(_B if b else _T for b in codec.binary_capable)
    now_us = time.time_ns() // 1000
    stamp = Stamp(Position(high, high, now_us, None, "incremental"), now_us)
    written = 0
    for fields in absent:
        try:
            row, _ = codec.row(
                TupleData(bytes(_NULL if v is None else k for v, k in zip(fields, kinds, strict=True)), tuple(fields))
            )
            key = codec.key_of(row)
        except ValueError as exc:  # a key no event can carry (a hand-written request): no store can hold it
            log.warning("a listed key %s.%s does not have is not deleted: %s", codec.schema, codec.table, exc)
            continue
        if key in dropped:
            continue
        writer.produce(codec.topic, key, codec.envelope("d", stamp, row, None))
        writer.produce(codec.topic, key, None)
        written += 1
    if written:
        metrics.count(codec.topic, "d", written)
    return written


def _xmax(conn: psycopg.Connection[Any]) -> int:
    """The first transaction id not yet assigned: every transaction running now has a smaller one."""
    row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _xmin(conn: psycopg.Connection[Any]) -> int:
    """The oldest transaction id still running (or :func:`_xmax` when none is)."""
    row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _last_value(conn: psycopg.Connection[Any], statements: sql.Composed) -> str:
    """The value the last of several statements (sent in one round trip) returns."""
    cur = conn.execute(statements)
    while cur.nextset():
        pass
    row = cur.fetchone()
    assert row is not None
    return str(row[0])


def _without(packed: bytes, rows: int, dropped: set[bytes]) -> tuple[bytes, int]:
    """``packed`` rows (RowEncoder.encode_copy_packed) without those whose key is in ``dropped``."""
    if not dropped:
        return packed, rows
    keys, records = packed_rows(packed)
    assert records is not None
    out = bytearray()
    kept = 0
    for key, record in zip(keys, records, strict=True):
        if key not in dropped:
            out += PACKED_HEAD.pack(len(record), len(key))
            out += record
            out += key
            kept += 1
    return bytes(out), kept


def check_where(conn: psycopg.Connection[Any], table: TableInfo, where: str, timeout_s: float) -> None:
    """ValueError saying what PostgreSQL says when ``where`` is not a read-only filter of ``table`` (planned in a
    READ ONLY transaction with a statement timeout, rolled back)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET TRANSACTION READ ONLY")
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(int(timeout_s * 1000))))
            conn.execute(sql.SQL("EXPLAIN SELECT 1 FROM {} WHERE ({})").format(table.ident(), sql.SQL(where)))
    except psycopg.Error as exc:
        raise ValueError(f"--where {where!r} is not a filter of {table.qualified}: {str(exc).strip()}") from exc


__all__ = ["WATERMARK_PREFIX", "Backfills", "ChunkReader", "KeyList", "check_where", "parse_keys", "plan_new_tables"]
