"""Running `cdc sinks …` and `cdc verify` as an operator would: child processes on one config file."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

import psycopg
import pytest
from pgcdc_dev.cluster import ObjectStoreBucket, submit_command, submit_env

from cdc import source_tables
from pgcdc_common.errors import CDCError
from sinks.config import load_sink_settings
from sinks.progress import TopicEnds, sink_progress
from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    ChildProcess,
    LogView,
    records_to_end,
    scratch_database,
    wait_for,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from redis import Redis

# Every test that runs Spark (in the test's process or in a child) carries this mark. When `./dev test` spreads
# the tests over two pytest-xdist workers (--dist loadgroup), they all run one after another on one worker,
# which shares one SparkSession between the in-process ones, while the other worker runs the capture's tests:
# two Spark applications side by side overload two cores. The type zoo's modules carry it too: each makes its
# own zoo, and they share the server-wide extensions (tests/integration/test_types_zoo.py).
SPARK_WORKER = pytest.mark.xdist_group("spark")


@dataclass(frozen=True)
class Stack:
    """Where the services of the whole pipeline are (the `stack` fixture)."""

    kafka: str
    registry: str
    opensearch: str
    redis: str
    spark_jars: list[str]

    def config(
        self,
        dsn: str,
        tables: list[str],
        *,
        prefix: str,
        unique: str,
        workdir: Path,
        bucket: ObjectStoreBucket | None = None,
    ) -> CdcConfig:
        """The capture's and the sinks' configuration in one file, state and warehouse under ``workdir``, or
        in ``bucket`` of an object store."""
        state, warehouse, storage = str(workdir / "state"), str(workdir / "warehouse"), ""
        if bucket is not None:
            state, warehouse, storage = bucket.uri("state"), bucket.uri("warehouse"), bucket.toml()
        return CdcConfig(
            dsn=dsn,
            kafka=self.kafka,
            registry=self.registry,
            prefix=prefix,
            tables=tables,
            slot=f"s_{unique}",
            publication=f"p_{unique}",
            extra=f"""
[sinks]
state_dir = "{state}"
trigger_interval_s = 1.0
lane_trigger_interval_s = 2.0  # the tests wait for checkpoints: at most 2 s apart, not the default 5
metrics_port = 0
spark_jars = {json.dumps(self.spark_jars)}
{storage}

[sinks.search]
url = "{self.opensearch}"

[sinks.cache]
url = "{self.redis}"

[sinks.warehouse]
path = "{warehouse}"
history = true
trigger_interval_s = 1.0
""",
        )


def cdc(*args: str, timeout: float = 600, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cdc ARGS``; ``env``: variables added to this process's environment (settings: ``CDC_…``)."""
    return subprocess.run(
        [sys.executable, "-m", "pgcdc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env} if env else None,
    )


class SinksLog(LogView):
    """The sinks' log, whether a child process or the test's own process writes it."""

    def batches(self) -> int:
        return self.log.read_text(errors="replace").count(": batch ") if self.log.exists() else 0


class SinksProcess(ChildProcess, SinksLog):
    """`cdc sinks run [NAME…]` on a configuration file."""

    def __init__(self, config: Path, log: Path, names: list[str] | None = None) -> None:
        super().__init__(["sinks", "run", *(names or []), "--config", str(config)], log)

    def stop(self) -> int:
        """SIGTERM if still running; the exit code."""
        assert self.proc is not None
        return self.terminate(120) if self.alive() else int(self.proc.returncode)


class InProcessSinks(SinksLog):
    """`cdc sinks run [NAME…]` inside the test process, on the run's one Spark application (the ``spark``
    fixture): for tests of what the stores hold. Starting Spark is most of a small test's time; tests of the
    process itself (kills, signals, exit codes, spark-submit, its log) use :class:`SinksProcess`.

    The same face as :class:`SinksProcess`: ``start``, ``stop`` (the exit code `cdc` would give), ``alive``,
    ``tail``, ``batches`` (the sinks' log lines go to ``log``), and ``kill``, which can only stop it."""

    def __init__(self, spark: SparkSession, config: Path, log: Path, names: list[str] | None = None) -> None:
        self.spark, self.config, self.log, self.names = spark, config, log, names or []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self.exit_code: int | None = None

    def start(self) -> None:
        from sinks.app import run as run_sinks

        settings = load_sink_settings(self.config)
        self._stop = threading.Event()
        self.exit_code = None
        self._listen()

        def run() -> None:
            try:
                names = self.names or list(settings.sinks.enabled)
                self.exit_code = run_sinks(settings, names, self._stop, lambda: source_tables(self.config))
            except CDCError as exc:
                logging.getLogger("cdc.sinks").error("cdc: error: %s", exc)
                self.exit_code = exc.exit_code
            except BaseException:
                logging.getLogger("cdc.sinks").exception("the sinks failed")
                self.exit_code = 1

        self._thread = threading.Thread(target=run, name="test-sinks", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        """The sinks' log lines (as `cdc`'s own format writes them) appended to ``log``."""
        handler = logging.FileHandler(self.log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.INFO)
        self._handler = handler

    def stop(self) -> int:
        """Stops it as a SIGTERM would; the exit code `cdc sinks run` would give."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(180)
            assert not self._thread.is_alive(), f"the sinks did not stop within 180s:\n{self.tail()}"
        if self._handler is not None:
            for name in _LOGGERS:
                logging.getLogger(name).removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        return 1 if self.exit_code is None else self.exit_code

    kill = stop

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


_LOGGERS = ("sinks", "cdc")


def cdc_here(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`cdc sinks …` or `cdc verify …` run in the test process on the run's Spark application (the ``spark``
    fixture must be set up), as :func:`cdc` would run it: its output and exit code as a CompletedProcess."""
    from pgcdc import sinks_cli

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        code = sinks_cli.main(list(args))
    return subprocess.CompletedProcess(["cdc", *args], code, out.getvalue(), err.getvalue())


def dead_letters(kafka: str, topic: str) -> list[dict[str, str]]:
    """Every record the dead-letter ``topic`` holds now: its headers (pgcdc.sink, pgcdc.error, …) and repr'd
    value (read to the topic's end; none while the topic does not exist)."""
    out = []
    for msg in records_to_end(kafka, topic):
        pairs: list[tuple[str, bytes]] = list(msg.headers() or [])  # type: ignore[arg-type]
        out.append({k: v.decode() for k, v in pairs} | {"value": repr(msg.value())})
    return out


PIPELINE_TABLES = ["public.items", 'public."Notes"']


def cached_row(cache: Redis, prefix: str, key: str, table: str = "public.t") -> dict[str, object] | None:
    """The cache sink's row of ``key`` (the primary key as the cache names it: '[1]', '["b"]') in generation 1."""
    row = cache.hget(f"{prefix}:g1:{table}:{key}", "row")
    return None if row is None else dict(json.loads(row))


def create_pipeline_tables(dsn: str) -> None:
    """The pipeline tests' source: ``items`` (every kind of column the sinks map) and a mixed-case table
    with a composite key."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(10,2), "
            "at timestamptz DEFAULT '2026-01-02 03:04:05.123456+00', day date DEFAULT 'infinity', tags text[])"
        )
        conn.execute(
            "INSERT INTO items (id, name, qty, price) SELECT g, 'item ' || g, g, g * 1.5 FROM generate_series(1, 300) g"
        )
        conn.execute('CREATE TABLE "Notes" (k text, n int, body text, PRIMARY KEY (k, n))')
        conn.execute("""INSERT INTO "Notes" SELECT 'k' || (g % 7), g, 'note ' || g FROM generate_series(1, 50) g""")


def pipeline_workload(dsn: str, stop: threading.Event, errors: list[BaseException], seed: int) -> None:
    """Small transactions of inserts, updates and deletes on ``items`` until ``stop``; errors go to ``errors``."""
    rnd = random.Random(seed)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            next_id = 10_000
            while not stop.is_set():
                with conn.transaction():
                    for _ in range(rnd.randint(1, 5)):
                        r = rnd.random()
                        if r < 0.45:
                            next_id += 1
                            conn.execute(
                                "INSERT INTO items (id, name, qty, price, tags) VALUES (%s, %s, %s, %s, %s)",
                                (next_id, f"new {next_id}", rnd.randint(0, 9), rnd.randint(1, 99_999) / 100, ["x"]),
                            )
                        elif r < 0.85:
                            conn.execute(
                                "UPDATE items SET qty = qty + 1, name = name || '+' WHERE id = %s",
                                (rnd.randint(1, next_id),),
                            )
                        else:
                            conn.execute("DELETE FROM items WHERE id = %s", (rnd.randint(1, next_id),))
                time.sleep(0.01)
    except BaseException as exc:
        errors.append(exc)
        raise


# --- the sinks on a Spark standalone cluster ---------------------------------------------------------------


class SubmittedSinks(SinksProcess):
    """`cdc sinks run` as spark-submit runs it on a standalone master, in client mode (docs/sinks.md)."""

    def __init__(
        self,
        config: Path,
        log: Path,
        *,
        master: str,
        pex: Path | None,
        jars: list[str],
        ui_port: int,
        classpath: str = "",
        names: list[str] | None = None,
    ) -> None:
        super().__init__(config, log, names)
        # The test run's JIT options (./dev test sets JAVA_TOOL_OPTIONS) reach the executors only as Spark conf:
        # the workers start their JVMs with their own environment.
        self.launcher = submit_command(
            master=master,
            pex=pex,
            jars=jars,
            ui_port=ui_port,
            classpath=classpath,
            java_options=os.environ.get("JAVA_TOOL_OPTIONS", ""),
        )
        self.args = ["--log-level", "info", *self.args]
        self.ui = f"http://127.0.0.1:{ui_port}/api/v1"
        self.env = submit_env()

    def stop(self) -> int:
        """SIGTERM to the driver's Python and spark-submit's JVM together; the driver's exit code."""
        assert self.proc is not None
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(120)


SINKS = ("search", "cache", "warehouse")


class PipelineWorkload:
    """:func:`pipeline_workload` on a thread: ``start``, then ``finish`` (failing with what it raised);
    ``close`` in a ``finally``."""

    def __init__(self, dsn: str, seed: int) -> None:
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=pipeline_workload, args=(dsn, self._stop, self.errors, seed))

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        self.close()
        assert not self.errors, self.errors

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)


Running = TypeVar("Running", SinksProcess, InProcessSinks)


@dataclass
class Captured(Generic[Running]):
    """A scratch database whose tables the capture streams, and the sinks on the same configuration."""

    dsn: str
    prefix: str
    config: Path
    capture: CdcProcess
    sinks: Running

    def topic(self, table: str) -> str:
        return f"{self.prefix}.public.{table}"


@contextlib.contextmanager
def captured(
    stack: Stack,
    pg_dsn: str,
    unique: str,
    workdir: Path,
    *,
    name: str,
    setup: Sequence[str],
    tables: Sequence[str],
    sinks: Callable[[Path, Path], Running],
    kafka_extra: str = "",
    capture_extra: str = "",
) -> Iterator[Captured[Running]]:
    """The scratch database ``name``_``unique`` made by the ``setup`` statements; the capture of ``tables``
    (``public.`` ones) on it, streaming (topics ``name````unique``.public.*); the sinks ``sinks(config, log)``
    builds, not started (``kafka_extra``, ``capture_extra``: more of the capture's [kafka], [capture]
    settings). Both are stopped on the way out, the sinks first, and the database dropped."""
    with scratch_database(pg_dsn, f"{name}_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in setup:
                conn.execute(statement.encode())
        prefix = f"{name}{unique}"
        cfg = stack.config(dsn, [f"public.{t}" for t in tables], prefix=prefix, unique=unique, workdir=workdir)
        cfg.kafka_extra += kafka_extra
        cfg.extra = capture_extra + "\n" + cfg.extra  # [capture]'s keys come first: the sinks' sections follow
        capture = cfg.start(workdir)
        config = workdir / "cdc.toml"
        running = sinks(config, workdir / "sinks.log")
        try:
            capture.wait_streaming(180)
            yield Captured(dsn, prefix, config, capture, running)
        finally:
            if running.alive():
                running.kill()
            capture.stop()


def assert_no_drift(config: Path, sinks: SinksProcess | InProcessSinks, *, spark: SparkSession | None = None) -> None:
    """`cdc verify` of every built-in sink, in one command (waiting up to 480 s each for it to converge), finds
    no drift: run in the test process on ``spark`` (the fixture) when given, else as a child process (a
    configuration the run's Spark application cannot serve: an object store's, say). A busy machine's warehouse
    takes a minute and more a batch while verify reads beside it; the wait ends as soon as a store converges."""
    args = ("verify", *SINKS, "--config", str(config), "--wait", "480")
    result = cdc_here(*args) if spark is not None else cdc(*args, timeout=2400)
    assert_verified(result, SINKS, sinks.tail())


def wait_caught_up(
    config: Path, sinks: SinksProcess | InProcessSinks, names: Sequence[str] = SINKS, timeout: float = 240
) -> None:
    """Waits until each of ``names`` has applied every record its topics hold now (`cdc status`'s lag)."""
    settings = load_sink_settings(config)
    ends = TopicEnds(settings)
    try:
        marks = ends.read()

        def applied() -> bool:
            lags = {p.name: p.lag_records for p in sink_progress(settings, marks)}
            return all(lags.get(name) == 0 for name in names)

        wait_for(applied, timeout, "the sinks to apply what the topics hold", sinks)
    finally:
        ends.close()


def assert_verified(result: subprocess.CompletedProcess[str], names: Sequence[str], context: str = "") -> None:
    """A `cdc verify` of ``names`` exited 0 and reported each of them clean."""
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{context}"
    assert "DRIFT" not in result.stdout, result.stdout
    for name in names:
        assert re.search(rf"^{name} \S+: no drift$", result.stdout, re.M), f"{name}:\n{result.stdout}"
