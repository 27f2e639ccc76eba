"""The fold (sinks._fold): decode, last event per key, truncates, unchanged TOAST, tombstones and poison, run
as a small batch runs it (one pass in Python) and as a larger one does, on a real local Spark (in tasks, the
records shuffled by key, the rows handed back as typed Spark frames: sinks._frames).

Real envelopes and keys are written by the capture's own code (TableCodec over schemas.envelope_schema and
key_schema), Confluent-framed with the ids a small in-memory registry gives them, and fed to the fold as the
raw Kafka records (topic, partition, offset, key, value) Spark's Kafka source gives. The registry is a fake
with the two calls the Decoder makes; Spark is real. A batch's truncate is applied by the writers after its other
changes, so the changes listed here are what the store keeps: those older than the truncate are gone.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pgcdc_dev.codecs import make_codec

from cdc.encoding import Position, SourceInfo, Stamp, TableCodec
from decoders import TupleData
from schemas import PgType
from sinks._api import Change, ChangeMaker
from sinks._fold import KEY_UNFRAMED, VALUE_UNFRAMED, TopicFold, TopicSchemas
from sinks._reader import Decoder
from sinks._values import Names, doc_converter, envelope_row
from sinks.config import SinkSettings
from tests.integration._sinks_helpers import SPARK_WORKER

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.slow, SPARK_WORKER]

PREFIX = "p"
TOPIC = "p.public.t"
NOW_US = 1_800_000_000_000_000

INT4 = PgType(23, "int4")
TEXT = PgType(25, "text")
NUMERIC = PgType(1700, "numeric")
TSTZ = PgType(1184, "timestamptz")
BYTEA = PgType(17, "bytea")
JSONB = PgType(3802, "jsonb")
FLOAT8 = PgType(701, "float8")
BOOL = PgType(16, "bool")
TIME = PgType(1083, "time")

_SESSION: list[SparkSession] = []


@pytest.fixture(autouse=True, params=["tasks", "one"])
def _spark(spark: SparkSession, request: pytest.FixtureRequest) -> None:
    """The run's SparkSession and the path under test (a larger batch's tasks, or a small batch's one pass),
    for the harness below (hypothesis' tests take no function fixtures)."""
    _SESSION[:] = [spark]
    _PATH[:] = [request.param]


# --- a registry, the batch's planning and fold ----------------------------------------------------------


@dataclass
class _Schema:
    schema_str: str


@dataclass
class _Registered:
    schema_id: int
    schema: _Schema


@dataclass
class FakeRegistry:
    """What Decoder calls of SchemaRegistryClient: get_versions(subject) and get_version(subject, version).

    ``register`` is what the capture's TableCodec is given: one id per distinct schema text (the registry's
    rule), versions appended to the subject.
    """

    ids: dict[str, int] = field(default_factory=dict)
    subjects: dict[str, list[int]] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True)  # as cdc._kafka registers them
        schema_id = self.ids.setdefault(text, len(self.ids) + 1)
        versions = self.subjects.setdefault(subject, [])
        if schema_id not in versions:
            versions.append(schema_id)
        return schema_id

    def _text(self, schema_id: int) -> str:
        return next(text for text, i in self.ids.items() if i == schema_id)

    def get_versions(self, subject: str) -> list[int]:
        self.calls.append(("get_versions", subject))
        if not self.subjects.get(subject):
            raise SchemaRegistryError(404, 40401, f"Subject '{subject}' not found")
        return list(range(1, len(self.subjects[subject]) + 1))

    def get_version(self, subject: str, version: int) -> _Registered:
        self.calls.append(("get_version", (subject, version)))
        schema_id = self.subjects[subject][version - 1]
        return _Registered(schema_id, _Schema(self._text(schema_id)))


@dataclass
class Table:
    topic: str
    name: str
    key_schema: dict[str, Any]
    row_schema: dict[str, Any]
    truncate: tuple[int, int] | None
    changes: list[Change]


@dataclass
class Decoded:
    tables: list[Table]
    poison: list[tuple[Any, ...]]  # (topic, partition, offset, key, value, error), by (topic, partition, offset)
    records: int
    newest_ts_ms: int | None


def _local(registry: FakeRegistry) -> Decoder:
    decoder = Decoder(SinkSettings(kafka={"topic_prefix": PREFIX}))  # type: ignore[arg-type]
    decoder._client = registry  # type: ignore[assignment]  # constructing the real client opens no connection
    return decoder


def _decode(decoder: Decoder, rows: list[dict[str, Any]]) -> Decoded:
    """One batch through the runtime's planning and the fold under test; the folded rows collected."""
    by_place = {(r["topic"], r["partition"], r["offset"]): r for r in rows}
    out = _FOLDS[_PATH[0]](decoder, rows)
    tables, poison, records, newest = [], [], 0, None
    for topic, name, schemas, folded, (n, ts) in out:
        records += n
        if ts is not None:
            newest = max(newest or 0, ts)
        for r in folded:
            if r["op"] == "!":
                raw_row = by_place[(r["topic"], r["partition"], r["offset"])]
                poison.append((r["topic"], r["partition"], r["offset"], raw_row["key"], raw_row["value"], r["error"]))
        if not schemas.registered:
            continue
        key_schema, row_schema = schemas.key_schema, schemas.row_schema
        make = ChangeMaker(key_schema, row_schema, spark=_PATH[0] == "tasks")
        truncates = [(r["commit_lsn"], r["lsn"]) for r in folded if r["op"] == "t"]
        changes = sorted((make(r) for r in folded if r["op"] not in ("!", "t")), key=lambda c: (c.partition, c.offset))
        if truncates:
            # The writers apply the truncate after the batch's other writes: what it makes of the older ones.
            changes = [c for c in changes if c.position is None or c.position > truncates[0]]
        if changes or truncates:
            tables.append(Table(topic, name, key_schema, row_schema, truncates[0] if truncates else None, changes))
    return Decoded(tables, sorted(poison, key=lambda p: p[:3]), records, newest)


_Folded = list[tuple[str, str, TopicSchemas, list[dict[str, Any]], tuple[int, int | None]]]


def _tasks_fold(decoder: Decoder, rows: list[dict[str, Any]]) -> _Folded:
    """sinks._frames as a larger batch runs it: folded in two Spark tasks (the records shuffled by key), the
    marks collected, the rows as a frame sink's typed frame, projected as a writer reads it."""
    from sinks._api import projected
    from sinks._frames import folded_frames, table_frame

    spark = _SESSION[0]
    raw = spark.createDataFrame(
        [(r["topic"], r["partition"], r["offset"], r["key"], r["value"]) for r in rows],
        "topic string, partition int, offset long, key binary, value binary",
    )
    folds = [TopicFold(decoder.schemas(topic)) for topic in sorted({r["topic"] for r in rows})]
    layout, out = folded_frames(folds, raw, 2, events=False)
    out = out.cache()
    marks = [m.asDict() for m in out.filter("kind NOT IN ('row', 'event')").collect()]
    result: _Folded = []
    for fold in folds:
        s = fold.schemas
        mine = [m for m in marks if m["topic"] == s.topic]
        seen = [m for m in mine if m["kind"] == "seen"]
        stamps = [m["ts_ms"] for m in seen if m["ts_ms"] is not None]
        folded = [{**m, "op": "!"} for m in mine if m["kind"] == "rejected"]
        truncates = [m for m in mine if m["kind"] == "truncate"]
        if truncates:  # each task's newest: the table's is the newest of them
            folded.append({**max(truncates, key=lambda m: (m["commit_lsn"], m["lsn"])), "op": "t"})
        if s.registered:
            frame = projected(table_frame(out, layout, s.topic, "row", None), s.key_schema, s.row_schema)
            folded += frame.toArrow().to_pylist()
        counts = (sum(m["offset"] for m in seen), max(stamps) if stamps else None)
        result.append((s.topic, decoder.settings.table_name(s.topic), s, folded, counts))
    out.unpersist()
    return result


def _task_fold(decoder: Decoder, rows: list[dict[str, Any]]) -> _Folded:
    """sinks._fold as the one task of a small batch runs it (the records in the order Kafka gives them)."""
    out: _Folded = []
    for topic in sorted({r["topic"] for r in rows}):
        fold = TopicFold(decoder.schemas(topic))
        folded = fold.fold(r for r in rows if r["topic"] == topic)
        name = decoder.settings.table_name(topic)
        out.append((topic, name, fold.schemas, folded.rows, (folded.records, folded.newest_ts_ms)))
    return out


_FOLDS = {"tasks": _tasks_fold, "one": _task_fold}
_PATH = ["tasks"]


def _poison(decoded: Decoded) -> list[tuple[Any, ...]]:
    return decoded.poison


def _table(decoded: Decoded, topic: str = TOPIC) -> Table:
    (table,) = [t for t in decoded.tables if t.topic == topic]
    return table


def _changes(decoded: Decoded, topic: str = TOPIC) -> list[Change]:
    return _table(decoded, topic).changes


KEY_998 = f"key schema id 998 is not a version of {TOPIC}-key"
VALUE_999 = f"value schema id 999 is not a version of {TOPIC}-value"


# --- the capture's side ------------------------------------------------------------------------------


Column = tuple[str, PgType, int]
COLUMNS: list[Column] = [
    ("id", INT4, -1),
    ("big doc", TEXT, -1),  # sanitised to big_doc in Avro; documents use the column name
    ("amount", NUMERIC, (10 << 16 | 2) + 4),
    ("at", TSTZ, -1),
    ("raw", BYTEA, -1),
    ("doc", JSONB, -1),
    ("f", FLOAT8, -1),
    ("ok", BOOL, -1),
]


def _codec(
    registry: FakeRegistry, columns: list[Column] = COLUMNS, *, topic: str = TOPIC, key: tuple[str, ...] = ("id",)
) -> TableCodec:
    return make_codec(columns, topic=topic, key=key, source=SourceInfo("1.0", PREFIX, "db"), register=registry.register)


def _row(codec: TableCodec, **text: str | None) -> tuple[dict[str, Any], list[str]]:
    """A row as the capture makes it from pgoutput's text form; a value ``"<u>"`` is unchanged TOAST."""
    kinds = bytearray()
    values: list[bytes | None] = []
    names = [c.name for c in codec.columns]
    for name in names:
        value = text.get(name.replace(" ", "_"))
        if value == "<u>":
            kinds.append(ord("u"))
            values.append(None)
        elif value is None:
            kinds.append(ord("n"))
            values.append(None)
        else:
            kinds.append(ord("t"))
            values.append(value.encode())
    return codec.row(TupleData(bytes(kinds), tuple(values)))


def _event(
    codec: TableCodec, op: str, row: dict[str, Any], commit_lsn: int, lsn: int, *, unchanged: list[str] | None = None
) -> tuple[bytes, bytes]:
    """The framed key and envelope the capture produces for a change of ``row``."""
    pos = Position(commit_lsn=commit_lsn, lsn=lsn, commit_time_us=commit_lsn * 1000 + 7, xid=42)
    before, after = (row, None) if op == "d" else (None, row)
    value = codec.envelope(op, Stamp(pos, NOW_US), before, after, unchanged)
    return codec.key_of(row), value


def _truncate(codec: TableCodec, commit_lsn: int, lsn: int) -> tuple[bytes, bytes]:
    pos = Position(commit_lsn=commit_lsn, lsn=lsn, commit_time_us=commit_lsn * 1000 + 7, xid=43)
    return codec.truncate_key, codec.envelope("t", Stamp(pos, NOW_US), None, None)


def _raw(
    offset: int, key: bytes | None, value: bytes | None, *, partition: int = 0, topic: str = TOPIC
) -> dict[str, Any]:
    return {"topic": topic, "partition": partition, "offset": offset, "key": key, "value": value}


def _doc(codec: TableCodec, row: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = doc_converter(codec.value_schema["fields"][0]["type"][1], Names(), spark=False)(row)
    return converted


# --- decoding ------------------------------------------------------------------------------------------


def test_decoded_rows_equal_the_source_values() -> None:
    registry = FakeRegistry()
    codec = _codec(registry)
    full, _ = _row(
        codec,
        id="1",
        big_doc="héllo",
        amount="12.34",
        at="2024-01-01 00:00:00.5+00",
        raw="\\x00ff",
        doc='{"a": [1, 2.5, null]}',
        f="-0.5",
        ok="t",
    )
    sparse, _ = _row(codec, id="2", f="NaN", ok="f")
    rows = [_raw(10, *_event(codec, "c", full, 100, 90)), _raw(11, *_event(codec, "r", sparse, 100, 95))]
    decoded = _decode(_local(registry), rows)
    assert decoded.poison == []
    assert decoded.records == 2
    assert decoded.newest_ts_ms == 100  # commit_time_us // 1000
    table = _table(decoded)
    assert (table.name, table.truncate) == ("public.t", None)
    assert table.row_schema == envelope_row(codec.value_schema)
    assert table.key_schema == codec.key_schema
    first, second = _changes(decoded)
    assert first == Change(
        key={"id": 1},
        row={
            "id": 1,
            "big doc": "héllo",
            "amount": "12.34",
            "at": "2024-01-01T00:00:00.500000Z",
            "raw": "AP8=",
            "doc": '{"a": [1, 2.5, null]}',  # jsonb: its text form
            "f": -0.5,
            "ok": True,
        },
        op="c",
        commit_lsn=100,
        lsn=90,
        ts_ms=100,
        unchanged=(),
        partition=0,
        offset=10,
    )
    assert second.row == {
        "id": 2,
        "big doc": None,
        "amount": None,
        "at": None,
        "raw": None,
        "doc": None,
        "f": "NaN",
        "ok": False,
    }
    assert (second.op, second.position, second.offset) == ("r", (100, 95), 11)


def test_a_time_of_day_is_read_as_its_microseconds() -> None:
    """Spark would read Avro's time-micros as its TIME type, which the fold's aggregation refuses."""
    registry = FakeRegistry()
    codec = _codec(registry, [("id", INT4, -1), ("t", TIME, -1)])
    noon, _ = _row(codec, id="1", t="12:34:56.789")
    midnight, _ = _row(codec, id="2", t="24:00:00")
    rows = [_raw(0, *_event(codec, "c", noon, 5, 4)), _raw(1, *_event(codec, "c", midnight, 5, 5))]
    assert [c.row for c in _changes(_decode(_local(registry), rows))] == [
        {"id": 1, "t": "12:34:56.789000"},
        {"id": 2, "t": "24:00:00.000000"},
    ]


_texts = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)


# Each example runs Spark jobs (about a second): fewer examples than a pure-Python property test would get.
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ident=st.integers(-(2**31), 2**31 - 1),
    big=st.none() | _texts,
    amount=st.none() | st.decimals(min_value=-(10**7), max_value=10**7, places=2).map(str),
    at=st.none() | st.integers(-(10**15), 10**15),
    raw=st.none() | st.binary(max_size=10),
    f=st.none() | st.floats(allow_nan=False),
    ok=st.none() | st.booleans(),
)
def test_decoded_rows_equal_the_source_values_property(
    *,
    ident: int,
    big: str | None,
    amount: str | None,
    at: int | None,
    raw: bytes | None,
    f: float | None,
    ok: bool | None,
) -> None:
    """Whatever the row, the document is the source row's document form (what `cdc verify` compares)."""
    registry = FakeRegistry()
    codec = _codec(registry)
    row, _ = _row(
        codec,
        id=str(ident),
        big_doc=big,
        amount=amount,
        raw=None if raw is None else "\\x" + raw.hex(),
        f=None if f is None else repr(f),
        ok=None if ok is None else "tf"[not ok],
    )
    row["at"] = at  # timestamptz as the capture's binary reader gives it: microseconds since the Unix epoch
    (change,) = _changes(_decode(_local(registry), [_raw(0, *_event(codec, "u", row, 5, 4))]))
    assert change.key == {"id": ident}
    assert change.row == _doc(codec, row)
    assert change.row is not None
    assert change.row["big doc"] == big
    assert change.row["amount"] == (None if amount is None else str(Decimal(amount).quantize(Decimal("0.01"))))
    assert change.row["ok"] == ok


def test_several_topics_are_several_tables_in_topic_order() -> None:
    registry = FakeRegistry()
    columns: list[Column] = [("id", INT4, -1), ("name", TEXT, -1)]
    b, a = _codec(registry, columns, topic="p.public.b"), _codec(registry, columns, topic="p.public.a")
    rows = [
        _raw(0, *_event(b, "c", _row(b, id="1", name="b")[0], 10, 1), topic="p.public.b"),
        _raw(0, *_event(a, "c", _row(a, id="1", name="a")[0], 11, 1), topic="p.public.a"),
    ]
    decoded = _decode(_local(registry), rows)
    assert [(t.topic, t.name) for t in decoded.tables] == [("p.public.a", "public.a"), ("p.public.b", "public.b")]
    assert [c.row for c in _changes(decoded, "p.public.a")] == [{"id": 1, "name": "a"}]
    assert [c.row for c in _changes(decoded, "p.public.b")] == [{"id": 1, "name": "b"}]


# --- the newest event per key ----------------------------------------------------------------------

NAMED: list[Column] = [("id", INT4, -1), ("name", TEXT, -1)]


def test_only_the_newest_event_per_key_survives() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)

    def ev(offset: int, ident: int, name: str, commit_lsn: int, lsn: int, *, op: str = "u") -> dict[str, Any]:
        row, _ = _row(codec, id=str(ident), name=name)
        return _raw(offset, *_event(codec, op, row, commit_lsn, lsn))

    rows = [
        # key 1: offsets out of position order; the newest position is at the lowest offset
        ev(7, 1, "newest", 300, 5),
        ev(8, 1, "older", 200, 9),
        ev(9, 1, "oldest", 100, 1, op="c"),
        # key 2: same commit, the higher lsn wins over the higher offset
        ev(10, 2, "lsn 7", 400, 7),
        ev(11, 2, "lsn 6", 400, 6),
        # key 3: same commit and lsn (a replayed write): the higher offset wins
        ev(12, 3, "first copy", 500, 1),
        ev(13, 3, "second copy", 500, 1),
    ]
    changes = _changes(_decode(_local(registry), rows))
    assert [(c.key["id"], c.row and c.row["name"], c.position, c.offset) for c in changes] == [
        (1, "newest", (300, 5), 7),
        (2, "lsn 7", (400, 7), 10),
        (3, "second copy", (500, 1), 13),
    ]


@st.composite
def _histories(draw: st.DrawFn) -> list[tuple[int, str, int, int]]:
    """Events (key, op, commit_lsn, lsn) in some offset order: positions collide on purpose."""
    return draw(
        st.lists(
            st.tuples(st.integers(1, 4), st.sampled_from("cud"), st.integers(1, 5), st.integers(1, 3)),
            min_size=1,
            max_size=25,
        )
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_histories(), st.randoms(use_true_random=False), st.booleans())
def test_the_newest_by_commit_lsn_lsn_offset_survives_property(
    history: list[tuple[int, str, int, int]], rng: Any, tombstones: bool
) -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    offsets = list(range(100, 100 + len(history)))
    rng.shuffle(offsets)  # the offset order need not be the position order
    rows, events = [], []
    for (ident, op, commit_lsn, lsn), offset in zip(history, offsets, strict=True):
        row, _ = _row(codec, id=str(ident), name=f"{ident}@{offset}")
        key, value = _event(codec, op, row, commit_lsn, lsn)
        rows.append(_raw(offset, key, value))
        events.append((ident, op, commit_lsn, lsn, offset))
        if tombstones and op == "d":
            rows.append(_raw(offset + 1000, key, None))  # its tombstone: nothing new
    rows.sort(key=lambda r: r["offset"])
    expected: dict[int, tuple[int, str, int, int, int]] = {}
    for ident, op, commit_lsn, lsn, offset in events:
        best = expected.get(ident)
        if best is None or (commit_lsn, lsn, offset) > best[2:]:
            expected[ident] = (ident, op, commit_lsn, lsn, offset)
    got = {
        c.key["id"]: (c.key["id"], c.op, c.commit_lsn, c.lsn, c.offset)
        for c in _changes(_decode(_local(registry), rows))
    }
    assert got == expected
    for c in _changes(_decode(_local(registry), rows)):
        assert c.row == (None if c.op == "d" else {"id": c.key["id"], "name": f"{c.key['id']}@{c.offset}"})


def test_keys_group_as_spark_groups_them() -> None:
    """-0.0 and 0.0 are one key, as are NaN and NaN, as Spark's grouping normalises them; composite keys work."""
    registry = FakeRegistry()
    codec = _codec(registry, [("f", FLOAT8, -1), ("name", TEXT, -1), ("v", INT4, -1)], key=("f", "name"))
    rows = []
    for offset, (f, name, v, commit_lsn) in enumerate(
        [
            ("0.0", "a", "1", 10),
            ("-0.0", "a", "2", 20),
            ("NaN", "a", "3", 30),
            ("NaN", "a", "4", 40),
            ("0", "b", "5", 5),
        ]
    ):
        row, _ = _row(codec, f=f, name=name, v=v)
        rows.append(_raw(offset, *_event(codec, "u", row, commit_lsn, 1)))
    changes = _changes(_decode(_local(registry), rows))
    assert [(c.row and c.row["v"], c.offset) for c in changes] == [(2, 1), (4, 3), (5, 4)]
    assert [c.key for c in changes] == [{"f": -0.0, "name": "a"}, {"f": "NaN", "name": "a"}, {"f": 0.0, "name": "b"}]


# --- deletes and tombstones ----------------------------------------------------------------------------


def test_delete_then_tombstone_is_the_delete() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    row, _ = _row(codec, id="1", name="gone")
    key, insert = _event(codec, "c", row, 10, 1)
    _, delete = _event(codec, "d", row, 20, 2)
    rows = [_raw(0, key, insert), _raw(1, key, delete), _raw(2, key, None)]
    assert _changes(_decode(_local(registry), rows)) == [Change({"id": 1}, None, "d", 20, 2, 20, (), 0, 1)]


def test_a_lone_tombstone_is_a_delete_without_a_position() -> None:
    """Its delete event was compacted away: the newest tombstone of the key, by offset."""
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    other, _ = _row(codec, id="2", name="kept")
    key1 = _event(codec, "c", _row(codec, id="1", name="x")[0], 1, 1)[0]
    rows = [
        _raw(5, key1, None, partition=1),
        _raw(9, key1, None, partition=1),
        _raw(3, *_event(codec, "c", other, 30, 3)),
    ]
    decoded = _decode(_local(registry), rows)
    assert decoded.poison == []
    assert decoded.newest_ts_ms == 30
    assert _changes(decoded) == [
        Change({"id": 2}, {"id": 2, "name": "kept"}, "c", 30, 3, 30, (), 0, 3),
        Change({"id": 1}, None, "d", None, None, None, (), 1, 9),
    ]


def test_a_tombstone_followed_by_a_new_row_of_the_key_is_the_new_row() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    row, _ = _row(codec, id="1", name="again")
    key, insert = _event(codec, "c", row, 50, 1)
    changes = _changes(_decode(_local(registry), [_raw(0, key, None), _raw(1, key, insert)]))
    assert [(c.op, c.row, c.offset) for c in changes] == [("c", {"id": 1, "name": "again"}, 1)]


def test_a_tombstone_in_a_batch_of_unframed_values_is_still_a_tombstone() -> None:
    """Null values have no schema id: among unframed ones, only those go to the dead letters."""
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    key = _event(codec, "c", _row(codec, id="1", name="x")[0], 1, 1)[0]
    decoded = _decode(_local(registry), [_raw(0, key, None), _raw(1, key, b"{json}")])
    assert _poison(decoded) == [(TOPIC, 0, 1, key, b"{json}", VALUE_UNFRAMED)]
    assert _changes(decoded) == [Change({"id": 1}, None, "d", None, None, None, (), 0, 0)]


# --- unchanged TOAST ------------------------------------------------------------------------------


TOASTY: list[Column] = [("id", INT4, -1), ("big doc", TEXT, -1), ("n", INT4, -1)]


def test_unchanged_toast_is_filled_from_the_keys_earlier_event_in_the_batch() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, TOASTY)
    insert, _ = _row(codec, id="1", big_doc="large v1", n="1")
    update, _ = _row(codec, id="1", big_doc="large v2", n="2")
    partial, unchanged = _row(codec, id="1", big_doc="<u>", n="3")
    assert unchanged == ["big_doc"]
    rows = [
        _raw(0, *_event(codec, "c", insert, 10, 1)),
        # offsets out of position order: the partial update is the newest by position
        _raw(1, *_event(codec, "u", partial, 30, 1, unchanged=unchanged)),
        _raw(2, *_event(codec, "u", update, 20, 1)),
    ]
    (change,) = _changes(_decode(_local(registry), rows))
    assert change.row == {"id": 1, "big doc": "large v2", "n": 3}
    assert (change.unchanged, change.position, change.offset) == ((), (30, 1), 1)


def test_unchanged_toast_unknown_in_the_batch_stays_listed_by_column_name() -> None:
    """The store keeps what it holds: the field is null and named (as a PostgreSQL column) in ``unchanged``."""
    registry = FakeRegistry()
    codec = _codec(registry, TOASTY)
    partial, unchanged = _row(codec, id="1", big_doc="<u>", n="3")
    other, _ = _row(codec, id="2", big_doc="mine", n="4")
    rows = [
        _raw(0, *_event(codec, "c", other, 5, 1)),
        _raw(1, *_event(codec, "u", partial, 10, 1, unchanged=unchanged)),
    ]
    changes = _changes(_decode(_local(registry), rows))
    assert [(c.row, c.unchanged) for c in changes] == [
        ({"id": 2, "big doc": "mine", "n": 4}, ()),  # another key's value is not this key's
        ({"id": 1, "big doc": None, "n": 3}, ("big doc",)),
    ]


def test_a_null_sent_earlier_is_a_known_value() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, TOASTY)
    insert, _ = _row(codec, id="1", big_doc=None, n="1")
    partial, unchanged = _row(codec, id="1", big_doc="<u>", n="2")
    rows = [
        _raw(0, *_event(codec, "c", insert, 10, 1)),
        _raw(1, *_event(codec, "u", partial, 20, 1, unchanged=unchanged)),
    ]
    (change,) = _changes(_decode(_local(registry), rows))
    assert (change.row, change.unchanged) == ({"id": 1, "big doc": None, "n": 2}, ())


def test_filling_follows_positions_not_offsets() -> None:
    """The full row is at a later offset but an earlier position (commit 10 < 20): it fills the partial update."""
    registry = FakeRegistry()
    codec = _codec(registry, TOASTY)
    partial, unchanged = _row(codec, id="1", big_doc="<u>", n="9")
    full, _ = _row(codec, id="1", big_doc="old", n="1")
    rows = [
        _raw(0, *_event(codec, "u", partial, 20, 1, unchanged=unchanged)),
        _raw(1, *_event(codec, "c", full, 10, 1)),
    ]
    (change,) = _changes(_decode(_local(registry), rows))
    assert (change.row, change.unchanged, change.offset) == ({"id": 1, "big doc": "old", "n": 9}, (), 0)


# --- truncates ---------------------------------------------------------------------------------------------


def test_a_truncate_drops_the_older_events_and_is_reported() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)

    def ev(offset: int, ident: int, commit_lsn: int, lsn: int, partition: int = 0) -> dict[str, Any]:
        row, _ = _row(codec, id=str(ident), name=str(ident))
        return _raw(offset, *_event(codec, "c", row, commit_lsn, lsn), partition=partition)

    rows = [
        ev(0, 1, 100, 1),  # before the truncate: gone
        ev(1, 4, 200, 4),  # the truncate's transaction, earlier: gone
        _raw(2, *_truncate(codec, 200, 5)),
        _raw(0, *_truncate(codec, 200, 5), partition=1),  # one marker per partition
        _raw(1, *_truncate(codec, 150, 1), partition=1),  # an older truncate: the newest counts
        ev(3, 3, 200, 6),  # later in the truncate's transaction: kept
        ev(2, 2, 300, 1, partition=1),
    ]
    decoded = _decode(_local(registry), rows)
    assert decoded.poison == []
    assert decoded.newest_ts_ms == 300
    assert _table(decoded).truncate == (200, 5)
    assert [(c.key, c.op, c.position) for c in _changes(decoded)] == [
        ({"id": 3}, "c", (200, 6)),
        ({"id": 2}, "c", (300, 1)),
    ]


def test_a_batch_of_a_truncate_alone_is_a_table_without_changes() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    decoded = _decode(_local(registry), [_raw(0, *_truncate(codec, 70, 2))])
    assert (_table(decoded).truncate, _changes(decoded)) == ((70, 2), [])


# --- dead letters ------------------------------------------------------------------------------------


def _garbage_key(codec: TableCodec) -> bytes:
    return codec.key_of(_row(codec, id="1", name="x")[0])[:5] + b"\x05"  # union branch -3: no such branch


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("key magic byte 1", KEY_UNFRAMED),
        ("key shorter than the framing", KEY_UNFRAMED),
        ("key null", KEY_UNFRAMED),
        ("value magic byte 1", VALUE_UNFRAMED),
        ("value shorter than the framing", VALUE_UNFRAMED),
        ("unknown value id", VALUE_999),
        ("unknown key id", KEY_998),
        ("no subject", "no schema registered for p.public.nothing"),
        ("value cut short", "Avro decoding failed with the writer schema ids key {kid} / value {vid}"),
        ("value framing alone", "Avro decoding failed with the writer schema ids key {kid} / value {vid}"),
        ("key not Avro of its schema", "Avro decoding failed with the writer schema ids key {kid} / value {vid}"),
    ],
)
def test_poison_goes_to_the_dead_letters_with_its_reason(case: str, reason: str) -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    good_key, good_value = _event(codec, "c", _row(codec, id="7", name="fine")[0], 10, 1)
    key, value, topic = good_key, good_value, TOPIC
    if case == "key magic byte 1":
        key = b"\x01" + good_key[1:]
    elif case == "key shorter than the framing":
        key = b"\x00\x00\x01"
    elif case == "key null":
        key = None  # type: ignore[assignment]
    elif case == "value magic byte 1":
        value = b"\x01" + good_value[1:]
    elif case == "value shorter than the framing":
        value = b"\x00\x00"
    elif case == "unknown value id":
        value = b"\x00" + struct.pack(">I", 999) + good_value[5:]
    elif case == "unknown key id":
        key = b"\x00" + struct.pack(">I", 998) + good_key[5:]
    elif case == "no subject":
        topic = "p.public.nothing"
    elif case == "value cut short":
        value = good_value[:-9]
    elif case == "value framing alone":
        value = good_value[:5]
    elif case == "key not Avro of its schema":
        key = _garbage_key(codec)
    reason = reason.format(kid=codec.key_id, vid=codec.value_id)
    rows = [_raw(3, key, value, partition=2, topic=topic), _raw(4, good_key, good_value, partition=2)]
    decoded = _decode(_local(registry), rows)
    assert _poison(decoded) == [(topic, 2, 3, key, value, reason)]  # the original bytes, and why
    assert decoded.records == 2
    # The rest of the batch goes on.
    assert [(c.key, c.offset) for c in _changes(decoded)] == [({"id": 7}, 4)]


def test_a_batch_without_poison_has_no_dead_letter_frame() -> None:
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    decoded = _decode(_local(registry), [_raw(0, *_event(codec, "c", _row(codec, id="1", name="a")[0], 1, 1))])
    assert decoded.poison == []


def test_a_tombstone_whose_key_id_is_unknown_goes_to_the_dead_letters() -> None:
    """Not decodable (no key schema): it cannot be applied, so it is kept where it can be inspected."""
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    key = b"\x00" + struct.pack(">I", 998) + codec.key_of(_row(codec, id="1", name="x")[0])[5:]
    decoded = _decode(_local(registry), [_raw(0, key, None)])
    assert [p[-1] for p in decoded.poison] == [KEY_998]
    assert decoded.tables == []


def test_schema_versions_are_fetched_once() -> None:
    """Each batch asks for the subjects' version lists; a version's schema is fetched only the first time."""
    registry = FakeRegistry()
    codec = _codec(registry, NAMED)
    good_key, good_value = _event(codec, "c", _row(codec, id="7", name="fine")[0], 10, 1)
    bad = b"\x00" + struct.pack(">I", 999) + good_value[5:]
    local = _local(registry)
    for _ in range(2):
        decoded = _decode(local, [_raw(0, good_key, bad), _raw(1, good_key, bad), _raw(2, good_key, good_value)])
        assert [p[-1] for p in _poison(decoded)] == [VALUE_999] * 2
    assert registry.calls.count(("get_versions", f"{TOPIC}-value")) == 2
    assert registry.calls.count(("get_version", (f"{TOPIC}-value", 1))) == 1


# --- schema evolution --------------------------------------------------------------------------------

V1: list[Column] = [("id", INT4, -1), ("name", TEXT, -1)]
V2: list[Column] = [*V1, ("extra", INT4, -1)]


def test_an_event_written_with_an_older_schema_reads_as_the_latest() -> None:
    registry = FakeRegistry()
    old = _codec(registry, V1)
    new = _codec(registry, V2)
    assert old.key_id == new.key_id  # the same key schema: the same id
    assert old.value_id != new.value_id
    rows = [
        _raw(0, *_event(old, "c", _row(old, id="1", name="before ALTER")[0], 10, 1)),
        _raw(1, *_event(new, "c", _row(new, id="2", name="after ALTER", extra="5")[0], 20, 1)),
    ]
    decoded = _decode(_local(registry), rows)
    assert decoded.poison == []
    assert _table(decoded).row_schema == envelope_row(new.value_schema)
    assert [c.row for c in _changes(decoded)] == [
        {"id": 1, "name": "before ALTER", "extra": None},  # the added nullable column: None
        {"id": 2, "name": "after ALTER", "extra": 5},
    ]


def test_a_dropped_column_is_gone_from_events_written_before() -> None:
    registry = FakeRegistry()
    old = _codec(registry, V2)
    new = _codec(registry, [("id", INT4, -1), ("extra", INT4, -1)])
    rows = [_raw(0, *_event(old, "u", _row(old, id="1", name="dropped", extra="3")[0], 10, 1))]
    assert [c.row for c in _changes(_decode(_local(registry), rows))] == [{"id": 1, "extra": 3}]
    assert new.value_id > old.value_id


def test_a_later_batch_reads_a_new_schema_version_with_it() -> None:
    """The readers cached for a topic are fetched again when a batch brings a writer id not seen before."""
    registry = FakeRegistry()
    old = _codec(registry, V1)
    local = _local(registry)
    first = _decode(local, [_raw(0, *_event(old, "c", _row(old, id="1", name="a")[0], 10, 1))])
    assert [c.row for c in _changes(first)] == [{"id": 1, "name": "a"}]
    new = _codec(registry, V2)
    second = _decode(local, [_raw(1, *_event(new, "c", _row(new, id="2", name="b", extra="5")[0], 20, 1))])
    assert [c.row for c in _changes(second)] == [{"id": 2, "name": "b", "extra": 5}]


def test_a_new_schema_version_after_old_events_in_the_same_batch_is_read_with_it() -> None:
    registry = FakeRegistry()
    old = _codec(registry, V1)
    local = _local(registry)
    _decode(local, [_raw(0, *_event(old, "c", _row(old, id="1", name="a")[0], 10, 1))])  # caches V1 as latest
    new = _codec(registry, V2)  # ALTER TABLE ... ADD COLUMN extra; the capture registers V2
    rows = [
        _raw(1, *_event(old, "u", _row(old, id="1", name="b")[0], 20, 1)),  # before the ALTER
        _raw(2, *_event(new, "c", _row(new, id="2", name="c", extra="5")[0], 30, 1)),  # after it
    ]
    decoded = _decode(local, rows)
    assert _table(decoded).row_schema == envelope_row(new.value_schema)
    assert [c.row for c in _changes(decoded)] == [
        {"id": 1, "name": "b", "extra": None},
        {"id": 2, "name": "c", "extra": 5},
    ]


# --- frame-based sinks ----------------------------------------------------------------------------------


def test_a_frame_sink_gets_the_fold_and_its_rows_on_the_driver_with_a_deprecation_warning() -> None:
    """The frame path (the warehouse's larger batches, frame plugins): the fold in tasks, the table's truncate
    and its changes and events after it as frames; ``changes()`` still hands the rows over on the driver, and
    warns."""
    import sinks._api
    from sinks._frames import in_frames

    registry = FakeRegistry()
    codec = _codec(registry, NAMED)

    def ev(offset: int, ident: int, name: str, commit_lsn: int, op: str = "c") -> dict[str, Any]:
        return _raw(offset, *_event(codec, op, _row(codec, id=str(ident), name=name)[0], commit_lsn, 1))

    rows = [ev(0, 1, "gone", 10), _raw(1, *_truncate(codec, 20, 1)), ev(2, 2, "a", 30), ev(3, 2, "b", 40, "u")]
    raw = _SESSION[0].createDataFrame(
        [(r["topic"], r["partition"], r["offset"], r["key"], r["value"]) for r in rows],
        "topic string, partition int, offset long, key binary, value binary",
    )
    decoder = _local(registry)
    got: list[tuple[tuple[int, int] | None, list[Change]]] = []
    events: list[str] = []

    class FrameSink:
        name = "frames"

        def write(self, batch: Any) -> None:
            got.extend((t.truncate, list(t.changes())) for t in batch.tables)
            events.extend(r["row"]["name"] for t in batch.tables for r in t.events.orderBy("offset").collect())

    sinks._api._WARNED.clear()
    folds = [TopicFold(decoder.schemas(TOPIC))]
    with pytest.warns(DeprecationWarning, match="moves every row to the Spark driver"):
        outcome = in_frames(FrameSink(), folds, raw, decoder.settings, (5, 1), tasks=2)
    assert (outcome.records, outcome.dead_letters, outcome.newest_ts_ms) == (4, 0, 40)
    ((truncate, changes),) = got
    assert truncate == (20, 1)
    assert [(c.key, c.row, c.op, c.position) for c in changes] == [({"id": 2}, {"id": 2, "name": "b"}, "u", (40, 1))]
    assert events == ["a", "b"]  # the events after the truncate
