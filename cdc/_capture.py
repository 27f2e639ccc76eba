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
import struct
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

import psycopg

from cdc._attach import CaptureContext, TextModeNeededError, attach
from cdc._batch import CommitPolicy, KafkaBatchWriter
from cdc._config import Settings
from cdc._events import Position, TableCodec
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
    format_lsn,
    parse_copy_data,
)
from schemas import (
    avro_mapping,
    avro_namespace,
    compile_writer,
    message_key_schema,
    message_value_schema,
    transaction_key_schema,
    transaction_value_schema,
)

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "pgcdc.heartbeat"
_CHANGES = frozenset({Insert, Update, Delete, Truncate})
_FAST_KINDS = frozenset(b"IUD")  # Insert, Update, Delete: the frames _fast_change takes (and cdc._native)
_XLOG_DATA = ord("w")
_XLOG_UNPACK = XLOG_HEADER.unpack_from
_PAYLOAD_AT = XLOG_PAYLOAD_AT
_OLD_TUPLE = frozenset(b"KO")
_NEW_TUPLE = ord("N")
_U32 = struct.Struct(">I").unpack_from
_STREAM_START = struct.Struct(">BIB")  # 'S', xid, first segment

_SPILL_HEAD = struct.Struct(">QI")  # a spilled message: its LSN and length, then the pgoutput message as received


_SPILL_BLOCK = 4 << 20  # a spill is replayed in blocks of whole messages of about this size
# While a streamed transaction arrives, a read that found less than _STREAM_PACE_BELOW waiting (and stopped at
# no other message) is followed by a _STREAM_PACE_S pause, so that the backlog is taken in fewer, larger reads
# instead of a wake-up every few messages. The changes are invisible until the transaction commits; a small
# transaction committed meanwhile waits at most one pause more. Measured (the 1 GB transaction: the walsender and
# our reader both spend less per row, 0.69-0.73x -> 0.75-0.93x of pg_recvlogical under TLS) and what is not
# understood: docs/design/capture-hot-path.md.
_STREAM_PACE_S = 0.001
_STREAM_PACE_BELOW = 256 * 1024
_SPILL_READ = 1 << 20  # how much of a streamed transaction's changes are read at most in one call


@dataclass
class _Spill:
    """The changes of one streamed transaction, on disk until it commits or aborts: the messages as they
    arrived (they carry their subtransaction's xid after the type byte), each after its LSN and length
    (_SPILL_HEAD), replayed in blocks of whole messages."""

    file: IO[bytes]
    aborted_subxids: set[int] = field(default_factory=set)
    block: int = _SPILL_BLOCK
    size: int = 0
    cuts: list[int] = field(default_factory=list)  # where a block ends: after a whole message

    def add(self, lsn: int, payload: bytes | memoryview) -> None:
        self.file.write(_SPILL_HEAD.pack(lsn, len(payload)))
        self.file.write(payload)
        self._grew(_SPILL_HEAD.size + len(payload))

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


@dataclass
class _TxMeta:
    """Transaction metadata being gathered for one PostgreSQL transaction (capture.emit_transactions)."""

    id: str
    commit_time_us: int
    total: int = 0
    per_table: dict[str, int] = field(default_factory=dict)
    begun: bool = False


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
        self._codecs: dict[int, TableCodec] = {}
        self._binary = settings.capture.binary
        self._side: dict[str, tuple[str, bytes, Any, bytes, Any]] = {}
        self._stream_codecs: dict[int, TableCodec] = {}
        self._fast_txn: tuple[int, int, int | None, bool] | None = None  # _fast_change's Position, per transaction
        self._fast_pos = Position(0, 0, 0, None)
        self._relations: dict[int, Relation] = {}
        self._stream_relations: dict[int, Relation] = {}
        self._tx: _TxMeta | None = None
        # The open live transaction's tables whose Inserts and Updates go from C (_more_changes), and those seen
        # once.
        self._live_targets: dict[int, Any] = {}
        self._live_seen: set[int] = set()

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
            self._binary = s.capture.binary and self._all_binary_capable()
            while not self.stop.is_set():
                try:
                    self._stream(repl, state)
                    break
                except TextModeNeededError as exc:
                    # pgoutput's binary option is all or nothing for a connection: go back to the committed
                    # position and stream in text, which every type has.
                    log.info("%s: restarting the stream in text mode", exc)
                    repl.close()
                    self._binary = False
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

    def _codec(self, relid: int) -> TableCodec:
        """The codec a change of ``relid`` is encoded with: its streamed transaction's own schema first.

        Built on the first change, not when the Relation arrives: PostgreSQL also describes relations no
        event will be written for (the leaf partitions of a table published via its root) and re-sends
        unchanged ones (after a truncate, in every streamed transaction).
        """
        for relations, codecs in ((self._stream_relations, self._stream_codecs), (self._relations, self._codecs)):
            rel = relations.get(relid)
            if rel is not None:
                codec = codecs.get(relid)
                if codec is None:
                    codec = codecs[relid] = self.attached.codecs.for_relation(rel, binary=self._binary)
                return codec
        raise StreamError(f"change for relation {relid} before its Relation message")

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
            if self._binary:
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
        spills: dict[int, _Spill] = {}
        stream_xid: int | None = None
        last_status = time.monotonic()
        last_heartbeat = time.monotonic()
        stopping = False
        txn_now_us = 0
        writer = self.writer
        policy = writer.policy
        bulk = repl.reads_changes_in_bulk
        live_c = bulk and writer.produces_from_c  # a live transaction's changes from C (_more_changes)
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
                # straight to Kafka (anything _fast_change does not take goes the general way), or of a streamed
                # (large, in-progress) one, to disk as received: it is decoded when it commits (the decoder's
                # state only changes at Stream Start/Stop).
                if raw[0] == _XLOG_DATA and len(raw) > _PAYLOAD_AT and raw[_PAYLOAD_AT] in _FAST_KINDS:
                    if stream_xid is not None:
                        lsn, end_lsn, _ = _XLOG_UNPACK(raw, 1)
                        received = max(received, end_lsn)
                        into = spills[stream_xid]
                        into.add(lsn, raw[_PAYLOAD_AT:])
                        if bulk:  # the changes after it that have arrived, from C in one call
                            framed, count, end_lsn, held = repl.read_changes(_SPILL_READ)
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
                        if self._fast_change(data, current, lsn, txn_now_us, start=_PAYLOAD_AT):
                            if live_c and self._tx is None:  # the ones after it, from C
                                held, end_lsn = self._more_changes(repl, data, current, txn_now_us)
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
                        self._apply(msg, Position(current[0], lsn, current[1], current[2]), txn_now_us)  # type: ignore[arg-type]
                elif isinstance(msg, Begin):
                    current = (msg.final_lsn, msg.commit_time_us, msg.xid, msg.final_lsn < resume)
                    self._live_targets, self._live_seen = {}, set()
                    if not current[3]:
                        self.metrics.pending(msg.commit_time_us)
                    txn_now_us = time.time_ns() // 1000  # one "processed at" per transaction
                    self._tx_begin(msg.xid, msg.final_lsn, msg.commit_time_us)
                elif isinstance(msg, Commit):
                    if current is not None and not current[3]:
                        batch_lsn = max(batch_lsn, msg.end_lsn)
                        writer.note_commit(current[1])
                        self._tx_end()
                    current = None
                    if writer.full:
                        flush()
                elif isinstance(msg, Relation):
                    if stream_xid is not None:
                        # Inside a streamed transaction the schema is that transaction's own (it may have
                        # altered the table): it applies to its changes only, when it commits.
                        spills[stream_xid].add(lsn, bytes(payload))
                    elif self._relations.get(msg.relid) != msg:
                        self._relations[msg.relid] = msg
                        self._codecs.pop(msg.relid, None)
                        self._live_targets.pop(msg.relid, None)
                elif isinstance(msg, TypeInfo):
                    self.attached.types.invalidate(msg.oid)
                elif isinstance(msg, LogicalMessage):
                    if msg.transactional:
                        if s.capture.emit_messages and stream_xid is not None:
                            spills[stream_xid].add(lsn, bytes(payload))
                        elif s.capture.emit_messages and current is not None and not current[3]:
                            self._apply(msg, Position(current[0], msg.lsn, current[1], current[2]), txn_now_us)
                    elif msg.lsn >= resume:
                        # Not part of any transaction: PostgreSQL skips such a message only when it lies
                        # before the start position, so the resume position must move past it.
                        heartbeat = msg.prefix == HEARTBEAT_PREFIX
                        if not heartbeat and s.capture.emit_messages:
                            now_us = time.time_ns() // 1000
                            self._apply(msg, Position(msg.lsn, msg.lsn, now_us, None), now_us)
                        if current is None and stream_xid is None:
                            batch_lsn = max(batch_lsn, msg.lsn + 1)
                            if heartbeat and bytes(msg.content) == s.source.slot.encode():
                                flush()  # our own heartbeat (other instances' pass by)
                elif isinstance(msg, StreamStart):
                    stream_xid = msg.xid
                    if msg.xid not in spills:
                        spill_dir = os.environ.get("CDC_SPILL_DIR") or None
                        # Closed by _Spill.close() at Stream Commit/Abort or when streaming ends.
                        spills[msg.xid] = _Spill(tempfile.TemporaryFile(dir=spill_dir))  # noqa: SIM115
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
                                txn_now_us = time.time_ns() // 1000
                                # Worth a line each: a streamed transaction is one larger than the server's
                                # logical_decoding_work_mem, and its events only start to flow now.
                                log.info(
                                    "replaying streamed transaction %d (%.0f MB spilled)", msg.xid, spill.size / 2**20
                                )
                                replay_started = time.monotonic()
                                self._tx_begin(msg.xid, msg.commit_lsn, msg.commit_time_us)
                                self._replay(spill, msg, proto, txn_now_us)
                                log.info(
                                    "replayed streamed transaction %d in %.2f s (its events commit with the batch)",
                                    msg.xid,
                                    time.monotonic() - replay_started,
                                )
                                batch_lsn = max(batch_lsn, msg.end_lsn)
                                writer.note_commit(msg.commit_time_us)
                                self._tx_end()
                        finally:
                            spill.close()
                elif isinstance(msg, Origin):
                    pass  # replicated-in changes are captured like any other
                else:
                    raise StreamError(f"unexpected {type(msg).__name__} at {lsn:X} (two-phase is not enabled)")
        finally:
            # A later attempt on this Capture must not see this one's transaction state (_fast_change and
            # _more_changes take a table's codec from it).
            self._stream_relations, self._stream_codecs = {}, {}
            self._live_targets, self._live_seen = {}, set()
            for spill in spills.values():
                spill.close()
            writer.abort()
            self.metrics.set_state("stopped")

    def _codec_in_use(self, relid: int) -> TableCodec:
        """The codec _fast_change has just encoded a change of ``relid`` with (it inlines this lookup): a streamed
        transaction's own schema while its spill is replayed, else the live one."""
        return (self._stream_codecs if relid in self._stream_relations else self._codecs)[relid]

    def _more_changes(
        self, repl: ReplicationConnection, data: bytes, current: tuple[int, int, int | None, bool], now_us: int
    ) -> tuple[bytes | None, int]:
        """After a live Insert, Update or Delete the fast path took (``data``): the ones already received after
        it, produced from C (ChangeReader.live_changes) from a table's second one in the transaction on (a
        one-row transaction does not pay for a ReplayTarget). Returns (the next message, not taken, or None; the
        largest end LSN of those produced, 0 without any)."""
        relid = _U32(data, _PAYLOAD_AT + 1)[0]
        targets = self._live_targets
        if relid not in targets:
            if relid not in self._live_seen:
                self._live_seen.add(relid)
                return None, 0
            codec = self._codec_in_use(relid)
            pos = Position(current[0], 0, current[1], current[2])
            target = self.writer.replay_target(codec.topic, codec.native_plan, codec.event_parts(pos, now_us))
            if target is None:
                return None, 0
            targets[relid] = target
        count, end_lsn, held = repl.read_live_changes(self.writer.direct, targets, current[0], _SPILL_READ)
        if count:
            self.writer.produced_from_c(targets, count)
        return held, end_lsn

    def _replay(self, spill: _Spill, msg: StreamCommit, proto: int, now_us: int) -> None:
        """A committed streamed transaction's spilled changes, in order, into the open Kafka batch.

        Runs of Inserts, Updates and Deletes go from C (DirectProducer.replay_changes: the tuples encoded, the
        events written and produced per message, no Python per row) for every table whose first one the fast path took,
        when there is no transaction metadata to count per event; every other message takes the same way as a
        live one."""
        self._stream_relations, self._stream_codecs = {}, {}
        try:
            self._replay_spill(spill, msg, proto, now_us)
        finally:  # its schema is the streamed transaction's own: never a later one's
            self._stream_relations, self._stream_codecs = {}, {}

    def _replay_spill(self, spill: _Spill, msg: StreamCommit, proto: int, now_us: int) -> None:
        # The spilled messages carry an xid after their type byte, as inside a stream.
        decoder = PgOutputDecoder(proto, streaming=True)
        decoder.decode(_STREAM_START.pack(ord("S"), msg.xid, 0))
        txn = (msg.commit_lsn, msg.commit_time_us, msg.xid, False)
        aborted = spill.aborted_subxids
        # relation id -> cdc._native.ReplayTarget (tables without one go through _fast_change)
        targets: dict[int, Any] = {}
        writer = self.writer
        from_c = self._tx is None and writer.produces_from_c
        pos = Position(msg.commit_lsn, 0, msg.commit_time_us, msg.xid)
        for block in spill.blocks():
            at, size = 0, len(block)
            while at < size:
                if targets:
                    at = writer.replay_changes(block, at, targets, aborted, msg.commit_lsn)
                    if at == size:
                        break
                change_lsn, length = _SPILL_HEAD.unpack_from(block, at)
                data = block[at + _SPILL_HEAD.size : at + _SPILL_HEAD.size + length]
                at += _SPILL_HEAD.size + length
                if aborted and _U32(data, 1)[0] in aborted:
                    continue
                if data[0] in _FAST_KINDS and self._fast_change(data, txn, change_lsn, now_us, streamed=True):
                    if from_c:  # the table's next ones from C
                        relid = _U32(data, 5)[0]
                        if relid not in targets:
                            codec = self._codec_in_use(relid)
                            target = writer.replay_target(
                                codec.topic, codec.native_plan, codec.event_parts(pos, now_us)
                            )
                            if target is not None:
                                targets[relid] = target
                    continue
                change = decoder.decode(data)
                if isinstance(change, Relation):
                    self._stream_relations[change.relid] = change
                    self._stream_codecs.pop(change.relid, None)
                    targets.pop(change.relid, None)
                    continue
                self._apply(
                    change,  # type: ignore[arg-type]
                    Position(msg.commit_lsn, change_lsn, msg.commit_time_us, msg.xid),
                    now_us,
                )

    def _side_event(self, name: str, schemas: tuple[dict[str, Any], dict[str, Any]], key: Any, value: Any) -> None:
        """An event on one of the side topics (<prefix>.messages, <prefix>.transaction): event streams with
        cleanup.policy=delete, registered on first use."""
        side = self._side.get(name)
        if side is None:
            topic = f"{self.settings.kafka.topic_prefix}.{name}"
            self.attached.topics.ensure(topic, policy="delete")
            frames = [
                struct.pack(">bI", 0, self.attached.registry.register(f"{topic}-{part}", schema, table=name))
                for part, schema in zip(("key", "value"), schemas, strict=True)
            ]
            side = self._side[name] = (
                topic,
                frames[0],
                compile_writer(schemas[0]),
                frames[1],
                compile_writer(schemas[1]),
            )
        topic, key_frame, write_key, value_frame, write_value = side
        key_bytes, value_bytes = bytearray(key_frame), bytearray(value_frame)
        write_key(key, key_bytes)
        write_value(value, value_bytes)
        self.writer.produce(topic, bytes(key_bytes), bytes(value_bytes))

    def _message(self, msg: LogicalMessage, pos: Position, now_us: int) -> None:
        """A pg_logical_emit_message() message, to <prefix>.messages."""
        ns = avro_namespace(self.settings.kafka.topic_prefix, "messages")
        src = self.attached.codecs.source_info
        self.metrics.count(f"{self.settings.kafka.topic_prefix}.messages", "m")
        self._side_event(
            "messages",
            (message_key_schema(ns), message_value_schema(ns)),
            {"prefix": msg.prefix},
            {
                "op": "m",
                "ts_ms": now_us // 1000,
                "source": {
                    "version": src.version,
                    "connector": "postgresql",
                    "name": src.name,
                    "db": src.db,
                    "ts_ms": pos.commit_time_us // 1000,
                    "ts_us": pos.commit_time_us,
                    "snapshot": "false",
                    "sequence": f'["{pos.commit_lsn}","{pos.lsn}"]',
                    "schema": "",
                    "table": "",
                    "txId": pos.xid,
                    "lsn": pos.lsn,
                    "xmin": None,
                    "commit_lsn": pos.commit_lsn,
                },
                "message": {"prefix": msg.prefix, "content": bytes(msg.content), "transactional": msg.transactional},
            },
        )

    # --- transaction metadata -------------------------------------------------------------------

    def _tx_begin(self, xid: int | None, commit_lsn: int, commit_time_us: int) -> None:
        self._tx = _TxMeta(f"{xid}:{commit_lsn}", commit_time_us) if self.settings.capture.emit_transactions else None

    def _tx_event(self, status: str) -> None:
        tx = self._tx
        assert tx is not None
        ns = avro_namespace(self.settings.kafka.topic_prefix, "transaction")
        end = status == "END"
        self._side_event(
            "transaction",
            (transaction_key_schema(ns), transaction_value_schema(ns)),
            {"id": tx.id},
            {
                "status": status,
                "id": tx.id,
                "event_count": tx.total if end else None,
                "data_collections": [{"data_collection": t, "event_count": n} for t, n in tx.per_table.items()]
                if end
                else None,
                "ts_ms": tx.commit_time_us // 1000,
            },
        )

    def _tx_block(self, codec: TableCodec) -> tuple[str, int, int] | None:
        """The next change event's place in its transaction (and the BEGIN event before the first)."""
        tx = self._tx
        if tx is None:
            return None
        if not tx.begun:
            tx.begun = True
            self._tx_event("BEGIN")
        name = f"{codec.schema}.{codec.table}"
        tx.total += 1
        tx.per_table[name] = tx.per_table.get(name, 0) + 1
        return tx.id, tx.total, tx.per_table[name]

    def _tx_end(self) -> None:
        if self._tx is not None and self._tx.begun:
            self._tx_event("END")
        self._tx = None

    def _fast_change(
        self,
        data: bytes,
        current: tuple[int, int, int | None, bool],
        lsn: int,
        now_us: int,
        *,
        start: int = 0,
        streamed: bool = False,
    ) -> bool:
        """An Insert, Update or Delete message at ``start`` of ``data`` (live, or replayed from a streamed
        transaction's spill: ``streamed``, an xid after the type byte) straight to Kafka.

        The same events as decode + :meth:`_apply_change`, without building messages and row dicts
        (TableCodec.encode_tuple). Returns False, having done nothing, for anything it does not take (a relation
        whose codec is not built yet, a missing key, a malformed or unconvertible frame): the general path then
        handles that frame and reports errors with the full diagnosis.
        """
        kind = data[start]
        at = start + 5 if streamed else start + 1
        if len(data) < at + 4:  # cut before its relation id: the general path says what is wrong
            return False
        relid = _U32(data, at)[0]
        # A streamed transaction's own schema first (set while its spill is replayed), as in _codec.
        codec = self._stream_codecs.get(relid) if relid in self._stream_relations else self._codecs.get(relid)
        if codec is None:
            return False
        at += 4
        try:
            before = old_key = None
            if kind != 73 and data[at] in _OLD_TUPLE:  # Update/Delete: the old key ('K') or row ('O')
                before, old_key, _, at = codec.encode_tuple(data, at + 1)
                if old_key is None:
                    return False
            if kind == 68:  # Delete
                after = key = None
                unchanged: list[str] = []
                if before is None or at != len(data):
                    return False
            else:
                if data[at] != _NEW_TUPLE:
                    return False
                after, key, unchanged, at = codec.encode_tuple(data, at + 1)
                if key is None or at != len(data):
                    return False
        except Exception:  # malformed or unconvertible: the general path diagnoses it
            return False
        if current is not self._fast_txn:  # one Position per transaction; each change passes its own LSN
            self._fast_txn = current
            self._fast_pos = Position(current[0], 0, current[1], current[2])
        if kind == 68:
            self._emit(codec, "d", self._fast_pos, lsn, key=old_key, before=before, after=None, now_us=now_us)  # type: ignore[arg-type]
        else:
            self._emit(
                codec,
                "c" if kind == 73 else "u",
                self._fast_pos,
                lsn,
                key=key,  # type: ignore[arg-type]
                before=before,
                after=after,
                old_key=old_key,
                unchanged=unchanged,
                now_us=now_us,
            )
        return True

    def _emit(
        self,
        codec: TableCodec,
        op: str,
        pos: Position,
        lsn: int,
        *,
        key: bytes,
        before: bytes | None,
        after: bytes | None,
        old_key: bytes | None = None,
        unchanged: list[str] | None = None,
        now_us: int,
    ) -> None:
        """The Kafka records of one row change (rows as encoded Value records): c, u or d (+ tombstone); an
        update that changed the key is a delete + tombstone of the old key and a create of the new one."""
        if op == "u" and old_key is not None and old_key != key:
            self._emit(codec, "d", pos, lsn, key=old_key, before=before, after=None, now_us=now_us)
            op, before = "c", None
        self.metrics.count(codec.topic, op)
        value = codec.envelope_bytes(
            op,
            pos,
            lsn=lsn,
            before=before,
            after=after,
            unchanged=unchanged,
            now_us=now_us,
            transaction=self._tx_block(codec),
        )
        produce = self.writer.produce
        produce(codec.topic, key, value)
        if op == "d":
            produce(codec.topic, key, None)  # tombstone: lets compaction drop the key

    def _apply(self, msg: Insert | Update | Delete | Truncate | LogicalMessage, pos: Position, now_us: int) -> None:
        try:
            self._apply_change(msg, pos, now_us)
        except (ValueError, IndexError) as exc:  # an unconvertible value, a missing key: stop, ack nothing
            raise StreamError(f"cannot capture the change at LSN {format_lsn(pos.lsn)}: {exc}") from exc

    def _apply_change(
        self, msg: Insert | Update | Delete | Truncate | LogicalMessage, pos: Position, now_us: int
    ) -> None:
        if isinstance(msg, LogicalMessage):
            self._message(msg, pos, now_us)
            return
        if isinstance(msg, Truncate):
            if not self.settings.capture.emit_truncates:
                return
            for relid in msg.relids:
                truncated = self._codec(relid)
                self.metrics.count(truncated.topic, "t")
                value = truncated.envelope(
                    "t", pos, before=None, after=None, now_us=now_us, transaction=self._tx_block(truncated)
                )
                # A truncate concerns every key: one marker per partition keeps it in order with each.
                for partition in range(self.attached.topics.ensure(truncated.topic)):
                    self.writer.produce(truncated.topic, truncated.truncate_key, value, partition)
            return
        codec = self._codec(msg.relid)
        if isinstance(msg, Insert):
            after, unchanged = codec.row(msg.new)
            self._emit(
                codec,
                "c",
                pos,
                pos.lsn,
                key=codec.key_of(after),
                before=None,
                after=codec.encode_row(after),
                unchanged=unchanged,
                now_us=now_us,
            )
        elif isinstance(msg, Update):
            after, unchanged = codec.row(msg.new)
            before = codec.row(msg.old)[0] if msg.old is not None else None
            key = codec.key_of(after)
            self._emit(
                codec,
                "u",
                pos,
                pos.lsn,
                key=key,
                before=None if before is None else codec.encode_row(before),
                after=codec.encode_row(after),
                old_key=None if before is None else codec.key_of(before),
                unchanged=unchanged,
                now_us=now_us,
            )
        else:
            before = codec.row(msg.old)[0]
            self._emit(
                codec,
                "d",
                pos,
                pos.lsn,
                key=codec.key_of(before),
                before=codec.encode_row(before),
                after=None,
                now_us=now_us,
            )


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
