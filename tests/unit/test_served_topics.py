"""Which topic generation a store generation reads (sinks._served), and the serving app's rebuild after a move
(sinks._moves): the rules, with the rebuild and the topic listing as plain functions."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sinks import _moves
from sinks._moves import Mover
from sinks._served import ServedTopics, served_topics
from sinks.config import SinkSettings
from sinks.errors import SinkConfigError

TOPICS = ["p.public.items", "p.public.items.g2", "p.public.other", "p.public.later"]


def test_a_store_generation_reads_the_generation_it_began_with_and_later_tables_from_their_first() -> None:
    served = ServedTopics("p", {"p.public.items": 1, "p.public.other": 1})
    assert served.superseded(TOPICS) == {"p.public.items.g2"}
    assert served.behind(TOPICS) == {"p.public.items": (1, 2)}
    # A table created after the store generation began, and moved since: read from its first generation.
    assert served.superseded([*TOPICS, "p.public.later.g2"]) == {"p.public.items.g2", "p.public.later.g2"}
    # One begun after the move reads the new generation, and is behind nothing.
    moved = ServedTopics("p", {"p.public.items": 2})
    assert moved.superseded(TOPICS) == {"p.public.items"}
    assert moved.behind(TOPICS) == {}
    # The chosen topic deleted by hand: the newest is read.
    assert served.superseded(["p.public.items.g2", "p.public.items.g3"]) == {"p.public.items.g2"}


def test_a_sink_without_generations_reads_each_tables_newest() -> None:
    newest = ServedTopics("p", None)
    assert newest.superseded(TOPICS) == {"p.public.items"}
    assert newest.behind(TOPICS) == {}


def test_the_choice_is_made_once_per_store_generation_and_kept(tmp_path: Path) -> None:
    settings = SinkSettings.model_validate({"kafka": {"topic_prefix": "p"}, "sinks": {"state_dir": str(tmp_path)}})
    first = served_topics(settings, "search", 3, lambda: ["p.public.items", "p.public.other"])
    assert first.chosen == {"p.public.items": 1, "p.public.other": 1}
    again = served_topics(settings, "search", 3, lambda: TOPICS)  # the table moved since: the choice stays
    assert again.chosen == first.chosen
    assert served_topics(settings, "search", 4, lambda: TOPICS).chosen == {
        "p.public.items": 2,
        "p.public.other": 1,
        "p.public.later": 1,
    }
    (tmp_path / "search" / "g3" / "topics.json").write_text("[1, 2]")
    with pytest.raises(SinkConfigError, match=r"g3/topics.json: not the topic generations .* delete the file"):
        served_topics(settings, "search", 3, lambda: TOPICS)


@dataclass
class _Query:
    name: str
    generation: int
    served: ServedTopics

    def behind(self, topics: Iterable[str]) -> dict[str, tuple[int, int]]:
        return self.served.behind(topics)


@dataclass(frozen=True)
class _Outcome:
    name: str
    generation: int
    clean: bool


class _Rebuilds:
    """Records each rebuild asked for; ``clean``: what every outcome says."""

    def __init__(self, clean: bool = True) -> None:
        self.asked: list[list[str]] = []
        self.reasons: list[str] = []
        self.clean = clean

    def __call__(self, names: list[str], stop: threading.Event, reason: str) -> list[Any]:
        self.asked.append(names)
        self.reasons.append(reason)
        return [_Outcome(name, 2, self.clean) for name in names]


def test_the_app_rebuilds_the_sinks_a_moved_table_leaves_behind_and_switches_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_moves, "LOOK_S", 0.0)
    rebuilds = _Rebuilds()
    topics = ["p.public.items", "p.public.other"]
    mover = Mover(rebuilds, lambda: list(topics), "p")
    queries = {
        name: _Query(name, 1, ServedTopics("p", {"p.public.items": 1, "p.public.other": 1}))
        for name in ("cache", "search")
    }
    mover.look(queries)
    assert not mover.running  # nothing moved
    assert rebuilds.asked == []
    topics.append("p.public.items.g2")
    mover.look(queries)
    mover.wait(10)
    assert rebuilds.asked == [["cache", "search"]]
    assert rebuilds.reasons == ["public.items moved to topic generation 2"]
    mover.look(queries)  # the replaced generations' queries, not yet switched: no second rebuild
    assert rebuilds.asked == [["cache", "search"]]
    assert mover.swapped() == ["cache", "search"]
    assert mover.swapped() == []
    assert (
        "table public.items moved to topic generation 2 (a type change its topic could not take): the served "
        "copies of cache, search hold what topic generation 1 held" in caplog.text
    )


def test_a_rebuild_that_drifts_swaps_nothing_and_waits_before_it_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_moves, "LOOK_S", 0.0)
    rebuilds = _Rebuilds(clean=False)
    mover = Mover(rebuilds, lambda: ["p.public.items", "p.public.items.g2"], "p")
    queries = {"sql": _Query("sql", 1, ServedTopics("p", {"p.public.items": 1}))}
    mover.look(queries)
    mover.wait(10)
    assert mover.swapped() == []
    assert "the rebuild of sql failed (sql differed from the source" in caplog.text
    assert "`cdc sinks rebuild sql`" in caplog.text
    mover.look(queries)  # within RETRY_S: not again
    assert rebuilds.asked == [["sql"]]
