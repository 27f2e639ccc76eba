"""cdc._native.KafkaProducer: the capture's own librdkafka producer, on librdkafka's public API (no broker here:
what it refuses, and the delivery failures it reports with their topic and size)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc._encoder import native_module
from cdc._libs import librdkafka_addresses

_native: Any = native_module()
pytestmark = pytest.mark.skipif(_native is None, reason="the C build (cdc._native) is not installed")


def _producer(conf: dict[str, str], failures: list[tuple[int, str, int]]) -> Any:
    symbols = librdkafka_addresses(_native.LIBRDKAFKA_FUNCTIONS)
    return _native.KafkaProducer(conf, symbols, lambda *failure: failures.append(failure))


def test_an_unknown_setting_is_refused_as_confluent_kafka_refuses_it() -> None:
    with pytest.raises(KafkaException) as info:
        _producer({"bootstrap.servers": "127.0.0.1:1", "no.such.setting": "1"}, [])
    err = info.value.args[0]
    assert err.code() == KafkaError._INVALID_ARG
    assert "no.such.setting" in err.str()


def test_a_failed_delivery_is_reported_with_its_topic_and_size() -> None:
    failures: list[tuple[int, str, int]] = []
    conf = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": "300", "delivery.report.only.error": "true"}
    producer = _producer(conf, failures)
    producer.produce("orders", b"v" * 10, b"key")
    producer.produce("orders", None, b"k2")  # a tombstone
    assert producer.flush(10.0) == 0
    assert sorted(failures) == [(KafkaError._MSG_TIMED_OUT, "orders", 2), (KafkaError._MSG_TIMED_OUT, "orders", 13)]


def test_an_event_over_the_producers_limit_is_refused_at_once() -> None:
    producer = _producer({"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": "1000"}, [])
    with pytest.raises(KafkaException) as info:
        producer.produce("orders", b"v" * 5000, b"key")
    assert info.value.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE


def test_a_full_queue_is_a_buffer_error() -> None:
    producer = _producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": "1"}, [])
    producer.produce("orders", b"v", b"k")
    with pytest.raises(BufferError):
        producer.produce("orders", b"v", b"k")


def test_transactions_without_a_broker_fail_as_kafka_errors() -> None:
    conf = {"bootstrap.servers": "127.0.0.1:1", "transactional.id": "t", "transaction.timeout.ms": "1000"}
    producer = _producer(conf, [])
    with pytest.raises(KafkaException) as info:
        producer.init_transactions(0.5)
    assert info.value.args[0].code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT)
