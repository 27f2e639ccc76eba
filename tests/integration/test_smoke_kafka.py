"""Kafka: a compacted topic is created, its configuration read back, and a keyed record round-trips."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic


def _wait_for_partitions(admin: AdminClient, topic: str, count: int) -> None:
    """CreateTopics answers once the controller has the topic; the broker serving the next request may learn
    of it a moment later (describe_configs then says UNKNOWN_TOPIC_OR_PART), so wait until its metadata shows it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) == count:
            return
        time.sleep(0.1)
    raise AssertionError(f"topic {topic!r} was created but its {count} partitions never appeared in the metadata")


def test_compacted_topic_config_and_round_trip(kafka_bootstrap: str, unique: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"smoke.compact.{unique}"
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=3, replication_factor=1, config={"cleanup.policy": "compact"})]
    )
    futures[topic].result(timeout=30)
    try:
        _wait_for_partitions(admin, topic, 3)
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        configs = admin.describe_configs([resource])[resource].result(timeout=30)
        assert configs["cleanup.policy"].value == "compact"

        producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
        producer.produce(topic, key=b"k1", value=b"v1")
        producer.produce(topic, key=b"k1", value=b"v2")
        assert producer.flush(30) == 0

        consumer = Consumer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "group.id": f"smoke-{unique}",
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
            }
        )
        consumer.subscribe([topic])
        seen: list[tuple[bytes | None, bytes | None]] = []
        try:
            for _ in range(60):
                msg = consumer.poll(1.0)
                if msg is None:
                    if len(seen) == 2:
                        break
                    continue
                assert msg.error() is None, msg.error()
                seen.append((msg.key(), msg.value()))
        finally:
            consumer.close()
        assert seen == [(b"k1", b"v1"), (b"k1", b"v2")]  # same key, same partition, in order
    finally:
        admin.delete_topics([topic])[topic].result(timeout=30)
