"""Running the sinks: `cdc sinks run`'s app (:func:`run`) and the supervisor that keeps each sink's query going.

The supervisor starts each sink's query (sinks._query) with the generation its store serves, restarts it with
backoff when it fails, switches to the new generation when a rebuild swaps one in, and gives a sink up when
retrying cannot help. The built-ins' bridges (sinks._bridge) apply what their topics hold while Spark starts,
and a table moved to a new topic generation is rebuilt inside the app (sinks._moves, by sinks._rebuild).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from pgcdc_common.errors import CDCError
from sinks._api import DropsGeneration
from sinks._bridge import Bridge, served_generation
from sinks._feed import LaneFeed
from sinks._fold import share_decoding
from sinks._metrics import SinkMetrics
from sinks._moves import Mover
from sinks._plugins import load
from sinks._preflight import check_writable, missing_module
from sinks._progress import HEARTBEAT_S, topic_names
from sinks._query import BUILT_IN, GENERATION_CHANGED, SinkQuery, opened, opened_without_spark
from sinks._reader import Decoder, RegistryFolds, ensure_dead_letter_topic
from sinks._rebuild import InApp, Rebuilt, rebuild
from sinks._spark import spark_session, stop_session
from sinks._status import raised_by, short, sink_status, state_disk_full
from sinks.errors import PluginError, SinkConfigError, SinkTerminalError, SinkTransientError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

_HEALTHY_S = 300.0  # a query that ran this long before failing was healthy: its backoff starts over
_BRIDGE_WAIT_S = 120  # a bridge's store calls time out within this (their clients' own timeouts)


def run(
    settings: SinkSettings,
    names: Sequence[str],
    stop: threading.Event,
    source_tables: Callable[[], Sequence[Any]] | None = None,
) -> int:
    """Run the sinks until ``stop``; a failing sink is restarted with backoff, the others go on.

    A sink that cannot be loaded is reported and skipped; only when none is left is it an error.
    ``source_tables``: the source's tables, to verify what the app rebuilds after a table moved to a new topic
    generation (sinks._moves); without it, such a rebuild is left to `cdc sinks rebuild`.
    """
    usable, problems = [], []
    for name in names:
        try:
            load(name)
            usable.append(name)
        except PluginError as exc:
            problems.append(exc)
            log.error("%s; running the other sinks", exc)
    if not usable:
        raise problems[0] if problems else SinkConfigError("no sinks to run: name some or set sinks.enabled")
    check_writable(settings.state, "sinks.state_dir")
    if not reach_kafka(settings, stop):
        return 0  # stopped before Kafka answered: nothing ran, nothing to resume
    cfg = settings.sinks
    share_decoding(cfg.shared_decode_records)  # the sinks read the same records: each is decoded once
    metrics = SinkMetrics()
    server = metrics.serve(cfg.metrics_host, cfg.metrics_port) if cfg.metrics_enabled else None
    # The built-ins open without Spark: what their topics hold past their checkpoints is applied while it starts.
    bridges = {
        name: Bridge(settings, name, lambda name=name: opened_without_spark(name, settings))  # type: ignore[misc]
        for name in usable
        if name in BUILT_IN
    }
    for bridge in bridges.values():
        bridge.start()
    spark = spark_session(settings, "pgcdc-sinks")
    supervisor = _Supervisor(settings, usable, spark, metrics)
    supervisor.bridges = bridges
    if cfg.rebuild_moved_tables and source_tables is not None:
        supervisor.mover = _mover(settings, spark, source_tables)
    try:
        supervisor.run(stop)
    finally:  # a bridge still running (a store that hangs) is not waited for: what it writes is written again
        for bridge in bridges.values():
            bridge.finish()
        if server is not None:
            server.shutdown()
        stop_session(spark)
    return 0


def reach_kafka(
    settings: SinkSettings, stop: threading.Event, timeout_s: float = 30, backoff_s: tuple[float, float] = (1, 60)
) -> bool:
    """The app's first contact with Kafka (its dead-letter topic checked or created), retried while Kafka does
    not answer, ``backoff_s`` (first, most) apart with jitter: sinks started beside a broker that is restarting,
    or before the cluster is up, wait for it, as their queries do later. False when ``stop`` is set first: a
    stop cuts a wait short, and no attempt starts after it."""

    def report(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.error("%s; retrying in %.0fs", exc, state.upcoming_sleep)

    def pause(seconds: float) -> None:
        stop.wait(seconds)

    retrying = Retrying(
        retry=retry_if_exception_type(SinkTransientError),
        wait=wait_exponential_jitter(multiplier=backoff_s[0], max=backoff_s[1]),
        stop=lambda _: stop.is_set(),
        sleep=pause,
        before_sleep=report,
        reraise=True,
    )
    with contextlib.suppress(SinkTransientError):  # it ends the retries only once stop is set (tenacity's stop)
        for attempt in retrying:
            if stop.is_set():
                return False
            with attempt:
                ensure_dead_letter_topic(settings, timeout_s)
    return not stop.is_set()


def _mover(settings: SinkSettings, spark: SparkSession, source_tables: Callable[[], Sequence[Any]]) -> Mover:
    """The app's rebuilds after a table moved (sinks._moves), on its own Spark application."""

    def rebuild_moved(names: list[str], stop: threading.Event, reason: str) -> list[Rebuilt]:
        return rebuild(settings, names, source_tables, report=log.info, app=InApp(spark, stop, reason))

    return Mover(rebuild_moved, lambda: topic_names(settings), settings.kafka.topic_prefix)


class _Supervisor:
    """Keeps each sink's query running: started with the generation it serves, restarted with backoff when it
    fails, switched when a rebuild swaps in a new generation, given up when retrying cannot help."""

    def __init__(self, settings: SinkSettings, names: list[str], spark: SparkSession, metrics: SinkMetrics) -> None:
        self.settings, self.names, self.spark, self.metrics = settings, names, spark, metrics
        self.queries: dict[str, SinkQuery] = {}
        self.delays: dict[str, float] = {}  # the next backoff per sink
        self.started_at: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}
        self.given_up: dict[str, SinkTerminalError] = {}
        self.starting: dict[str, threading.Thread] = {}  # sinks whose start runs on its own thread
        self.bridges: dict[str, Bridge] = {}  # the sinks' bridges (sinks._bridge), joined before their query
        self.feed = LaneFeed(settings, RegistryFolds(Decoder(settings)))  # every lane's one reader
        self.mover: Mover | None = None  # rebuilds the sinks a moved table leaves behind (sinks._moves)
        self._outcomes: queue.SimpleQueue[tuple[str, SinkQuery | None, Exception | None]] = queue.SimpleQueue()

    def run(self, stop: threading.Event) -> None:
        for name in self.names:
            sink_status(self.settings, name).update(heartbeat_at=time.time())
        threading.Thread(target=self._heartbeat, args=(stop,), name="pgcdc-heartbeat", daemon=True).start()
        try:
            for name in self.names:
                self._start(name)
            while not stop.is_set():
                self._started()
                for name in self.names:
                    if name not in self.given_up and name not in self.starting:
                        self._check(name)
                if self.mover is not None:
                    self._follow_moves(self.mover)
                stop.wait(0.2 if self.starting else 1.0)
        finally:
            if self.mover is not None:
                self.mover.stop()
            for thread in list(self.starting.values()):  # a query started after this would outlive the app
                thread.join(120)
            with contextlib.suppress(CDCError):
                self._started()
            for q in self.queries.values():
                q.stop()
            self.feed.stop()
            for name in self.names:
                if name not in self.given_up:
                    sink_status(self.settings, name).update(state="stopped")

    def _follow_moves(self, mover: Mover) -> None:
        """Switches the sinks whose rebuilt generation is now served; starts a rebuild when a table moved (after
        the switch: the replaced generations' queries, behind the move, must not ask for another)."""
        for name in mover.swapped():
            q = self.queries.pop(name, None)
            if q is not None:  # else its start is under way, or its backoff: either takes the served generation
                q.stop()
                log.info("sink %s: switching to the rebuilt generation", name)
                self._start(name, replaced=q.generation)
        mover.look(self.queries)

    def _heartbeat(self, stop: threading.Event) -> None:
        # "Alive" for readers outside the app (cdc status, the capture's dashboard and metrics). Its own
        # thread: the loop blocks while a sink starts or stops (Spark, a store's timeouts).
        while not stop.wait(HEARTBEAT_S):
            for name in self.names:
                sink_status(self.settings, name).update(heartbeat_at=time.time())

    def _check(self, name: str) -> None:
        """Starts the sink when its backoff is over; looks at its query when it has stopped."""
        q = self.queries.get(name)
        if q is None:
            if time.monotonic() >= self.retry_at.get(name, 0):
                self._start(name)
            return
        if q.query is None:
            return
        if q.query.isActive:
            q.observe_progress()
            return
        error = q.query.exception()
        q.stop()
        self.queries.pop(name)
        if error is not None and GENERATION_CHANGED in str(error):
            log.info("sink %s: a rebuild swapped in a new generation; switching to it", name)
            self._start(name, replaced=q.generation)
            return
        full = state_disk_full(self.settings, name, error)
        if full is not None:  # terminal for the whole app: see pgcdc_common.errors.StateDiskFullError
            self.metrics.running.labels(name).set(0)
            raise full
        missing = missing_module(error)
        if missing is not None:
            self._give_up(name, missing)
            return
        if raised_by(error) is None:  # not one of ours: its whole account (Spark's own log is off)
            log.warning("sink %s: the query failed:\n%s", name, error)
        self._back_off(name, f"stopped: {short(error)}")

    def _start(self, name: str, replaced: int | None = None) -> None:
        """Starts the sink on a thread of its own: its warm-up takes seconds, which no other sink waits for.
        ``replaced``: the generation whose query stopped because a rebuild swapped in a new one."""
        self.started_at[name] = time.monotonic()
        thread = threading.Thread(target=self._launch, args=(name, replaced), name=f"pgcdc-start-{name}", daemon=True)
        self.starting[name] = thread
        thread.start()

    def _launch(self, name: str, replaced: int | None) -> None:
        try:
            q = self._warmed(name, replaced)
            q.start(self.metrics)
            q.status.update(state="running")
            self.metrics.running.labels(name).set(1)
            self._outcomes.put((name, q, None))
        except Exception as exc:
            self._outcomes.put((name, None, exc))

    def _warmed(self, name: str, replaced: int | None) -> SinkQuery:
        """The sink's query, warmed up, with its bridge ended: the query's batches never write beside it (see
        Bridge), whether the warm-up succeeded or not. ``replaced``: as for :meth:`_start`."""
        bridge = self.bridges.pop(name, None)
        try:
            if bridge is not None:  # the bridge settles (on a first start: creates) the served generation
                bridge.settled.wait(_BRIDGE_WAIT_S)
            probe = opened(name, self.settings, 0, self.spark)
            generation = served_generation(probe)
            if replaced is not None and replaced < generation and isinstance(probe, DropsGeneration):
                probe.drop_generation(replaced)  # what its last batch wrote after the swap's drop: see the protocol
                log.info("sink %s: generation %d's query stopped; what it left was dropped", name, replaced)
            probe.close()
            q = SinkQuery(name, self.settings, self.spark, generation)
            q.feed = self.feed
            q.warm()
            return q
        finally:
            if bridge is not None:
                bridge.finish()
                bridge.join(_BRIDGE_WAIT_S)
                if bridge.is_alive():
                    log.warning("sink %s: its bridge still runs after %ds; the query starts", name, _BRIDGE_WAIT_S)

    def _started(self) -> None:
        """Takes the outcome of each start that has ended (on the supervisor's thread, which owns its state)."""
        while True:
            try:
                name, q, exc = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self.starting.pop(name, None)
            if q is not None:
                self.queries[name] = q
            elif isinstance(exc, SinkTerminalError):
                self._give_up(name, exc)
            else:  # the store or Kafka not reachable yet, a plugin's own failure
                full = state_disk_full(self.settings, name, exc)
                if full is not None:
                    raise full from exc
                self._back_off(name, f"could not start ({short(exc)})")

    def _back_off(self, name: str, why: str) -> None:
        # A query that ran a while before failing starts the backoff over; a crash loop doubles it up to 60 s.
        ran = time.monotonic() - self.started_at.get(name, time.monotonic())
        delay = 2.0 if ran > _HEALTHY_S else min(self.delays.get(name, 1.0) * 2, 60.0)
        self.delays[name], self.retry_at[name] = delay, time.monotonic() + delay
        self.metrics.running.labels(name).set(0)
        sink_status(self.settings, name).update(state="backoff", last_error=why)
        log.error("sink %s %s; restarting in %.0fs", name, why, delay)

    def _give_up(self, name: str, exc: SinkTerminalError) -> None:
        # Retrying cannot help (its configuration, say): this sink stops, the others go on.
        self.queries.pop(name, None)
        bridge = self.bridges.pop(name, None)
        if bridge is not None:
            bridge.finish()
        self.given_up[name] = exc
        self.metrics.running.labels(name).set(0)
        sink_status(self.settings, name).update(state="given_up", last_error=short(exc))
        log.error("sink %s cannot run: %s; the other sinks go on", name, exc)
        if len(self.given_up) == len(self.names):
            raise exc
