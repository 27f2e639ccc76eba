"""The capture service: snapshot, then stream every committed change into Kafka, exactly once.

The coordinator of one capture's phases: attach (cdc/_attach.py), the initial snapshot when the slot is new or
its snapshot was interrupted (cdc/_snapshot.py), then streaming (cdc/_stream.py), restarted in text mode when a
table has a column without a binary reader. Every event reaches Kafka through the batch writer (cdc/_batch.py),
in Kafka transactions that also carry the committed state (cdc/_offsets.py); cdc/_batch.py's docstring gives
the delivery protocol, why nothing is lost or doubled.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from types import FrameType

import psycopg
from confluent_kafka import KafkaException

from cdc._attach import CaptureContext, TextModeNeededError, attach
from cdc._backfill import Backfills, plan_new_tables
from cdc._batch import CommitPolicy, KafkaBatchWriter
from cdc._changes import ChangeWriter
from cdc._config import Settings
from cdc._fastpaths import log_fast_paths
from cdc._kafka import OffsetStore, TransactionalProducer
from cdc._metrics import CaptureMetrics
from cdc._offsets import CaptureState, SnapshotState
from cdc._replication import ReplicationConnection
from cdc._resnapshot import TopicReader
from cdc._snapshot import SnapshotStoppedError, Snapshotter
from cdc._source import translate_pg_error
from cdc._standby import nudging
from cdc._stream import ReplicationSource, Streamer
from cdc.errors import SourceCheckError
from decoders import format_lsn
from pgcdc_common.errors import CDCError
from schemas import avro_mapping

log = logging.getLogger(__name__)


class Capture:
    """One capture: a slot, its publication's tables, their topics."""

    def __init__(
        self,
        settings: Settings,
        *,
        stop: threading.Event | None = None,
        metrics: CaptureMetrics | None = None,
        new_slot: bool = False,
    ) -> None:
        self.settings = settings
        # Whether a missing slot may be created anew though Kafka holds a committed position (`cdc run
        # --new-slot`): never silently, as the changes between that position and a new slot are not in it.
        self.new_slot = new_slot
        self.slot_created = False  # set once this attempt has created the slot (--new-slot is then spent)
        self.stop = stop or threading.Event()
        self.metrics = metrics or CaptureMetrics()
        self.ctx = CaptureContext(settings, self.stop, self.metrics)

    # --- set-up -------------------------------------------------------------------------------

    def _new_producer(self) -> TransactionalProducer:
        s = self.settings
        return TransactionalProducer(
            s.kafka.client_conf(),
            s.transactional_id,
            gap_s=s.kafka.transaction_gap_ms / 1000,
            stop=self.stop,
            shutdown_s=s.capture.shutdown_timeout_s,
        )

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
        log_fast_paths()
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
        repl = ReplicationConnection(s.source.conninfo(replication="database"), where=s.source.display_dsn())
        try:
            state = self._start_position(repl)
            plan_new_tables(state, [t.qualified for t in self.attached.report.tables], s)
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

    def _start_position(self, repl: ReplicationConnection) -> CaptureState:
        """The committed state to stream from: on the first run the slot is created (with the initial snapshot,
        from the slot's own exported snapshot); a snapshot interrupted before is finished first."""
        s = self.settings
        state = self.attached.offsets.load()
        signals = self._signal_start() if state is None else state.signal_offsets
        if not self.attached.report.slot_exists:
            if state is not None and state.lsn is not None and not self.new_slot:
                raise self._slot_missing(state.lsn)
            # A standby cannot create a failover slot (its copies come from the primary).
            failover = s.source.failover and not self._in_recovery()
            with nudging(s) if self.attached.primary is not None else contextlib.nullcontext():
                created = repl.create_slot(
                    s.source.slot, export_snapshot=s.capture.snapshot == "initial", failover=failover
                )
            self.slot_created = True
            log.info("created replication slot %s at %X", s.source.slot, created.consistent_lsn)
            old, state = state, CaptureState(lsn=created.consistent_lsn, signal_offsets=signals)
            if old is not None:
                state.signal = old.signal  # the signal-table requests already taken stay taken
                state.generations = old.generations  # a moved table's first topics cannot take its schema
            self.attached.codecs.generations.bind(state)
            if s.capture.snapshot == "initial":
                state.snapshot = SnapshotState.started(created.consistent_lsn)
                if old is not None:
                    # Committed before the snapshot's first rows: a crash before them must not leave Kafka's
                    # older position in place, which the new slot would move past without a snapshot. (With no
                    # committed state, a restart snapshots anyway.) The exported snapshot outlives the commit:
                    # only the next replication command ends it.
                    self.writer.commit(state)
                self._snapshot(state, created.snapshot_name)
            else:
                self.writer.commit(state)
            return state
        self._align_failover(repl)
        if (state is not None and state.snapshot_running) or (state is None and s.capture.snapshot == "initial"):
            # The exported snapshot died with the process that created it. Finish with a fresh snapshot: the
            # stream restarts at the slot's position, so every change after it is replayed over the rows read
            # now, and each key ends at its latest value.
            state = state or CaptureState(signal_offsets=signals)
            if state.lsn is None:
                state.lsn = self._slot_confirmed_lsn()
            if state.snapshot is None:
                state.snapshot = SnapshotState.started(state.lsn)
            self.attached.codecs.generations.bind(state)
            self._snapshot(state, None)
        state = state or CaptureState(signal_offsets=signals)
        if state.lsn is None:
            state.lsn = self._slot_confirmed_lsn()
        self.attached.codecs.generations.bind(state)
        return state

    def _slot_missing(self, committed: int) -> SourceCheckError:
        s = self.settings
        return SourceCheckError(
            f"replication slot {s.source.slot!r} does not exist on {s.source.display_dsn()}, but the capture "
            f"committed changes up to {format_lsn(committed)} to Kafka: a new slot would start at the server's "
            "current position and the changes in between would be missing, unseen. Causes: the slot was dropped "
            "(`cdc detach`), or the primary failed over to a server that had no synchronized copy of it "
            "(PostgreSQL 17+ failover slots, docs/operations.md#high-availability); check source.dsn names the server "
            "you mean. Way out: `cdc run --new-slot` creates it anew and, with capture.snapshot = 'initial', "
            "snapshots every table again (rows deleted meanwhile get a delete and a tombstone), or with "
            "capture.snapshot = 'never' resumes from now and `cdc snapshot TABLE` backfills what was missed",
            check="slot-missing",
        )

    def _in_recovery(self) -> bool:
        row = self.attached.sql.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def _align_failover(self, repl: ReplicationConnection) -> None:
        """An existing slot made a failover slot (or not) as source.failover says (17+, not on a standby). Not
        while another process holds the slot: PostgreSQL's ALTER would wait for it to let go. A slot left as it
        is only warns: the capture goes on, and the next start tries again."""
        sql, slot, wanted = self.attached.sql, self.settings.source.slot, self.settings.source.failover
        if sql.info.server_version < 170000:
            return
        row = sql.execute(
            "SELECT failover, active, pg_is_in_recovery() FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        if row is None or row[0] == wanted or row[2]:
            return
        if row[1]:
            log.warning("replication slot %s is in use: its failover setting is aligned at a later start", slot)
            return
        try:
            repl.set_failover(slot, wanted)
        except SourceCheckError as exc:
            log.warning("%s (the capture goes on; the next start tries again)", exc)
            return
        log.info("replication slot %s: failover = %s", slot, str(wanted).lower())

    def _signal_start(self) -> dict[int, int]:
        """Where a new capture takes requests from the signal topic (see cdc._signals.SignalTopic): its end
        now, before the slot and the snapshot. Unreachable, it is left to the first read, with a warning."""
        topic = self.settings.signal_topic
        if topic is None:
            return {}
        try:
            self.attached.topics.ensure(topic, partitions=1, policy="delete")
            reader = TopicReader(self.settings.kafka.client_conf(), f"pgcdc-signals-{self.settings.source.slot}")
            try:  # its ends wait out a just-created topic's leader election
                return {p: high for p, (_low, high) in reader.ends(topic).items()}
            finally:
                reader.close()
        except (CDCError, KafkaException) as exc:
            log.warning("the signal topic %s cannot be read yet (%s): it is read from its end when it can", topic, exc)
            return {}

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

    def _stream(self, repl: ReplicationConnection, state: CaptureState) -> None:
        s = self.settings
        primary = self.attached.primary is not None
        source = ReplicationSource(
            repl,
            self.attached.writer,
            s.capture,
            s.source.slot,
            where=s.source.display_dsn(primary=primary),
            standby=self.attached.sql if primary else None,
        )
        streamer = Streamer(self.ctx, self.attached, source, self.changes, writer=self.writer, state=state)
        if self.attached.sql.info.server_version < 140000:  # logical messages reach pgoutput from 14 on
            if any(not b.finished for b in state.backfills):
                log.warning("backfills need PostgreSQL 14 or later (watermarks are logical messages): they wait")
            streamer.run()
            return
        backfills = streamer.backfills = Backfills(self.ctx, self.attached, self.changes, state)
        streamer.between.append(backfills)
        try:
            streamer.run()
        finally:
            backfills.close()


class Stop(threading.Event):
    """The capture's stop request, and when it was first made (``asked_at``, monotonic; 0 before): a shutdown's
    bound counts from the signal, not from when some wait first notices it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked_at = 0.0

    def set(self) -> None:
        self.asked_at = self.asked_at or time.monotonic()
        super().set()


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT ask the capture to finish its current transaction, commit and exit."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


__all__ = ["Capture", "Stop", "install_signal_handlers"]
