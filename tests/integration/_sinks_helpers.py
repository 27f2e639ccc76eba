"""Running `cdc sinks …` and `cdc verify` as an operator would: child processes on one config file."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer

from tests.integration._capture_helpers import CdcConfig, ChildProcess


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
""",
        )


@dataclass(frozen=True)
class ObjectStore:
    """The S3-compatible server (deploy/services.py's s3proxy) and the jars Spark needs to reach it."""

    url: str
    access_key: str
    secret_key: str
    classpath: str  # hadoop-aws, the AWS SDK bundle, spark-hadoop-cloud: for extraClassPath

    def filesystem(self) -> Any:
        from pyarrow import fs

        return fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.url,
            force_virtual_addressing=False,
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def ensure_bucket(self, name: str) -> None:
        from pyarrow import fs

        store = self.filesystem()
        if store.get_file_info(name).type == fs.FileType.NotFound:
            store.create_dir(name)

    def keys(self, bucket: str) -> list[str]:
        """Every object's path (``bucket/key``) in ``bucket``."""
        from pyarrow import fs

        return [i.path for i in self.filesystem().get_file_info(fs.FileSelector(bucket, recursive=True))]

    def bucket(self, name: str) -> ObjectStoreBucket:
        """A new, empty bucket (each test its own: the server is shared)."""
        self.filesystem().create_dir(name)
        return ObjectStoreBucket(self, name)


@dataclass(frozen=True)
class ObjectStoreBucket:
    store: ObjectStore
    name: str

    def uri(self, key: str) -> str:
        return f"s3a://{self.name}/{key}"

    def toml(self) -> str:
        """``[sinks.storage]`` and the classpath, inside a ``[sinks]`` table."""
        s = self.store
        classpath = {"spark.driver.extraClassPath": s.classpath, "spark.executor.extraClassPath": s.classpath}
        conf = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in classpath.items())
        return f"""spark_conf = {{ {conf} }}

[sinks.storage]
endpoint = "{s.url}"
region = "us-east-1"
access_key = "{s.access_key}"
secret_key = "{s.secret_key}"
path_style = true
"""


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

ROOT = Path(__file__).resolve().parents[2]
_PACKAGED = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def pgcdc_pex(cache: Path) -> Path:
    """pgcdc and its sinks' dependencies as one PEX file for the executors (built once per source tree).

    It is made the way docs/sinks.md tells users to: a wheel of the project, then ``pex 'pgcdc[sinks]'``
    without pyspark and delta-spark (Spark puts its own pyspark on the workers' PYTHONPATH, which
    ``--inherit-path=fallback`` keeps).
    """
    digest = hashlib.sha256()
    for path in sorted(p for d in _PACKAGED for p in (ROOT / d).rglob("*") if p.is_file() and _shipped(p)):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    for name in ("pyproject.toml", "setup.py"):
        digest.update((ROOT / name).read_bytes())
    out = cache / "pex" / f"pgcdc-{digest.hexdigest()[:16]}.pex"
    if out.exists():
        return out
    pex = Path(sys.executable).parent / "pex"
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        wheels = Path(tmp) / "wheels"
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(wheels)])
        built = Path(tmp) / "pgcdc.pex"
        _run([str(pex), "-f", str(wheels), "pgcdc[sinks]", "--exclude", "pyspark", "--exclude", "delta-spark",
              "--inherit-path=fallback", "--python", sys.executable, "-o", str(built)])  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        built.replace(out)
    return out


def _shipped(path: Path) -> bool:
    return "__pycache__" not in path.parts and path.suffix not in (".so", ".c", ".pyc")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def submit_command(*, master: str, pex: Path | None, jars: list[str], ui_port: int, classpath: str = "") -> list[str]:
    """spark-submit in client mode on ``master`` as docs/sinks.md gives it, up to the application's arguments
    (cdc's: ``sinks run …``, ``sinks rebuild NAME …``)."""
    spark_submit = Path(sys.executable).parent / "spark-submit"
    # Jars already on the machines (the S3 connector): on the JVMs' classpath, not copied to each executor.
    extra = ["--driver-class-path", classpath, "--conf", f"spark.executor.extraClassPath={classpath}"]
    return [
        str(spark_submit),
        "--master", master,
        "--deploy-mode", "client",
        # No PEX: the executors run the machine's plain python3.11, which lacks pgcdc.
        *(["--files", str(pex), "--conf", f"spark.pyspark.python=./{pex.name}"] if pex else []),
        *([] if pex else ["--conf", "spark.pyspark.python=python3.11"]),
        "--conf", f"spark.pyspark.driver.python={sys.executable}",
        "--jars", ",".join(jars),
        "--driver-memory", "1g",
        "--executor-memory", "1g",
        "--conf", f"spark.ui.port={ui_port}",
        "--conf", "spark.ui.showConsoleProgress=false",
        *(extra if classpath else []),
        cdc("sinks", "spark-app").stdout.strip(),  # where the installed pgcdc keeps the file
    ]  # fmt: skip


def submit_env() -> dict[str, str]:
    """pyspark's bin/spark-submit looks for Spark with whatever `python3` is first on PATH otherwise."""
    import pyspark

    return {"SPARK_HOME": str(Path(pyspark.__file__).parent)}


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
    """`cdc verify` of every built-in sink (waiting up to 240 s each for it to converge) finds no drift."""
    for name in SINKS:
        result = cdc("verify", name, "--config", str(config), "--wait", "240", timeout=600)
        assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr}\n{sinks.tail()}"
        assert "no drift" in result.stdout
