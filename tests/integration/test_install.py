"""pgcdc as a user installs it: the wheel built from this checkout, installed with its ``sinks`` extra into a
clean virtualenv, then `cdc attach`, `cdc run`, `cdc sinks run` and `cdc verify` from that virtualenv's ``cdc``,
in a directory outside the checkout, with nothing of the repository on the path and no jar list configured:
the sinks' Spark resolves its Kafka, Avro and Delta connectors by Maven coordinates (sinks.connectors).

pip takes the dependencies from its cache when it has them (the dev virtualenv put them there), else from PyPI;
Spark's Ivy resolves the connectors from its cache, the local Maven repository or Maven Central.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import CdcProcess, scratch_database
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800), SPARK_WORKER]

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    said = f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{said}"
    return proc.stdout


def _clean_env() -> dict[str, str]:
    """This process's environment without what would put the checkout or the dev virtualenv on the path."""
    dropped = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME"}
    return {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith(("CDC_SINKS__", "CDC_TEST"))}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean virtualenv with the wheel of this checkout and its ``sinks`` extra: its bin directory."""
    root = tmp_path_factory.mktemp("install")
    env = _clean_env()
    # The sources a wheel is built from, copied as the container image's build copies them: setuptools writes
    # its build directory beside them, and the checkout's own compiled extension must not be taken for a build.
    source = root / "source"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    leftovers = shutil.ignore_patterns("__pycache__", "*.so", "_native.c")
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in packages:
        shutil.copytree(REPO / package, source / package, ignore=leftovers)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"), str(source)], root, env)
    (wheel,) = (root / "dist").glob("pgcdc-*.whl")
    venv.create(root / "venv", with_pip=True)
    bin_dir = root / "venv" / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", f"{wheel}[sinks]"], root, env)
    return bin_dir


def _config(path: Path, *, dsn: str, stack: Stack, unique: str) -> Path:
    """A user's configuration: the source, Kafka, the registry, two stores; no jar list."""
    path.write_text(
        f"""
[source]
dsn = "{dsn}"
tables = ["public.items"]
slot = "s_{unique}"
publication = "p_{unique}"

[kafka]
bootstrap_servers = "{stack.kafka}"
topic_prefix = "i{unique}"

[registry]
url = "{stack.registry}"

[metrics]
port = 0

[sinks]
state_dir = "{path.parent / "state"}"
trigger_interval_s = 1.0
metrics_port = 0

[sinks.cache]
url = "{stack.redis}"

[sinks.warehouse]
path = "{path.parent / "warehouse"}"
"""
    )
    return path


def test_a_wheel_installed_into_a_clean_virtualenv_runs_the_pipeline_without_a_jar_list(
    installed: Path, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    env = _clean_env()
    found = "import cdc, sinks; print(cdc.__file__, sinks.__file__)"
    where = _run([str(installed / "python"), "-c", found], tmp_path, env)
    assert str(REPO) not in where, where
    assert str(installed.parent) in where, where
    with scratch_database(pg_dsn, f"install_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 200) g")
        config = _config(tmp_path / "cdc.toml", dsn=dsn, stack=stack, unique=unique)
        attach = _run([str(installed / "cdc"), "attach", "--config", str(config)], tmp_path, env, timeout=300)
        assert "items" in attach, attach
        capture = CdcProcess(config, tmp_path / "cdc.log")
        sinks = SinksProcess(config, tmp_path / "sinks.log", ["cache", "warehouse"])
        for proc in (capture, sinks):
            proc.launcher, proc.env = [str(installed / "cdc")], {"PYTHONPATH": ""}
        capture.start()
        try:
            capture.wait_streaming(180)
            sinks.start()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = qty + 1000 WHERE id <= 50")
                conn.execute("DELETE FROM items WHERE id > 190")
            verify = [str(installed / "cdc"), "verify", "cache", "warehouse", "--config", str(config), "--wait", "600"]
            out = _run(verify, tmp_path, env)
            assert "cache public.items: no drift" in out, out
            assert "warehouse public.items: no drift" in out, out
            # Spark's Ivy said what it resolved: the connectors came by their coordinates.
            assert "io.delta#delta-spark" in sinks.this_run(), sinks.tail()
            assert "spark-sql-kafka-0-10" in sinks.this_run(), sinks.tail()
            assert sinks.alive(), sinks.tail()
        finally:
            for proc in (sinks, capture):
                if proc.alive():
                    proc.terminate(120)
