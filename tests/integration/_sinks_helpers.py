"""Running `cdc sinks …` and `cdc verify` as an operator would: child processes on one config file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def sinks_section(*, state: Path, warehouse: Path, jars: list[str], opensearch: str, redis: str) -> str:
    return f"""
[sinks]
state_dir = "{state}"
trigger_interval_s = 1.0
spark_jars = [{", ".join(f'"{j}"' for j in jars)}]

[sinks.search]
url = "{opensearch}"

[sinks.cache]
url = "{redis}"

[sinks.warehouse]
path = "{warehouse}"
history = true
"""


def cdc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


class SinksProcess:
    """`cdc sinks run` as a child process."""

    def __init__(self, config: Path, log: Path, names: list[str] | None = None) -> None:
        self.config, self.log, self.names = config, log, names or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child, closed by it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc.cli", "sinks", "run", *self.names, "--config", str(self.config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
        out.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(120)
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def batches(self) -> int:
        return self.log.read_text(errors="replace").count(": batch ") if self.log.exists() else 0
