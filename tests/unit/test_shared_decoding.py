"""The driver's readers share decoded records (sinks._fold.SharedDecoding): a record is decoded once, and an
event is only taken for the very same record read with the very same schemas."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import fastavro
import pytest

from schemas import ColumnShape, PgType, envelope_schema, key_schema
from sinks import _fold
from sinks._fold import SharedDecoding, TopicFold, TopicSchemas, share_decoding

INT4, TEXT = PgType(23, "int4"), PgType(25, "text")
COLS = [ColumnShape("id", INT4, -1, "int"), ColumnShape("name", TEXT, -1, "string")]
TOPIC = "pgcdc.public.people"


def _schemas(columns: list[ColumnShape] = COLS) -> TopicSchemas:
    key = json.dumps(key_schema(TOPIC, columns[:1]))
    value = json.dumps(envelope_schema(TOPIC, columns))
    return TopicSchemas(TOPIC, key, value, {1: key}, {2: value})


def _framed(schema_id: int, schema: str, record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    out.write(b"\x00" + schema_id.to_bytes(4, "big"))
    fastavro.schemaless_writer(out, fastavro.parse_schema(json.loads(schema)), record)
    return out.getvalue()


def _record(schemas: TopicSchemas, offset: int, name: str) -> dict[str, Any]:
    source: dict[str, Any] = {
        "version": "0",
        "connector": "postgresql",
        "name": "pgcdc",
        "ts_ms": 1,
        "snapshot": "false",
    }
    source |= {"db": "d", "sequence": None, "ts_us": 1, "schema": "public", "table": "people", "txId": 1}
    source |= {"lsn": offset, "xmin": None, "commit_lsn": offset}
    value: dict[str, Any] = {"before": None, "after": {"id": 7, "name": name}, "source": source, "transaction": None}
    value |= {"op": "u", "ts_ms": 1, "ts_us": 1, "unchanged_toast": []}
    assert schemas.key_reader is not None
    assert schemas.value_reader is not None
    return {
        "topic": TOPIC,
        "partition": 0,
        "offset": offset,
        "key": _framed(1, schemas.key_reader, {"id": 7}),
        "value": _framed(2, schemas.value_reader, value),
    }


@pytest.fixture
def shared() -> Iterator[SharedDecoding]:
    share_decoding(3)
    try:
        yield _fold._SHARED
    finally:
        share_decoding(0)


def test_a_second_reader_takes_the_first_ones_event(shared: SharedDecoding) -> None:
    schemas = _schemas()
    record = _record(schemas, 10, "Ada")
    first = TopicFold(schemas).decode(record)
    again = TopicFold(_schemas()).decode(dict(record))  # another sink's fold, equal schemas
    assert again is first
    assert first["row"] == {"id": 7, "name": "Ada"}
    assert first["error"] is None


def test_only_the_same_bytes_with_the_same_readers_are_taken(shared: SharedDecoding) -> None:
    schemas = _schemas()
    first = TopicFold(schemas).decode(_record(schemas, 10, "Ada"))
    # The same offset holding other bytes (a topic made anew under the same name): decoded afresh.
    other = TopicFold(schemas).decode(_record(schemas, 10, "Grace"))
    assert other is not first
    assert other["row"]["name"] == "Grace"
    # The same bytes resolved to a newer reader (a column added since): decoded afresh, in the new shape.
    new = _schemas([*COLS, ColumnShape("extra", INT4, -1, "int")])
    assert new.value_reader is not None
    wider = TopicSchemas(
        TOPIC, new.key_reader, new.value_reader, schemas.key_writers, {**schemas.value_writers, 3: new.value_reader}
    )
    newer = TopicFold(wider).decode(_record(schemas, 10, "Grace"))
    assert newer is not other
    assert newer["row"] == {"id": 7, "name": "Grace", "extra": None}


def test_the_oldest_go_first_and_errors_are_not_kept(shared: SharedDecoding) -> None:
    schemas = _schemas()
    records = [_record(schemas, offset, f"n{offset}") for offset in range(5)]
    events = [TopicFold(schemas).decode(r) for r in records]
    assert len(shared._events) == 3  # the bound
    assert TopicFold(schemas).decode(records[4]) is events[4]
    assert TopicFold(schemas).decode(records[0]) is not events[0]  # pushed out, decoded again
    broken = {**records[1], "value": b"\x00\x00\x00\x00\x02\xff"}  # framed, but not the schema's bytes
    assert TopicFold(schemas).decode(broken)["error"] is not None
    assert (TOPIC, 0, 1) not in shared._events or shared._events[(TOPIC, 0, 1)][1] != broken["value"]


def test_tasks_and_other_processes_decode_their_own() -> None:
    schemas = _schemas()
    record = _record(schemas, 10, "Ada")
    assert TopicFold(schemas).decode(record) is not TopicFold(schemas).decode(record)
