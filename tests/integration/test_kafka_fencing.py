"""TransactionalProducer against the real broker, fenced two ways: by the transaction coordinator, which aborts a
transaction open longer than transaction.timeout.ms (a broker restart or a stall held it up), and by a second
producer with the same transactional id (another pgcdc instance). The first is transient: a new producer goes on
from the last commit. The second stops the instance, so that only one writes.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, TopicPartition

from cdc.errors import KafkaSetupError
from cdc.kafka import Topics, TransactionalProducer, TransactionTimedOutError
from tests.integration._capture_helpers import committed_records, wait_for

pytestmark = [pytest.mark.integration]


class _Ends:
    """The topic's end as a read_committed reader sees it (its last stable offset) and as a read_uncommitted
    one does (every record and marker written)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._tp = TopicPartition(topic, 0)
        self._consumers = {
            level: Consumer({"bootstrap.servers": bootstrap, "group.id": f"ends-{level}", "isolation.level": level})
            for level in ("read_committed", "read_uncommitted")
        }

    def end(self, level: str) -> int:
        return int(self._consumers[level].get_watermark_offsets(self._tp, timeout=10, cached=False)[1])

    def close(self) -> None:
        for consumer in self._consumers.values():
            consumer.close()


def test_a_transaction_the_coordinator_timed_out_is_transient_and_another_instance_is_not(
    kafka_bootstrap: str, unique: str
) -> None:
    topic = f"fencing.{unique}"
    Topics({"bootstrap.servers": kafka_bootstrap}, partitions=1, replication_factor=1).ensure(topic)
    conf = {"bootstrap.servers": kafka_bootstrap, "transaction.timeout.ms": 1000}
    ends = _Ends(kafka_bootstrap, topic)
    producers: list[TransactionalProducer] = []
    try:
        # The coordinator's abort: the transaction's event is written, then the transaction outlives its timeout
        # and the coordinator writes the abort marker (the broker looks every 10 s), which the read_committed
        # end passes.
        timed_out = TransactionalProducer(conf, f"fencing-a-{unique}")
        producers.append(timed_out)
        timed_out.begin()
        timed_out.produce(topic, b"k", b"aborted by the coordinator")
        wait_for(lambda: ends.end("read_uncommitted") >= 1, 60, "the open transaction's event")
        wait_for(lambda: ends.end("read_committed") >= 2, 60, "the coordinator's abort of the timed-out transaction")
        with pytest.raises(TransactionTimedOutError, match=r"transaction\.timeout\.ms"):
            timed_out.commit()
        # What the retry loop does next: a new producer with the same id, from the last commit.
        after = TransactionalProducer(conf, f"fencing-a-{unique}")
        producers.append(after)
        after.begin()
        after.produce(topic, b"k", b"committed by the next producer")
        after.commit()

        # Another instance: a second producer with the same id fences the first within its young transaction.
        first = TransactionalProducer({"bootstrap.servers": kafka_bootstrap}, f"fencing-b-{unique}")
        producers.append(first)
        first.begin()
        first.produce(topic, b"k", b"fenced by another instance")
        wait_for(lambda: ends.end("read_uncommitted") >= 5, 60, "the first instance's event")
        producers.append(TransactionalProducer({"bootstrap.servers": kafka_bootstrap}, f"fencing-b-{unique}"))
        with pytest.raises(KafkaSetupError, match="another pgcdc instance"):
            first.commit()
    finally:
        ends.close()
        for producer in producers:
            producer.close()
    values = [value for _, _, value in committed_records(kafka_bootstrap, topic, 1, in_order=True)]
    assert values == [b"committed by the next producer"]
