"""Running `cdc sinks …` and `cdc verify` as an operator would: child processes on one config file."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka import Consumer
from pgcdc_dev.cluster import ObjectStoreBucket, submit_command, submit_env

from sinks._config import load_sink_settings
from sinks._progress import TopicEnds, sink_progress
from tests.integration._capture_helpers import CdcConfig, ChildProcess, wait_for


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


class SinksProcess(ChildProcess):
    """`cdc sinks run [NAME…]` on a configuration file."""

    def __init__(self, config: Path, log: Path, names: list[str] | None = None) -> None:
        super().__init__(["sinks", "run", *(names or []), "--config", str(config)], log)

    def stop(self) -> int:
        """SIGTERM if still running; the exit code."""
        assert self.proc is not None
        return self.terminate(120) if self.alive() else int(self.proc.returncode)

    def batches(self) -> int:
        return self.log.read_text(errors="replace").count(": batch ") if self.log.exists() else 0


def dead_letters(kafka: str, topic: str) -> list[dict[str, str]]:
    """Every record of the dead-letter ``topic``: its headers (pgcdc.sink, pgcdc.error, …) and repr'd value."""
    consumer = Consumer(
        {"bootstrap.servers": kafka, "group.id": f"dlq-{time.time_ns()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    out = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            pairs: list[tuple[str, bytes]] = list(msg.headers() or [])  # type: ignore[arg-type]
            headers = {k: v.decode() for k, v in pairs}
            out.append(headers | {"value": repr(msg.value())})
    finally:
        consumer.close()
    return out


PIPELINE_TABLES = ["public.items", 'public."Notes"']


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
        self.launcher = submit_command(master=master, pex=pex, jars=jars, ui_port=ui_port, classpath=classpath)
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


def assert_no_drift(config: Path, sinks: SinksProcess) -> None:
    """`cdc verify` of every built-in sink, in one command (waiting up to 240 s each for it to converge), finds
    no drift."""
    result = cdc("verify", *SINKS, "--config", str(config), "--wait", "240", timeout=1200)
    assert_verified(result, SINKS, sinks.tail())


def wait_caught_up(config: Path, sinks: SinksProcess, names: Sequence[str] = SINKS, timeout: float = 240) -> None:
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
