"""The capture service: snapshot, then stream every committed change into Kafka, exactly once.

Every event reaches Kafka through the batch writer (cdc/_batch.py), in Kafka transactions that also carry the
committed state (cdc/_offsets.py); its docstring gives the delivery protocol, why nothing is lost or doubled.

Streamed (in-progress, protocol v2) transactions are spilled to disk per transaction and replayed into
the batch at Stream Commit, so memory stays bounded and aborted transactions never reach Kafka.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from types import FrameType

import psycopg

from cdc._assembler import _STREAM_PACE_BELOW, _STREAM_PACE_S, SPILL_READ, Spill
from cdc._attach import CaptureContext, TextModeNeededError, attach
from cdc._batch import CommitPolicy, KafkaBatchWriter
from cdc._changes import FAST_KINDS, ChangeWriter
from cdc._config import Settings
from cdc._kafka import OffsetStore, TransactionalProducer
from cdc._metrics import CaptureMetrics
from cdc._offsets import CaptureState, SnapshotState
from cdc._replication import ReplicationConnection
from cdc._snapshot import SnapshotStoppedError, Snapshotter
from cdc._source import translate_pg_error
from cdc.errors import StreamError
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
    parse_copy_data,
)
from schemas import (
    avro_mapping,
)

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "pgcdc.heartbeat"
_CHANGES = frozenset({Insert, Update, Delete, Truncate})
_XLOG_DATA = ord("w")
_XLOG_UNPACK = XLOG_HEADER.unpack_from
_PAYLOAD_AT = XLOG_PAYLOAD_AT


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


class Capture:
    """One capture: a slot, its publication's tables, their topics."""

    def __init__(
        self, settings: Settings, *, stop: threading.Event | None = None, metrics: CaptureMetrics | None = None
    ) -> None:
        self.settings = settings
        self.stop = stop or threading.Event()
        self.metrics = metrics or CaptureMetrics()
        self.ctx = CaptureContext(settings, self.stop, self.metrics)

    # --- set-up -------------------------------------------------------------------------------

    def _new_producer(self) -> TransactionalProducer:
        s = self.settings
        return TransactionalProducer(s.kafka.client_conf(), s.transactional_id, gap_s=s.kafka.transaction_gap_ms / 1000)

    def _new_writer(self, producer: TransactionalProducer, offsets: OffsetStore) -> KafkaBatchWriter:
        return KafkaBatchWriter(producer, offsets, self.metrics, CommitPolicy.from_settings(self.settings.capture))

    def run(self) -> None:
        """Attach, snapshot if needed, stream until ``stop`` is set; raises CDCError subclasses."""
        self.metrics.aborted()  # nothing counted by an earlier attempt that failed before its commit
        try:
            self._run()
        except psycopg.Error as exc:
            # The one boundary for the source's errors after connecting (heartbeats, catalogs, snapshot
            # workers): a dropped connection is transient, anything else says what PostgreSQL said.
            raise translate_pg_error(exc, self.settings.source.display_dsn()) from exc

    def _run(self) -> None:
        with attach(self.ctx) as attached:
            self.attached = attached
            producer = self._new_producer()
            self.writer = self._new_writer(producer, self.attached.offsets)
            self.changes = ChangeWriter(self.ctx, attached, self.writer)
            try:
                self._run_with_producer()
            finally:
                producer.close()

    def _run_with_producer(self) -> None:
        s = self.settings
        state = self.attached.offsets.load()
        repl = ReplicationConnection(s.source.conninfo(replication="database"), where=s.source.display_dsn())
        try:
            if not self.attached.report.slot_exists:
                created = repl.create_slot(s.source.slot, export_snapshot=s.capture.snapshot == "initial")
                log.info("created replication slot %s at %X", s.source.slot, created.consistent_lsn)
                state = CaptureState(lsn=created.consistent_lsn)
                if s.capture.snapshot == "initial":
                    state.snapshot = SnapshotState.started(created.consistent_lsn)
                    self._snapshot(state, created.snapshot_name)
                else:
                    self.writer.commit(state)
            elif (state is not None and state.snapshot_running) or (state is None and s.capture.snapshot == "initial"):
                # The exported snapshot died with the process that created it. Finish with a fresh
                # snapshot: the stream restarts at the slot's position, so every change after it is
                # replayed over the rows read now, and each key ends at its latest value.
                state = state or CaptureState()
                if state.lsn is None:
                    state.lsn = self._slot_confirmed_lsn()
                if state.snapshot is None:
                    state.snapshot = SnapshotState.started(state.lsn)
                self._snapshot(state, None)
            state = state or CaptureState()
            if state.lsn is None:
                state.lsn = self._slot_confirmed_lsn()
            self.changes.binary = s.capture.binary and self._all_binary_capable()
            while not self.stop.is_set():
                try:
                    self._stream(repl, state)
                    break
                except TextModeNeededError as exc:
                    # pgoutput's binary option is all or nothing for a connection: go back to the committed
                    # position and stream in text, which every type has.
                    log.info("%s: restarting the stream in text mode", exc)
                    repl.close()
                    self.changes.binary = False
                    repl = ReplicationConnection(
                        s.source.conninfo(replication="database"), where=s.source.display_dsn()
                    )
        finally:
            repl.close()

    def _all_binary_capable(self) -> bool:
        for table in self.attached.report.tables:
            for col in table.columns:
                if avro_mapping(self.attached.types.resolve(col.type_oid), col.typmod).from_binary is None:
                    log.info(
                        "column %s.%s has no binary reader: values are streamed as text", table.qualified, col.name
                    )
                    return False
        return True

    def _snapshot(self, state: CaptureState, snapshot_name: str | None) -> None:
        # On SnapshotStoppedError the progress is committed; run() sees the stop flag and returns.
        with contextlib.suppress(SnapshotStoppedError):
            Snapshotter(self.ctx, self.attached, self.writer, state).run(snapshot_name)

    def _slot_confirmed_lsn(self) -> int:
        row = self.attached.sql.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = %s",
            (self.settings.source.slot,),
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    # --- streaming ----------------------------------------------------------------------------

    def _stream(self, repl: ReplicationConnection, state: CaptureState) -> None:
        s = self.settings
        assert state.lsn is not None  # set by _run_with_producer
        resume = state.lsn
        server_version = self.attached.sql.info.server_version
        proto = 2 if server_version >= 140000 else 1
        options = {"proto_version": str(proto), "publication_names": _quote_list([s.source.publication])}
        if proto >= 2:
            options["streaming"] = "on"
            options["messages"] = "true"
            if self.changes.binary:
                options["binary"] = "true"
        decoder = PgOutputDecoder(proto, streaming=proto >= 2)
        repl.start(s.source.slot, resume, options)
        repl.send_status(resume, resume, resume)
        self.metrics.set_state("streaming")
        _freeze_startup_objects()
        log.info("streaming from slot %s at %X (protocol %d)", s.source.slot, resume, proto)

        acked = resume
        batch_lsn = resume
        received = resume
        current: tuple[int, int, int | None, bool] | None = None  # commit_lsn, commit_time, xid, skip
        spills: dict[int, Spill] = {}
        stream_xid: int | None = None
        last_status = time.monotonic()
        last_heartbeat = time.monotonic()
        stopping = False
        writer = self.writer
        policy = writer.policy
        changes = self.changes
        fast_change = changes.fast_change  # bound once: called for every live change
        bulk = repl.reads_changes_in_bulk
        live_c = bulk and writer.produces_from_c  # a live transaction's changes from C (more_changes)
        held: bytes | None = None
        raw: bytes | memoryview | None

        def flush() -> None:
            nonlocal acked
            if not writer.in_batch and batch_lsn <= acked:
                return
            state.lsn = batch_lsn
            writer.commit(state)
            acked = batch_lsn
            repl.send_status(received, acked, acked)

        try:
            while True:
                if self.stop.is_set() and not stopping:
                    stopping = True
                    log.info("stop requested: finishing the current transaction")
                if stopping and current is None:
                    flush()
                    return
                now = time.monotonic()
                if writer.in_batch and current is None and now - writer.started >= policy.linger_s:
                    flush()
                if now - last_heartbeat >= s.capture.heartbeat_interval_s:
                    self.attached.sql.execute(
                        "SELECT pg_logical_emit_message(false, %s, %s)", (HEARTBEAT_PREFIX, s.source.slot)
                    )
                    last_heartbeat = now
                if now - last_status >= s.capture.status_interval_s:
                    repl.send_status(received, acked, acked)
                    last_status = now
                if writer.in_batch:
                    # caught up between transactions: commit (a large batch: once coalesce_s since the last)
                    timeout = writer.coalescing(now) if current is None else policy.linger_s
                else:
                    timeout = min(1.0, s.capture.status_interval_s)
                if held is not None:  # the message after a run that read_changes took
                    raw, held = held, None
                else:
                    raw = repl.read(timeout)
                if raw is None:
                    if writer.in_batch and current is None and not writer.coalescing(time.monotonic()):
                        flush()
                    elif current is None and stream_xid is None and not spills:
                        self.metrics.set_behind(0.0)  # the server has nothing more to send: not behind
                    continue
                # The common cases first, without building an XLogData: a row change of a live transaction,
                # straight to Kafka (anything fast_change does not take goes the general way), or of a streamed
                # (large, in-progress) one, to disk as received: it is decoded when it commits (the decoder's
                # state only changes at Stream Start/Stop).
                if raw[0] == _XLOG_DATA and len(raw) > _PAYLOAD_AT and raw[_PAYLOAD_AT] in FAST_KINDS:
                    if stream_xid is not None:
                        lsn, end_lsn, _ = _XLOG_UNPACK(raw, 1)
                        received = max(received, end_lsn)
                        into = spills[stream_xid]
                        into.add(lsn, raw[_PAYLOAD_AT:])
                        if bulk:  # the changes after it that have arrived, from C in one call
                            framed, count, end_lsn, held = repl.read_changes(SPILL_READ)
                            if count:
                                into.add_framed(framed)
                                received = max(received, end_lsn)
                            if held is None and len(framed) < _STREAM_PACE_BELOW:
                                time.sleep(_STREAM_PACE_S)  # let the walsender's backlog build (above)
                        continue
                    if current is not None and not current[3]:
                        data = bytes(raw)
                        lsn, end_lsn, _ = _XLOG_UNPACK(data, 1)
                        received = max(received, end_lsn)
                        if fast_change(data, lsn, _PAYLOAD_AT):
                            if live_c and changes.tx is None:  # the ones after it, from C
                                held, end_lsn = changes.more_changes(repl, data)
                                received = max(received, end_lsn)
                            continue
                frame = parse_copy_data(raw)
                if isinstance(frame, Keepalive):
                    received = max(received, frame.end_lsn)
                    idle = current is None and stream_xid is None and not spills and not writer.in_batch
                    if received > acked and idle:
                        # Nothing received is waiting for Kafka: every transaction that committed up to the
                        # keepalive's position has been sent before it, and written and committed by us (or had
                        # nothing we capture). So that position is confirmed, as PostgreSQL's own apply worker
                        # and pg_recvlogical do: WAL written only for other tables or databases is freed without
                        # waiting for a heartbeat. Uncommitted transactions are decoded again after a restart
                        # whatever the slot confirms (it keeps their WAL: restart_lsn). The offsets state is not
                        # rewritten for it; on the next start PostgreSQL moves a start position older than the
                        # slot's confirmed one forward to it.
                        acked = batch_lsn = received
                    if frame.reply_requested:
                        repl.send_status(received, acked, acked)
                        last_status = time.monotonic()
                    continue
                lsn = frame.start_lsn
                received = max(received, frame.end_lsn)
                payload = frame.payload
                msg = decoder.decode(payload)

                if type(msg) in _CHANGES:  # the common case first: one type lookup, no isinstance chain
                    if stream_xid is not None:
                        spills[stream_xid].add(lsn, bytes(payload))
                    elif current is None:
                        raise StreamError(f"change outside a transaction at {lsn:X}")
                    elif not current[3]:
                        changes.apply(msg, lsn)  # type: ignore[arg-type]
                elif isinstance(msg, Begin):
                    current = (msg.final_lsn, msg.commit_time_us, msg.xid, msg.final_lsn < resume)
                    if not current[3]:
                        self.metrics.pending(msg.commit_time_us)
                    # One "processed at" per transaction.
                    changes.begin(msg.final_lsn, msg.commit_time_us, msg.xid, time.time_ns() // 1000)
                    changes.tx_begin(msg.xid, msg.final_lsn, msg.commit_time_us)
                elif isinstance(msg, Commit):
                    if current is not None and not current[3]:
                        batch_lsn = max(batch_lsn, msg.end_lsn)
                        writer.note_commit(current[1])
                        changes.tx_end()
                    current = None
                    if writer.full:
                        flush()
                elif isinstance(msg, Relation):
                    if stream_xid is not None:
                        # Inside a streamed transaction the schema is that transaction's own (it may have
                        # altered the table): it applies to its changes only, when it commits.
                        spills[stream_xid].add(lsn, bytes(payload))
                    else:
                        changes.relation(msg)
                elif isinstance(msg, TypeInfo):
                    self.attached.types.invalidate(msg.oid)
                elif isinstance(msg, LogicalMessage):
                    if msg.transactional:
                        if s.capture.emit_messages and stream_xid is not None:
                            spills[stream_xid].add(lsn, bytes(payload))
                        elif s.capture.emit_messages and current is not None and not current[3]:
                            changes.apply(msg, msg.lsn)
                    elif msg.lsn >= resume:
                        # Not part of any transaction: PostgreSQL skips such a message only when it lies
                        # before the start position, so the resume position must move past it.
                        heartbeat = msg.prefix == HEARTBEAT_PREFIX
                        if not heartbeat and s.capture.emit_messages:
                            changes.apply_outside(msg)
                        if current is None and stream_xid is None:
                            batch_lsn = max(batch_lsn, msg.lsn + 1)
                            if heartbeat and bytes(msg.content) == s.source.slot.encode():
                                flush()  # our own heartbeat (other instances' pass by)
                elif isinstance(msg, StreamStart):
                    stream_xid = msg.xid
                    if msg.xid not in spills:
                        spill_dir = os.environ.get("CDC_SPILL_DIR") or None
                        # Closed by Spill.close() at Stream Commit/Abort or when streaming ends.
                        spills[msg.xid] = Spill(tempfile.TemporaryFile(dir=spill_dir))  # noqa: SIM115
                elif isinstance(msg, StreamStop):
                    stream_xid = None
                elif isinstance(msg, StreamAbort):
                    spill = spills.get(msg.xid)
                    if spill is not None:
                        if msg.subxid == msg.xid:
                            spill.close()
                            del spills[msg.xid]
                        else:
                            spill.aborted_subxids.add(msg.subxid)
                elif isinstance(msg, StreamCommit):
                    spill = spills.pop(msg.xid, None)
                    if spill is not None:
                        try:
                            if msg.commit_lsn >= resume:
                                now_us = time.time_ns() // 1000
                                # Worth a line each: a streamed transaction is one larger than the server's
                                # logical_decoding_work_mem, and its events only start to flow now.
                                log.info(
                                    "replaying streamed transaction %d (%.0f MB spilled)", msg.xid, spill.size / 2**20
                                )
                                replay_started = time.monotonic()
                                changes.tx_begin(msg.xid, msg.commit_lsn, msg.commit_time_us)
                                changes.replay(spill, msg, proto, now_us)
                                log.info(
                                    "replayed streamed transaction %d in %.2f s (its events commit with the batch)",
                                    msg.xid,
                                    time.monotonic() - replay_started,
                                )
                                batch_lsn = max(batch_lsn, msg.end_lsn)
                                writer.note_commit(msg.commit_time_us)
                                changes.tx_end()
                        finally:
                            spill.close()
                elif isinstance(msg, Origin):
                    pass  # replicated-in changes are captured like any other
                else:
                    raise StreamError(f"unexpected {type(msg).__name__} at {lsn:X} (two-phase is not enabled)")
        finally:
            changes.reset()
            for spill in spills.values():
                spill.close()
            writer.abort()
            self.metrics.set_state("stopped")


def _quote_list(names: Sequence[str]) -> str:
    """A publication_names value: double-quoted identifiers, so any name survives the option parser."""
    return ",".join('"' + n.replace('"', '""') + '"' for n in names)


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT ask the capture to finish its current transaction, commit and exit."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


__all__ = ["Capture", "install_signal_handlers"]
