"""Running `cdc sinks …` and `cdc verify` as an operator would: child processes on one config file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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

    def config(self, dsn: str, tables: list[str], *, prefix: str, unique: str, workdir: Path) -> CdcConfig:
        """The capture's and the sinks' configuration in one file, state and warehouse under ``workdir``."""
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
state_dir = "{workdir / "state"}"
trigger_interval_s = 1.0
metrics_port = 0
spark_jars = {json.dumps(self.spark_jars)}

[sinks.search]
url = "{self.opensearch}"

[sinks.cache]
url = "{self.redis}"

[sinks.warehouse]
path = "{workdir / "warehouse"}"
history = true
""",
        )


def cdc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
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
