"""Streaming: the replication stream read from the committed position, every committed transaction's changes
into Kafka through the batch writer, the position confirmed to PostgreSQL only once Kafka holds it.

Two parts. :class:`ReplicationSource` owns the stream's positions (what was received, what is confirmed to
PostgreSQL) and what keeps them moving when nothing else does: status updates, heartbeats, keepalives.
:class:`Streamer` owns the transaction being read (live, or streamed and spilled to disk until it commits), the
position of the last transaction in the open batch, and when that batch is committed (cdc/_batch.py's policy).

The loop takes the common cases first, without building an XLogData: a row change of a live transaction goes
straight to Kafka (ChangeWriter.fast_change; anything it does not take goes the general way), a row change of a
streamed (large, in-progress) transaction goes to disk as received: it is decoded when it commits (the decoder's
state only changes at Stream Start/Stop). Every other message is decoded and handled by its type.
docs/design/capture-hot-path.md says what each path costs.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg

from cdc._attach import Attached, CaptureContext
from cdc._backfill import WATERMARK_PREFIX, Backfills
from cdc._batch import BatchWriter, KafkaBatchWriter
from cdc._changes import FAST_KINDS, ChangeWriter
from cdc._config import CaptureConfig
from cdc._offsets import CaptureState
from cdc._replication import ReplicationConnection
from cdc._source import translate_pg_error
from cdc._spill import SPILL_READ, STREAM_PACE_BELOW, STREAM_PACE_S, Spill
from cdc._standby import in_recovery
from cdc.errors import StreamError, TransientError
from decoders import (
    XLOG_HEADER,
    XLOG_PAYLOAD_AT,
    Begin,
    Commit,
    Delete,
    Insert,
    Keepalive,
    LogicalMessage,
    Origin,
    PgOutputDecoder,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TypeInfo,
    Update,
    XLogData,
    parse_copy_data,
)

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "pgcdc.heartbeat"
_XLOG_DATA = ord("w")
_XLOG_UNPACK = XLOG_HEADER.unpack_from
_PAYLOAD_AT = XLOG_PAYLOAD_AT

# A transaction being read: (its commit LSN = Begin's final LSN, its commit time, its xid, skipped: it
# committed before the resume position, so it is already in Kafka).
Txn = tuple[int, int, int | None, bool]


class BetweenTransactions(Protocol):
    """Work that writes to Kafka between two stream transactions (a backfill's chunk, say): its events and the
    state they advance are committed in a Kafka transaction of their own, after the stream's batch."""

    def ready(self, now: float) -> bool:
        """Whether it has something to write now (``now``: time.monotonic())."""
        ...

    def run(self, writer: BatchWriter, state: CaptureState) -> None:
        """Produce through ``writer`` and update ``state``; the streamer commits both together."""
        ...


def _freeze_startup_objects() -> None:
    """Hides what the process made before streaming (modules, settings, clients, codecs: ~hundreds of thousands of
    objects that live as long as it does) from the cyclic garbage collector. A full collection then scans only
    what streaming made since: measured at 2,000 txn/s, full collections of the whole heap paused the capture
    for up to ~55 ms, and every event in flight waited (commit -> Kafka latency p99). Once per process: objects
    frozen are never collected, so a retried attempt's must not be frozen again."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()


def _quote_list(names: Sequence[str]) -> str:
    """A publication_names value: double-quoted identifiers, so any name survives the option parser."""
    return ",".join('"' + n.replace('"', '""') + '"' for n in names)


class ReplicationSource:
    """The replication stream's positions: ``received`` (the end of what arrived) and ``acked`` (what PostgreSQL
    was told is flushed: the slot may free the WAL before it), and the timers that keep them moving."""

    def __init__(
        self,
        conn: ReplicationConnection,
        sql: psycopg.Connection[Any],
        capture: CaptureConfig,
        slot: str,
        *,
        where: str = "source.dsn",
        standby: psycopg.Connection[Any] | None = None,
    ) -> None:
        self.conn = conn  # read by the loop directly: no call added per message
        self._sql = sql  # where heartbeats are written (``where`` names it in errors)
        self._where = where
        # Reading a standby (heartbeats then go to its primary): looked at on each heartbeat, so that a promotion
        # re-attaches the capture, which then writes on the promoted server instead of a primary it left.
        self._standby = standby
        self._capture = capture
        self._slot = slot
        self.received = self.acked = 0
        self._last_status = self._last_heartbeat = 0.0
        self.due = 0.0  # when on_timers has something to do (time.monotonic)

    def start(self, resume: int, options: dict[str, str]) -> None:
        """START_REPLICATION at ``resume`` (what Kafka holds); PostgreSQL is told so at once."""
        self.conn.start(self._slot, resume, options)
        self.conn.send_status(resume, resume, resume)
        self.received = self.acked = resume
        self._last_status = self._last_heartbeat = time.monotonic()
        self._set_due()

    def on_timers(self, now: float) -> None:
        """A heartbeat (a logical message through the WAL, so an idle slot still moves) and a status update
        when each is due."""
        cfg = self._capture
        if now - self._last_heartbeat >= cfg.heartbeat_interval_s:
            self._heartbeat()
            self._last_heartbeat = now
        if now - self._last_status >= cfg.status_interval_s:
            self.conn.send_status(self.received, self.acked, self.acked)
            self._last_status = now
        self._set_due()

    def _heartbeat(self) -> None:
        if self._standby is not None:
            try:
                promoted = not in_recovery(self._standby)
            except psycopg.Error as exc:
                raise translate_pg_error(exc, "source.dsn (the standby)") from exc
            if promoted:
                raise TransientError(
                    "source.dsn's server has been promoted: the capture attaches again, to write its heartbeats and "
                    "watermarks there rather than on source.primary_dsn"
                )
        try:
            self._sql.execute("SELECT pg_logical_emit_message(false, %s, %s)", (HEARTBEAT_PREFIX, self._slot))
        except psycopg.Error as exc:
            raise translate_pg_error(exc, self._where) from exc

    def _set_due(self) -> None:
        cfg = self._capture
        self.due = min(self._last_heartbeat + cfg.heartbeat_interval_s, self._last_status + cfg.status_interval_s)

    def confirm(self, lsn: int) -> None:
        """Kafka holds everything before ``lsn``: PostgreSQL may free the WAL before it."""
        self.acked = lsn
        self.conn.send_status(self.received, lsn, lsn)

    def keepalive(self, frame: Keepalive, *, idle: bool) -> bool:
        """A keepalive. ``idle``: nothing received waits for Kafka. Then every transaction that committed up to
        the keepalive's position has been sent before it, and written and committed by us (or had nothing we
        capture), so that position is confirmed, as PostgreSQL's own apply worker and pg_recvlogical do: WAL
        written only for other tables or databases is freed without waiting for a heartbeat. Uncommitted
        transactions are decoded again after a restart whatever the slot confirms (it keeps their WAL:
        restart_lsn). Returns whether it was confirmed (the committed state is not rewritten for it; on the next
        start PostgreSQL moves a start position older than the slot's confirmed one forward to it)."""
        self.received = max(self.received, frame.end_lsn)
        confirmed = idle and self.received > self.acked
        if confirmed:
            self.acked = self.received
        if frame.reply_requested:
            self.conn.send_status(self.received, self.acked, self.acked)
            self._last_status = time.monotonic()
        return confirmed


class Streamer:
    """One attempt at streaming, from the committed state's LSN until the stop request (at a transaction
    boundary) or an error. The state's LSN is moved only here, when a batch is committed."""

    def __init__(
        self,
        ctx: CaptureContext,
        attached: Attached,
        source: ReplicationSource,
        changes: ChangeWriter,
        *,
        writer: KafkaBatchWriter,
        state: CaptureState,
    ) -> None:
        assert state.lsn is not None  # known before streaming starts
        self.ctx, self.attached, self.source, self.changes, self.writer = ctx, attached, source, changes, writer
        self.state = state
        self.resume = state.lsn
        self.batch_lsn = state.lsn  # the end of the last transaction (or message) the open batch covers
        self.current: Txn | None = None  # the live transaction being read
        self.capturing = False  # current is not None and not skipped: its changes are written
        self.stream_xid: int | None = None  # the streamed transaction whose changes arrive now
        self.spills: dict[int, Spill] = {}  # streamed transactions not yet committed or aborted
        self.relations_seen = 0  # Relation messages received, in or out of streamed transactions: their order
        self.held: bytes | None = None  # the message after a run of changes read from C
        self.stopping = False
        self.between: list[BetweenTransactions] = []  # run at transaction boundaries, each in its own commit
        self.backfills: Backfills | None = None  # told of watermarks and written transactions (cdc/_backfill.py)
        self.proto = 1
        self.decoder = PgOutputDecoder(1)
        self._handlers: dict[type, Callable[[Any, int, Any], None]] = {
            Insert: self._on_change,
            Update: self._on_change,
            Delete: self._on_change,
            Truncate: self._on_change,
            Begin: self._on_begin,
            Commit: self._on_commit,
            Relation: self._on_relation,
            TypeInfo: self._on_type,
            LogicalMessage: self._on_logical_message,
            StreamStart: self._on_stream_start,
            StreamStop: self._on_stream_stop,
            StreamAbort: self._on_stream_abort,
            StreamCommit: self._on_stream_commit,
            Origin: self._on_origin,
        }

    def run(self) -> None:
        self._start()
        try:
            self._loop()
        finally:
            self._close()

    def _start(self) -> None:
        s = self.ctx.settings
        self.proto = 2 if self.attached.sql.info.server_version >= 140000 else 1
        options = {"proto_version": str(self.proto), "publication_names": _quote_list([s.source.publication])}
        if self.proto >= 2:
            options["streaming"] = "on"
            options["messages"] = "true"
            if self.changes.binary:
                options["binary"] = "true"
        self.decoder = PgOutputDecoder(self.proto, streaming=self.proto >= 2)
        self.source.start(self.resume, options)
        self.ctx.metrics.set_state("streaming")
        _freeze_startup_objects()
        log.info("streaming from slot %s at %X (protocol %d)", s.source.slot, self.resume, self.proto)

    def _loop(self) -> None:
        writer, changes, source, stop = self.writer, self.changes, self.source, self.ctx.stop
        repl = source.conn
        fast_change, read, monotonic = changes.fast_change, repl.read, time.monotonic
        linger, idle_wait = writer.policy.linger_s, min(1.0, self.ctx.settings.capture.status_interval_s)
        bulk = repl.reads_changes_in_bulk
        live_c = bulk and writer.produces_from_c  # a live transaction's changes from C (more_changes)
        raw: bytes | memoryview | None
        while True:
            if stop.is_set() and self._stopped():
                return
            now = monotonic()
            between = self.current is None
            if writer.in_batch and between and now - writer.started >= linger:
                self._commit()
            if now >= source.due:
                source.on_timers(now)
            if self.held is not None:
                raw, self.held = self.held, None
            elif writer.in_batch:  # caught up between transactions: commit (a large batch: see coalescing)
                raw = read(writer.coalescing(now) if between else linger)
            else:
                raw = read(idle_wait)
            if raw is None:
                self._caught_up()
                continue
            if raw[0] == _XLOG_DATA and len(raw) > _PAYLOAD_AT and raw[_PAYLOAD_AT] in FAST_KINDS:
                if self.stream_xid is not None:
                    self._spill_raw(raw, bulk)
                    continue
                if self.capturing:
                    data = bytes(raw)
                    lsn, end_lsn, _ = _XLOG_UNPACK(data, 1)
                    source.received = max(source.received, end_lsn)
                    if fast_change(data, lsn, _PAYLOAD_AT):
                        if live_c and changes.tx is None:  # the ones after it, from C
                            self.held, end_lsn = changes.more_changes(repl, data)
                            source.received = max(source.received, end_lsn)
                        continue
            frame = parse_copy_data(raw)
            if isinstance(frame, Keepalive):
                if source.keepalive(frame, idle=self._idle and not writer.in_batch):
                    self.batch_lsn = source.received
                if self.between and self._idle and not writer.in_batch:
                    # Nothing of ours is being read, as when a read times out. While other databases write, the
                    # server sends a keepalive each time it waits for more of their WAL, so reads stop timing out:
                    # without this, backfill chunks and signals waited for those writes to end.
                    self._between_transactions()
            else:
                self._on_message(frame)

    @property
    def _idle(self) -> bool:
        """No transaction is being read, live or streamed."""
        return self.current is None and self.stream_xid is None and not self.spills

    def _stopped(self) -> bool:
        """The stop request is taken at the next transaction boundary: the batch is committed there."""
        if not self.stopping:
            self.stopping = True
            log.info("stop requested: finishing the current transaction")
        if self.current is not None:
            return False
        self._commit()
        return True

    def _commit(self) -> None:
        """The open batch committed with the state at its last transaction's end, then confirmed to PostgreSQL."""
        if not self.writer.in_batch and self.batch_lsn <= self.source.acked:
            return
        self.state.lsn = self.batch_lsn
        self.writer.commit(self.state)
        self.source.confirm(self.batch_lsn)

    def _caught_up(self) -> None:
        """Nothing more arrived: the batch is committed at a transaction boundary (unless it coalesces), and an
        idle stream is not behind."""
        if self.writer.in_batch and self.current is None and not self.writer.coalescing(time.monotonic()):
            self._commit()
        elif self._idle:
            self.ctx.metrics.set_behind(0.0)  # the server has nothing more to send: not behind
        if self.between and self.current is None:
            self._between_transactions()

    def _between_transactions(self) -> None:
        """The work that is ready, each piece in a Kafka transaction of its own after the stream's batch is
        committed: every Kafka transaction is either the stream's or one piece's, and each piece's state record
        carries the stream position already committed, so a crash in between replays nothing twice."""
        if self.ctx.stop.is_set():  # a backfill's chunk or a signal read would only hold the stop up
            return
        now = time.monotonic()
        ready = [task for task in self.between if task.ready(now)]
        if not ready:
            return
        self._commit()
        for task in ready:
            task.run(self.writer, self.state)
            self.writer.commit(self.state)

    def _spill_raw(self, raw: bytes | memoryview, bulk: bool) -> None:
        """A row change of the streamed transaction, to its spill as received, with the ones after it that have
        arrived (from C in one call)."""
        source = self.source
        lsn, end_lsn, _ = _XLOG_UNPACK(raw, 1)
        source.received = max(source.received, end_lsn)
        assert self.stream_xid is not None
        into = self.spills[self.stream_xid]
        into.add(lsn, raw[_PAYLOAD_AT:])
        if bulk:
            framed, count, end_lsn, self.held = source.conn.read_changes(SPILL_READ)
            if count:
                into.add_framed(framed)
                source.received = max(source.received, end_lsn)
            if self.held is None and len(framed) < STREAM_PACE_BELOW:
                time.sleep(STREAM_PACE_S)  # let the walsender's backlog build (cdc/_spill.py)

    def _on_message(self, frame: XLogData) -> None:
        """Any message the fast paths did not take: decoded, then handled by its type."""
        source = self.source
        source.received = max(source.received, frame.end_lsn)
        msg = self.decoder.decode(frame.payload)
        handler = self._handlers.get(type(msg))
        if handler is None:
            lsn = frame.start_lsn
            raise StreamError(f"unexpected {type(msg).__name__} at {lsn:X} (two-phase is not enabled)")
        handler(msg, frame.start_lsn, frame.payload)

    def _on_change(self, msg: Insert | Update | Delete | Truncate, lsn: int, payload: bytes | memoryview) -> None:
        if self.stream_xid is not None:
            self.spills[self.stream_xid].add(lsn, bytes(payload))
        elif self.current is None:
            raise StreamError(f"change outside a transaction at {lsn:X}")
        elif not self.capturing:
            return
        elif isinstance(msg, Truncate):
            self.changes.apply(msg, lsn)
        else:  # the fast path did not take it
            self.changes.change(bytes(payload), lsn)

    def _on_begin(self, msg: Begin, _lsn: int, _payload: object) -> None:
        skip = msg.final_lsn < self.resume
        self.current = (msg.final_lsn, msg.commit_time_us, msg.xid, skip)
        self.capturing = not skip
        if not skip:
            self.ctx.metrics.pending(msg.commit_time_us)
        # One "processed at" per transaction.
        self.changes.begin(msg.final_lsn, msg.commit_time_us, msg.xid, time.time_ns() // 1000)
        self.changes.tx_begin(msg.xid, msg.final_lsn, msg.commit_time_us)

    def _on_commit(self, msg: Commit, _lsn: int, _payload: object) -> None:
        if self.current is not None and self.capturing:
            self.batch_lsn = max(self.batch_lsn, msg.end_lsn)
            self.writer.note_commit(self.current[1])
            self.changes.tx_end()
            if self.backfills is not None:
                self.backfills.note_commit(self.current[2], self.current[0])
        self.current, self.capturing = None, False
        if self.writer.full:
            self._commit()
        if self.between:
            self._between_transactions()

    def _on_relation(self, msg: Relation, lsn: int, payload: bytes | memoryview) -> None:
        self.relations_seen += 1
        if self.stream_xid is not None:
            # Inside a streamed transaction the schema is that transaction's own (it may have altered the
            # table): it applies to its changes, when it commits, and to later ones (see _on_stream_commit).
            spill = self.spills[self.stream_xid]
            spill.add(lsn, bytes(payload))
            spill.relations[msg.relid] = (self.relations_seen, msg)
        else:
            self.changes.relation(msg, self.relations_seen)

    def _on_type(self, msg: TypeInfo, _lsn: int, _payload: object) -> None:
        self.attached.types.invalidate(msg.oid)

    def _on_logical_message(self, msg: LogicalMessage, lsn: int, payload: bytes | memoryview) -> None:
        s = self.ctx.settings
        if msg.transactional:
            if s.capture.emit_messages and self.stream_xid is not None:
                self.spills[self.stream_xid].add(lsn, bytes(payload))
            elif s.capture.emit_messages and self.capturing:
                self.changes.apply(msg, msg.lsn)
            return
        if msg.lsn <= self.resume:
            return
        # Not part of any transaction. pgoutput gives such a message the LSN of its record's end, and PostgreSQL
        # skips it on a restart at any position past its start: resuming at that end does. (A byte further would
        # confirm a position the server has not written when the message is the newest record, as an idle
        # database's heartbeat is: a standby never synchronizes a failover slot confirmed ahead of its WAL.)
        heartbeat = msg.prefix == HEARTBEAT_PREFIX
        watermark = msg.prefix == WATERMARK_PREFIX
        if not (heartbeat or watermark) and s.capture.emit_messages:
            self.changes.apply_outside(msg)
        chunk_due = watermark and self.backfills is not None and self.backfills.on_watermark(bytes(msg.content), lsn)
        if self.current is None and self.stream_xid is None:
            self.batch_lsn = max(self.batch_lsn, msg.lsn)
            if heartbeat and bytes(msg.content) == s.source.slot.encode():
                self._commit()  # our own heartbeat (other instances' pass by)
            if chunk_due:  # its rows go before anything after the watermark, in the open batch
                assert self.backfills is not None
                self.backfills.write(self.writer)

    def _on_stream_start(self, msg: StreamStart, _lsn: int, _payload: object) -> None:
        self.stream_xid = msg.xid
        if msg.xid not in self.spills:
            spill_dir = os.environ.get("CDC_SPILL_DIR") or None
            # Closed by Spill.close() at Stream Commit/Abort or when streaming ends.
            self.spills[msg.xid] = Spill(tempfile.TemporaryFile(dir=spill_dir))  # noqa: SIM115

    def _on_stream_stop(self, _msg: StreamStop, _lsn: int, _payload: object) -> None:
        self.stream_xid = None

    def _on_stream_abort(self, msg: StreamAbort, _lsn: int, _payload: object) -> None:
        spill = self.spills.get(msg.xid)
        if spill is None:
            return
        if msg.subxid == msg.xid:
            spill.close()
            del self.spills[msg.xid]
        else:
            spill.aborted_subxids.add(msg.subxid)

    def _on_stream_commit(self, msg: StreamCommit, _lsn: int, _payload: object) -> None:
        spill = self.spills.pop(msg.xid, None)
        if spill is None:
            return
        try:
            if msg.commit_lsn >= self.resume:
                self._replay(spill, msg)
            # pgoutput counts the Relations it sent in a committed streamed transaction as sent for good: it does
            # not send them again before later transactions' changes (replayed or not, here).
            self.changes.keep_relations(spill.relations)
        finally:
            spill.close()

    def _replay(self, spill: Spill, msg: StreamCommit) -> None:
        # Worth a line each: a streamed transaction is one larger than the server's logical_decoding_work_mem,
        # and its events only start to flow now.
        log.info("replaying streamed transaction %d (%.0f MB spilled)", msg.xid, spill.size / 2**20)
        started = time.monotonic()
        self.changes.tx_begin(msg.xid, msg.commit_lsn, msg.commit_time_us)
        self.changes.replay(spill, msg, self.proto, time.time_ns() // 1000)
        log.info(
            "replayed streamed transaction %d in %.2f s (its events commit with the batch)",
            msg.xid,
            time.monotonic() - started,
        )
        self.batch_lsn = max(self.batch_lsn, msg.end_lsn)
        self.writer.note_commit(msg.commit_time_us)
        self.changes.tx_end()
        if self.backfills is not None:
            self.backfills.note_commit(msg.xid, msg.commit_lsn)

    def _on_origin(self, _msg: Origin, _lsn: int, _payload: object) -> None:
        pass  # replicated-in changes are captured like any other

    def _close(self) -> None:
        self.changes.reset()
        for spill in self.spills.values():
            spill.close()
        self.writer.abort()
        self.ctx.metrics.set_state("stopped")


__all__ = ["HEARTBEAT_PREFIX", "BetweenTransactions", "ReplicationSource", "Streamer"]
