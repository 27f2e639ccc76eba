"""The demo's measure of freshness: when each store first showed a change of the live workload."""

from __future__ import annotations

from pgcdc._demo import _FirstRows


def test_each_store_is_timed_from_the_first_change_to_its_first_live_row() -> None:
    first = _FirstRows()
    snapshot = {"search public.customers": (150, "150 documents"), "cache public.customers": (200, "200 entries")}
    first.look(snapshot)  # before any change: not timed
    assert first.after == {}
    first.changed()
    began = first.first_change
    first.changed()  # only the first change counts
    assert first.first_change == began
    # The snapshot still arriving in a store is not a live change: only rows of the table the workload fills are.
    landed = {
        "search public.customers": (200, "200 documents"),
        "search public.orders": (0, "0 documents"),
        "cache public.orders": (2, "2 entries"),
        "warehouse public.customers": (200, "200 rows"),
    }
    first.look(landed)
    assert set(first.after) == {"cache"}
    cache = first.after["cache"]
    first.look({"search public.orders": (1, "1 documents"), "cache public.orders": (9, "9 entries")})
    assert set(first.after) == {"cache", "search"}
    assert first.after["cache"] == cache  # the first time only
    assert first.note("cache public.customers").startswith(" (changes arriving ")
    assert first.note("warehouse public.orders") == ""
    summary = first.summary()
    assert "warehouse never during the live part" in summary
    assert summary.index("search") < summary.index("cache")  # in the stores' order
    first.look({"warehouse public.orders": (1, "1 rows")})
    assert "warehouse" in first.after
    assert first.note("warehouse public.orders").startswith(" (changes arriving ")
