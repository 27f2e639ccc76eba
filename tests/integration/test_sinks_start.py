"""`cdc sinks run` started while Kafka does not answer (a broker restarting, a cluster still coming up) waits for
it: its first contact, the dead-letter topic, is retried with backoff and a message naming the topic and the
brokers, and a stop ends the wait. No Spark: the wait comes before the app's session."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from sinks.app import reach_kafka
from sinks.config import SinkSettings
from tests.integration._capture_helpers import wait_for
from tests.integration._proxy import Proxy, kafka_proxied


@pytest.fixture
def unreachable(kafka_bootstrap: str) -> Iterator[Proxy]:
    """A proxy on the port the broker's PROXIED listener advertises, cut: Kafka refuses every connection."""
    listener, advertised = kafka_proxied(kafka_bootstrap)
    proxy = Proxy(("127.0.0.1", listener), port=advertised)
    proxy.cut()
    try:
        yield proxy
    finally:
        proxy.cut()


class _Waiting:
    """``reach_kafka`` on its own thread, as the app calls it before starting Spark."""

    def __init__(self, settings: SinkSettings, backoff_s: tuple[float, float] = (1, 60)) -> None:
        self.stop = threading.Event()
        self.reached: list[bool] = []
        self.thread = threading.Thread(
            target=lambda: self.reached.append(reach_kafka(settings, self.stop, 3, backoff_s)), daemon=True
        )
        self.thread.start()

    def ended(self, timeout: float) -> list[bool]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "reach_kafka still waiting"
        return self.reached


@pytest.fixture
def waits() -> Iterator[list[_Waiting]]:
    """Every wait the test starts, stopped at its end whatever the outcome."""
    started: list[_Waiting] = []
    yield started
    for waiting in started:
        waiting.stop.set()
        waiting.thread.join(60)


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sinks._supervisor" and "retrying in" in r.message]


def _settings(brokers: str, prefix: str) -> SinkSettings:
    return SinkSettings(kafka={"bootstrap_servers": brokers, "topic_prefix": prefix})  # type: ignore[arg-type]


@pytest.mark.xdist_group("kafka-proxied")  # one proxy can listen on the advertised port at a time
def test_the_sinks_wait_for_kafka_at_start_and_a_stop_ends_the_wait(
    *,
    kafka_bootstrap: str,
    unique: str,
    unreachable: Proxy,
    waits: list[_Waiting],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="sinks._supervisor")
    brokers, prefix = f"127.0.0.1:{unreachable.port}", f"t{unique}"
    waits.append(waiting := _Waiting(_settings(brokers, prefix)))
    wait_for(lambda: len(_retries(caplog)) >= 2, 120, "two retries of the sinks' first contact with Kafka")
    first = _retries(caplog)[0]
    assert f"dead-letter topic {prefix}.dead-letter on {brokers}" in first, first
    assert not waiting.reached, "reach_kafka returned while Kafka refused every connection"

    unreachable.restore()
    assert waiting.ended(120) == [True]
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    wait_for(lambda: f"{prefix}.dead-letter" in admin.list_topics(timeout=30).topics, 60, "the dead-letter topic")

    # A stop during a long wait ends it at once, and no attempt follows, though Kafka answers again meanwhile.
    unreachable.cut()
    caplog.clear()
    waits.append(stopped := _Waiting(_settings(brokers, f"{prefix}b"), backoff_s=(600, 600)))
    wait_for(lambda: _retries(caplog), 120, "a retry while Kafka refuses connections")
    assert "retrying in 600s" in _retries(caplog)[0], _retries(caplog)
    unreachable.restore()
    stopped.stop.set()
    assert stopped.ended(30) == [False]
    assert f"{prefix}b.dead-letter" not in admin.list_topics(timeout=30).topics
