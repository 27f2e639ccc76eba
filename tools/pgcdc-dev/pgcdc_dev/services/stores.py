"""What the sinks write to, and the S3 server: OpenSearch, Redis, MariaDB (a target of the sql sink) and
s3proxy (in memory)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import (
    DATA,
    OPENSEARCH_VERSION,
    OPENSEARCH_VERSION_JAVA17,
    OPT,
    PORTS,
    S3_ACCESS_KEY,
    S3_SECRET_KEY,
    S3PROXY_VERSION,
    DeployError,
    run,
)
from pgcdc_dev.services._install import (
    apt_install,
    chown_tree,
    download,
    ensure_service_user,
    extract,
    java_home,
    maven_url,
)
from pgcdc_dev.services._process import Service, http_get, spawn


class OpenSearch(Service):
    name = "opensearch"
    ready_timeout = 180.0

    def flavour(self) -> tuple[str, Path]:
        jh = java_home(21)
        if jh is not None:
            return OPENSEARCH_VERSION, jh
        jh = java_home(17)
        if jh is None:
            raise DeployError("OpenSearch needs Java 17+ (21+ for 3.x): apt-get install -y openjdk-17-jre-headless")
        return OPENSEARCH_VERSION_JAVA17, jh

    def home(self) -> Path:
        return OPT / f"opensearch-{self.flavour()[0]}"

    def version(self) -> str:
        return f"OpenSearch {self.flavour()[0]}"

    def install(self) -> None:
        ver, _ = self.flavour()
        archive = download(maven_url("org.opensearch.distribution.integ-test-zip", "opensearch", ver, "zip"))
        extract(archive, self.home(), f"opensearch-{ver}")
        user = ensure_service_user()
        conf = DATA / "opensearch" / "config"
        if not conf.exists():
            # A config copy of our own: OpenSearch writes its keystore beside the config.
            shutil.copytree(self.home() / "config", conf)
            (DATA / "opensearch" / "data").mkdir(parents=True, exist_ok=True)
            (DATA / "opensearch" / "logs").mkdir(parents=True, exist_ok=True)
            # jvm.options names paths relative to the install, which the service user cannot write.
            d = DATA / "opensearch"
            options = (conf / "jvm.options").read_text()
            options = options.replace("logs/", f"{d / 'logs'}/").replace(
                "HeapDumpPath=data", f"HeapDumpPath={d / 'data'}"
            )
            (conf / "jvm.options").write_text(options + "\n-Xms512m\n-Xmx512m\n")
            chown_tree(DATA / "opensearch", user)

    def start(self) -> None:
        _, jh = self.flavour()
        d = DATA / "opensearch"
        spawn(
            self.name,
            [
                str(self.home() / "bin" / "opensearch"),
                "-Ecluster.name=pgcdc-local",
                "-Enode.name=local",
                "-Ediscovery.type=single-node",
                "-Enetwork.host=127.0.0.1",
                f"-Ehttp.port={PORTS['opensearch']}",
                f"-Etransport.port={PORTS['opensearch-transport']}",
                f"-Epath.data={d / 'data'}",
                f"-Epath.logs={d / 'logs'}",
                # a nearly full dev disk must not turn indices read-only under the tests
                "-Ecluster.routing.allocation.disk.threshold_enabled=false",
            ],
            cwd=d,
            env={
                "OPENSEARCH_JAVA_HOME": str(jh),
                "OPENSEARCH_PATH_CONF": str(d / "config"),
                "JAVA_HOME": str(jh),
            },
            user=ensure_service_user(),
        )

    def ready(self) -> bool:
        status, body = http_get(self.endpoint()["url"] + "/_cluster/health")
        return status == 200 and json.loads(body).get("status") in ("green", "yellow")

    def endpoint(self) -> dict[str, Any]:
        port = PORTS["opensearch"]
        return {"port": port, "url": f"http://127.0.0.1:{port}"}


class Redis(Service):
    name = "redis"
    ready_timeout = 30.0

    def version(self) -> str:
        return run(["redis-server", "--version"]).stdout.split()[2].removeprefix("v=")

    def install(self) -> None:
        apt_install("redis-server", "redis-server")
        (DATA / "redis").mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        spawn(
            self.name,
            [
                "redis-server",
                "--port",
                str(PORTS["redis"]),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(DATA / "redis"),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
        )

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", PORTS["redis"]), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def endpoint(self) -> dict[str, Any]:
        port = PORTS["redis"]
        return {"port": port, "url": f"redis://127.0.0.1:{port}/0"}


MARIADBD = "/usr/sbin/mariadbd"  # not on a user's PATH in Debian


class MariaDB(Service):
    """Debian's MariaDB, a target database of the sql sink: a data directory of its own, a user with every
    privilege (pgcdc/pgcdc, a throwaway server on 127.0.0.1)."""

    name = "mariadb"
    ready_timeout = 60.0
    user, password = "pgcdc", "pgcdc"

    def version(self) -> str:
        return run([MARIADBD, "--version"]).stdout.split()[2]

    def install(self) -> None:
        apt_install(MARIADBD, "mariadb-server")
        d = DATA / "mariadb"
        if not (d / "data" / "mysql").exists():
            d.mkdir(parents=True, exist_ok=True)
            user = ensure_service_user()
            chown_tree(d, user)
            args = ["mariadb-install-db", f"--datadir={d / 'data'}", "--auth-root-authentication-method=socket"]
            run([*args, f"--user={user}"] if user else args)
        (d / "init.sql").write_text(
            f"CREATE USER IF NOT EXISTS '{self.user}'@'%' IDENTIFIED BY '{self.password}';\n"
            f"GRANT ALL PRIVILEGES ON *.* TO '{self.user}'@'%' WITH GRANT OPTION;\n"
        )

    def start(self) -> None:
        d = DATA / "mariadb"
        spawn(
            self.name,
            [
                MARIADBD,
                "--no-defaults",
                f"--datadir={d / 'data'}",
                f"--socket={d / 'mariadb.sock'}",
                f"--pid-file={d / 'mariadb.pid'}",
                f"--port={PORTS['mariadb']}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                f"--init-file={d / 'init.sql'}",
                "--character-set-server=utf8mb4",
                "--collation-server=utf8mb4_unicode_ci",
                "--innodb-buffer-pool-size=256M",
                "--max-connections=500",
            ],
            user=ensure_service_user(),
        )

    def ready(self) -> bool:
        """The server's greeting: a protocol-10 handshake packet (its 5th byte), sent as a client connects."""
        try:
            with socket.create_connection(("127.0.0.1", PORTS["mariadb"]), timeout=1) as s:
                s.settimeout(2)
                return s.recv(64)[4:5] == b"\x0a"
        except OSError:
            return False

    def endpoint(self) -> dict[str, Any]:
        port = PORTS["mariadb"]
        return {"port": port, "url": f"mariadb+pymysql://{self.user}:{self.password}@127.0.0.1:{port}/"}


class S3(Service):
    """An S3-compatible server: s3proxy (Maven Central) with its in-memory store, path-style buckets.

    In memory because S3A keeps empty directories as ``dir/`` marker objects, which s3proxy's filesystem
    stores drop, so Spark's checkpoints would not find their own directories. Its contents go when it stops:
    a test server, not a place for data to keep. Clients create their buckets.
    """

    name = "s3"
    ready_timeout = 60.0

    def version(self) -> str:
        return f"s3proxy {S3PROXY_VERSION}"

    def install(self) -> None:
        download(maven_url("org.gaul", "s3proxy", S3PROXY_VERSION, "jar", "jar-with-dependencies"))
        (DATA / "s3").mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        jh = java_home(17)
        if jh is None:
            raise DeployError("s3proxy needs Java 17 or newer: apt-get install -y openjdk-17-jre-headless")
        conf = DATA / "s3" / "s3proxy.conf"
        conf.write_text(
            f"s3proxy.endpoint=http://127.0.0.1:{PORTS['s3']}\n"
            "s3proxy.authorization=aws-v2-or-v4\n"
            f"s3proxy.identity={S3_ACCESS_KEY}\ns3proxy.credential={S3_SECRET_KEY}\n"
            "jclouds.provider=transient\n"
            f"jclouds.identity={S3_ACCESS_KEY}\njclouds.credential={S3_SECRET_KEY}\n"
        )
        conf.chmod(0o600)
        jar = download(maven_url("org.gaul", "s3proxy", S3PROXY_VERSION, "jar", "jar-with-dependencies"))
        spawn(self.name, [str(jh / "bin" / "java"), "-Xmx2g", "-jar", str(jar), "--properties", str(conf)])

    def ready(self) -> bool:
        status, _ = http_get(f"http://127.0.0.1:{PORTS['s3']}/")
        return status == 403  # up, and asking for credentials

    def endpoint(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{PORTS['s3']}"
        return {"port": PORTS["s3"], "url": url, "access_key": S3_ACCESS_KEY, "secret_key": S3_SECRET_KEY}
