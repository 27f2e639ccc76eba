"""Requests to the running capture through a table in the source database (``source.signal_table``), or
through a Kafka topic (:class:`SignalTopic`).

`cdc snapshot` writes a row there; so can anyone with INSERT on the table (an application, a migration, psql),
which is why it works with database access only. The running capture reads the rows of its slot after the
last one it took, in id order, every ``capture.signal_poll_s``, and records the last id it took in its
committed state, so a request is taken once across restarts.

A row is untrusted input: its kind must be one of :data:`SIGNAL_KINDS` and its data a JSON object; a backfill's
``where`` only ever runs inside a READ ONLY transaction with a statement timeout (cdc/_backfill.py).

One limit: ids come from an identity column, in the order rows are inserted, not committed. A row inserted by a
transaction that commits after a later row was taken is not seen (its id is below the last taken). `cdc
snapshot` inserts each request in a transaction of its own; insert by hand in short transactions too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg import sql

from pgcdc_common.topics import split_table_name

log = logging.getLogger(__name__)

SIGNAL_KINDS = ("backfill", "cancel", "pause", "resume")
_BATCH = 100  # requests taken per poll at most


@dataclass(frozen=True)
class Signal:
    """A request: its id (the signal table's, or the record's offset in the signal topic), kind and data."""

    id: int
    kind: str
    data: dict[str, Any]
    partition: int | None = None  # from the signal topic: the record's partition

    @property
    def name(self) -> str:
        """What the backfills it asks for are called: the row's id, or ``kafka-<partition>-<offset>``."""
        return str(self.id) if self.partition is None else f"kafka-{self.partition}-{self.id}"


class SignalTable:
    """The signal table of one capture (its rows are those of ``slot``)."""

    def __init__(self, name: str, slot: str) -> None:
        self.name = name
        schema, table = split_table_name(name)
        self.ident = sql.Identifier(schema, table)
        self.slot = slot

    def ensure(self, conn: psycopg.Connection[Any]) -> str | None:
        """Creates the table when absent; a note saying why requests cannot be made when it cannot."""
        try:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                    "slot text NOT NULL, kind text NOT NULL, data jsonb NOT NULL DEFAULT '{{}}', "
                    "created_at timestamptz NOT NULL DEFAULT now())"
                ).format(self.ident)
            )
        except psycopg.Error as exc:
            return (
                f"signal table {self.name} is absent and cannot be created ({str(exc).strip()}): backfills can only "
                f"be asked for once it exists (create it as docs/operations.md shows, or set source.signal_table)"
            )
        return None

    def read(self, conn: psycopg.Connection[Any], after: int) -> list[Signal]:
        """The requests of this capture after id ``after``, oldest first. A row that is not a request is taken
        as one of kind "invalid" (the capture records it as failed, and says why)."""
        rows = conn.execute(
            sql.SQL("SELECT id, kind, data::text FROM {} WHERE slot = %s AND id > %s ORDER BY id LIMIT %s").format(
                self.ident
            ),
            (self.slot, after, _BATCH),
        ).fetchall()
        return [_signal(int(id_), str(kind), str(data)) for id_, kind, data in rows]

    def data(self, conn: psycopg.Connection[Any], id_: int) -> dict[str, Any] | None:
        """The data of this capture's request ``id_`` (None when its row is gone, or is not a request)."""
        row = conn.execute(
            sql.SQL("SELECT kind, data::text FROM {} WHERE slot = %s AND id = %s").format(self.ident), (self.slot, id_)
        ).fetchone()
        if row is None:
            return None
        signal = _signal(id_, str(row[0]), str(row[1]))
        return None if signal.kind == "invalid" else signal.data

    def send(self, conn: psycopg.Connection[Any], kind: str, data: dict[str, Any]) -> int:
        """Inserts a request (in a transaction of its own when ``conn`` is in autocommit); its id."""
        row = conn.execute(
            sql.SQL("INSERT INTO {} (slot, kind, data) VALUES (%s, %s, %s::jsonb) RETURNING id").format(self.ident),
            (self.slot, kind, json.dumps(data)),
        ).fetchone()
        assert row is not None
        return int(row[0])


class SignalTopic:
    """Requests through a Kafka topic (``kafka.signal_topic``, ``<topic_prefix>.signals`` by default), for
    whoever speaks Kafka rather than SQL (and for captures whose database role cannot create the signal table).

    A record's value is a JSON object ``{"kind": …, "data": {…}}``, the signal table's columns; its key, when set,
    must be the capture's slot (several captures can share one topic; a record keyed to another slot is passed
    over). The topic is read read_committed from the offsets of the committed state, which records a request as
    taken in the same Kafka transaction as the backfill it queues: taken once across restarts. A new capture
    records the topic's end in its first state (cdc._capture): older requests were not meant for it, every
    later one is taken, even one produced during its initial snapshot. A partition the state does not name (the
    topic was unreachable then, or gained partitions) starts at its end as it is when first opened, and that
    position is recorded with the next commit."""

    def __init__(self, conf: dict[str, Any], topic: str, slot: str) -> None:
        self.topic, self.slot = topic, slot
        self._conf = conf
        self._consumer: Consumer | None = None
        self._position: dict[int, int] = {}  # per partition, the offset after the last record returned

    def read(self, committed: dict[int, int]) -> list[Signal]:
        """The requests that have arrived, without waiting; a record that is not a request is one of kind
        "invalid". The first read starts at ``committed`` (the state's offsets; a partition it lacks gets the
        topic's end now, which the state's next commit records)."""
        consumer = self._consumer or self._open(committed)
        out = []
        for msg in consumer.consume(_BATCH, timeout=0):
            error = msg.error()
            if error is not None:
                if error.fatal():  # the consumer is done for: a new one goes on after the last record returned
                    self.close()
                    raise KafkaException(error)
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("reading the signal topic %s: %s", self.topic, error.str())
                continue
            partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
            self._position[partition] = offset + 1
            key, value = msg.key(), msg.value()
            if key is not None and key != self.slot.encode():
                out.append(Signal(offset, "other", {}, partition))  # another capture's: only its offset is taken
                continue
            out.append(_record(offset, partition, value if isinstance(value, bytes) else b""))
        return out

    def _open(self, committed: dict[int, int]) -> Consumer:
        consumer = Consumer(
            {
                **self._conf,
                "group.id": f"pgcdc-signals-{self.slot}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        try:  # short timeouts: this runs on the stream's thread, between transactions
            partitions = list(consumer.list_topics(self.topic, timeout=5).topics[self.topic].partitions)
            for p in partitions:
                if p not in self._position:
                    if p not in committed:
                        committed[p] = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=5)[1]
                    self._position[p] = committed[p]
            consumer.assign([TopicPartition(self.topic, p, self._position[p]) for p in partitions])
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        return consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def _record(offset: int, partition: int, value: bytes) -> Signal:
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # untrusted: "[[[[…" nested past Python's recursion limit
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("kind"), str) and isinstance(parsed.get("data", {}), dict):
        signal = _signal(offset, parsed["kind"], json.dumps(parsed.get("data", {})))
        if signal.kind != "invalid":
            return Signal(offset, signal.kind, signal.data, partition)
    shown = value[:200].decode(errors="replace")
    error = f'signal topic record {partition}/{offset}: {shown!r} is not a request ({{"kind": …, "data": {{…}}}})'
    return Signal(offset, "invalid", {"error": error}, partition)


def _signal(id_: int, kind: str, data: str) -> Signal:
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        parsed = None
    if kind not in SIGNAL_KINDS or not isinstance(parsed, dict):
        return Signal(id_, "invalid", {"error": f"signal {id_}: kind {kind!r} with data {data!r} is not a request"})
    return Signal(id_, kind, parsed)


__all__ = ["SIGNAL_KINDS", "Signal", "SignalTable", "SignalTopic"]
