"""What an app reads while Spark starts (sinks._bridge.backlog_ranges): past each partition's committed offset
(from its start when the checkpoint does not name it: a first start, a new topic), within what the topic still
holds, at most so many offsets."""

from __future__ import annotations

from sinks._bridge import backlog_ranges


def test_backlog_ranges_start_at_the_commit_and_stop_at_the_bound() -> None:
    a, b, c, d = ("t", 0), ("t", 1), ("u", 0), ("u", 1)
    done = {a: 10, b: 50, c: 3}
    ends = {
        a: (0, 25),  # 15 new
        b: (0, 50),  # nothing new
        c: (8, 9_000),  # compacted below the commit, and more than the bound
        d: (0, 40),  # not in the checkpoint: read from its start, as the query reads it
    }
    assert backlog_ranges(done, ends, 1_000) == {a: (10, 25), c: (8, 1_008), d: (0, 40)}


def test_a_first_start_reads_every_partition_from_its_start() -> None:
    ends = {("t", 0): (0, 3_000), ("t", 1): (5, 5), ("u", 0): (12, 20)}
    assert backlog_ranges({}, ends, 1_000) == {("t", 0): (0, 1_000), ("u", 0): (12, 20)}
