"""Re-snapshots into topics that already hold data: the keys the source no longer has get deleted.

A snapshot only writes rows that exist. When a table's topic already holds events (after a lost slot, after
``cdc detach`` + ``cdc run``, after a table is captured again), a row deleted while nobody streamed would keep
its last event live in the compacted topic — and in every derived store — for ever. So, per table:

1. Before the snapshot writes anything, the topic's end offsets are taken (``since``, kept in the snapshot's
   committed progress so a resumed snapshot uses the same boundary) and the topic is read ``read_committed``
   from the beginning to them. The keys whose latest record is not a tombstone are the *live keys*; only key
   bytes and a (partition, offset) are kept, never values, so memory follows the number of live keys. An
   empty topic (the normal first snapshot) costs one end-offsets query and no read.
2. A resumed snapshot also reads what earlier attempts committed after ``since`` (their snapshot rows and
   deletes): those keys are settled and leave the set.
3. Every key the snapshot writes leaves the set. When the table's last chunk is written, the keys left were
   live in the topic but are not in the source at the snapshot's consistent point: each gets a delete event
   and a tombstone, as the stream writes a DELETE. Rows deleted after the consistent point are the stream's
   (it starts at that point), so nothing is deleted twice by design, and a key the snapshot saw is never
   deleted here.

When: every snapshot (the first after ``cdc detach`` + ``cdc run``, after a lost slot, with a table captured
again, and a snapshot resumed after a crash), per table, whenever the topic held records before it; the
rule needs no knowledge of why. It can only delete keys the snapshot did not read, and the snapshot reads
every row that exists at its consistent point, so it never deletes a row the source has then (one inserted
after that point is streamed after the delete, and wins). Keys whose latest
record predates a streamed TRUNCATE are live by this rule; deleting them again is a no-op for the stores
(the truncate removed them) and lets compaction finally drop them. With ``capture.snapshot = "never"``
there is no snapshot and nothing is deleted.

The deletes are written like snapshot chunks: in Kafka transactions with the snapshot's progress, the table
marked done only with the last of them. A crash anywhere leaves committed deletes (whose tombstones are now
the keys' latest records, after ``since``: step 2 drops them) or none; the rerun deletes what is left.
They go to the table's own topic with the stream's envelope, so sinks running meanwhile apply them as any
delete; their position is the snapshot's consistent point, above every event the topic held and below
every change streamed afterwards, so a store keeps the newest of them whatever order it reads them in.

Keys are compared without the 5-byte Confluent header: the snapshot writes them with the current key schema
id, and earlier events may carry another id for the same key (the registry was rebuilt, the key schema
evolved compatibly). Records with the current id are compared by their Avro payload as is (Avro's binary
encoding of a record is deterministic, so equal keys are equal bytes); records with another id are decoded
with their writer schema, resolved to the current key schema and re-encoded — as the sinks resolve them —
and a key that does not resolve is left alone (the sinks cannot read it either). A key whose fields are all
null is a truncate marker, not a row, and is never deleted.
"""

from __future__ import annotations

import io
import json
import logging
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import fastavro
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError as _RegistryHTTPError

from cdc._events import Position, Stamp, TableCodec
from cdc._offsets import TableProgress
from cdc.errors import KafkaSetupError, TransientError

if TYPE_CHECKING:
    from cdc._config import Settings

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">bI")
_TIMEOUT_S = 30.0
# A partition that does not reach its end offset for this long holds a transaction another producer left
# open (ours were aborted by init_transactions): give up the attempt, the retry reads again.
_STALL_S = 120.0

Lookup = Callable[[int], Any | None]  # schema id -> parsed writer schema (logical types stripped), None if unknown


class LiveKeys:
    """Keys whose latest record in the topic is not a tombstone, by canonical key (the Avro payload).

    Each physical key — (partition, key bytes as written) — is tracked on its own: the same canonical key may
    have been written under two schema ids, or into two partitions after the topic grew. The common case
    (current schema id, one partition) costs one dict entry of payload -> (partition, offset).
    """

    def __init__(self, frame: bytes) -> None:
        self._frame = frame  # the current key schema's Confluent header
        self._live: dict[bytes, tuple[int, int]] = {}
        self._other: dict[bytes, dict[tuple[int, bytes], int]] = {}

    def record(self, canonical: bytes, partition: int, raw: bytes, offset: int, *, tombstone: bool) -> None:
        """A record before the snapshot's boundary, in offset order within its partition."""
        common = len(raw) == len(canonical) + 5 and raw.startswith(self._frame)
        if tombstone:
            loc = self._live.get(canonical)
            if common and loc is not None and loc[0] == partition:
                del self._live[canonical]
                return
            other = self._other.get(canonical)
            if other is not None:
                other.pop((partition, raw), None)
                if not other:
                    del self._other[canonical]
            return
        loc = self._live.get(canonical)
        if common and (loc is None or loc[0] == partition):
            self._live[canonical] = (partition, offset)
        else:
            self._other.setdefault(canonical, {})[(partition, raw)] = offset

    def discard(self, canonical: bytes) -> None:
        """The key is settled: the snapshot wrote it, or an earlier attempt of this snapshot did."""
        self._live.pop(canonical, None)
        if self._other:
            self._other.pop(canonical, None)

    def __len__(self) -> int:
        return len(self._live) + sum(len(v) for v in self._other.values())

    def remaining(self) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """partition -> {offset of the latest live record: (key bytes as written, canonical key)}."""
        out: dict[int, dict[int, tuple[bytes, bytes]]] = {}
        for canonical, (partition, offset) in self._live.items():
            out.setdefault(partition, {})[offset] = (self._frame + canonical, canonical)
        for canonical, records in self._other.items():
            for (partition, raw), offset in records.items():
                out.setdefault(partition, {})[offset] = (raw, canonical)
        return out


def plain_schema(schema: Any) -> Any:
    """``schema`` without logical types: values decode to the Avro-ready form the capture writes (ints for
    timestamps, unscaled bytes for decimals), so they re-encode to the same bytes."""
    if isinstance(schema, dict):
        return {k: plain_schema(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [plain_schema(s) for s in schema]
    return schema


def parse_plain(schema: Mapping[str, Any] | str) -> Any:
    return fastavro.parse_schema(plain_schema(json.loads(schema) if isinstance(schema, str) else dict(schema)))


def _decode(data: bytes, writer: Any, reader: Any) -> Any:
    # Named types in unions of several come back as (name, value) so that fastavro writes them back to the
    # same branch; unions with one named type give the value itself.
    return fastavro.schemaless_reader(
        io.BytesIO(data),
        writer,
        reader,
        return_record_name=True,
        return_record_name_override=True,
        return_named_type=True,
        return_named_type_override=True,
    )


def _encode(schema: Any, record: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, record)
    return out.getvalue()


class KeyCanon:
    """Canonical keys: the Avro payload of a key under the table's current key schema."""

    def __init__(self, *, key_id: int, key_schema: Mapping[str, Any], lookup: Lookup) -> None:
        self.key_id = key_id
        self.frame = _FRAME.pack(0, key_id)
        self.schema = parse_plain(key_schema)
        self._lookup = lookup

    def canonical(self, raw: bytes | None) -> bytes | None:
        """The key's canonical form; None for what is not a row's key (never deleted)."""
        if raw is None or len(raw) < 5 or raw[0] != 0:
            return None  # not Confluent-framed: the sinks dead-letter it
        if raw.startswith(self.frame):
            payload = raw[5:]
        else:
            writer = self._lookup(_FRAME.unpack_from(raw)[1])
            if writer is None:
                return None
            try:
                payload = _encode(self.schema, _decode(raw[5:], writer, self.schema))
            except Exception:  # any failure to resolve means "not a key of today's table"
                return None
        # Every field null (each union branch 0 is a zero byte): the truncate marker's key, not a row's.
        return payload if payload.strip(b"\x00") else None

    def record(self, canonical: bytes) -> dict[str, Any]:
        return dict(_decode(canonical, self.schema, self.schema))


Record = tuple[int, int, bytes, Any]  # partition, offset, key, value (None: a tombstone)


def live_keys(canon: KeyCanon, before: Iterable[Record], settled: Iterable[Record]) -> LiveKeys:
    """The keys live in the topic before the snapshot's boundary (``before``: the records below it, in offset
    order per partition) and not written since by this snapshot (``settled``: the records from it on).

    ``before`` is read to its end first: a later record of one partition must not be undone by an earlier
    one of another partition read after it.
    """
    live = LiveKeys(canon.frame)
    for partition, offset, key, value in before:
        canonical = canon.canonical(key)
        if canonical is not None:
            live.record(canonical, partition, key, offset, tombstone=value is None)
    for _partition, _offset, key, _value in settled:
        canonical = canon.canonical(key)
        if canonical is not None:
            live.discard(canonical)
    return live


class GapDeletes:
    """One table's deletes for keys live in its topic but absent from the snapshot (see the module doc)."""

    def __init__(
        self, *, codec: TableCodec, canon: KeyCanon, live: LiveKeys, lookup: Lookup, reader: TopicReader
    ) -> None:
        self.codec = codec
        self.canon = canon
        self.live = live
        self._lookup = lookup
        self._reader = reader
        self._envelope = parse_plain(codec.value_schema)
        self._value_frame = _FRAME.pack(0, codec.value_id)

    def seen(self, keys: Iterable[bytes]) -> None:
        """The snapshot wrote ``keys`` (current schema): those rows exist, never delete them."""
        for key in keys:
            self.live.discard(key[5:])

    def before_image(self, value: bytes | None, canonical: bytes) -> dict[str, Any] | None:
        """The delete's ``before``: the row as the key's latest event had it (its ``after``, read with the
        current schema: columns added since, or unchanged TOAST in that event, are null). When that event
        cannot be read (unknown schema id, not Avro), the key columns alone, as a DELETE under REPLICA
        IDENTITY DEFAULT has. None when that event is no live row after all (a delete or a truncate)."""
        if value is not None and len(value) >= 5 and value[0] == 0:
            writer = (
                self._envelope if value.startswith(self._value_frame) else self._lookup(_FRAME.unpack_from(value)[1])
            )
            if writer is not None:
                try:
                    event = _decode(value[5:], writer, self._envelope)
                except Exception:  # an unreadable event still gets deleted, by its key
                    event = None
                if event is not None:
                    if event.get("op") in ("d", "t") or event.get("after") is None:
                        return None
                    return dict(event["after"])
        names = self.codec.field_names
        row: dict[str, Any] = dict.fromkeys(names)
        key = self.canon.record(canonical)
        for key_name, index in zip(self.codec.key_field_names, self.codec.key_indexes, strict=True):
            row[names[index]] = key.get(key_name)
        return row

    def delete_event(self, before: dict[str, Any], pos: Position, now_us: int) -> bytes:
        # fastavro, not the codec's compiled writer: the before image comes from decoding and may hold
        # (name, value) union choices, which only fastavro writes back. Same bytes otherwise (_events.py).
        record = self.codec.envelope_record("d", Stamp(pos, now_us), before, None)
        return self._value_frame + _encode(self._envelope, record)

    def emit(
        self,
        *,
        produce: Callable[[str, bytes, bytes | None, int], None],
        commit: Callable[[int], None],
        consistent_lsn: int,
        batch: int,
    ) -> int:
        """Write a delete and a tombstone for every key left, ``batch`` keys per Kafka transaction, each ended
        by ``commit(n)`` (n deletes in it). Returns how many were deleted."""
        remaining = self.live.remaining()
        # The consistent point as the position: after every event the topic held (all earlier), before every
        # change the stream writes next (all later), which is where the rows' deletes belong.
        now_us = time.time_ns() // 1000
        pos = Position(consistent_lsn, consistent_lsn, now_us, None)
        topic = self.codec.topic
        deleted = 0
        pending: list[tuple[int, bytes, dict[str, Any]]] = []

        def flush() -> None:
            nonlocal deleted
            # Produced and committed together, never while the topic is being read: the first produce opens
            # the Kafka transaction, and a scan of a large topic would outlast transaction.timeout.ms, the
            # broker would abort it, and every retry would do the same.
            for partition, raw, before in pending:
                # The key bytes and partition as written, so that compaction drops the old records.
                produce(topic, raw, self.delete_event(before, pos, now_us), partition)
                produce(topic, raw, None, partition)
            deleted += len(pending)
            commit(len(pending))
            pending.clear()

        def delete(partition: int, raw: bytes, before: dict[str, Any]) -> None:
            pending.append((partition, raw, before))
            if len(pending) >= batch:
                flush()

        ranges = {p: (min(offsets), max(offsets) + 1) for p, offsets in remaining.items()}
        for partition, offset, key, value in self._reader.read(topic, ranges):
            found = remaining[partition].get(offset)
            if found is None or key != found[0]:
                continue  # not a record we are after (left in ``remaining``: deleted by its key below)
            del remaining[partition][offset]
            before = self.before_image(value, found[1])
            if before is not None:
                delete(partition, found[0], before)
        # Not read back (the topic's retention removed the record meanwhile): the stores may still hold the
        # row, so it is deleted by its key.
        for partition, records in remaining.items():
            for raw, canonical in records.values():
                delete(partition, raw, self.before_image(None, canonical) or {})
        if pending:
            flush()
        return deleted


class TopicReader:
    """A read_committed consumer over offset ranges of one topic at a time."""

    def __init__(self, conf: Mapping[str, Any], group: str) -> None:
        self._consumer = Consumer(
            {
                **conf,
                "group.id": group,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
            }
        )

    def close(self) -> None:
        self._consumer.close()

    def ends(self, topic: str) -> dict[int, tuple[int, int]]:
        """partition -> (low, high) watermarks. A just-created topic's leaders may take a moment."""
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            try:
                md = self._consumer.list_topics(topic, timeout=_TIMEOUT_S).topics[topic]
                if md.error is not None:
                    raise KafkaException(md.error)
                return {
                    p: self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=_TIMEOUT_S)
                    for p in sorted(md.partitions)
                }
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    raise _error(exc, f"reading the end offsets of topic {topic!r}") from exc
                time.sleep(0.5)

    def read(self, topic: str, ranges: Mapping[int, tuple[int, int]]) -> Iterator[Record]:
        """(partition, offset, key, value) of the committed records with start <= offset < stop, in offset
        order within each partition (the partitions interleave)."""
        todo = {p: stop for p, (start, stop) in ranges.items() if stop > start}
        if not todo:
            return
        consumer = self._consumer
        assigned = [TopicPartition(topic, p, ranges[p][0]) for p in todo]
        consumer.assign(assigned)
        consumer.resume(assigned)  # a partition paused by an earlier read of this consumer must fetch again
        progress = time.monotonic()

        def done(partition: int) -> None:
            del todo[partition]
            # Stop fetching it: the rest of that partition is not wanted, and its records would hide a stall
            # of another partition from the timer below.
            consumer.pause([TopicPartition(topic, partition)])

        try:
            while todo:
                msgs = consumer.consume(1000, 1.0)
                if not msgs:
                    if time.monotonic() - progress > _STALL_S:
                        raise TransientError(
                            f"reading topic {topic!r} before the re-snapshot: partitions {sorted(todo)} did not "
                            f"reach their end offsets in {_STALL_S:.0f} s (a transaction of another producer open?)"
                        )
                    continue
                progress = time.monotonic()
                for msg in msgs:
                    partition, offset = msg.partition(), msg.offset()
                    if partition not in todo or offset is None:
                        continue
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            raise _error(KafkaException(err), f"reading topic {topic!r}")
                        # read_committed: the end is the last stable offset, reported as this event's offset.
                        if offset >= todo[partition]:
                            done(partition)
                        continue
                    if offset >= todo[partition]:
                        done(partition)
                        continue
                    yield partition, offset, msg.key() or b"", msg.value()
                    if offset + 1 >= todo[partition]:
                        done(partition)
        except KafkaException as exc:
            raise _error(exc, f"reading topic {topic!r}") from exc
        finally:
            consumer.unassign()


def _error(exc: KafkaException, doing: str) -> Exception:
    err: KafkaError = exc.args[0]
    if err.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED):
        return KafkaSetupError(f"{doing}: not authorised by Kafka (the capture reads its topics back): {err.str()}")
    return TransientError(f"{doing}: {err.str()}")


class Reconciler:
    """What a snapshot needs to tombstone what the source lost: one consumer and the writer schemas."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._reader: TopicReader | None = None
        self._registry: SchemaRegistryClient | None = None
        self._schemas: dict[int, Any | None] = {}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    @property
    def reader(self) -> TopicReader:
        if self._reader is None:
            # The capture's own Kafka client settings (security included), as the offsets topic is read.
            self._reader = TopicReader(
                self.settings.kafka.client_conf(), f"pgcdc-resnapshot-{self.settings.source.slot}"
            )
        return self._reader

    def lookup(self, schema_id: int) -> Any | None:
        """The writer schema of ``schema_id`` (logical types stripped); None when the registry does not know it."""
        if schema_id not in self._schemas:
            if self._registry is None:
                self._registry = SchemaRegistryClient({"timeout": 30, **self.settings.registry.client_conf()})
            try:
                text = self._registry.get_schema(schema_id).schema_str
                self._schemas[schema_id] = parse_plain(text) if text else None
            except _RegistryHTTPError as exc:
                if exc.http_status_code != 404:
                    raise TransientError(f"schema registry: cannot fetch schema id {schema_id}: {exc}") from exc
                self._schemas[schema_id] = None
            except Exception as exc:  # transport errors (httpx) share no base class we can name
                raise TransientError(f"cannot reach the schema registry: {type(exc).__name__}: {exc}") from exc
        return self._schemas[schema_id]

    def prepare(self, table: str, codec: TableCodec, progress: TableProgress) -> GapDeletes | None:
        """Before ``table``'s snapshot writes: its live keys, or None when its topic held nothing before.

        ``progress`` is the table's entry in the snapshot's committed state; ``since`` (the topic's end
        offsets when this snapshot first started on the table) is added to it, committed with the first chunk.
        """
        if progress.legacy_after is not None and progress.since is None:
            # Chunks were committed by a version that kept no boundary: the topic's snapshot rows cannot be
            # told from older events, and deleting on a guess could delete rows that exist.
            log.warning("re-snapshot of %s resumed without its start offsets: deleted rows are not tombstoned", table)
            return None
        ends = self.reader.ends(codec.topic)
        if progress.since is None:
            progress.since = {p: high for p, (_, high) in ends.items()}
        since = progress.since
        # Partitions added after the boundary was taken hold only what was written after it.
        # Never past the current end: a topic recreated (or truncated by an unclean election) since the boundary
        # was taken would otherwise never reach it, and every retry would wait for it again.
        before = {p: (low, min(since.get(p, 0), high)) for p, (low, high) in ends.items()}
        if all(stop <= start for start, stop in before.values()):
            return None  # the topic held nothing before this snapshot: the common first snapshot
        started = time.monotonic()
        canon = KeyCanon(key_id=codec.key_id, key_schema=codec.key_schema, lookup=self.lookup)
        # What earlier attempts of this snapshot committed after the boundary (rows, deletes) is settled.
        after = {p: (max(low, since.get(p, 0)), high) for p, (low, high) in ends.items()}
        live = live_keys(canon, self.reader.read(codec.topic, before), self.reader.read(codec.topic, after))
        log.info(
            "re-snapshot of %s into a topic that holds data: %d live key(s) read in %.1f s; those the snapshot "
            "does not find are tombstoned",
            table,
            len(live),
            time.monotonic() - started,
        )
        return GapDeletes(codec=codec, canon=canon, live=live, lookup=self.lookup, reader=self.reader)


__all__ = ["GapDeletes", "KeyCanon", "LiveKeys", "Reconciler", "TopicReader", "live_keys", "plain_schema"]
