"""Work between two stream transactions (what backfills write through) gets Kafka transactions of its own: the
stream's batch is committed first, then each piece's events with the state it advanced, and never inside a
live transaction. Kafka itself is in the integration tests; a recording producer stands in for the transport."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from cdc._batch import BatchWriter, CommitPolicy, KafkaBatchWriter
from cdc._offsets import CaptureState, SnapshotState
from cdc._stream import Streamer
from cdc.config import load_settings
from cdc.encoding import CaptureContext
from cdc.kafka import OffsetStore
from cdc.metrics import CaptureMetrics
from decoders import Begin, Commit


class _Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def begin(self) -> None:
        self.calls.append(("begin",))

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        self.calls.append(("produce", topic, key, value))

    def commit(self) -> None:
        self.calls.append(("commit",))

    def transactions(self) -> list[list[tuple[Any, ...]]]:
        """The committed Kafka transactions, each as its records."""
        out: list[list[tuple[Any, ...]]] = []
        for call in self.calls:
            if call[0] == "begin":
                out.append([])
            elif call[0] == "produce":
                out[-1].append(call[1:])
        return out


class _Source:
    """The replication source's positions, without a server."""

    def __init__(self) -> None:
        self.acked = 100
        self.confirmed: list[int] = []

    def confirm(self, lsn: int) -> None:
        self.acked = lsn
        self.confirmed.append(lsn)


class _Changes:
    """What the streamer tells the change writer at transaction boundaries (nothing to encode here)."""

    def begin(self, *_: Any) -> None: ...

    def tx_begin(self, *_: Any) -> None: ...

    def tx_end(self) -> None: ...


class _Backfill:
    """A piece of work that writes one event and records how far it got."""

    def __init__(self) -> None:
        self.due = False
        self.runs = 0

    def ready(self, now: float) -> bool:
        return self.due

    def run(self, writer: BatchWriter, state: CaptureState) -> None:
        self.runs += 1
        writer.produce("p.public.added", b"k%d" % self.runs, b"read")
        state.snapshot = SnapshotState("running", 42)  # stands for the backfill's progress
        self.due = False


def _streamer(tmp_path: Path) -> tuple[Streamer, _Recording, _Source, _Backfill]:
    config = tmp_path / "cdc.toml"
    config.write_text('[source]\ndsn = "postgresql://u@localhost/db"\ntables = ["public.t"]\n')
    ctx = CaptureContext(load_settings(config), threading.Event(), CaptureMetrics())
    producer = _Recording()
    offsets = OffsetStore({}, "p.offsets", "slot")
    writer = KafkaBatchWriter(producer, offsets, ctx.metrics, CommitPolicy(max_events=1000))  # type: ignore[arg-type]
    source, backfill = _Source(), _Backfill()
    streamer = Streamer(ctx, None, source, _Changes(), writer=writer, state=CaptureState(lsn=100))  # type: ignore[arg-type]
    streamer.between.append(backfill)
    return streamer, producer, source, backfill


def _transaction(streamer: Streamer, final_lsn: int, key: bytes) -> None:
    """A live transaction of one change, as the loop hands its messages over (the change as the fast path
    writes it)."""
    streamer._on_begin(Begin(final_lsn, 1_700_000_000_000_000, 7), 0, b"")
    streamer.writer.produce("p.public.t", key, b"change")
    streamer._on_commit(Commit(0, final_lsn, final_lsn + 8, 1_700_000_000_000_000), 0, b"")


def _state(record: tuple[Any, ...]) -> dict[str, Any]:
    topic, key, value = record
    assert (topic, key) == ("p.offsets", b"slot")
    state: dict[str, Any] = json.loads(value)
    return state


def test_a_piece_of_work_is_committed_between_two_stream_transactions(tmp_path: Path) -> None:
    streamer, producer, source, backfill = _streamer(tmp_path)
    _transaction(streamer, 200, b"a")  # nothing ready: the stream's batch stays open
    assert producer.transactions() == [[("p.public.t", b"a", b"change")]]
    backfill.due = True
    _transaction(streamer, 300, b"b")
    _transaction(streamer, 400, b"c")
    streamer._caught_up()
    a_and_b, work, c = producer.transactions()
    assert a_and_b[:2] == [("p.public.t", b"a", b"change"), ("p.public.t", b"b", b"change")]
    assert _state(a_and_b[2]) == {"version": 3, "lsn": 308}  # the stream's batch, at B's end
    assert work[0] == ("p.public.added", b"k1", b"read")
    # The work's own state record carries the stream's committed position and what the work advanced.
    assert _state(work[1]) == {
        "version": 3,
        "lsn": 308,
        "snapshot": {"status": "running", "consistent_lsn": 42, "tables": {}},
    }
    assert c[0] == ("p.public.t", b"c", b"change")
    assert _state(c[1])["lsn"] == 408
    assert producer.calls.count(("commit",)) == 3
    assert source.confirmed == [308, 408]  # PostgreSQL hears of each stream position once Kafka holds it
    assert backfill.runs == 1


def test_work_never_runs_inside_a_live_transaction(tmp_path: Path) -> None:
    streamer, producer, _, backfill = _streamer(tmp_path)
    backfill.due = True
    streamer._on_begin(Begin(200, 1_700_000_000_000_000, 7), 0, b"")
    streamer.writer.produce("p.public.t", b"a", b"change")
    streamer._caught_up()  # read everything, but the transaction is still open
    assert backfill.runs == 0
    assert ("commit",) not in producer.calls
    streamer._on_commit(Commit(0, 200, 208, 1_700_000_000_000_000), 0, b"")
    assert backfill.runs == 1
    stream, work = producer.transactions()
    assert [r[1] for r in stream] == [b"a", b"slot"]
    assert [r[1] for r in work] == [b"k1", b"slot"]
