"""Installing the services: downloads verified by checksum, archives extracted in place, jar sets resolved by
Maven, the JDK a service needs, the user services run as when this runs as root, Debian packages, and the local
certificate authority and server certificate the TLS endpoints present."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from pgcdc_dev.services._base import CACHE, IS_ROOT, MAVEN, SERVICE_USER, TLS, DeployError, run, say


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
