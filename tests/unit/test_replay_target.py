"""TransactionalProducer.replay_target: a topic librdkafka gave no handle for is asked about and logged once."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from cdc.kafka import TransactionalProducer


class _NoHandles:
    """A DirectProducer whose every target() fails as when librdkafka refuses a topic handle."""

    def __init__(self) -> None:
        self.asked = 0

    def target(self, plan: Any, topic: bytes, parts: tuple[bytes, ...]) -> Any:
        self.asked += 1
        raise RuntimeError(f"librdkafka refused a handle for topic {topic!r}: error -191")


def test_a_topic_without_a_handle_is_asked_about_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    direct = _NoHandles()
    producer = types.SimpleNamespace(_direct=direct, _not_from_c=set())
    caplog.set_level(logging.INFO, logger="cdc._kafka")
    for _ in range(5):  # a live transaction's changes each ask again
        assert TransactionalProducer.replay_target(producer, "p.public.t", object(), ()) is None  # type: ignore[arg-type]
    assert direct.asked == 1
    assert [r.getMessage() for r in caplog.records] == [
        "events for 'p.public.t' go through produce(), not from C: "
        "librdkafka refused a handle for topic b'p.public.t': error -191"
    ]
    assert TransactionalProducer.replay_target(producer, "p.public.u", object(), ()) is None  # type: ignore[arg-type]
    assert direct.asked == 2  # another topic is asked about on its own
