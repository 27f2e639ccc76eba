"""SIGTERM ends `cdc run` within a bounded time whatever the broker does (docs/operations.md): with the broker
stalled (its connections open, nothing answered), the open Kafka transaction is abandoned
``capture.shutdown_timeout_s`` after the signal, the slot stays where the last commit put it, and the next run
writes the abandoned changes, once each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import CdcConfig, read_topic, scratch_database, wait_for
from tests.integration._proxy import Proxy, kafka_proxied

SHUTDOWN_S = 3.0
# What SIGTERM may take beyond the bound: the commit slice under way (a second of draining, a second of
# committing), the abandoned transaction's abort (a second), the producer's close (a second), and a busy CI
# machine's slack.
MARGIN_S = 8.0


@pytest.fixture
def source(pg_dsn: str, unique: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"cdc_{unique}") as dsn:
        yield dsn


@pytest.fixture
def stallable(kafka_bootstrap: str) -> Iterator[Proxy]:
    """A proxy to the broker's PROXIED listener (the port it advertises there), which the test can stall."""
    listener, advertised = kafka_proxied(kafka_bootstrap)
    proxy = Proxy(("127.0.0.1", listener), port=advertised)
    try:
        yield proxy
    finally:
        proxy.flow()
        proxy.cut()


@pytest.mark.xdist_group("kafka-proxied")  # one proxy can listen on the advertised port at a time
def test_sigterm_under_a_stalled_broker_exits_in_bounded_time_and_loses_nothing(
    *, source: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path, stallable: Proxy
) -> None:
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO items VALUES (1, 'before')")
    topic = f"t{unique}.public.items"
    config = CdcConfig(
        source,
        f"127.0.0.1:{stallable.port}",
        registry_url,
        f"t{unique}",
        ["public.items"],
        f"s_{unique}",
        f"p_{unique}",
        extra=f"shutdown_timeout_s = {SHUTDOWN_S}",
        kafka_extra='signal_topic = ""',  # the producer alone talks to the broker once the capture streams
    )
    proc = config.start(tmp_path)
    proc.wait_streaming()
    wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) == 1, 120, "the snapshot", proc)
    stallable.stall()
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'while stalled' FROM generate_series(2, 50) g")
    # The capture has produced the changes and waits for the broker: it is inside the Kafka transaction.
    wait_for(lambda: stallable.held > 0, 60, "the capture's requests to the stalled broker", proc)
    asked = time.monotonic()
    assert proc.proc is not None
    code = proc.terminate(timeout=SHUTDOWN_S + MARGIN_S + 60)
    took = time.monotonic() - asked
    assert code == 0, proc.tail()
    assert took < SHUTDOWN_S + MARGIN_S, f"SIGTERM took {took:.1f} s:\n{proc.tail()}"

    stallable.flow()
    proc.start()
    try:
        wait_for(lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 50, 120, "the changes", proc)
        events = read_topic(kafka_bootstrap, registry_url, topic)
    finally:
        proc.stop()
    ids = [e.value["after"]["id"] for e in events if e.value]
    assert sorted(ids) == list(range(1, 51))  # each once: the abandoned transaction was never visible
