"""A transaction's changes as Kafka events: live from the stream, or replayed from a streamed transaction's
spill; rows encoded by the table's codec, written through the batch writer.

Insert, Update and Delete frames are encoded as they arrive, without decoding them into messages, by the
table's row encoder (cdc._encoder): one at a time (fast_change), or in runs produced from C (more_changes,
replay). A frame the C encoder refuses goes to the Python encoder (change), which takes it or says what is wrong
with it. docs/design/capture-hot-path.md says what each costs and why it is built this way."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from cdc._attach import Attached, CaptureContext
from cdc._batch import KafkaBatchWriter
from cdc._deadletter import Refused
from cdc._encoder import Encoded
from cdc._events import Position, Stamp, TableCodec
from cdc._metrics import DEAD_LETTER_OP
from cdc._replication import ReplicationConnection
from cdc._spill import SPILL_HEAD, SPILL_READ, Spill
from cdc._window import ChunkWindow
from cdc.errors import StreamError
from decoders import (
    XLOG_PAYLOAD_AT,
    Delete,
    Insert,
    LogicalMessage,
    PgOutputDecoder,
    Relation,
    StreamCommit,
    Truncate,
    Update,
    fill_unchanged_from_old,
    format_lsn,
)
from schemas import (
    avro_namespace,
    compile_writer,
    message_key_schema,
    message_value_schema,
    transaction_key_schema,
    transaction_value_schema,
)

FAST_KINDS = frozenset(b"IUD")  # Insert, Update, Delete: the frames fast_change takes (and cdc._native)
_PAYLOAD_AT = XLOG_PAYLOAD_AT
_OLD_TUPLE = frozenset(b"KO")
_NEW_TUPLE = ord("N")
_FULL_OLD_ROW = ord("O")  # an update's old row under REPLICA IDENTITY FULL
_INSERT, _DELETE = ord("I"), ord("D")
# _read_change's result: before, the old key, after, the key, the unchanged TOAST fields
_Read = tuple[bytes | None, bytes | None, bytes | None, bytes | None, list[str] | None]
_U32 = struct.Struct(">I").unpack_from
_STREAM_START = struct.Struct(">BIB")  # 'S', xid, first segment


@dataclass
class _TxMeta:
    """Transaction metadata being gathered for one PostgreSQL transaction (capture.emit_transactions)."""

    id: str
    commit_time_us: int
    total: int = 0
    per_table: dict[str, int] = field(default_factory=dict)
    begun: bool = False


class ChangeWriter:
    """Encodes the changes of the transaction being captured and writes them through the batch writer.

    Owns the codecs of the tables the stream has described (and of a streamed transaction's own schema while it
    is replayed), the transaction's metadata (capture.emit_transactions) and the live transaction's tables whose
    changes go from C."""

    def __init__(self, ctx: CaptureContext, attached: Attached, writer: KafkaBatchWriter) -> None:
        self._settings = ctx.settings
        self._metrics = ctx.metrics
        self._attached = attached
        self._writer = writer
        self._produce = writer.produce  # bound once: called for every event
        self.binary = ctx.settings.capture.binary  # the stream is in binary mode (pgoutput's binary option)
        self._codecs: dict[int, TableCodec] = {}
        self._relations: dict[int, Relation] = {}
        self._arrived: dict[int, int] = {}  # relation id -> when its Relation in _relations arrived
        self._stream_codecs: dict[int, TableCodec] = {}
        self._stream_relations: dict[int, Relation] = {}
        self._side: dict[str, tuple[str, bytes, Any, bytes, Any]] = {}
        # The transaction being captured: its position (each change passes its own LSN) and its processing time.
        self._pos = Position(0, 0, 0, None)
        self._now_us = 0
        self._stamp = Stamp(self._pos, 0)  # the two together: what every change event of the transaction says
        self.tx: _TxMeta | None = None
        # The open live transaction's tables whose Inserts and Updates go from C (more_changes), and those seen
        # once.
        self._live_targets: dict[int, Any] = {}
        self._live_seen: set[int] = set()
        # The tables (by topic) a backfill chunk is open on (cdc/_backfill.py): each change of theirs is
        # reported to the chunk's window with its transaction's xid and commit LSN, so none of theirs goes from C.
        self._watching: dict[str, list[ChunkWindow]] = {}

    def begin(self, commit_lsn: int, commit_time_us: int, xid: int | None, now_us: int) -> None:
        """A transaction begins (live, or a streamed one replayed): its changes are events of this position,
        processed at ``now_us``; a live one's tables are looked at again for changes from C."""
        self._pos = Position(commit_lsn, 0, commit_time_us, xid)
        self._now_us = now_us
        self._stamp = Stamp(self._pos, now_us)
        self._live_targets, self._live_seen = {}, set()

    def relation(self, msg: Relation, arrived: int) -> None:
        """A Relation outside a streamed transaction (``arrived``: its place among all Relations received): a
        changed one makes its table's codec again."""
        self._arrived[msg.relid] = arrived
        if self._relations.get(msg.relid) != msg:
            if msg.relid in self._relations:
                self._disturb(msg, "its table's schema changed")
            self._relations[msg.relid] = msg
            self._codecs.pop(msg.relid, None)
            self._live_targets.pop(msg.relid, None)

    def keep_relations(self, streamed: dict[int, tuple[int, Relation]]) -> None:
        """A committed streamed transaction's last Relation of each table, with when it arrived: each describes
        the table for later transactions too, unless a Relation of that table arrived after it outside."""
        for relid, (arrived, msg) in streamed.items():
            if arrived > self._arrived.get(relid, -1):
                self.relation(msg, arrived)

    def watch(self, topic: str, window: ChunkWindow) -> None:
        """Every change of the table whose topic is ``topic`` goes to ``window`` from now on (with its xid)."""
        self._watching.setdefault(topic, []).append(window)

    def unwatch(self, topic: str, window: ChunkWindow) -> None:
        windows = self._watching.get(topic, [])
        if window in windows:
            windows.remove(window)
        if not windows:
            self._watching.pop(topic, None)

    def _disturb(self, rel: Relation, why: str) -> None:
        if self._watching:
            for window in self._watching.get(self._attached.codecs.topic_of(rel.namespace, rel.name), ()):
                window.disturbed(why)

    def reset(self) -> None:
        """The stream ended: a later stream must not see this one's transaction state (fast_change and
        more_changes take a table's codec from it). The codecs of the live relations are kept."""
        self._stream_relations, self._stream_codecs = {}, {}
        self._live_targets, self._live_seen = {}, set()

    def _codec(self, relid: int) -> TableCodec:
        """The codec a change of ``relid`` is encoded with: its streamed transaction's own schema first.

        Built on the first change, not when the Relation arrives: PostgreSQL also describes relations no
        event will be written for (the leaf partitions of a table published via its root) and re-sends
        unchanged ones (after a truncate, in every streamed transaction).
        """
        for relations, codecs in ((self._stream_relations, self._stream_codecs), (self._relations, self._codecs)):
            rel = relations.get(relid)
            if rel is not None:
                codec = codecs.get(relid)
                if codec is None:
                    codec = codecs[relid] = self._attached.codecs.for_relation(rel, binary=self.binary)
                return codec
        raise StreamError(f"change for relation {relid} before its Relation message")

    def _codec_in_use(self, relid: int) -> TableCodec:
        """The codec fast_change has just encoded a change of ``relid`` with (it inlines this lookup): a streamed
        transaction's own schema while its spill is replayed, else the live one."""
        return (self._stream_codecs if relid in self._stream_relations else self._codecs)[relid]

    def more_changes(self, repl: ReplicationConnection, data: bytes) -> tuple[bytes | None, int]:
        """After a live Insert, Update or Delete the fast path took (``data``): the ones already received after
        it, produced from C (ChangeReader.live_changes) from a table's second one in the transaction on (a
        one-row transaction does not pay for a ReplayTarget). Returns (the next message, not taken, or None; the
        largest end LSN of those produced, 0 without any)."""
        relid = _U32(data, _PAYLOAD_AT + 1)[0]
        targets = self._live_targets
        if relid not in targets:
            if relid not in self._live_seen:
                self._live_seen.add(relid)
                return None, 0
            codec = self._codec_in_use(relid)
            if codec.topic in self._watching:
                return None, 0
            parts = codec.event_parts(self._pos, self._now_us)
            target = self._writer.replay_target(codec.topic, codec.native_plan, parts)
            if target is None:
                return None, 0
            targets[relid] = target
        commit_lsn = self._pos.commit_lsn
        count, end_lsn, held = repl.read_live_changes(self._writer.direct, targets, commit_lsn, SPILL_READ)
        if count:
            self._writer.produced_from_c(targets, count)
        return held, end_lsn

    def replay(self, spill: Spill, msg: StreamCommit, proto: int, now_us: int) -> None:
        """A committed streamed transaction's spilled changes, in order, into the open Kafka batch.

        Runs of Inserts, Updates and Deletes go from C (DirectProducer.replay_changes: the tuples encoded, the
        events written and produced per message, no Python per row) for every table whose first one the fast path took,
        when there is no transaction metadata to count per event; every other message takes the same way as a
        live one."""
        self._stream_relations, self._stream_codecs = {}, {}
        self.begin(msg.commit_lsn, msg.commit_time_us, msg.xid, now_us)
        try:
            self._replay_spill(spill, msg, proto)
        finally:  # its schema is the streamed transaction's own: never a later one's
            self._stream_relations, self._stream_codecs = {}, {}

    def _replay_spill(self, spill: Spill, msg: StreamCommit, proto: int) -> None:
        # The spilled messages carry an xid after their type byte, as inside a stream.
        decoder = PgOutputDecoder(proto, streaming=True)
        decoder.decode(_STREAM_START.pack(ord("S"), msg.xid, 0))
        aborted = spill.aborted_subxids
        # relation id -> cdc._native.ReplayTarget (tables without one go through fast_change)
        targets: dict[int, Any] = {}
        writer = self._writer
        from_c = self.tx is None and writer.produces_from_c
        for block in spill.blocks():
            at, size = 0, len(block)
            while at < size:
                if targets:
                    at = writer.replay_changes(block, at, targets, aborted, msg.commit_lsn)
                    if at == size:
                        break
                change_lsn, length = SPILL_HEAD.unpack_from(block, at)
                data = block[at + SPILL_HEAD.size : at + SPILL_HEAD.size + length]
                at += SPILL_HEAD.size + length
                if aborted and _U32(data, 1)[0] in aborted:
                    continue
                if data[0] in FAST_KINDS:
                    self.change(data, change_lsn, streamed=True)
                    if from_c:  # the table's next ones from C
                        relid = _U32(data, 5)[0]
                        if relid not in targets:
                            codec = self._codec_in_use(relid)
                            if codec.topic in self._watching:
                                continue
                            parts = codec.event_parts(self._pos, self._now_us)
                            target = writer.replay_target(codec.topic, codec.native_plan, parts)
                            if target is not None:
                                targets[relid] = target
                    continue
                change = decoder.decode(data)
                if isinstance(change, Relation):
                    if change != self._relations.get(change.relid):
                        self._disturb(change, "its table's schema changed")
                    self._stream_relations[change.relid] = change
                    self._stream_codecs.pop(change.relid, None)
                    targets.pop(change.relid, None)
                    continue
                self.apply(change, change_lsn)  # type: ignore[arg-type]

    def _side_event(self, name: str, schemas: tuple[dict[str, Any], dict[str, Any]], key: Any, value: Any) -> None:
        """An event on one of the side topics (<prefix>.messages, <prefix>.transaction): event streams with
        cleanup.policy=delete, registered on first use."""
        side = self._side.get(name)
        if side is None:
            topic = f"{self._settings.kafka.topic_prefix}.{name}"
            self._attached.topics.ensure(topic, policy="delete")
            frames = [
                struct.pack(">bI", 0, self._attached.registry.register(f"{topic}-{part}", schema, table=name))
                for part, schema in zip(("key", "value"), schemas, strict=True)
            ]
            side = self._side[name] = (
                topic,
                frames[0],
                compile_writer(schemas[0]),
                frames[1],
                compile_writer(schemas[1]),
            )
        topic, key_frame, write_key, value_frame, write_value = side
        key_bytes, value_bytes = bytearray(key_frame), bytearray(value_frame)
        write_key(key, key_bytes)
        write_value(value, value_bytes)
        self._produce(topic, bytes(key_bytes), bytes(value_bytes))

    def _message(self, msg: LogicalMessage, pos: Position, now_us: int) -> None:
        """A pg_logical_emit_message() message, to <prefix>.messages."""
        ns = avro_namespace(self._settings.kafka.topic_prefix, "messages")
        src = self._attached.codecs.source_info
        self._metrics.count(f"{self._settings.kafka.topic_prefix}.messages", "m")
        self._side_event(
            "messages",
            (message_key_schema(ns), message_value_schema(ns)),
            {"prefix": msg.prefix},
            {
                "op": "m",
                "ts_ms": now_us // 1000,
                "source": {
                    "version": src.version,
                    "connector": "postgresql",
                    "name": src.name,
                    "db": src.db,
                    "ts_ms": pos.commit_time_us // 1000,
                    "ts_us": pos.commit_time_us,
                    "snapshot": "false",
                    "sequence": f'["{pos.commit_lsn}","{pos.lsn}"]',
                    "schema": "",
                    "table": "",
                    "txId": pos.xid,
                    "lsn": pos.lsn,
                    "xmin": None,
                    "commit_lsn": pos.commit_lsn,
                },
                "message": {"prefix": msg.prefix, "content": bytes(msg.content), "transactional": msg.transactional},
            },
        )

    # --- transaction metadata -------------------------------------------------------------------

    def tx_begin(self, xid: int | None, commit_lsn: int, commit_time_us: int) -> None:
        self.tx = _TxMeta(f"{xid}:{commit_lsn}", commit_time_us) if self._settings.capture.emit_transactions else None

    def _tx_event(self, status: str) -> None:
        tx = self.tx
        assert tx is not None
        ns = avro_namespace(self._settings.kafka.topic_prefix, "transaction")
        end = status == "END"
        self._side_event(
            "transaction",
            (transaction_key_schema(ns), transaction_value_schema(ns)),
            {"id": tx.id},
            {
                "status": status,
                "id": tx.id,
                "event_count": tx.total if end else None,
                "data_collections": [{"data_collection": t, "event_count": n} for t, n in tx.per_table.items()]
                if end
                else None,
                "ts_ms": tx.commit_time_us // 1000,
            },
        )

    def _tx_stamp(self, codec: TableCodec) -> Stamp:
        """The transaction's stamp with the next change event's place in it (transaction metadata is on)."""
        return Stamp(self._pos, self._now_us, self._tx_block(codec))

    def _tx_block(self, codec: TableCodec) -> tuple[str, int, int] | None:
        """The next change event's place in its transaction (and the BEGIN event before the first)."""
        tx = self.tx
        if tx is None:
            return None
        if not tx.begun:
            tx.begun = True
            self._tx_event("BEGIN")
        name = f"{codec.schema}.{codec.table}"
        tx.total += 1
        tx.per_table[name] = tx.per_table.get(name, 0) + 1
        return tx.id, tx.total, tx.per_table[name]

    def tx_end(self) -> None:
        if self.tx is not None and self.tx.begun:
            self._tx_event("END")
        self.tx = None

    def fast_change(self, data: bytes, lsn: int, start: int = 0, streamed: bool = False) -> bool:
        """An Insert, Update or Delete message at ``start`` of ``data`` (live, or replayed from a streamed
        transaction's spill: ``streamed``, an xid after the type byte) straight to Kafka, as a change of the
        transaction :meth:`begin` began, by the table's row encoder.

        Returns False, having done nothing, for anything it does not take (a relation whose codec is not built
        yet, a missing key, a malformed or unconvertible frame): :meth:`change` then handles that frame.
        """
        at = start + 5 if streamed else start + 1
        if len(data) < at + 4:  # cut before its relation id: change() says what is wrong
            return False
        relid = _U32(data, at)[0]
        # A streamed transaction's own schema first (set while its spill is replayed), as in _codec.
        codec = self._stream_codecs.get(relid) if relid in self._stream_relations else self._codecs.get(relid)
        if codec is None:
            return False
        try:
            read = _read_change(codec.encoder.encode, data, start, at + 4)
        except Exception:  # malformed, unconvertible, no key: change() takes it or says why
            return False
        self._write(codec, lsn, data[start], read)
        return True

    def change(self, data: bytes, lsn: int, start: int = 0, streamed: bool = False) -> None:
        """:meth:`fast_change`, for any Insert, Update or Delete: the table's codec is built if it is not yet,
        and a change the row encoder refuses goes through the Python encoder, which takes it (the C encoder
        refuses a few rare forms) or says what is wrong with it (StreamError: the column, a missing key)."""
        if self.fast_change(data, lsn, start, streamed):  # a replayed change comes here first
            return
        at = start + 5 if streamed else start + 1
        try:
            codec = self._codec(_U32(data, at)[0])
        except (ValueError, IndexError, struct.error) as exc:  # no relation id, or a table we cannot encode
            raise StreamError(f"cannot capture the change at LSN {format_lsn(lsn)}: {exc}") from exc
        if self.fast_change(data, lsn, start, streamed):  # its codec is built now
            return
        try:
            read = _read_change(codec.python_encoder.encode_keyed, data, start, at + 4)
        except (ValueError, IndexError, struct.error) as exc:  # an unconvertible value, a missing key
            self._refuse(codec, data[start : start + 1] + data[at:] if streamed else data[start:], lsn, exc)
            return
        self._write(codec, lsn, data[start], read)

    def _refuse(self, codec: TableCodec, payload: bytes, lsn: int, exc: Exception) -> None:
        """A change no encoder takes (``payload``: its message without an xid), to capture.on_unencodable:
        a stop that names it, or its dead letter in the open batch."""
        try:
            msg = PgOutputDecoder(1).decode(payload)
        except (ValueError, IndexError, struct.error):  # malformed: the dead letter says why, without the row
            msg = None
        row = before = None
        if isinstance(msg, Insert | Update):
            row = list(zip(msg.new.kinds, msg.new.values, strict=True))
        if isinstance(msg, Update | Delete) and msg.old is not None:
            before = list(zip(msg.old.kinds, msg.old.values, strict=True))
        if isinstance(msg, Delete):
            row, before = before, None
        op = {_INSERT: "c", _DELETE: "d"}.get(payload[0], "u")
        refused = Refused(codec.described, op, lsn, self._pos.commit_lsn, exc, row, before)
        self._attached.dead_letters.refuse(
            refused, self._produce, partial(self._metrics.count, codec.topic, DEAD_LETTER_OP)
        )

    def _write(self, codec: TableCodec, lsn: int, kind: int, read: _Read) -> None:
        before, old_key, after, key, unchanged = read
        if self._watching:
            xid, commit_lsn = self._pos.xid or 0, self._pos.commit_lsn
            for window in self._watching.get(codec.topic, ()):
                for changed in (old_key, key):
                    if changed is not None:
                        window.changed(xid, commit_lsn, changed)
        if kind == _DELETE:
            self._delete(codec, lsn, old_key, before)  # type: ignore[arg-type]
        elif kind == _INSERT:
            self._insert(codec, lsn, key, after, unchanged)  # type: ignore[arg-type]
        else:
            self._update(codec, lsn, (old_key, key), before, after, unchanged=unchanged)  # type: ignore[arg-type]

    def _insert(self, codec: TableCodec, lsn: int, key: bytes, after: bytes, unchanged: list[str] | None) -> None:
        self._metrics.count(codec.topic, "c")
        stamp = self._stamp if self.tx is None else self._tx_stamp(codec)
        value = codec.envelope_bytes("c", stamp, None, after, unchanged, lsn)
        self._produce(codec.topic, key, value)

    def _update(
        self,
        codec: TableCodec,
        lsn: int,
        keys: tuple[bytes | None, bytes],
        before: bytes | None,
        after: bytes,
        *,
        unchanged: list[str] | None,
    ) -> None:
        """``keys``: the old key (None when the update has no old row) and the new one. An update that changed
        the key is a delete + tombstone of the old key and a create of the new one."""
        old_key, key = keys
        if old_key is not None and old_key != key:
            self._delete(codec, lsn, old_key, before)
            self._insert(codec, lsn, key, after, unchanged)
            return
        self._metrics.count(codec.topic, "u")
        stamp = self._stamp if self.tx is None else self._tx_stamp(codec)
        value = codec.envelope_bytes("u", stamp, before, after, unchanged, lsn)
        self._produce(codec.topic, key, value)

    def _delete(self, codec: TableCodec, lsn: int, key: bytes, before: bytes | None) -> None:
        """The delete event, then its tombstone, which lets compaction drop the key."""
        self._metrics.count(codec.topic, "d")
        stamp = self._stamp if self.tx is None else self._tx_stamp(codec)
        value = codec.envelope_bytes("d", stamp, before, None, None, lsn)
        self._produce(codec.topic, key, value)
        self._produce(codec.topic, key, None)

    def apply(self, msg: Truncate | LogicalMessage, lsn: int) -> None:
        """A truncate or a transactional logical message at ``lsn`` of the transaction :meth:`begin` began (row
        changes go through :meth:`change`)."""
        try:
            if isinstance(msg, LogicalMessage):
                self._message(msg, replace(self._pos, lsn=lsn), self._now_us)
            else:
                self._truncate(msg, lsn)
        except (ValueError, IndexError) as exc:  # an unconvertible value, a missing key: stop, ack nothing
            raise StreamError(f"cannot capture the change at LSN {format_lsn(lsn)}: {exc}") from exc

    def apply_outside(self, msg: LogicalMessage) -> None:
        """A logical message written outside any transaction: its own position and processing time."""
        now_us = time.time_ns() // 1000
        try:
            self._message(msg, Position(msg.lsn, msg.lsn, now_us, None), now_us)
        except (ValueError, IndexError) as exc:
            raise StreamError(f"cannot capture the message at LSN {format_lsn(msg.lsn)}: {exc}") from exc

    def _truncate(self, msg: Truncate, lsn: int) -> None:
        if self._watching:
            for relid in msg.relids:
                rel = self._stream_relations.get(relid) or self._relations.get(relid)
                if rel is not None:
                    self._disturb(rel, "its table was truncated")
        if not self._settings.capture.emit_truncates:
            return
        pos = replace(self._pos, lsn=lsn)
        for relid in msg.relids:
            truncated = self._codec(relid)
            self._metrics.count(truncated.topic, "t")
            value = truncated.envelope("t", Stamp(pos, self._now_us, self._tx_block(truncated)), None, None)
            # A truncate concerns every key: one marker per partition keeps it in order with each.
            for partition in range(self._attached.topics.ensure(truncated.topic)):
                self._produce(truncated.topic, truncated.truncate_key, value, partition)


def _read_change(encode: Callable[..., Encoded], data: bytes, start: int, at: int) -> _Read:
    """The rows of the Insert, Update or Delete message at ``start`` of ``data`` whose tuples begin at ``at``,
    encoded by ``encode``: (before, the old key, after, the key, the unchanged TOAST fields), the old ones None
    when the message has no old tuple, the new ones None for a Delete. Raises ValueError on anything else."""
    kind = data[start]
    before = old_key = None
    old_at = at
    if kind != _INSERT and data[at] in _OLD_TUPLE:  # Update/Delete: the old key ('K') or row ('O')
        before, old_key, _, at = encode(data, at + 1)
        if old_key is None:
            raise ValueError("the old row has no key")
    if kind == _DELETE:
        if before is None:
            raise ValueError("a Delete without its old key or row")
        after = key = unchanged = None
    else:
        if data[at] != _NEW_TUPLE:
            raise ValueError(f"the new row's marker is {data[at]:#04x}, not 'N'")
        after, key, unchanged, at = encode(data, at + 1)
        if key is None:
            raise ValueError("the new row has no key")
        if unchanged and data[old_at] == _FULL_OLD_ROW:  # the old row has the values PostgreSQL left out
            filled = fill_unchanged_from_old(data, old_at)
            if filled is not None:
                return _read_change(encode, filled, start, old_at)
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes after the change's rows")
    return before, old_key, after, key, unchanged


__all__ = ["FAST_KINDS", "ChangeWriter"]
