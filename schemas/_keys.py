"""Key field types that survive a column's widening.

A framed key's bytes are the key schema's id followed by the Avro encoding of the key's values. Kafka
compacts by those bytes and the producer picks the partition from them, so a key schema that gets a new id
after ``ALTER TABLE … ALTER COLUMN id TYPE bigint`` would give every row a second key: its later events land
in another partition (per-key order across the change is gone), compaction keeps the old record beside the
new one, and a delete's tombstone never removes the old one.

Two things keep the id. A key field has the widest type of its column's family (:func:`widest`): ``long``
for int2/int4/int8, a decimal of precision 38 for numeric(p, s), so the widenings PostgreSQL allows within a
family leave the key schema as it was. Avro encodes ``int`` and ``long`` alike, and a decimal's bytes are its
unscaled value, whatever its precision: the bytes are those of the column's own type. And a key subject
registered before keys were widened (an ``int`` field) keeps its schema while it can carry the columns with
the same bytes (:func:`carries`). A change that neither covers (a decimal's scale, ``int`` to ``text``, an
``int`` key field that must now hold int8 values) gives the key a new schema, and so new bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas._numeric import MAX_DECIMAL_PRECISION

_SAME_BYTES = {"int": "long"}  # a type, and the wider one that writes every value of it with the same bytes


def widest(schema: Any) -> Any:
    """``schema`` with each integer widened to ``long`` and each decimal to precision 38, inside unions too."""
    if isinstance(schema, list):
        return [widest(s) for s in schema]
    if isinstance(schema, str):
        return _SAME_BYTES.get(schema, schema)
    if _is_decimal(schema):
        return {**schema, "precision": max(int(schema["precision"]), MAX_DECIMAL_PRECISION)}
    return schema


def fits(value_type: Any, key_type: Any) -> bool:
    """Whether a key field of ``key_type`` carries every value of ``value_type`` with the same bytes."""
    if value_type == key_type:
        return True
    if isinstance(value_type, list) and isinstance(key_type, list):
        return len(value_type) == len(key_type) and all(fits(v, k) for v, k in zip(value_type, key_type, strict=True))
    if isinstance(value_type, str) and isinstance(key_type, str):
        return _SAME_BYTES.get(value_type) == key_type
    if _is_decimal(value_type) and _is_decimal(key_type):
        return bool(value_type["scale"] == key_type["scale"] and value_type["precision"] <= key_type["precision"])
    return False


def carries(registered: Mapping[str, Any], own: Mapping[str, Any]) -> bool:
    """Whether the key schema ``registered`` (a subject's latest) writes every key of the key schema ``own``
    (the key columns in their own types) with the same bytes: the same record, the same fields in the same
    order with the same attributes, each field's type fitting (:func:`fits`)."""
    if any(registered.get(k) != own.get(k) for k in ("type", "name", "namespace")):
        return False
    theirs, ours = registered.get("fields"), own.get("fields")
    if not isinstance(theirs, list) or not isinstance(ours, Sequence) or len(theirs) != len(ours):
        return False
    for t, o in zip(theirs, ours, strict=True):
        if not isinstance(t, dict) or _attributes(t) != _attributes(o) or not fits(o.get("type"), t.get("type")):
            return False
    return True


def _attributes(field: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in field.items() if k != "type"}


def _is_decimal(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("logicalType") == "decimal" and schema.get("type") == "bytes"
