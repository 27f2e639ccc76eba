"""Rebuilding and verifying sinks: what `cdc sinks rebuild` and `cdc verify` run (the app's own rebuilds too).

A rebuild builds generation N+1 of each sink from offset zero beside the served one (a query of role
``rebuild``, sinks._query: its own checkpoint and status file), waits until it has caught up with the topics,
compares it with the source (:func:`verify`, by sinks._verify) and swaps every new generation in only when all
of them are clean. :func:`verify` compares a sink's served generation, or a named one, with the source;
:func:`never_ran` tells, before Spark starts, that a built-in sink has nothing to compare yet.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks._api import ChangesUnderRead, Rebuildable
from sinks._bridge import served_generation
from sinks._preflight import check_writable
from sinks._progress import REBUILD_FILE, TopicEnds, checkpoint_offsets, reached
from sinks._query import BUILT_IN, SinkQuery, opened, opened_without_spark
from sinks._reader import ensure_dead_letter_topic
from sinks._spark import spark_session, stop_session
from sinks._status import raised_by, short
from sinks._verify import Drift, compare
from sinks.errors import SinkConfigError, SinkError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

_CATCH_UP_TIMEOUT_S = 3600.0  # a rebuild that has not read every topic by then fails


# --- verify -----------------------------------------------------------------------------------


def never_ran(settings: SinkSettings, name: str) -> SinkConfigError | None:
    """The error for a built-in sink whose store has no served generation yet, found before Spark starts (a
    plugin's ``open`` may need Spark: it is asked inside :func:`verify`)."""
    if name not in BUILT_IN:
        return None
    sink = opened_without_spark(name, settings)
    try:
        return None if sink.current_generation() is not None else _never_ran(name)
    finally:
        sink.close()


_READS_UNDER_CHANGE = 5  # reads of a store that keeps changing its schema under them before verify gives up


def _never_ran(name: str) -> SinkConfigError:
    return SinkConfigError(f"sink {name!r} has never run: nothing to verify")


def verify(
    settings: SinkSettings,
    name: str,
    source_tables: Callable[[], Sequence[Any]],
    *,
    generation: int | None = None,
    wait_s: float = 0.0,
    spark: SparkSession | None = None,
) -> list[Drift]:
    """Compare until clean or ``wait_s`` has passed (a live store converges as its query catches up)."""
    session = spark if spark is not None else spark_session(settings, "pgcdc-verify")
    sink = opened(name, settings, generation or 0, session)
    try:
        if not isinstance(sink, Rebuildable):
            raise SinkConfigError(f"sink {name!r} cannot be read back (it does not implement sinks.Rebuildable)")
        deadline, reads = time.monotonic() + wait_s, 0
        while True:
            gen = generation if generation is not None else sink.current_generation()
            if gen is None:
                if time.monotonic() < deadline:  # a sink started moments ago has not set up its store yet
                    time.sleep(2.0)
                    continue
                raise _never_ran(name)
            reports, reads = settings.state / name / "verify", reads + 1
            try:
                drifts = compare(session, sink, source_tables(), gen, table_name=settings.table_name, reports=reports)
            except Exception as exc:
                if not _changed_under_read(sink, exc):
                    raise
                if reads >= _READS_UNDER_CHANGE:
                    raise
                log.info("verify %s: a table changed its shape while it was read; reading it again", name)
                continue
            if all(d.clean for d in drifts) or time.monotonic() >= deadline:
                return drifts
            time.sleep(2.0)
    finally:
        sink.close()
        if spark is None:
            stop_session(session)


def _changed_under_read(sink: object, error: Exception) -> bool:
    """Whether ``sink`` says its store changed under the read that raised ``error`` (sinks.ChangesUnderRead); a
    plugin whose answer itself fails leaves ``error`` as it is."""
    try:
        return isinstance(sink, ChangesUnderRead) and sink.changed_under_read(error) is True
    except Exception:
        log.warning("sink %s could not tell whether its store changed under a read", type(sink).__name__)
        return False


# --- rebuild ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InApp:
    """A rebuild inside the serving app (sinks._moves): its Spark session, and its stop (set: the rebuild ends
    before its swap)."""

    spark: SparkSession
    stop: threading.Event
    reason: str = ""  # why, for `cdc status` and the dashboard (the rebuild's status file)


@dataclass(frozen=True)
class Rebuilt:
    """One sink's part of a rebuild: the generation built beside the served one, and its final comparison."""

    name: str
    generation: int
    drifts: list[Drift]

    @property
    def clean(self) -> bool:
        return all(d.clean for d in self.drifts)


def rebuild(
    settings: SinkSettings,
    names: Sequence[str],
    source_tables: Callable[[], Sequence[Any]],
    *,
    verify_wait_s: float = 120.0,
    report: Callable[[str], None] = print,
    app: InApp | None = None,
) -> list[Rebuilt]:
    """Build generation N+1 of each sink from offset zero beside its served one, verify it, swap it in.

    The sinks rebuild side by side in one Spark application (one JVM start; their queries share its cores):
    ``app``'s when given (the serving app's: sinks._moves). Every new generation is swapped in only when all of
    them verify clean: on drift in any, none is swapped (the served copies stay) and the caller reports it, so
    a rebuild never leaves the stores half rebuilt.
    """
    check_writable(settings.state, "sinks.state_dir")
    spark = app.spark if app is not None else spark_session(settings, f"pgcdc-rebuild-{'-'.join(names)}")
    stop = app.stop if app is not None else threading.Event()
    ensure_dead_letter_topic(settings)
    queries: list[SinkQuery] = []
    results: list[Rebuilt] = []
    try:
        for name in names:  # one that cannot start (a sink that cannot be rebuilt) stops those started before it
            q = _rebuild_query(settings, name, spark, report)
            queries.append(q)
            if app is not None and app.reason:
                q.status.update(reason=app.reason)
        for q in queries:
            _catch_up(q, settings, _CATCH_UP_TIMEOUT_S, stop)
            report(f"generation {q.generation} of {q.name} caught up with the topics")
        for q in queries:
            report(f"verifying generation {q.generation} of {q.name} against the source")
            q.status.update(state="verifying")
            drifts = verify(settings, q.name, source_tables, generation=q.generation, wait_s=verify_wait_s, spark=spark)
            results.append(Rebuilt(q.name, q.generation, drifts))
    finally:
        outcomes = {r.name: "done" if r.clean else "drift" for r in results}
        for q in queries:
            q.stop()
            q.status.update(state=outcomes.get(q.name, "failed"), finished_at=time.time())
    if all(r.clean for r in results):
        for r in results:
            swapper = opened(r.name, settings, r.generation, spark)
            swapper.swap(r.generation)
            swapper.close()
            report(f"{r.name}: generation {r.generation} is now served; generation {r.generation - 1} was dropped")
    return results


def _rebuild_query(settings: SinkSettings, name: str, spark: SparkSession, report: Callable[[str], None]) -> SinkQuery:
    """A new generation of ``name`` prepared beside the served one, and its query started from offset zero."""
    probe: Any = opened(name, settings, 0, spark)
    if not isinstance(probe, Rebuildable):
        raise SinkConfigError(f"sink {name!r} does not support rebuild (it does not implement sinks.Rebuildable)")
    current = served_generation(probe)
    new = current + 1
    probe.prepare_generation(new)
    _close(probe)
    (settings.state / name / f"g{new}").remove_tree()
    report(f"rebuilding {name}: generation {new} from offset zero, while generation {current} keeps serving")
    # The rebuild's own status file: the served generation's status.json stays the running app's.
    (settings.state / name / REBUILD_FILE).remove()
    q = SinkQuery(name, settings, spark, new, role="rebuild")
    q.status.update(state="running", serving=current, started_at=time.time())
    q.start()
    return q


def _catch_up(q: SinkQuery, settings: SinkSettings, timeout_s: float, stop: threading.Event) -> None:
    """Wait until the rebuild's query has read everything, with a progress bar (records of the topics)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    ends = TopicEnds(settings)
    progress = Progress(
        TextColumn(f"rebuild {q.name} g{q.generation}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
    )
    task = progress.add_task("records", total=None)
    deadline = time.monotonic() + timeout_s

    def show() -> bool | None:
        """Update the bar; whether the checkpoint has reached the topics' ends (None: could not tell)."""
        with contextlib.suppress(Exception):  # progress is cosmetic: a metadata hiccup must not fail the rebuild
            marks = ends.read()
            done = checkpoint_offsets(q.checkpoint) or {}
            total = sum(high - low for low, high in marks.values())
            read = sum(min(high, done.get(tp, low)) - low for tp, (low, high) in marks.items())
            progress.update(task, total=total, completed=read)
            q.status.update(records_total=total, records_done=read)
            return reached(done, marks)
        return None

    try:
        with progress:
            for looks in itertools.count():
                if q.query is not None and not q.query.isActive:
                    error = q.query.exception()
                    if raised_by(error) is None:  # not one of ours: its whole account (Spark's own log is off)
                        log.warning("rebuild of %s: the query failed:\n%s", q.name, error)
                    raise SinkError(f"rebuild query of {q.name} failed: {short(error)}")
                if time.monotonic() > deadline:
                    raise SinkError(f"rebuild of {q.name} did not catch up within {timeout_s:.0f}s")
                if stop.is_set():
                    raise SinkError(f"rebuild of {q.name} stopped before it caught up")
                # Spark's own answer (lastProgress) is dozens of py4j round trips, ~80 ms of the JVM's CPU on
                # a busy machine: asked once the checkpoint says the end is near, and every 10 s regardless.
                if (show() is not False or looks % 10 == 9) and q.caught_up():
                    return
                stop.wait(1.0)
    finally:
        ends.close()


def _close(sink: Any) -> None:
    sink.close()
