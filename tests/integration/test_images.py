"""The capture's container image, built from deploy/docker/capture.Dockerfile with a daemonless builder (buildah)
and run: its `cdc run` snapshots a table into Kafka.

Where no Docker engine runs and no registry is reachable (these machines), the Dockerfile's base image is
replaced by a stand-in of the same distribution built from Debian's packages (mmdebstrap: Debian 12 with its
Python 3.11 in a virtualenv on PATH, as python:3.11-slim-bookworm has it), carrying the machine's CA certificates
and pip configuration, as a site behind a TLS-inspecting proxy would put into its base image. Everything after
the FROM lines is the Dockerfile as shipped. buildah runs each step, and then the image's command, with chroot
isolation and the machine's network: an OCI runtime (podman's crun) cannot set a container's resource limits
here ("setrlimit `RLIMIT_NPROC`: Operation not permitted").

The sinks' image is not built here: its base (apache/spark) and the uv image it copies from are on registries
these machines do not reach. The first run builds the stand-in (about 30 s); the image's build and run take
about 45 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pgcdc_dev import discovery

from tests.integration._capture_helpers import read_topic, scratch_database, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/pgcdc-python:3.11-bookworm"  # the stand-in for python:3.11-slim-bookworm
_CA_DIR = Path("/usr/local/share/ca-certificates")


def _tools() -> dict[str, str]:
    """buildah and mmdebstrap, or a skip saying how to install them (a failure when services are required)."""
    return {name: discovery.tool_or_skip(name, install=f"apt-get install {name}") for name in ("buildah", "mmdebstrap")}


def _run(args: list[str], timeout: float = 1200) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    said = f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{said}"
    return proc.stdout


def _base(tools: dict[str, str], work: Path) -> None:
    """The stand-in base image, built once per machine (buildah's image store keeps it)."""
    found = subprocess.run([tools["buildah"], "images", "-q", BASE], capture_output=True, text=True, check=False)
    if found.returncode == 0 and found.stdout.strip():
        return
    hooks = []
    certificates = sorted(_CA_DIR.glob("*.crt"))
    if certificates:
        hooks += ["--customize-hook", f"copy-in {' '.join(map(str, certificates))} {_CA_DIR}/"]
        hooks += ["--customize-hook", 'chroot "$1" update-ca-certificates']
    if Path("/etc/pip.conf").exists():
        hooks += ["--customize-hook", "copy-in /etc/pip.conf /etc/"]
    hooks += ["--customize-hook", 'chroot "$1" python3 -m venv /usr/local/python']
    rootfs = work / "base.tar"
    packages = "python3,python3-venv,python3-dev,ca-certificates"
    _run([tools["mmdebstrap"], "--variant=minbase", f"--include={packages}", *hooks, "bookworm", str(rootfs)])
    with _container(tools, "scratch") as name:
        _run([tools["buildah"], "add", name, str(rootfs), "/"])
        path = "PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        _run([tools["buildah"], "config", "--env", path, name])
        _run([tools["buildah"], "commit", name, BASE])


@contextlib.contextmanager
def _container(tools: dict[str, str], image: str) -> Iterator[str]:
    name = _run([tools["buildah"], "from", image]).strip().splitlines()[-1]
    try:
        yield name
    finally:
        subprocess.run([tools["buildah"], "rm", name], capture_output=True, check=False)


def test_the_capture_image_builds_and_its_cdc_run_snapshots_into_kafka(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    tools = _tools()
    _base(tools, tmp_path)
    image = f"localhost/pgcdc-capture:{unique}"
    build = [tools["buildah"], "bud", "--isolation", "chroot", "--build-arg", f"PYTHON_IMAGE={BASE}"]
    _run([*build, "-f", str(REPO / "deploy/docker/capture.Dockerfile"), "-t", image, str(REPO)])
    try:
        config = tmp_path / "etc" / "pgcdc.toml"
        config.parent.mkdir()
        with scratch_database(pg_dsn, f"img_{unique}") as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text)")
                conn.execute("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 100) g")
            config.write_text(
                f'[source]\ndsn = "{dsn}"\ntables = ["public.items"]\nslot = "s_{unique}"\n'
                f'publication = "p_{unique}"\n[kafka]\nbootstrap_servers = "{kafka_bootstrap}"\n'
                f'topic_prefix = "img{unique}"\n[registry]\nurl = "{registry_url}"\n[metrics]\nport = 0\n'
            )
            # The image's unprivileged user reads it through the mount.
            os.chmod(config.parent, 0o755)  # noqa: S103 - a test's own directory, nothing secret in it
            os.chmod(config, 0o644)
            with _container(tools, image) as name:
                mount = f"{config.parent}:/etc/pgcdc:ro"
                run = [tools["buildah"], "run", "--isolation", "chroot", "--user", "10001:10001", "-v", mount, name]
                log = tmp_path / "cdc.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        [*run, "--", "cdc", "run", "--config", "/etc/pgcdc/pgcdc.toml"],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                try:
                    topic = f"img{unique}.public.items"
                    wait_for(
                        lambda: len(read_topic(kafka_bootstrap, registry_url, topic)) >= 100 or proc.poll() is not None,
                        300,
                        "the image's capture to snapshot the table",
                    )
                    assert proc.poll() is None, log.read_text()[-3000:]
                    assert "fast paths: encoder=c" in log.read_text(), log.read_text()[-3000:]
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(60)
    finally:
        subprocess.run([tools["buildah"], "rmi", image], capture_output=True, check=False)
