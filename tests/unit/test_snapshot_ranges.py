"""A table's key ranges in the snapshot's progress: split once, kept across restarts, and a table begun by a
version that read it in one range continues in that one range."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cdc._snapshot import Snapshotter, next_chunk_rows


def _snapshotter(progress: dict[str, Any], split: list[list[str]]) -> tuple[Snapshotter, list[str]]:
    snapshotter = Snapshotter.__new__(Snapshotter)
    snapshotter.snap = {"tables": {"public.t": progress}}
    sampled: list[str] = []

    def fake_split(table: Any) -> list[list[str]]:
        sampled.append(table.qualified)
        return split

    snapshotter._split = fake_split  # type: ignore[method-assign]
    return snapshotter, sampled


_TABLE: Any = SimpleNamespace(qualified="public.t")


def test_a_new_table_is_split_into_ranges_that_meet_at_the_bounds() -> None:
    progress: dict[str, Any] = {"since": {"0": 0}}
    snapshotter, sampled = _snapshotter(progress, [["10"], ["20"]])
    ranges = snapshotter._ranges(_TABLE)
    assert ranges == [
        {"after": None, "upto": ["10"], "done": False},
        {"after": ["10"], "upto": ["20"], "done": False},
        {"after": ["20"], "upto": None, "done": False},
    ]
    assert progress["ranges"] is ranges  # written into the progress committed with the chunks
    assert progress["since"] == {"0": 0}
    assert sampled == ["public.t"]


def test_a_small_table_is_one_unbounded_range() -> None:
    snapshotter, _ = _snapshotter({}, [])
    assert snapshotter._ranges(_TABLE) == [{"after": None, "upto": None, "done": False}]


def test_committed_ranges_are_kept_and_not_split_again() -> None:
    ranges = [{"after": ["7"], "upto": ["10"], "done": False}, {"after": ["10"], "upto": None, "done": True}]
    snapshotter, sampled = _snapshotter({"ranges": ranges}, [["5"]])
    assert snapshotter._ranges(_TABLE) == ranges
    assert sampled == []


@pytest.mark.parametrize("key", [["42"], ["a", "2026-01-01 00:00:00+00"]])
def test_a_table_begun_in_one_range_goes_on_after_its_last_key(key: list[str]) -> None:
    progress: dict[str, Any] = {"after": key, "done": False, "since": {"0": 3}}
    snapshotter, sampled = _snapshotter(progress, [["99"]])
    assert snapshotter._ranges(_TABLE) == [{"after": key, "upto": None, "done": False}]
    assert "after" not in progress  # one place for the position: the range
    assert sampled == []  # splitting now would read again what is committed


@pytest.mark.parametrize(
    ("size", "rows", "expected"),
    [
        (100 * 1000, 1000, 25_000),  # narrow rows: the configured rows
        (8 * 1000 * 1000, 1000, 1048),  # 8 kB rows: what fits 8 MiB
        (50 << 20, 1, 1),  # one row over the budget: still one row at a time
        (0, 0, 25_000),  # an empty chunk says nothing about the rows: no smaller than configured
    ],
)
def test_chunks_are_kept_near_8_mib_whatever_the_row_size(size: int, rows: int, expected: int) -> None:
    assert next_chunk_rows(25_000, size, rows) == expected
