"""Kafka: the single KRaft broker (a plaintext, a SASL_SSL and a proxied listener) and the replicated cluster
beside it, three KRaft nodes by one name (kafka-cluster; on demand)."""

from __future__ import annotations

import base64
import textwrap
import uuid
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import (
    DATA,
    KAFKA_SASL_PASSWORD,
    KAFKA_SASL_USER,
    KAFKA_VERSION,
    LOG4J_VERSION,
    OPT,
    PORTS,
    SCALA_BINARY,
    SLF4J_VERSION,
    TLS,
    DeployError,
    run,
    say,
)
from pgcdc_dev.services._install import java_home, maven_copy_dependencies, tls_material
from pgcdc_dev.services._process import SERVICES, Service, ServiceGroup, port_open, spawn


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
        if not port_open(PORTS["kafka-sasl"]):
            return False
        return _broker_answers(PORTS["kafka"], None)

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
        return _broker_answers(cluster_ports(self.number)[0], self.number)

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


def _broker_answers(port: int, node: int | None) -> bool:
    """Whether the broker on ``port`` answers a metadata request (listing broker ``node``, when given). Only an
    open port is asked where confluent_kafka is missing (the tool runs with the stdlib alone)."""
    if not port_open(port):
        return False
    try:
        from confluent_kafka.admin import AdminClient  # present in the project's virtualenv
    except ImportError:
        return True
    try:
        md = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=2)
    except Exception:
        return False
    return bool(md.brokers) if node is None else node in md.brokers
