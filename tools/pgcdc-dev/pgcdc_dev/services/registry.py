"""The schema registry (Apicurio Registry, Confluent-compatible API): on the single broker, on the three-node
cluster (on demand), and behind nginx with HTTPS and basic authentication."""

from __future__ import annotations

import base64
import http.client
import shutil
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import (
    APICURIO_VERSION,
    DATA,
    OPT,
    PORTS,
    REGISTRY_PASSWORD,
    REGISTRY_USER,
    RUN,
    TLS,
    DeployError,
    run,
)
from pgcdc_dev.services._install import apt_install, download, extract, java_home, maven_url, tls_material
from pgcdc_dev.services._process import Service, http_get, spawn
from pgcdc_dev.services.kafka import CLUSTER_NODES, cluster_ports


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
