"""Shared by the tests where consumers that are not ours (Flink, Kafka Connect, Java clients) read the topics."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration._capture_helpers import CdcConfig, CdcProcess

PROGRAMS = Path(__file__).parent / "consumers"  # Java programs, run by `java File.java` (no build step)


def java() -> str:
    """The `java` of JAVA_HOME, else of PATH; fails (a required tool) when there is none."""
    home = os.environ.get("JAVA_HOME")
    path = shutil.which("java", path=os.path.join(home, "bin")) if home else shutil.which("java")
    if path is None:
        pytest.fail("java is not installed: apt-get install -y openjdk-17-jdk-headless (./dev bootstrap does)")
    return path


def start_capture(*, source: str, kafka: str, registry: str, unique: str, table: str, workdir: Path) -> CdcProcess:
    """`cdc run` on ``table`` with the topic prefix ``t<unique>``, once it streams."""
    cfg = CdcConfig(
        dsn=source,
        kafka=kafka,
        registry=registry,
        prefix=f"t{unique}",
        tables=[table],
        slot=f"s_{unique}",
        publication=f"p_{unique}",
    )
    proc = cfg.start(workdir)
    proc.wait_streaming()
    return proc
