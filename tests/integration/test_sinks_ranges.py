"""A live batch read by the driver by offset range (sinks._ranges), against a real broker with transactions:
exactly the committed records of each range, whether it ends at a record, at a commit marker, or holds only an
aborted transaction."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from sinks._ranges import RangeReader, batch_ranges
from sinks.config import SinkSettings

pytestmark = pytest.mark.timeout(300)


def _transactions(kafka: str, topic: str) -> None:
    """Offsets 0-2 committed (marker 3), 4-5 aborted (marker 6), 7-8 committed (marker 9)."""
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"ranges-{topic}"})
    producer.init_transactions(30)
    for keys, commit in (((0, 1, 2), True), ((4, 5), False), ((7, 8), True)):
        producer.begin_transaction()
        for k in keys:
            producer.produce(topic, key=f"k{k}".encode(), value=f"v{k}".encode(), partition=0)
        assert producer.flush(30) == 0  # written to the log before the abort: else they are only dropped
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    assert producer.flush(30) == 0


@pytest.fixture
def topic(kafka_bootstrap: str, unique: str) -> str:
    name = f"ranges_{unique}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    _transactions(kafka_bootstrap, name)
    return name


@pytest.mark.parametrize(
    ("start", "end", "offsets"),
    [
        pytest.param(0, 10, [0, 1, 2, 7, 8], id="everything, ending at a commit marker"),
        pytest.param(0, 4, [0, 1, 2], id="one transaction and its marker"),
        pytest.param(0, 2, [0, 1], id="ending at a record"),
        pytest.param(4, 7, [], id="only an aborted transaction"),
        pytest.param(3, 8, [7], id="from a marker, past an aborted transaction"),
    ],
)
def test_a_range_reads_exactly_its_committed_records(
    kafka_bootstrap: str, topic: str, start: int, end: int, offsets: list[int]
) -> None:
    reader = RangeReader(SinkSettings(kafka={"bootstrap_servers": kafka_bootstrap}), "t", timeout_s=30)  # type: ignore[arg-type]
    try:
        got = reader.read({(topic, 0): (start, end)})
        assert [r["offset"] for r in got] == offsets
        assert all(r["key"] == f"k{r['offset']}".encode() and r["topic"] == topic for r in got)
        again = reader.read({(topic, 0): (start, end)})  # the same consumer, a batch re-run
        assert [r["offset"] for r in again] == offsets
    finally:
        reader.close()


def test_ranges_need_every_partition_s_start() -> None:
    a, b = ("t", 0), ("t", 1)
    assert batch_ranges({a: 5, b: 7}, {a: 9, b: 7}) == {a: (5, 9)}
    assert batch_ranges({a: 5}, {a: 9, b: 3}) is None  # b is new to the query: Spark reads it from its start
