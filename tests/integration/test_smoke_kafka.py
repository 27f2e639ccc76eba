"""Kafka: a compacted topic is created, its configuration read back, and a keyed record round-trips."""

from __future__ import annotations

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic


def test_compacted_topic_config_and_round_trip(kafka_bootstrap: str, unique: str) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"smoke.compact.{unique}"
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=3, replication_factor=1, config={"cleanup.policy": "compact"})]
    )
    futures[topic].result(timeout=30)
    try:
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
