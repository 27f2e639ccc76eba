"""Reading one micro-batch's exact offset ranges from Kafka on the driver, without a Spark job.

A live batch of a :class:`sinks.PartitionSink` holds a few records to a few thousand. Reading, folding and
writing them takes milliseconds; a Spark job to do it (scheduling, the executor's Kafka consumer, a Python
worker's round trip, the Arrow hand-over) cost ~0.2 s per batch on an idle two-core machine and over a second on
a busy one — most of the cache's and the search index's freshness. So a batch of up to :data:`DRIVER_RECORDS`
offsets is read here, by a consumer of the driver's own, and applied by the driver (sinks._write.on_driver).

Spark's query still decides every batch: its ranges are the ones its checkpoint fixed (``offsets/N`` against
``offsets/N-1``), read read_committed as its own source reads them, so a batch re-run after a crash reads the
same records again, and the stores' position guard makes the second write change nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sinks.errors import SinkTransientError

if TYPE_CHECKING:
    from confluent_kafka import Consumer, Message

    from sinks._config import SinkSettings

DRIVER_RECORDS = 5_000  # offsets up to which the driver reads, folds and writes a partition sink's batch
Ranges = Mapping[tuple[str, int], tuple[int, int]]  # (topic, partition) -> [start, end) offsets


def batch_ranges(
    start: Mapping[tuple[str, int], int], end: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], tuple[int, int]] | None:
    """Each partition's [start, end) between two batches' end offsets; None when a partition's start is not
    known (new to the query: Spark reads it from its beginning)."""
    ranges: dict[tuple[str, int], tuple[int, int]] = {}
    for tp, stop in end.items():
        begin = start.get(tp)
        if begin is None:
            return None
        if stop > begin:
            ranges[tp] = (begin, stop)
    return ranges


def driver_consumer(settings: SinkSettings, group: str, *, linger_ms: int = 0) -> Consumer:
    """A consumer that reads a sink's topics as its query does, for the driver's own reads (a batch's ranges,
    the lane). It is only ever assigned partitions: it never joins ``group`` or commits, the query's checkpoint
    owns the offsets. ``linger_ms``: how long the broker may hold a fetch to gather records (a tail's reads);
    0 for bounded reads, which must hear of a partition's end at once."""
    from confluent_kafka import Consumer

    gather = {"fetch.wait.max.ms": linger_ms, "fetch.min.bytes": 1_048_576} if linger_ms > 0 else {}
    return Consumer(
        {
            **settings.kafka.client_conf(),  # brokers, TLS and SASL, as the capture's
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # Only committed capture transactions, as the Spark source: an aborted one never reaches a store.
            "isolation.level": "read_committed",
            # An offset compacted away since the checkpoint fixed the range: from what is left of it.
            "auto.offset.reset": "earliest",
            # A range may end at a transaction's commit marker, which is never returned: the end of the
            # partition says it was passed.
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 10,
            **gather,
        }
    )


def as_record(message: Message) -> dict[str, Any]:
    """A Kafka message as the Spark source's row (topic, partition, offset, key, value)."""
    return {
        "topic": message.topic(),
        "partition": message.partition(),
        "offset": message.offset(),
        "key": message.key(),
        "value": message.value(),
    }


def size_of(ranges: Ranges) -> int:
    """The offsets ``ranges`` span (records and transaction markers)."""
    return sum(end - start for start, end in ranges.values())


class RangeReader:
    """One sink's consumer for reading batches by offset range (:func:`driver_consumer`)."""

    def __init__(self, settings: SinkSettings, name: str, *, timeout_s: float = 60.0) -> None:
        self._timeout = timeout_s
        self._consumer = driver_consumer(settings, f"pgcdc-sink-{name}")

    def read(self, ranges: Ranges) -> list[dict[str, Any]]:
        """The records of ``ranges``, each partition's in offset order, as the Spark source's rows (topic,
        partition, offset, key, value)."""
        from confluent_kafka import KafkaError, TopicPartition

        if not ranges:
            return []
        self._consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in ranges.items()])
        pending = set(ranges)
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + self._timeout
        try:
            while pending:
                if time.monotonic() > deadline:
                    missing = ", ".join(f"{t}[{p}] to {ranges[(t, p)][1]}" for t, p in sorted(pending))
                    raise SinkTransientError(
                        f"Kafka did not return a batch's records within {self._timeout:g}s: {missing}"
                    )
                # consume() waits its whole timeout unless it fills the count: a short one, as a batch's last
                # records (or the partition's end) arrive within milliseconds of the first.
                for m in self._consumer.consume(1000, timeout=0.01):
                    tp = (m.topic(), m.partition())
                    if tp not in pending:
                        continue
                    end, error, offset = ranges[tp][1], m.error(), m.offset()
                    if error is not None and error.code() != KafkaError._PARTITION_EOF:
                        raise SinkTransientError(f"reading {tp[0]}[{tp[1]}] from Kafka: {error}")
                    if offset is None:
                        continue
                    if offset >= end:  # past the range (or at the partition's end beyond it)
                        pending.discard(tp)
                    elif error is None:
                        out.append(as_record(m))
                        if offset == end - 1:
                            pending.discard(tp)
        finally:
            self._consumer.unassign()
        return out

    def close(self) -> None:
        self._consumer.close()
