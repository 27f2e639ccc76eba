"""Signal-table rows are untrusted input (cdc._signals): what is not a request becomes one of kind "invalid"
saying what is wrong, and the capture lists it as a failed backfill instead of stopping."""

from __future__ import annotations

import pytest

from cdc._signals import _record, _signal


@pytest.mark.parametrize(
    ("kind", "data", "says"),
    [
        ("drop", '{"tables": ["public.t"]}', "kind 'drop'"),
        ("backfill", "[1, 2]", "is not a request"),
        ("backfill", "not json", "is not a request"),
    ],
)
def test_a_row_that_is_not_a_request_says_what_is_wrong(kind: str, data: str, says: str) -> None:
    signal = _signal(7, kind, data)
    assert signal.kind == "invalid"
    assert signal.id == 7
    assert says in signal.data["error"]


def test_a_request_keeps_its_data() -> None:
    signal = _signal(8, "backfill", '{"tables": ["public.t"], "where": "id > 1"}')
    assert (signal.kind, signal.data) == ("backfill", {"tables": ["public.t"], "where": "id > 1"})


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b'{"kind": "drop", "data": {}}',
        b'{"kind": "backfill", "data": [1]}',
        b'{"data": {"tables": ["public.t"]}}',
        b"\xff\xfe",
        b"[" * 100_000,  # nested past Python's recursion limit: refused, not raised
    ],
)
def test_a_signal_topic_record_that_is_not_a_request_says_where_it_is(value: bytes) -> None:
    signal = _record(12, 0, value)
    assert (signal.kind, signal.id, signal.partition, signal.name) == ("invalid", 12, 0, "kafka-0-12")
    assert signal.data["error"].startswith("signal topic record 0/12: ")


def test_a_signal_topic_request_is_named_by_its_partition_and_offset() -> None:
    signal = _record(5, 2, b'{"kind": "backfill", "data": {"tables": ["public.t"]}}')
    assert (signal.kind, signal.data, signal.name) == ("backfill", {"tables": ["public.t"]}, "kafka-2-5")
    assert _record(6, 0, b'{"kind": "cancel", "data": {"id": "kafka-2-5"}}').data == {"id": "kafka-2-5"}
