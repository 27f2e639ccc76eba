"""The batch writer: every event and the state that covers it in one Kafka transaction, the state record last;
a failed commit counts nothing as delivered; the commit policy's timings. Kafka itself is in the integration
tests (test_capture.py, test_faults.py); here a recording producer stands in for the transport only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cdc._offsets import CaptureState, SnapshotState
from cdc.encoding import CommitPolicy, KafkaBatchWriter
from cdc.kafka import OffsetStore
from cdc.metrics import CaptureMetrics


class _Recording:
    """The calls a TransactionalProducer gets, in order."""

    def __init__(self, fail_commit: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_commit = fail_commit

    def begin(self) -> None:
        self.calls.append(("begin",))

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        self.calls.append(("produce", topic, key, value, partition))

    def produce_packed(self, topic: str, packed: bytes, rows: int, prefix: bytes, suffix: bytes) -> None:
        self.calls.append(("packed", topic, rows))

    def commit(self) -> None:
        self.calls.append(("commit",))
        if self.fail_commit:
            raise RuntimeError("fenced")

    def abort(self) -> None:
        self.calls.append(("abort",))


class _Metrics(CaptureMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[Any, ...]] = []

    def committed(self, events: int, seconds: float, lsn: int, commits_us: tuple[int, int] | None) -> None:
        self.log.append(("committed", events, lsn, commits_us))

    def aborted(self) -> None:
        self.log.append(("aborted",))


def _writer(producer: _Recording, max_events: int = 1000) -> tuple[KafkaBatchWriter, _Metrics]:
    metrics = _Metrics()
    offsets = OffsetStore({}, "p.offsets", "slot_a")
    return KafkaBatchWriter(producer, offsets, metrics, CommitPolicy(max_events=max_events)), metrics  # type: ignore[arg-type]


def test_events_and_their_state_are_one_transaction_with_the_state_last() -> None:
    producer = _Recording()
    writer, metrics = _writer(producer)
    writer.produce("p.public.t", b"k1", b"v1")
    writer.produce("p.public.t", b"k1", None)
    writer.produce_packed("p.public.t", b"\0\0\0\1\0\0\0\11a\0\0\0\1\0\0\0\12b", 2, b"<", b">")
    writer.note_commit(100)
    writer.note_commit(250)
    assert writer.in_batch
    assert writer.events == 4
    state = CaptureState(lsn=0x16B3748, snapshot=SnapshotState("done", 7))
    writer.commit(state)
    assert [c[0] for c in producer.calls] == ["begin", "produce", "produce", "packed", "produce", "commit"]
    record = producer.calls[-2]
    assert record[1:3] == ("p.offsets", b"slot_a")
    assert record[4] == 0  # the offsets topic has one partition
    assert json.loads(record[3]) == {
        "version": 3,
        "lsn": 0x16B3748,
        "snapshot": {"status": "done", "consistent_lsn": 7, "tables": {}},
    }
    assert metrics.log == [("committed", 4, 0x16B3748, (100, 250))]
    assert not writer.in_batch


def test_a_state_alone_is_committed_in_a_transaction_of_its_own() -> None:
    producer = _Recording()
    writer, metrics = _writer(producer)
    writer.commit(CaptureState(lsn=5))
    assert [c[0] for c in producer.calls] == ["begin", "produce", "commit"]
    assert metrics.log == [("committed", 0, 5, None)]
    writer.produce("t", b"k", b"v")  # the next event opens the next transaction
    assert producer.calls[-2:] == [("begin",), ("produce", "t", b"k", b"v", None)]
    assert writer.events == 1


def test_a_failed_commit_counts_nothing_as_delivered() -> None:
    producer = _Recording(fail_commit=True)
    writer, metrics = _writer(producer)
    writer.produce("t", b"k", b"v")
    with pytest.raises(RuntimeError, match="fenced"):
        writer.commit(CaptureState(lsn=9))
    assert metrics.log == [("aborted",)]


def test_abort_drops_the_open_batch_and_nothing_else() -> None:
    producer = _Recording()
    writer, metrics = _writer(producer)
    writer.abort()
    assert producer.calls == []
    writer.produce("t", b"k", b"v")
    writer.note_commit(1)
    writer.abort()
    assert producer.calls[-1] == ("abort",)
    assert metrics.log == [("aborted",)]
    assert not writer.in_batch
    writer.commit(CaptureState(lsn=3))
    assert metrics.log[-1] == ("committed", 0, 3, None)  # the aborted batch's commit times are gone with it


def test_a_batch_is_full_at_max_events_and_ages_from_its_first_event() -> None:
    writer, _ = _writer(_Recording(), max_events=2)
    assert writer.batch_age(1e9) == 0.0
    assert not writer.full
    writer.produce("t", b"k", b"v")
    assert not writer.full
    assert writer.batch_age(writer.started + 1.5) == 1.5
    writer.produce("t", b"k", None)
    assert writer.full


def test_only_a_large_batch_caught_up_soon_after_a_commit_reads_on() -> None:
    """A small batch (light load) is committed as soon as it is caught up; a large one (heavy load) reads on
    until coalesce_s after the previous commit, then is committed."""
    writer, _ = _writer(_Recording())
    policy = writer.policy
    writer._committed_at = 100.0
    writer.events = policy.coalesce_events - 1
    assert writer.coalescing(100.001) == 0.0
    writer.events = policy.coalesce_events
    assert writer.coalescing(100.005) == pytest.approx(policy.coalesce_s - 0.005)
    assert writer.coalescing(100.0 + policy.coalesce_s) == 0.0
    assert writer.coalescing(200.0) == 0.0
