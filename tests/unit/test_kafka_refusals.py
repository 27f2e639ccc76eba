"""One rule for which of Kafka's answers need a fix rather than a retry (pgcdc_common.kafka_refusals): the
capture's topics and producer and the sinks' dead-letter topic judge the same codes alike."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc._kafka import _kafka_error
from cdc.errors import KafkaSetupError, TransientError
from sinks._reader import _topic_error
from sinks.errors import SinkConfigError, SinkTransientError

REFUSED = (
    "TOPIC_AUTHORIZATION_FAILED",
    "CLUSTER_AUTHORIZATION_FAILED",
    "INVALID_REPLICATION_FACTOR",
    "POLICY_VIOLATION",
)
RETRIED = ("_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN", "NOT_CONTROLLER", "LEADER_NOT_AVAILABLE")


def _raised(name: str) -> KafkaException:
    return KafkaException(KafkaError(getattr(KafkaError, name)))


@pytest.mark.parametrize("name", REFUSED)
def test_a_refusal_is_terminal_for_the_capture_and_the_sinks(name: str) -> None:
    assert isinstance(_kafka_error(_raised(name), "creating topic 't'"), KafkaSetupError)
    assert isinstance(_topic_error("the dead-letter topic d on k:9092", _raised(name), 30), SinkConfigError)


@pytest.mark.parametrize("name", RETRIED)
def test_kafka_not_answering_is_retried_by_the_capture_and_the_sinks(name: str) -> None:
    assert type(_kafka_error(_raised(name), "creating topic 't'")) is TransientError
    assert isinstance(_topic_error("the dead-letter topic d on k:9092", _raised(name), 30), SinkTransientError)
