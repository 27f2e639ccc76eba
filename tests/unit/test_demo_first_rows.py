"""The demo's measure of freshness: when each store first showed a change of the live workload."""

from __future__ import annotations

from pgcdc._demo import _FirstRows


def test_each_store_is_timed_from_the_first_change_to_its_first_live_row() -> None:
    first = _FirstRows()
    snapshot = {"search public.customers": (150, "150 documents"), "cache public.customers": (200, "200 entries")}
    first.look(snapshot, 1_000)  # before any change: not timed
    assert first.after == {}
    first.changed(2.0)
    first.changed(3.0)  # only the first change counts
    assert first.began_ms == 2_000
    # The snapshot still arriving in the search index is not a live change; the warehouse's snapshot batch lands
    # during the live part: its count grows, its newest change is older.
    landed = {
        "search public.customers": (200, "200 documents"),
        "search public.orders": (0, "0 documents"),
        "cache public.orders": (2, "2 entries"),
        "warehouse": (200, "1 batches, 200 events"),
    }
    first.look(landed, 1_500)
    assert set(first.after) == {"cache"}
    cache = first.after["cache"]
    first.look({"search public.orders": (1, "1 documents"), "cache public.orders": (9, "9 entries")}, 1_999)
    assert set(first.after) == {"cache", "search"}
    assert first.after["cache"] == cache  # the first time only
    assert first.note("cache public.customers").startswith(" (changes arriving ")
    assert first.note("warehouse") == ""
    summary = first.summary()
    assert "warehouse never during the live part" in summary
    assert summary.index("search") < summary.index("cache")  # in the stores' order
    first.look({}, 2_000)  # a change committed after the live part began
    assert "warehouse" in first.after
    assert first.note("warehouse").startswith(" (changes arriving ")
