"""A table's ranges in the snapshot's progress: split once, kept across restarts, and a table begun by a
version that read it in one range continues in that one range. Block ranges only in the slot's own snapshot,
and a table interrupted in them starts again in key order."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from cdc._chunks import block_cuts, next_chunk_rows
from cdc._offsets import RangeProgress, SnapshotState, TableProgress
from cdc._snapshot import Snapshotter


def _snapshotter(
    progress: dict[str, Any], split: list[list[str]], blocks: list[list[int | None]] | None = None
) -> tuple[Snapshotter, list[str]]:
    """A snapshotter whose state holds ``progress`` (as committed) for public.t."""
    snapshotter = Snapshotter.__new__(Snapshotter)
    snapshotter.snap = SnapshotState("running", 1, {"public.t": TableProgress.from_json(progress)})
    sampled: list[str] = []

    def fake_split(table: Any) -> list[list[str]]:
        sampled.append(table.qualified)
        return split

    def fake_blocks(table: Any) -> tuple[int, list[list[int | None]]] | None:
        sampled.append(f"blocks of {table.qualified}")
        return None if blocks is None else (16384, blocks)

    snapshotter._split = fake_split  # type: ignore[method-assign]
    snapshotter._block_ranges = fake_blocks  # type: ignore[method-assign]
    return snapshotter, sampled


_TABLE: Any = SimpleNamespace(qualified="public.t")


def _ranges(snapshotter: Snapshotter, *, exported: bool) -> list[dict[str, Any]]:
    """The table's ranges, as committed."""
    return [r.to_json() for r in snapshotter._ranges(_TABLE, exported=exported)]


def _committed(snapshotter: Snapshotter) -> dict[str, Any]:
    """The table's progress, as the next commit writes it."""
    return snapshotter.snap.tables["public.t"].to_json()


def test_a_new_table_is_split_into_ranges_that_meet_at_the_bounds() -> None:
    snapshotter, sampled = _snapshotter({"since": {"0": 0}}, [["10"], ["20"]])
    ranges = snapshotter._ranges(_TABLE, exported=False)
    assert ranges == [
        RangeProgress(after=None, upto=["10"]),
        RangeProgress(after=["10"], upto=["20"]),
        RangeProgress(after=["20"], upto=None),
    ]
    assert snapshotter.snap.tables["public.t"].ranges is ranges  # the progress committed with the chunks
    assert _committed(snapshotter) == {"since": {"0": 0}, "ranges": [r.to_json() for r in ranges]}
    assert sampled == ["public.t"]


def test_a_small_table_is_one_unbounded_range() -> None:
    snapshotter, _ = _snapshotter({}, [])
    assert _ranges(snapshotter, exported=False) == [{"after": None, "upto": None, "done": False}]


def test_committed_ranges_are_kept_and_not_split_again() -> None:
    ranges = [{"after": ["7"], "upto": ["10"], "done": False}, {"after": ["10"], "upto": None, "done": True}]
    snapshotter, sampled = _snapshotter({"ranges": ranges}, [["5"]])
    assert _ranges(snapshotter, exported=False) == ranges
    assert sampled == []


@pytest.mark.parametrize("key", [["42"], ["a", "2026-01-01 00:00:00+00"]])
def test_a_table_begun_in_one_range_goes_on_after_its_last_key(key: list[str]) -> None:
    progress: dict[str, Any] = {"after": key, "done": False, "since": {"0": 3}}
    snapshotter, sampled = _snapshotter(progress, [["99"]])
    assert _ranges(snapshotter, exported=False) == [{"after": key, "upto": None, "done": False}]
    # One place for the position: the range.
    assert _committed(snapshotter) == {"since": {"0": 3}, "ranges": [{"after": key, "upto": None, "done": False}]}
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


def test_a_new_table_in_the_slots_snapshot_is_read_in_block_ranges() -> None:
    snapshotter, sampled = _snapshotter({}, [["10"]], blocks=[[0, 4096], [4096, None]])
    ranges = _ranges(snapshotter, exported=True)
    assert ranges == [
        {"after": None, "upto": None, "done": False, "blocks": [0, 4096], "filenode": 16384},
        {"after": None, "upto": None, "done": False, "blocks": [4096, None], "filenode": 16384},
    ]
    assert _committed(snapshotter) == {"ranges": ranges}
    assert sampled == ["blocks of public.t"]  # no key sample


def test_a_table_not_to_be_read_in_blocks_is_split_by_key_even_in_the_slots_snapshot() -> None:
    snapshotter, sampled = _snapshotter({}, [["10"]], blocks=None)  # too large, partitioned, no C build
    assert _ranges(snapshotter, exported=True) == [
        {"after": None, "upto": ["10"], "done": False},
        {"after": ["10"], "upto": None, "done": False},
    ]
    assert sampled == ["blocks of public.t", "public.t"]


def test_a_fresh_snapshot_never_reads_in_block_ranges() -> None:
    snapshotter, sampled = _snapshotter({}, [], blocks=[[0, None]])
    assert _ranges(snapshotter, exported=False) == [{"after": None, "upto": None, "done": False}]
    assert sampled == ["public.t"]


def test_a_table_interrupted_in_block_ranges_starts_again_in_key_order() -> None:
    """Block positions hold only in the snapshot they were read in: a done block range says nothing about
    which rows are left in a new one, so none of them counts."""
    ranges = [
        {"after": None, "upto": None, "done": True, "blocks": [0, 4096], "filenode": 16384},
        {"after": None, "upto": None, "done": False, "blocks": [4096, None], "filenode": 16384},
    ]
    progress: dict[str, Any] = {"ranges": ranges, "since": {"0": 5}}
    snapshotter, sampled = _snapshotter(progress, [["10"]], blocks=[[0, None]])
    new = [{"after": None, "upto": ["10"], "done": False}, {"after": ["10"], "upto": None, "done": False}]
    assert _ranges(snapshotter, exported=False) == new
    # The new ranges are committed, and the re-snapshot's boundary is kept.
    assert _committed(snapshotter) == {"ranges": new, "since": {"0": 5}}
    assert sampled == ["public.t"]


def test_a_table_whose_block_ranges_are_all_read_is_not_read_again() -> None:
    """Every range read and committed, stopped before the table was finished (its gap deletes): it is done."""
    ranges = [{"after": None, "upto": None, "done": True, "blocks": [0, None], "filenode": 16384}]
    snapshotter, sampled = _snapshotter({"ranges": ranges}, [["10"]])
    assert _ranges(snapshotter, exported=False) == ranges
    assert sampled == []


@pytest.mark.parametrize(("blocks", "parts"), [(8192, 2), (10007, 3), (5, 3), (0, 1), (4096, 1)])
def test_block_cuts_cover_every_block_once_from_block_0_and_the_last_is_open_ended(blocks: int, parts: int) -> None:
    cuts = block_cuts(blocks, parts)
    assert len(cuts) == parts
    assert cuts[0][0] == 0
    assert cuts[-1][1] is None  # blocks added after the size was read are read too
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))  # each starts where the last ended
    sizes = [(hi if hi is not None else blocks) - lo for lo, hi in cuts]  # type: ignore[operator]
    assert sum(sizes) == blocks
    assert max(sizes) - min(sizes) <= 1  # balanced
