"""The fold: one batch of raw change records to the latest change per key, in Python, wherever the batch runs.

Every batch of every sink is folded here: on the driver (a partition sink's batch of up to
``sinks._ranges.DRIVER_RECORDS`` offsets, the warehouse's of up to :data:`DRIVER_FOLD_RECORDS`), in the one
task that takes a medium batch, or in the tasks of a larger one (sinks._write.in_tasks for the partition
sinks, sinks._frames for the warehouse and frame plugins), each over records that hold every event of their
keys: one task, a task per Kafka partition (the capture partitions by key), or a shuffle by key. Doing the fold
with fastavro, instead of as Spark expressions, leaves no plan to build on the driver, and one implementation
of the rules below serves every batch size and every sink.

The rules:

* **Decoding.** A record is Confluent-framed Avro; it is read with the schema it was written with (its id is
  one of the subject's versions, known from the registry before the batch runs) and resolved to the subject's
  latest version, so events written before an ALTER TABLE read in today's shape.
* **Poison.** A record that is not framed, names a schema id that is not a version of its subject, does not
  decode, or has a key with a null field outside a truncate comes out as a row of its own with ``op = '!'``
  and its ``error`` (it goes to the dead-letter topic); the rest of the batch goes on.
* **Last event per key** by ``(commit_lsn, lsn, offset, partition)``.
* **Truncates** (``op = 't'``, a key whose fields are all null): the table's newest truncate comes out as one
  row with ``op = 't'`` and its position, which a store applies as "remove every row older than this" after
  the batch's other writes (so whatever of the batch is older goes too).
* **Unchanged TOAST**: a partial update takes each missing column from the key's latest earlier event in the
  batch that sent it; columns still unknown stay listed in ``unchanged`` (the store keeps its value).
* **Lone tombstones**: a tombstone whose delete event is not in the batch (compacted away) is a delete
  without a position.

Values stay in raw Avro form (logical types dropped before fastavro reads them): they become documents with
``doc_converter(spark=False)``, the form `cdc verify` reads the source in, or typed Arrow columns
(sinks._delta_arrow) for Spark and Delta. ``tests/integration/test_sinks_fold.py`` runs every rule on the
driver and through the tasks of a larger batch.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sinks._values import envelope_row

ONE_TASK_RECORDS = 25_000  # offsets up to which a batch is read, folded and written by one task
# Offsets up to which a sink that writes whole folded tables on the driver (the warehouse, by delta-rs) takes a
# live batch there: its write costs the same seconds for a thousand changes as for a hundred thousand, where
# Spark's MERGE of a batch costs tens of seconds on a busy machine. The batch's records and, with history, its
# decoded events are held in memory meanwhile (tens to hundreds of MB at this size).
DRIVER_FOLD_RECORDS = 100_000
APPLY_OPS = ("c", "u", "r", "d")
TRUNCATE = "t"
POISON = "!"
KEY_UNFRAMED = "key is not Confluent-framed Avro (magic byte 0)"
VALUE_UNFRAMED = "value is not Confluent-framed Avro (magic byte 0)"
# Avro types whose values never live out of line (PostgreSQL TOASTs only variable-length values): no
# unchanged-TOAST filling is planned for them.
_FIXED_WIDTH = {"boolean", "int", "long", "float", "double"}


@dataclass(frozen=True)
class TopicSchemas:
    """What the registry holds for one topic when a batch is planned: the readers and every writer by id."""

    topic: str
    key_reader: str | None = None  # the subject's latest version; None when the subject is not registered
    value_reader: str | None = None
    key_writers: Mapping[int, str] = field(default_factory=dict)
    value_writers: Mapping[int, str] = field(default_factory=dict)

    @property
    def registered(self) -> bool:
        return self.key_reader is not None and self.value_reader is not None

    @property
    def key_schema(self) -> dict[str, Any]:
        """The key's reader schema, parsed."""
        assert self.key_reader is not None
        return dict(json.loads(self.key_reader))

    @property
    def row_schema(self) -> dict[str, Any]:
        """The row's record schema inside the envelope's reader schema."""
        assert self.value_reader is not None
        return envelope_row(json.loads(self.value_reader))


def fillable_fields(row_schema: Mapping[str, Any]) -> list[str]:
    """The row's fields whose values PostgreSQL may leave out as unchanged TOAST (variable-length ones)."""
    out = []
    for f in row_schema["fields"]:
        kinds = f["type"] if isinstance(f["type"], list) else [f["type"]]
        real = [k for k in kinds if k != "null"]
        if not (len(real) == 1 and isinstance(real[0], str) and real[0] in _FIXED_WIDTH) and not (
            len(real) == 1 and isinstance(real[0], dict) and real[0].get("type") in _FIXED_WIDTH
        ):
            out.append(f["name"])
    return out


def _plain(avro: Any) -> Any:
    """The schema without logical types: fastavro then returns the encoded values themselves."""
    if isinstance(avro, list):
        return [_plain(a) for a in avro]
    if isinstance(avro, dict):
        return {k: _plain(v) for k, v in avro.items() if k != "logicalType"}
    return avro


# Schema text -> fastavro's parse of it, in this process: a Python worker runs a sink's batches one after
# another (spark.python.worker.reuse), so its schemas are parsed once, not per batch.
_PARSED: dict[str, Any] = {}
_PARSED_MOST = 1024


def _parsed(schema: str) -> Any:
    parsed = _PARSED.get(schema)
    if parsed is None:
        import fastavro

        if len(_PARSED) >= _PARSED_MOST:  # many tables' versions over a long life: start again
            _PARSED.clear()
        parsed = _PARSED[schema] = fastavro.parse_schema(_plain(json.loads(schema)))
    return parsed


def _framed_id(data: bytes | None) -> int | None:
    """The Confluent schema id of a framed record (magic byte 0, then 4 bytes big-endian); None otherwise."""
    if data is None or len(data) < 5 or data[0] != 0:
        return None
    return int.from_bytes(data[1:5], "big")


def framed_ids(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[set[int], set[int]]]:
    """Per topic, the schema ids its records' keys and values are framed with (unframed ones left out)."""
    out: dict[str, tuple[set[int], set[int]]] = {}
    for r in records:
        keys, values = out.setdefault(r["topic"], (set(), set()))
        if (kid := _framed_id(r["key"])) is not None:
            keys.add(kid)
        if (vid := _framed_id(r["value"])) is not None:
            values.add(vid)
    return out


def knows(schemas: TopicSchemas, ids: tuple[set[int], set[int]]) -> bool:
    """Whether ``schemas`` holds every writer schema of ``ids`` (a topic's :func:`framed_ids`)."""
    return schemas.registered and ids[0] <= schemas.key_writers.keys() and ids[1] <= schemas.value_writers.keys()


_PLAIN = frozenset((int, str, bool, bytes))  # a key's values that are equal exactly where Spark groups them


class _CollectorPause:
    """How many folds in this process have the cyclic collector paused, and whether it ran before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.folds = 0
        self.was_enabled = False


_PAUSE = _CollectorPause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a batch is folded and written.

    A fold allocates a few dicts per event and keeps each key's newest: the collector, triggered by the
    allocations, walks every live one again and again, ~a fifth of a large batch's fold. Nothing a fold makes
    refers to itself, so reference counting frees it all; the collector runs again when the last fold in the
    process ends (folds on several threads of the driver share it)."""
    with _PAUSE.lock:
        if _PAUSE.folds == 0:
            _PAUSE.was_enabled = gc.isenabled()
            gc.disable()
        _PAUSE.folds += 1
    try:
        yield
    finally:
        with _PAUSE.lock:
            _PAUSE.folds -= 1
            if _PAUSE.folds == 0 and _PAUSE.was_enabled:
                gc.enable()


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a key's value, equal where Spark's grouping finds struct values equal."""
    if isinstance(value, dict):
        values = tuple(value.values())
        if all(type(v) in _PLAIN for v in values):  # most keys: ints and strings, hashable as they are
            return (tuple(value), values)
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, float):
        return ("NaN",) if math.isnan(value) else value + 0.0  # one group for NaNs, one for -0.0 and 0.0
    if isinstance(value, bytearray):
        return bytes(value)
    return value


def _position(e: Mapping[str, Any]) -> tuple[Any, ...]:
    """Spark's struct order of (commit_lsn, lsn, offset, partition): nulls first."""
    c, lsn = e["commit_lsn"], e["lsn"]
    return (c is not None, c or 0, lsn is not None, lsn or 0, e["offset"], e["partition"])


class SharedDecoding:
    """The latest decoded records of one process, for its other readers of the same records.

    On the driver of `cdc sinks run` every sink reads the same change records: search's and cache's lanes as
    they arrive, the warehouse's batches a few seconds later, the bridges of all three at a start. Decoding
    (fastavro, per record) was the largest part of the driver's work, paid once per sink; with this, the first
    reader of a record decodes it and the others take its event. An entry is only taken for the same record
    read with the same schemas: its (topic, partition, offset), its key and value bytes, and the readers it was
    resolved to, all equal. Events are shared, never changed: the fold and the writers build new rows from
    them. The oldest entries go first past ``most``; only decodes without an error are kept (an error can
    depend on the writers the registry held then).
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self._events: OrderedDict[tuple[str, int, int], tuple[Any, ...]] = OrderedDict()

    def clear(self) -> None:
        self._events.clear()

    def get(self, schemas: TopicSchemas, r: Mapping[str, Any]) -> dict[str, Any] | None:
        found = self._events.get((schemas.topic, r["partition"], r["offset"]))
        if found is None:
            return None
        key, value, key_reader, value_reader, event = found
        if key != r["key"] or value != r["value"]:
            return None
        if key_reader != schemas.key_reader or value_reader != schemas.value_reader:
            return None
        return event  # type: ignore[no-any-return]

    def put(self, schemas: TopicSchemas, r: Mapping[str, Any], event: dict[str, Any]) -> None:
        events = self._events
        events[(schemas.topic, r["partition"], r["offset"])] = (
            r["key"],
            r["value"],
            schemas.key_reader,
            schemas.value_reader,
            event,
        )
        while len(events) > self.most:
            try:  # OrderedDict's own operations are atomic: the readers' threads share it without a lock
                events.popitem(last=False)
            except KeyError:
                break


_SHARED = SharedDecoding(0)  # kept only on the driver of `cdc sinks run` (share_decoding); tasks decode their own


def share_decoding(most: int) -> None:
    """Decoded records are kept for this process's other readers, ``most`` at a time (0: none)."""
    _SHARED.most = most
    _SHARED.clear()


@dataclass
class TopicFold:
    """One topic's decode and fold, pickled to the task with the schemas the driver read from the registry."""

    schemas: TopicSchemas

    def _read(self, data: bytes, writer: str, reader: str) -> Any:
        from fastavro import schemaless_reader

        body = io.BytesIO(data)
        body.seek(5)  # past the framing, without copying the record
        # Written with the reader's own schema (most records): read without schema resolution.
        return schemaless_reader(body, _parsed(writer), None if writer == reader else _parsed(reader))

    def decode(self, r: Mapping[str, Any]) -> dict[str, Any]:
        """One raw record (topic, partition, offset, key, value) decoded: its event, or its ``error``; taken
        from another reader's decode of it when this process shares them (:func:`share_decoding`)."""
        shared = _SHARED
        if not shared.most:
            return self._decoded(r)
        event = shared.get(self.schemas, r)
        if event is None:
            event = self._decoded(r)
            if event["error"] is None:
                shared.put(self.schemas, r, event)
        return event

    def _decoded(self, r: Mapping[str, Any]) -> dict[str, Any]:
        s, topic = self.schemas, self.schemas.topic
        out: dict[str, Any] = {"partition": r["partition"], "offset": r["offset"], "tombstone": r["value"] is None}
        if s.key_reader is None or s.value_reader is None:
            return {**out, "error": f"no schema registered for {topic}"}
        kid, vid, value = _framed_id(r["key"]), _framed_id(r["value"]), r["value"]
        cheap = (
            KEY_UNFRAMED
            if kid is None
            else (f"key schema id {kid} is not a version of {topic}-key" if kid not in s.key_writers else None)
        )
        if cheap is None and value is not None:
            if vid is None:
                cheap = VALUE_UNFRAMED
            elif vid not in s.value_writers:
                cheap = f"value schema id {vid} is not a version of {topic}-value"
        if cheap is not None:
            return {**out, "error": cheap}
        try:  # PERMISSIVE, as from_avro: a record that does not decode is poison
            k = self._read(r["key"], s.key_writers[kid], s.key_reader)  # type: ignore[index]
            v = None if value is None else self._read(value, s.value_writers[vid], s.value_reader)  # type: ignore[index]
        except Exception:
            k = v = None
        op = None if v is None else v.get("op")
        holed = isinstance(k, dict) and any(x is None for x in k.values())
        broken = not isinstance(k, dict) or (value is not None and op is None)
        if broken or (holed and (value is None or op != TRUNCATE)):
            return {**out, "error": f"Avro decoding failed with the writer schema ids key {kid} / value {vid}"}
        source = (v or {}).get("source") or {}
        return {
            **out,
            "key": k,
            "row": None if v is None else v.get("after"),
            "op": op,
            "commit_lsn": source.get("commit_lsn"),
            "lsn": source.get("lsn"),
            "ts_ms": source.get("ts_ms"),
            "unchanged": list((v or {}).get("unchanged_toast") or ()),
            "error": None,
        }

    def fold(self, records: Iterable[Mapping[str, Any]]) -> Folded:
        """The topic's records of the batch (all of them: the fold is exact only over the whole batch)."""
        folding = Folding(self)
        for r in records:
            folding.add(r)
        return folding.finish()


class Folding:
    """One topic's fold under way: records are added one at a time and only each key's state is kept (its
    latest change, the newest value of each column an unchanged-TOAST event may need, its truncate, its
    tombstone), so memory grows with the batch's keys, not with its events or their raw bytes."""

    def __init__(self, fold: TopicFold, *, events: bool = False) -> None:
        """``events``: also keep every decoded change event (c, u, r, d) in :attr:`events`, for histories."""
        self.fold = fold
        self.out = Folded(fold.schemas.topic)
        self.events: list[dict[str, Any]] | None = [] if events else None
        self._keys: dict[Any, _KeyState] = {}
        self._fill: frozenset[str] | None = None

    def add(self, record: Mapping[str, Any]) -> None:
        e = self.fold.decode(record)
        out = self.out
        out.records += 1
        if e["error"] is not None:
            out.rows.append(_row(out.topic, e, POISON, error=e["error"]))
            return
        if e["ts_ms"] is not None:
            out.newest_ts_ms = max(out.newest_ts_ms or 0, int(e["ts_ms"]))
        if self.events is not None and not e["tombstone"] and e["op"] in APPLY_OPS:
            self.events.append(e)
        if self._fill is None:
            self._fill = frozenset(fillable_fields(self.fold.schemas.row_schema))
        frozen = _freeze(e["key"])
        state = self._keys.get(frozen)
        if state is None:
            state = self._keys[frozen] = _KeyState()
        state.add(e, self._fill)

    def finish(self) -> Folded:
        for state in self._keys.values():
            row = state.folded(self.out.topic)
            if row is not None:
                self.out.rows.append(row)
        self._keys.clear()
        return self.out


@dataclass
class _KeyState:
    """What the fold keeps of one key's events in a batch."""

    last: dict[str, Any] | None = None  # the newest change (c, u, r, d) by position
    known: dict[str, tuple[tuple[Any, ...], Any]] = field(default_factory=dict)  # column -> (position, value)
    truncate: dict[str, Any] | None = None  # the newest truncate (only a truncate's key has null fields)
    tombstone: dict[str, Any] | None = None  # the newest tombstone by offset

    def add(self, e: dict[str, Any], fill: frozenset[str]) -> None:
        if e["tombstone"]:
            if self.tombstone is None or (e["offset"], e["partition"]) > (
                self.tombstone["offset"],
                self.tombstone["partition"],
            ):
                self.tombstone = e
            return
        position = _position(e)
        if e["op"] == TRUNCATE:
            if self.truncate is None or position > _position(self.truncate):
                self.truncate = e
            return
        if e["op"] not in APPLY_OPS:
            return
        if self.last is None or position > _position(self.last):
            self.last = e
        if e["op"] != "d" and e["row"] is not None:  # what a later partial update of the key may take
            sent = [name for name in fill if name not in e["unchanged"]]
            for name in sent:
                had = self.known.get(name)
                if had is None or position > had[0]:
                    self.known[name] = (position, e["row"].get(name))

    def folded(self, topic: str) -> dict[str, Any] | None:
        """The key's row: its latest change (TOAST filled), else the table's truncate, else a lone tombstone."""
        last = self.last
        if last is not None:
            row, still = last["row"], last["unchanged"]
            if still:
                row = dict(row or {})
                still = []
                for name in last["unchanged"]:
                    if name in self.known:
                        row[name] = self.known[name][1]
                    else:
                        still.append(name)
            return _row(
                topic,
                last,
                last["op"],
                key=last["key"],
                row=None if last["op"] == "d" else row,
                commit_lsn=last["commit_lsn"],
                lsn=last["lsn"],
                ts_ms=last["ts_ms"],
                unchanged=still,
            )
        if self.truncate is not None:
            t = self.truncate
            return _row(topic, t, TRUNCATE, key=t["key"], commit_lsn=t["commit_lsn"], lsn=t["lsn"], ts_ms=t["ts_ms"])
        if self.tombstone is not None:
            return _row(topic, self.tombstone, "d", key=self.tombstone["key"])
        return None


@dataclass
class Folded:
    """A topic's folded batch: its rows (raw Avro values; ``op`` '!' for poison, 't' for the truncate) and its
    marks: records read, the newest commit time."""

    topic: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    records: int = 0
    newest_ts_ms: int | None = None


def _row(topic: str, e: Mapping[str, Any], op: str, **values: Any) -> dict[str, Any]:
    base = dict.fromkeys(("key", "row", "commit_lsn", "lsn", "ts_ms", "error"))
    return {
        **base,
        "topic": topic,
        "partition": e["partition"],
        "offset": e["offset"],
        "op": op,
        "unchanged": [],
        **values,
    }
