"""A PostgreSQL primary and its hot standby of the tests' own, from PostgreSQL 18's binaries (the postgres-18
local service's): a failover kills one of them, so they are never the shared servers."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from pgcdc_dev import discovery


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One cluster: its data directory, port, and the user it runs as (PostgreSQL refuses root)."""

    bindir: Path
    data: Path
    port: int
    user: str | None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def run(self, tool: str, *args: str) -> str:
        cmd = [str(self.bindir / tool), *args]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
        assert proc.returncode == 0, f"{tool} failed ({proc.returncode}): {proc.stdout}{proc.stderr}"
        return proc.stdout

    def start(self, *settings: str) -> None:
        opts = " ".join([f"-p {self.port}", f"-k {self.data}", *(f"-c {s}" for s in settings)])
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-w", "-o", opts, "start")

    def kill(self) -> None:
        """An immediate stop: the server's processes end as at a crash."""
        self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def promote(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-w", "promote")

    def log(self) -> str:
        path = self.data / "server.log"
        return path.read_text(errors="replace")[-20000:] if path.exists() else ""


@contextmanager
def primary_and_standby(
    bindir: Path, user: str | None, physical_slot: str, *, inherited: bool = False
) -> Iterator[tuple[Server, Server]]:
    """A primary (trust authentication on 127.0.0.1: a throwaway cluster) and a standby streaming from it
    through ``physical_slot``, set up for failover slots: the standby synchronizes slots with hot standby
    feedback, and the primary holds changes back from logical consumers until the standby has them.
    ``inherited``: the primary's synchronized_standby_slots is set before the base backup, so that the standby
    has it too (in its postgresql.auto.conf), as a standby copied from a configured primary does."""
    root = Path(tempfile.mkdtemp(prefix="pgcdc-failover-", dir="/var/tmp"))
    if user:  # the servers' user owns it; root reaches it all the same
        shutil.chown(root, user, user)
    primary = Server(bindir, root / "primary", free_port(), user)
    standby = Server(bindir, root / "standby", free_port(), user)
    try:
        primary.run("initdb", "-D", str(primary.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        primary.start(
            "listen_addresses=127.0.0.1", "wal_level=logical", "max_wal_senders=10", "max_replication_slots=10"
        )
        if inherited:
            _standby_slots(primary, physical_slot)
        primary.run(
            "pg_basebackup",
            *("-D", str(standby.data), "-R", "-C", "-S", physical_slot, "-X", "stream"),
            # dbname in the connection string: pg_basebackup -R writes it into primary_conninfo (slot sync needs it)
            *("-d", f"host=127.0.0.1 port={primary.port} user=postgres dbname=postgres"),
        )
        if not inherited:  # after the base backup: not in the standby's configuration
            _standby_slots(primary, physical_slot)
        standby.start(
            "listen_addresses=127.0.0.1",
            "wal_level=logical",
            "sync_replication_slots=on",
            "hot_standby_feedback=on",
        )
        yield primary, standby
    finally:
        for server in (standby, primary):
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):  # already down (a killed primary)
                server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _standby_slots(primary: Server, physical_slot: str) -> None:
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{physical_slot}'")
        conn.execute("SELECT pg_reload_conf()")


def pg18_binaries(why: str) -> tuple[Path, str | None]:
    """PostgreSQL 18's binaries (the postgres-18 local service installs them) and the user servers run as; a
    failure (CDC_TEST_REQUIRE_SERVICES) or a skip saying ``why`` the test needs them when they cannot be had."""
    try:
        record = discovery.deploy_record("postgres-18")
    except discovery.ServiceUnavailableError as exc:
        discovery.skip_unavailable(exc, f"{why}, from the postgres-18 local service")
    return Path(record["bindir"]), record.get("service_user")
