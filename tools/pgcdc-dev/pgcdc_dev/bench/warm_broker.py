"""Warms the Kafka broker's JVM before a benchmark run measures anything through it.

A broker just started (``./dev services up``, as CI and a fresh clone leave it) runs its produce path in the
interpreter and its first compiled tiers: measured on this project's 2-CPU box, the same transactional, LZ4
produce load cost the broker 0.62 CPU-µs per record in its first 5 s, 0.30 after 10 s and 0.20 to 0.28 after a
minute and more, and the 5M-row snapshot's broker share fell from 0.45 to 0.28 µs per row over nine runs (its
C2 compiler thread alone took 18 CPU-s meanwhile). Those CPU-µs are taken from PostgreSQL and the capture on
the same two cores, so a run on a cold broker measures the JIT compilers, not the capture. A production broker
is warm; the references (pg_recvlogical, COPY) do not touch Kafka, so only the capture's side needs this — as
the Debezium runs warm their own JVM first (``debezium_smoke.py --warmup-rows``).

:func:`warm` produces through the capture's own producer (``cdc._kafka.TransactionalProducer``: the same
settings, transactions and queue handling) to a scratch compacted topic, 20,000 records per transaction, ~100-byte
values that vary like table rows, and reports the broker's CPU per record in windows of a few seconds (when the
broker runs here). The topic is deleted afterwards. Run alone:
``./dev python -m bench._warm_broker [SECONDS]``.
"""

from __future__ import annotations

import contextlib
import json
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from cdc.kafka import Topics, TransactionalProducer
from pgcdc_dev.bench import cpu as _cpu

WINDOW_S = 5.0
TXN_RECORDS = 20_000


def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete topics, waiting for each; one already gone is fine (the benchmarks' one topic clean-up)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(list(topics)).values():
        with contextlib.suppress(KafkaException):
            fut.result(30)


@dataclass
class Window:
    at_s: float  # seconds since the warm-up began, at the window's end
    records_per_s: float
    broker_us_per_record: float | None  # None when the broker does not run on this machine


@dataclass
class WarmUp:
    topic: str  # the scratch topic, deleted afterwards
    seconds: float
    records: int
    windows: list[Window] = field(default_factory=list)


def _value(n: int) -> bytes:
    # Like an Avro-encoded row of the snapshot table: a schema id, varying numbers and short strings (LZ4 then
    # compresses it about as well as real events; one constant value would compress to nothing).
    return b"\x00\x00\x00\x00\x01" + struct.pack(">qiq", n, n % 1000, n * 7) + b"kind-%d|tag-x|%d" % (n % 10, n)


def warm(kafka: str, seconds: float, *, log: Callable[[str], None] = print) -> WarmUp:
    """Produces to a scratch topic on ``kafka`` for ``seconds``; returns what it did and measured."""
    topic = f"bench_warmup_{int(time.time() * 1000)}"
    conf: dict[str, Any] = {"bootstrap.servers": kafka}
    Topics(conf, partitions=1, replication_factor=1).ensure(topic)
    broker = _cpu.java_pid("kafka.Kafka")
    result = WarmUp(topic=topic, seconds=0.0, records=0)
    producer = TransactionalProducer(conf, topic)
    try:
        start = window_start = time.monotonic()
        cpu_start, window_records = (_cpu.tree_cpu(broker) if broker else None), 0
        while time.monotonic() - start < seconds:
            producer.begin()
            for n in range(result.records, result.records + TXN_RECORDS):
                producer.produce(topic, n.to_bytes(8, "big"), _value(n))
            producer.commit()
            result.records += TXN_RECORDS
            now = time.monotonic()
            if now - window_start >= WINDOW_S:
                cpu_now, done = (_cpu.tree_cpu(broker) if broker else None), result.records - window_records
                per = round((cpu_now - cpu_start) / done * 1e6, 3) if cpu_now and cpu_start else None
                result.windows.append(Window(round(now - start, 1), round(done / (now - window_start)), per))
                log(
                    f"warm-up: {now - start:4.0f} s, {done / (now - window_start):,.0f} records/s"
                    + (f", broker {per:.2f} CPU-µs per record" if per is not None else "")
                )
                window_start, cpu_start, window_records = now, cpu_now, result.records
        result.seconds = round(time.monotonic() - start, 1)
    except BaseException:
        producer.abort()
        raise
    finally:
        producer.close()
        with contextlib.suppress(Exception):  # a topic left behind must not hide why the warm-up failed
            delete_topics(kafka, [topic])
    return result


if __name__ == "__main__":
    from pgcdc_dev import discovery

    done = warm(discovery.find("kafka").value, float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
    print(json.dumps(asdict(done)))
