"""The Kafka batch writer: the one part that begins, writes and commits the capture's Kafka transactions.

Delivery protocol (why nothing is lost or doubled):

1. Events are produced inside a Kafka transaction, whole PostgreSQL transactions at a time; several
   PostgreSQL transactions may share one Kafka transaction (a *batch*).
2. The batch ends with a record in the offsets topic holding the committed state (cdc/_offsets.py: the resume
   LSN, the end of the last PostgreSQL commit in the batch, and the snapshot's progress), in the same Kafka
   transaction, which is then committed.
3. Only after that commit is the LSN reported to PostgreSQL as flushed, so the slot never moves past
   what Kafka holds.
4. On start, the state is read back (read_committed) and streaming restarts at its LSN; transactions
   that committed before it are skipped (PostgreSQL skips them too). A crash anywhere leaves either a
   committed batch with its state, or an aborted one without: never half.
5. A second instance with the same transactional.id fences the first (init_transactions), whose next
   commit fails, so it stops without acknowledging anything.

Snapshot chunks and a re-snapshot's deletes are written the same way, through the :class:`BatchWriter`
Protocol: their events and the progress that covers them commit together. Whoever writes between two stream
transactions (the stream's batch committed first) gets a Kafka transaction of its own, whose state record
carries the stream position already committed, so a crash in between replays nothing twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cdc._offsets import CaptureState

if TYPE_CHECKING:
    from cdc._config import CaptureConfig
    from cdc._kafka import OffsetStore, TransactionalProducer
    from cdc._metrics import CaptureMetrics


class BatchWriter(Protocol):
    """What the snapshot, the re-snapshot's deletes and other writers besides the stream write through."""

    @property
    def produces_from_c(self) -> bool:
        """Whether events are handed to librdkafka from C (the producer's fast path is available)."""
        ...

    @property
    def in_batch(self) -> bool:
        """Whether a Kafka transaction is open (something was written since the last commit)."""
        ...

    def batch_age(self, now: float) -> float:
        """Seconds since the open Kafka transaction began (``now``: time.monotonic()); 0 when none is open."""
        ...

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None: ...

    def produce_packed(self, topic: str, packed: bytes, rows: int, prefix: bytes, suffix: bytes) -> None: ...

    def commit(self, state: CaptureState) -> None:
        """Everything written since the last commit, and ``state``, in one Kafka transaction."""
        ...


@dataclass(frozen=True)
class CommitPolicy:
    """When the stream's open batch is committed.

    A batch is committed as soon as the stream has nothing more to read at a transaction boundary: under light
    load each transaction is visible in Kafka one commit round trip after PostgreSQL committed it; under load,
    what arrives during a commit makes the next batch, so batches grow with the load by themselves. A busy
    stream is still committed every ``linger_s`` (and every ``max_events`` events), so acknowledgements to
    PostgreSQL keep moving.

    Except under heavy load: a batch of ``coalesce_events`` events or more that is caught up within
    ``coalesce_s`` of the previous commit reads on until then. A commit costs librdkafka and the broker ~3 ms of
    CPU whatever its size (measured: update-heavy's 150 commits of ~700 events took 4.2-4.7 CPU-µs per change in
    librdkafka and 3.9-5.1 in the broker; 31 commits, 1.0-1.4 and 2.3-3.0), so at tens of thousands of changes
    per second the commits themselves took a tenth of the machine. At 2,000 small transactions per second a batch
    holds ~13 events and is still committed as soon as it is caught up, so its latency is unchanged.
    """

    max_events: int
    linger_s: float = 0.05
    coalesce_events: int = 256
    coalesce_s: float = 0.02

    @classmethod
    def from_settings(cls, capture: CaptureConfig) -> CommitPolicy:
        return cls(max_events=capture.max_batch_events)


class KafkaBatchWriter:
    """Meets :class:`BatchWriter`; the only caller of begin, produce and commit on the capture's producer.

    ``in_batch``, ``started`` and ``events`` are plain attributes: the stream's loop reads them per message."""

    def __init__(
        self, producer: TransactionalProducer, offsets: OffsetStore, metrics: CaptureMetrics, policy: CommitPolicy
    ) -> None:
        self.producer = producer
        self.offsets = offsets
        self.metrics = metrics
        self.policy = policy
        self.in_batch = False
        self.started = 0.0  # when the open batch began (time.monotonic)
        self.events = 0  # events in the open batch
        self._committed_at = 0.0  # when the last commit returned
        self._commits_us: tuple[int, int] | None = None  # source commit times of its oldest and newest transaction

    @property
    def produces_from_c(self) -> bool:
        return self.producer.produces_from_c

    def batch_age(self, now: float) -> float:
        return now - self.started if self.in_batch else 0.0

    @property
    def full(self) -> bool:
        """The open batch holds ``max_events`` or more: commit it at the next transaction boundary."""
        return self.in_batch and self.events >= self.policy.max_events

    def begin(self) -> None:
        if not self.in_batch:
            self.producer.begin()
            self.in_batch = True
            self.started = time.monotonic()
            self.events = 0

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        if not self.in_batch:  # checked here: this runs for every event
            self.begin()
        self.producer.produce(topic, key, value, partition)
        self.events += 1

    def produce_packed(self, topic: str, packed: bytes, rows: int, prefix: bytes, suffix: bytes) -> None:
        """The ``rows`` events of ``packed`` (RowEncoder.encode_copy_packed)."""
        if not self.in_batch:
            self.begin()
        self.producer.produce_packed(topic, packed, rows, prefix, suffix)
        self.events += rows

    def note_commit(self, commit_time_us: int) -> None:
        """A source transaction committed at ``commit_time_us`` is in the open batch (for the freshness metric)."""
        self._commits_us = (self._commits_us[0] if self._commits_us else commit_time_us, commit_time_us)

    def commit(self, state: CaptureState) -> None:
        """The open batch (or an empty one) and the record of ``state``, committed as one Kafka transaction."""
        self.begin()
        self.producer.produce(self.offsets.topic, self.offsets.key, self.offsets.encode(state), 0)
        started = time.monotonic()
        try:
            self.producer.commit()
        except BaseException:
            self.metrics.aborted()  # these events were not delivered: the next attempt counts them again
            raise
        self.in_batch = False
        self._committed_at = time.monotonic()
        self.metrics.committed(self.events, self._committed_at - started, state.lsn or 0, self._commits_us)
        self._commits_us = None

    def abort(self) -> None:
        """The open batch, if any, is dropped: none of its events becomes visible."""
        if self.in_batch:
            self.producer.abort()
            self.in_batch = False
            self.metrics.aborted()
            self._commits_us = None

    def coalescing(self, now: float) -> float:
        """How long the open batch, caught up at a transaction boundary, should read on before its commit: 0 but
        for a large batch within ``coalesce_s`` of the previous commit (see :class:`CommitPolicy`)."""
        if self.events < self.policy.coalesce_events:
            return 0.0
        return max(0.0, self._committed_at + self.policy.coalesce_s - now)

    # --- events produced from C (cdc._native): per run of changes, not per event ----------------

    def replay_target(self, topic: str, plan: Any, parts: tuple[bytes, ...]) -> Any | None:
        return self.producer.replay_target(topic, plan, parts)

    def replay_changes(self, block: bytes, at: int, targets: dict[int, Any], aborted: set[int], commit_lsn: int) -> int:
        """A streamed transaction's spilled changes from ``at`` of ``block``, produced from C while they are
        Inserts, Updates or Deletes of ``targets``' tables; the offset where it stopped."""
        if not self.in_batch:
            self.begin()
        at = self.producer.replay_changes(block, at, targets, aborted, commit_lsn)
        self.count_from_c(targets)
        return at

    @property
    def direct(self) -> Any | None:
        """The producer handle the replication reader produces live changes into from C (or None)."""
        return self.producer.direct

    def produced_from_c(self, targets: dict[int, Any], count: int) -> None:
        """``count`` live changes were produced into ``targets`` from C (ChangeReader.live_changes)."""
        self.count_from_c(targets)
        self.producer.produced_from_c(targets, count)

    def count_from_c(self, targets: dict[int, Any]) -> None:
        """Counts the events produced from C to ``targets`` (ReplayTargets) since the last call."""
        for target in targets.values():
            if target.inserts:
                self.metrics.count(target.topic.decode(), "c", target.inserts)
                self.events += target.inserts
                target.inserts = 0
            if target.updates:
                self.metrics.count(target.topic.decode(), "u", target.updates)
                self.events += target.updates
                target.updates = 0
            if target.deletes:
                self.metrics.count(target.topic.decode(), "d", target.deletes)
                self.events += 2 * target.deletes  # the event and its tombstone
                target.deletes = 0


__all__ = ["BatchWriter", "CommitPolicy", "KafkaBatchWriter"]
