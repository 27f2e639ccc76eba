"""Signal-table rows are untrusted input (cdc._signals): what is not a request becomes one of kind "invalid"
saying what is wrong, and the capture lists it as a failed backfill instead of stopping."""

from __future__ import annotations

import pytest

from cdc._signals import _signal


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
