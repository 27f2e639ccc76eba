"""A key column's type change and the key's bytes (schemas._keys): a widening keeps every key's bytes, so its
partition and its compaction; a change that cannot keep them gives the key a new schema.

The registry is played by a dict that gives identical schemas one id and a new schema the next id, as a
schema registry does; the integration test (tests/integration/test_type_changes.py) runs the same ALTERs
under a running capture against the real one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pgcdc_dev.codecs import make_codec

from cdc.encoding import TableCodec
from decoders import TupleData
from schemas import PgType

INT2, INT4, INT8 = PgType(21, "int2"), PgType(23, "int4"), PgType(20, "int8")
TEXT, VARCHAR, NUMERIC = PgType(25, "text"), PgType(1043, "varchar"), PgType(1700, "numeric")
TOPIC = "t.public.items"


def _numeric(precision: int, scale: int) -> int:
    return ((precision << 16) | scale) + 4  # atttypmod of numeric(precision, scale)


class _Registry:
    """Ids by schema content, one subject's latest schema: what the capture asks of a schema registry."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.latest: dict[str, Any] | None = None

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        if subject.endswith("-key"):
            self.latest = schema
        return self.ids.setdefault(json.dumps(schema, sort_keys=True), len(self.ids) + 1)

    def codec(self, pgtype: PgType, typmod: int = -1) -> TableCodec:
        columns = [("id", pgtype, typmod), ("name", TEXT, -1)]
        return make_codec(columns, topic=TOPIC, register=self.register, registered_key=self.latest)


def _key(codec: TableCodec, value: Any) -> bytes:
    """The framed key of a row whose id has ``value``'s text form, decoded as the stream decodes it."""
    row, _ = codec.row(TupleData(b"tt", (str(value).encode(), b"n")))
    return codec.key_of(row)


@pytest.mark.parametrize(
    ("before", "after", "value"),
    [
        ((INT4, -1), (INT8, -1), 7),
        ((INT2, -1), (INT4, -1), -300),
        ((INT2, -1), (INT8, -1), 2**15 - 1),
        ((VARCHAR, 14), (VARCHAR, 54), "k-1"),
        ((VARCHAR, 14), (TEXT, -1), "k-1"),
        ((NUMERIC, _numeric(10, 2)), (NUMERIC, _numeric(12, 2)), "12.50"),
    ],
    ids=["int4-int8", "int2-int4", "int2-int8", "varchar10-varchar50", "varchar-text", "numeric10-numeric12"],
)
def test_a_widened_key_column_keeps_every_keys_bytes(
    before: tuple[PgType, int], after: tuple[PgType, int], value: Any
) -> None:
    registry = _Registry()
    old, new = registry.codec(*before), registry.codec(*after)
    assert new.key_id == old.key_id
    assert _key(new, value) == _key(old, value)
    assert _key(new, value) != _key(new, 8)  # the bytes hold the value
    assert new.truncate_key == old.truncate_key
    if after[0] is INT8:  # and the wider values it now admits are written under the same schema
        assert _key(new, 2**40)[:5] == _key(old, 1)[:5]


def test_a_change_that_moves_a_decimals_scale_gives_the_key_a_new_schema() -> None:
    registry = _Registry()
    old = registry.codec(NUMERIC, _numeric(10, 2))
    new = registry.codec(NUMERIC, _numeric(10, 4))
    assert new.key_id != old.key_id


def test_an_int_key_registered_before_keys_were_widened_is_kept_while_it_fits() -> None:
    registry = _Registry()
    legacy = {
        "type": "record",
        "name": "Key",
        "namespace": TOPIC,
        "fields": [{"name": "id", "type": ["null", "int"], "default": None}],
    }
    registry.latest = legacy
    registry.ids[json.dumps(legacy, sort_keys=True)] = 41
    kept = registry.codec(INT4)
    assert (kept.key_schema, kept.key_id) == (legacy, 41)  # a restart of an existing topic changes nothing
    assert registry.codec(INT2).key_id == 41  # narrower values fit too
    widened = registry.codec(INT8)  # an int cannot carry int8's values: a new schema, the widest
    assert widened.key_id != 41
    assert widened.key_schema["fields"][0]["type"] == ["null", "long"]
    assert _key(widened, 5)[5:] == _key(kept, 5)[5:]  # the same payload under another id


def test_a_new_topics_key_fields_have_their_familys_widest_type() -> None:
    registry = _Registry()
    assert registry.codec(INT2).key_schema["fields"][0]["type"] == ["null", "long"]
    decimal = registry.codec(NUMERIC, _numeric(10, 2)).key_schema["fields"][0]["type"]
    assert decimal[1] == {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 2}
