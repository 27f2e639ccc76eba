"""Which topic generation of each table a store generation reads (docs/events.md, Type changes).

A table the capture moved to a later topic generation (a type change its topic could not take) has events in
schemas the stores built from the earlier generation may refuse: a column gone from int to text cannot go into
the Delta column or the OpenSearch field made for the int. So a store generation reads each table from the
topic generation that was the table's newest when the store generation began, and goes on serving what that
one holds (nothing more arrives in it after the move); the next store generation, rebuilt from the newest
topics beside it (by the serving app itself, sinks._moves, or by `cdc sinks rebuild`), is verified and swapped
in, and reads the moved table from its new generation.

The choice is written once per store generation, ``<state_dir>/<sink>/g<N>/topics.json`` ({first topic:
generation}), before anything is read for it. A table not in it (created later) is read from its first
generation; one whose chosen topic is gone (deleted by hand) from its newest (pgcdc_common.topics.superseded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pgcdc_common.topics import newest_generations, superseded
from sinks.errors import SinkConfigError

if TYPE_CHECKING:
    from sinks._config import SinkSettings
    from sinks._storage import Location

_FILE = "topics.json"


@dataclass(frozen=True)
class ServedTopics:
    """One store generation's topic generation per table (see the module)."""

    prefix: str
    # a table's first topic -> the generation this store generation reads; None: each table's newest (a sink
    # without generations, which cannot be rebuilt, takes a moved table's new events as they come)
    chosen: Mapping[str, int] | None

    def superseded(self, topics: Iterable[str]) -> set[str]:
        """The topics among ``topics`` this store generation does not read."""
        return superseded(topics, self.prefix, self.chosen)

    def behind(self, topics: Iterable[str]) -> dict[str, tuple[int, int]]:
        """The tables (first topic) read from an older generation than their newest among ``topics``:
        (read, newest). Their next store generation must be rebuilt to serve what they hold now."""
        names = list(topics)
        skipped = self.superseded(names)
        read = newest_generations([t for t in names if t not in skipped], self.prefix)
        newest = newest_generations(names, self.prefix)
        return {base: (read[base], newest[base]) for base in newest if read.get(base, newest[base]) < newest[base]}


def served_topics(
    settings: SinkSettings, sink: str, generation: int, topics: Callable[[], Iterable[str]]
) -> ServedTopics:
    """The choice of ``sink``'s store ``generation``: read from its file, or made from ``topics()`` (each
    table's newest) and written, when the generation has none yet (a new one; or one from a release before
    type changes moved tables, which read the newest too)."""
    path = location(settings, sink, generation)
    prefix = settings.kafka.topic_prefix
    text = path.read_text()
    if text is None:
        chosen = newest_generations(topics(), prefix)
        path.write_text(json.dumps({"generations": chosen}, sort_keys=True))
        return ServedTopics(prefix, chosen)
    try:
        found = json.loads(text)["generations"]
        return ServedTopics(prefix, {str(base): int(gen) for base, gen in found.items()})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SinkConfigError(
            f"{path}: not the topic generations a store generation reads ({exc}); delete the file to have it "
            "made again from each table's newest topic"
        ) from exc


def location(settings: SinkSettings, sink: str, generation: int) -> Location:
    return settings.state / sink / f"g{generation}" / _FILE
