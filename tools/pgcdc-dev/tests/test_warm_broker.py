"""The benchmarks' broker warm-up against the real broker: it produces, measures and cleans up after itself."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient
from pgcdc_dev.bench import warm_broker as _warm_broker

pytestmark = pytest.mark.integration  # the real broker: `./dev test` runs it once the services are up


def test_the_warm_up_produces_in_windows_and_deletes_its_topic(kafka_bootstrap: str) -> None:
    lines: list[str] = []
    done = _warm_broker.warm(kafka_bootstrap, _warm_broker.WINDOW_S + 1, log=lines.append)

    assert done.records >= _warm_broker.TXN_RECORDS
    assert done.seconds >= _warm_broker.WINDOW_S
    assert done.windows
    assert all(w.records_per_s > 0 for w in done.windows)
    assert len(lines) == len(done.windows)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    deadline = time.monotonic() + 10  # the broker's metadata follows the controller's deletion shortly
    while done.topic in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(0.2)
    assert done.topic not in admin.list_topics(timeout=10).topics
