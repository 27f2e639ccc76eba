"""Which topics count as a test's leftovers: only those are ever deleted from the local broker."""

from __future__ import annotations

import pytest
from pgcdc_dev import leftovers


@pytest.mark.parametrize(
    ("topic", "deleted"),
    [
        ("plainf964bd61a3", True),  # a test's prefix and its `unique` suffix
        ("txgap.table.0a1b2c3d4e", True),
        ("hb55af816e1.public.t", True),
        ("pgcdc.public.orders", False),  # a demo's
        ("bench_bigtxn_1795542778686.public.events", False),  # a benchmark's: digits only
        ("kafkasql-snapshots", False),  # the registry's
        ("registry-events", False),
        ("__consumer_offsets", False),
        ("_apicurio_registry", False),
    ],
)
def test_only_topics_named_like_a_tests_are_cleaned_up(topic: str, deleted: bool) -> None:
    assert leftovers.made_by_a_test(topic) is deleted
