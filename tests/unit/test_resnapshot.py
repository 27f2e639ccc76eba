"""The re-snapshot's set logic (cdc/_resnapshot.py): which keys of a topic get deleted, and with what before image.

Records are given as a topic would hold them (partition, offset, key bytes, value or None for a tombstone);
no Kafka is involved. The integration test is tests/integration/test_wal_safety.py's lost-slot test.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import fastavro
import pytest
from pgcdc_dev.codecs import make_codec

from cdc._resnapshot import GapDeletes, KeyCanon, LiveKeys, Record, live_keys, parse_plain
from cdc.encoding import Position, SourceInfo, Stamp, TableCodec
from decoders import TupleData
from schemas import PgType

INT4, INT8, TEXT = PgType(23, "int4"), PgType(20, "int8"), PgType(25, "text")
TIMESTAMPTZ, NUMERIC = PgType(1184, "timestamptz"), PgType(1700, "numeric")
KEY_ID, VALUE_ID = 7, 8


# The key schema of a topic made before key fields were widened (schemas._keys): an int4 key is an Avro int.
INT_KEY = {
    "type": "record",
    "name": "Key",
    "namespace": "t.public.items",
    "fields": [{"name": "id", "type": ["null", "int"], "default": None}],
}


def _codec(columns: list[tuple[str, PgType]], *, key: tuple[str, ...] = ("id",), ids: tuple[int, int]) -> TableCodec:
    return make_codec(
        [(name, pgtype, -1) for name, pgtype in columns],
        topic="t.public.items",
        key=key,
        source=SourceInfo("9.9.9", "t", "shop"),
        register=lambda subject, _schema: ids[0] if subject.endswith("-key") else ids[1],
        registered_key=INT_KEY if key == ("id",) else None,
    )


COLUMNS = [("id", INT4), ("name", TEXT), ("at", TIMESTAMPTZ), ("price", NUMERIC)]
CODEC = _codec(COLUMNS, ids=(KEY_ID, VALUE_ID))
# An older version of the table: no "price" column, registered under other ids.
OLD = _codec(COLUMNS[:3], ids=(3, 4))
# The key written with a long instead of an int (a compatible key schema change) under id 5.
LONG_KEY = _codec([("id", INT8), *COLUMNS[1:]], ids=(5, 6))
SCHEMAS: dict[int, Any] = {
    3: parse_plain(OLD.key_schema),
    4: parse_plain(OLD.value_schema),
    5: parse_plain(LONG_KEY.key_schema),
    6: parse_plain(LONG_KEY.value_schema),
}


def _row(codec: TableCodec, *values: str | None) -> dict[str, Any]:
    kinds = bytes(ord("n") if v is None else ord("t") for v in values)
    return codec.row(TupleData(kinds, tuple(None if v is None else v.encode() for v in values)))[0]


def _key(codec: TableCodec, ident: int) -> bytes:
    return codec.key_of({**dict.fromkeys(codec.field_names), "id": ident})


def _canon() -> KeyCanon:
    return KeyCanon(key_id=CODEC.key_id, key_schema=CODEC.key_schema, lookup=SCHEMAS.get)


def _gaps(before: list[Record], settled: tuple[Record, ...] | list[Record] = ()) -> LiveKeys:
    return live_keys(_canon(), before, settled)


def _left(live: LiveKeys) -> dict[int, list[int]]:
    """partition -> sorted key ids left to delete."""
    canon = _canon()
    return {p: sorted(canon.record(c)["id"] for _raw, c in records.values()) for p, records in live.remaining().items()}


POS = Position(100, 90, 1_700_000_000_000_000, 55)
VALUE = b"not-decoded-for-liveness"  # liveness needs only "tombstone or not"


def test_keys_absent_from_the_snapshot_are_left_and_those_it_writes_are_not() -> None:
    live = _gaps([(0, i, _key(CODEC, i), VALUE) for i in range(1, 6)])
    for i in (1, 3, 4):
        GapDeletes(codec=CODEC, canon=_canon(), live=live, lookup=SCHEMAS.get, reader=None).seen([_key(CODEC, i)])  # type: ignore[arg-type]
    assert _left(live) == {0: [2, 5]}


def test_a_key_whose_latest_record_is_a_tombstone_is_not_live_until_written_again() -> None:
    k = _key(CODEC, 1)
    assert len(_gaps([(0, 0, k, VALUE), (0, 1, k, None)])) == 0
    live = _gaps([(0, 0, k, VALUE), (0, 1, k, None), (0, 2, k, VALUE)])
    assert live.remaining() == {0: {2: (k, k[5:])}}  # the latest live record: its offset, for the before image


def test_what_earlier_attempts_committed_after_the_boundary_is_settled() -> None:
    # A resumed snapshot: keys 1 and 2 were live before it; the first attempt wrote key 1 (a snapshot row)
    # and already deleted key 3 (a delete event and its tombstone); key 2 is still to be looked at.
    before = [(0, i, _key(CODEC, i), VALUE) for i in (1, 2, 3)]
    settled = [(0, 10, _key(CODEC, 1), VALUE), (0, 11, _key(CODEC, 3), VALUE), (0, 12, _key(CODEC, 3), None)]
    assert _left(_gaps(before, settled)) == {0: [2]}


def test_a_later_partition_read_first_does_not_undo_the_boundary() -> None:
    # The settled records are applied after every record below the boundary, whatever the partition order.
    before = [(1, 0, _key(CODEC, 1), VALUE), (0, 0, _key(CODEC, 2), VALUE)]
    settled = [(0, 5, _key(CODEC, 1), VALUE)]
    assert _left(_gaps(before, settled)) == {0: [2]}


def test_keys_are_compared_without_the_schema_id_and_resolved_to_todays_key_schema() -> None:
    # Key 1 was written under another id for the same key schema (a registry rebuilt): same payload.
    old_same = struct.pack(">bI", 0, 3) + _key(OLD, 1)[5:]
    live = _gaps([(0, 0, old_same, VALUE), (0, 2, _key(CODEC, 3), VALUE)])
    assert len(live) == 2
    live.discard(_key(CODEC, 1)[5:])
    assert _left(live) == {0: [3]}
    # Today's key is a long, key 2 was written as an int (a promotion the sinks resolve too): decoded with its
    # writer schema, read as today's and encoded again, it is the key the snapshot writes.
    canon = KeyCanon(
        key_id=LONG_KEY.key_id, key_schema=LONG_KEY.key_schema, lookup={KEY_ID: parse_plain(CODEC.key_schema)}.get
    )
    assert canon.canonical(_key(CODEC, 2)) == _key(LONG_KEY, 2)[5:]
    assert canon.canonical(_key(CODEC, 300)) == _key(LONG_KEY, 300)[5:]
    # The other way (a long read as an int) does not resolve: not a key of today's table, never deleted.
    assert _canon().canonical(_key(LONG_KEY, 2)) is None


def test_a_key_under_two_ids_or_in_two_partitions_is_deleted_in_each_place_it_is_live() -> None:
    k, k_old = _key(CODEC, 1), struct.pack(">bI", 0, 3) + _key(CODEC, 1)[5:]
    live = _gaps([(0, 0, k, VALUE), (1, 0, k, VALUE), (0, 1, k_old, VALUE), (2, 0, k, VALUE), (2, 1, k, None)])
    remaining = live.remaining()
    assert sorted((p, off, raw) for p, records in remaining.items() for off, (raw, _) in records.items()) == [
        (0, 0, k),
        (0, 1, k_old),
        (1, 0, k),
    ]
    live.discard(k[5:])  # the snapshot writes it once: every copy is settled
    assert len(live) == 0


def test_what_is_not_a_rows_key_is_never_deleted() -> None:
    canon = _canon()
    assert canon.canonical(CODEC.truncate_key) is None  # the truncate marker (all key fields null)
    assert canon.canonical(struct.pack(">bI", 0, 3) + b"\x00") is None  # an older schema's truncate marker
    assert canon.canonical(b"plain text key") is None  # not Confluent-framed: poison for the sinks too
    assert canon.canonical(b"\x00\x00") is None
    assert canon.canonical(None) is None
    assert canon.canonical(struct.pack(">bI", 0, 999) + b"\x02\x02") is None  # an id the registry does not know
    # A key schema today's cannot read (a string where an int is): the sinks cannot read it as a key either.
    text_key = {
        "type": "record",
        "name": "Key",
        "namespace": "t.public.items",
        "fields": [{"name": "id", "type": "string"}],
    }
    odd = KeyCanon(key_id=KEY_ID, key_schema=CODEC.key_schema, lookup={11: parse_plain(text_key)}.get)
    assert odd.canonical(struct.pack(">bI", 0, 11) + b"\x02a") is None
    live = _gaps([(0, 0, CODEC.truncate_key, VALUE), (0, 1, b"junk", VALUE)])
    assert len(live) == 0


def _decode(value: bytes) -> dict[str, Any]:
    assert value[:5] == struct.pack(">bI", 0, VALUE_ID)
    event = fastavro.schemaless_reader(io.BytesIO(value[5:]), fastavro.parse_schema(CODEC.value_schema), None)
    assert isinstance(event, dict)
    return event


def _gap(record: Record) -> GapDeletes:
    live = _gaps([record])
    return GapDeletes(codec=CODEC, canon=_canon(), live=live, lookup=SCHEMAS.get, reader=None)  # type: ignore[arg-type]


def test_the_before_image_is_the_latest_events_row_and_the_delete_is_what_the_stream_writes() -> None:
    row = _row(CODEC, "1", "widget", "2024-01-01 00:00:00.000001+00", "12.34")
    last = CODEC.envelope("u", Stamp(POS, 1), None, row)
    gaps = _gap((0, 0, _key(CODEC, 1), last))
    before = gaps.before_image(last, _key(CODEC, 1)[5:])
    assert before == row
    assert before is not None
    pos = Position(500, 500, 1_800_000_000_000_000, None)
    # Byte for byte the delete the stream writes for the same row (the codec's own writer).
    assert gaps.delete_event(before, pos, 1_800_000_000_000_001) == CODEC.envelope(
        "d", Stamp(pos, 1_800_000_000_000_001), row, None
    )
    event = _decode(gaps.delete_event(before, pos, 1_800_000_000_000_001))
    assert (event["op"], event["after"], event["source"]["lsn"], event["source"]["commit_lsn"]) == ("d", None, 500, 500)
    assert event["before"]["name"] == "widget"


def test_an_older_events_row_is_read_with_todays_schema() -> None:
    old_row = _row(OLD, "2", "gadget", None)
    last = OLD.envelope("c", Stamp(POS, 1), None, old_row)
    before = _gap((0, 0, _key(OLD, 2), last)).before_image(last, _key(CODEC, 2)[5:])
    assert before == {"id": 2, "name": "gadget", "at": None, "price": None}  # a column added since: null


@pytest.mark.parametrize(
    "value",
    [None, b"not avro at all", struct.pack(">bI", 0, 999) + b"\x00"],
    ids=["record-gone", "poison", "unknown-schema-id"],
)
def test_an_unreadable_latest_event_still_gets_a_delete_with_the_key_columns(value: bytes | None) -> None:
    gaps = _gap((0, 0, _key(CODEC, 3), b"x"))
    assert gaps.before_image(value, _key(CODEC, 3)[5:]) == {"id": 3, "name": None, "at": None, "price": None}


def test_a_latest_event_that_is_no_row_is_not_deleted_again() -> None:
    gaps = _gap((0, 0, _key(CODEC, 4), b"x"))
    row = _row(CODEC, "4", "x", None, None)
    deleted = CODEC.envelope("d", Stamp(POS, 1), row, None)
    truncated = CODEC.envelope("t", Stamp(POS, 1), None, None)
    assert gaps.before_image(deleted, _key(CODEC, 4)[5:]) is None
    assert gaps.before_image(truncated, _key(CODEC, 4)[5:]) is None


class _Topic:
    """Serves the records of a topic to GapDeletes.emit by offset range, as TopicReader does."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records

    def read(self, _topic: str, ranges: dict[int, tuple[int, int]]) -> list[Record]:
        return [r for r in self.records if r[0] in ranges and ranges[r[0]][0] <= r[1] < ranges[r[0]][1]]


def test_emit_writes_a_delete_and_a_tombstone_per_key_left_in_batches() -> None:
    rows = {i: _row(CODEC, str(i), f"n{i}", None, None) for i in range(1, 6)}
    records: list[Record] = [
        (i % 2, i, _key(CODEC, i), CODEC.envelope("c", Stamp(POS, 1), None, rows[i])) for i in rows
    ]
    topic = _Topic(records[:-1])  # key 5's record is gone by the time the deletes are written (retention)
    live = live_keys(_canon(), records, [])
    gaps = GapDeletes(codec=CODEC, canon=_canon(), live=live, lookup=SCHEMAS.get, reader=topic)  # type: ignore[arg-type]
    gaps.seen([_key(CODEC, 2)])  # in the snapshot
    produced: list[tuple[bytes, bytes | None, int]] = []
    commits: list[int] = []
    deleted = gaps.emit(
        produce=lambda _t, k, v, p: produced.append((k, v, p)), commit=commits.append, consistent_lsn=900, batch=2
    )
    assert deleted == 4
    assert commits == [2, 2]
    by_key: dict[bytes, list[tuple[bytes | None, int]]] = {}
    for k, v, p in produced:
        by_key.setdefault(k, []).append((v, p))
    assert set(by_key) == {_key(CODEC, i) for i in (1, 3, 4, 5)}
    for i in (1, 3, 4, 5):
        (delete, p1), (tombstone, p2) = by_key[_key(CODEC, i)]
        assert tombstone is None
        assert p1 == p2 == i % 2  # where the key's records are, so that compaction drops them
        assert delete is not None
        event = _decode(delete)
        assert event["op"] == "d"
        assert event["source"]["commit_lsn"] == 900
        assert event["source"]["snapshot"] == "false"
        # The row as last captured; key 5's event could not be read back: its key columns only.
        assert event["before"]["name"] == (None if i == 5 else f"n{i}")
        assert event["before"]["id"] == i
