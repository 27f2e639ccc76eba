"""The serving app follows a table the capture moved to a new topic generation (docs/events.md, Type changes).

Each store generation reads every table from one topic generation (sinks._served), so after a move the served
copy of that table stays as it was at the move, and the other tables go on. :class:`Mover` looks at the topics
every :data:`LOOK_S`; when a served sink reads a table from an older generation than the newest, it rebuilds
those sinks from offset zero beside the served copies, in the app's own Spark application (sinks._rebuild.rebuild:
verified against the source before the swap, every sink or none), and tells the supervisor which sinks to
switch to their new generation. A rebuild that fails or drifts is tried again after :data:`RETRY_S`; the served
copies stay meanwhile. ``sinks.rebuild_moved_tables = false`` leaves it to `cdc sinks rebuild`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

LOOK_S = 10.0  # how often the topics are looked at for a moved table
RETRY_S = 600.0  # the wait before a failed or drifted rebuild is tried again


class Serving(Protocol):
    """What the mover needs of a served query (sinks._query.SinkQuery)."""

    name: str
    generation: int

    def behind(self, topics: Iterable[str]) -> dict[str, tuple[int, int]]:
        """The tables (first topic) its store generation reads from an older topic generation: (read, newest);
        empty for a query that is not its sink's served, rebuildable one."""
        ...


class Rebuilds(Protocol):
    def __call__(self, names: list[str], stop: threading.Event, reason: str) -> Sequence[Any]:
        """Rebuilds ``names`` side by side (``reason``: why, for their status); their outcomes (each with
        ``name``, ``generation``, ``clean``)."""
        ...


class Mover:
    """Starts a rebuild of the served sinks a moved table leaves behind, one rebuild at a time (see the module).
    Its methods are called on the supervisor's thread; the rebuild runs on one of its own."""

    def __init__(self, rebuild: Rebuilds, topics: Callable[[], list[str]], prefix: str) -> None:
        self._rebuild, self._topics, self._prefix = rebuild, topics, prefix
        self._next_look = 0.0
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._swapped: list[str] = []  # sinks whose new generation the rebuild swapped in, not yet switched to
        self._lock = threading.Lock()
        self._told: set[tuple[str, int]] = set()  # (table, newest generation) already logged

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def look(self, queries: Mapping[str, Serving]) -> None:
        """Every LOOK_S: rebuilds the sinks whose served generation reads a table from an older topic one. Not
        while a rebuild runs, nor before the sinks it swapped in are switched (:meth:`swapped`): ``queries``
        would still hold the replaced generations, behind the move."""
        with self._lock:
            switching = bool(self._swapped)
        if self.running or switching or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LOOK_S
        try:
            topics = self._topics()
        except Exception as exc:  # the broker not reachable now: the next look asks again
            log.debug("moved tables: could not list the topics (%s)", exc)
            return
        behind = {name: q.behind(topics) for name, q in queries.items()}
        names = sorted(name for name, tables in behind.items() if tables)
        if not names:
            return
        self._tell(behind)
        moved = {base: newest for tables in behind.values() for base, (_, newest) in tables.items()}
        reason = ", ".join(f"{self._table(base)} moved to topic generation {g}" for base, g in sorted(moved.items()))
        self._thread = threading.Thread(target=self._run, args=(names, reason), name="pgcdc-rebuild-moved", daemon=True)
        self._thread.start()

    def swapped(self) -> list[str]:
        """The sinks whose rebuilt generation is now served (each named once): their queries are switched."""
        with self._lock:
            names, self._swapped = self._swapped, []
        return names

    def stop(self, wait_s: float = 30.0) -> None:
        self._halt.set()
        self.wait(wait_s)

    def wait(self, timeout_s: float) -> None:
        """Until the rebuild under way, if any, has ended (or ``timeout_s`` has passed)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _tell(self, behind: Mapping[str, dict[str, tuple[int, int]]]) -> None:
        """One line per moved table (each once): which generation it moved to, which sinks serve an older one."""
        tables: dict[tuple[str, int, int], list[str]] = {}
        for name, moved in sorted(behind.items()):
            for base, (read, newest) in moved.items():
                tables.setdefault((base, read, newest), []).append(name)
        for (base, read, newest), names in sorted(tables.items()):
            if (base, newest) not in self._told:
                self._told.add((base, newest))
                log.warning(
                    "table %s moved to topic generation %d (a type change its topic could not take): the served "
                    "copies of %s hold what topic generation %d held; rebuilding them beside it",
                    self._table(base),
                    newest,
                    ", ".join(names),
                    read,
                )

    def _table(self, base: str) -> str:
        """``schema.table`` of a table's first topic."""
        return base[len(self._prefix) + 1 :] if base.startswith(self._prefix + ".") else base

    def _run(self, names: list[str], reason: str) -> None:
        started = time.monotonic()
        try:
            results = self._rebuild(names, self._halt, reason)
        except Exception as exc:
            self._failed(names, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if all(r.clean for r in results):
            with self._lock:
                self._swapped.extend(r.name for r in results)
            served = ", ".join(f"{r.name} generation {r.generation}" for r in results)
            log.info("moved tables: rebuilt and verified in %.0fs; now served: %s", time.monotonic() - started, served)
        else:
            drifted = ", ".join(r.name for r in results if not r.clean)
            self._failed(names, f"{drifted} differed from the source after the rebuild; nothing was swapped in")

    def _failed(self, names: list[str], why: str) -> None:
        if self._halt.is_set():
            return
        self._next_look = time.monotonic() + RETRY_S
        log.error(
            "moved tables: the rebuild of %s failed (%s); the served copies stay, and it is tried again in %.0f "
            "minutes (or run `cdc sinks rebuild %s`)",
            ", ".join(names),
            why,
            RETRY_S / 60,
            " ".join(names),
        )
