"""The driver's batches ask the registry only for a schema id they have not seen (sinks._fold.knows)."""

from __future__ import annotations

from typing import Any

from sinks._fold import TopicSchemas, framed_ids, knows


def _framed(schema_id: int) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + b"payload"


def test_framed_ids_are_gathered_per_topic_leaving_unframed_and_tombstones_out() -> None:
    records: list[dict[str, Any]] = [
        {"topic": "a", "key": _framed(1), "value": _framed(2)},
        {"topic": "a", "key": _framed(1), "value": None},  # a tombstone
        {"topic": "a", "key": b"not framed", "value": _framed(5)},
        {"topic": "b", "key": _framed(3), "value": _framed(4)},
    ]
    assert framed_ids(records) == {"a": ({1}, {2, 5}), "b": ({3}, {4})}


def test_schemas_know_ids_only_when_registered_and_holding_every_writer() -> None:
    held = TopicSchemas("a", key_reader="{}", value_reader="{}", key_writers={1: "{}"}, value_writers={2: "{}"})
    assert knows(held, ({1}, {2}))
    assert knows(held, (set(), set()))
    assert not knows(held, ({1}, {2, 6}))  # a new version of the value schema: ask again
    assert not knows(held, ({7}, {2}))
    assert not knows(TopicSchemas("a"), (set(), set()))  # not registered yet
