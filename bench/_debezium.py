"""Debezium Server as the benchmark's reference: install, run against one database, measure.

    ./dev python -m bench._debezium install   # download (SHA-1 checked) and extract once
    ./dev python -m bench._debezium newest    # newest 3.x Final Maven Central serves with a SHA-1

What runs: ``io.debezium:debezium-server-dist`` (PostgreSQL connector in Debezium's embedded engine, Kafka sink)
on Java 21+, started directly as ``java -cp … io.debezium.server.Main`` in a scratch directory holding its
``config/application.properties``, so parallel runs never share a config or an offsets file and nothing is
written into the install. The download goes to pgcdc_dev.services's cache (~/.cache/pgcdc/downloads), the
install beside the other services (its ``OPT``), never into the repository.

Values and keys are Avro in the Confluent framing (magic 0 + 4-byte schema id), schemas registered in our
Apicurio registry: the same work per event as ``cdc run`` (a registry lookup per new schema, a binary Avro key and
value). Two converters can do that (``avro=``):
- "confluent" (default): Confluent's AvroConverter 7.0.16 against the registry's Confluent-compatible API, the
  usual Debezium + Avro setup. The distribution ships its jars, but only in connectors/debezium-connector-dse/
  (for the Cassandra DSE connector); we put just those jars on the class path.
- "apicurio": the converter Debezium Server documents (lib/apicurio-registry-utils-converter) against the
  registry's native v3 API; the distribution lacks Apache Avro, fetched from Maven Central. It is ~3x slower
  here (cold JVM, 100,000 rows: 1,728 rows/s and 47 CPU s against Confluent's 5,677 rows/s and 24 CPU s):
  Apicurio serde 3.1.7 re-serialises the whole envelope schema for every record
  (AvroSchemaParser.getSchemaFromData → Schema.toString, seen in jstack; Apicurio issue #5968, fixed by PR
  #7507 in a release this Maven Central does not have). A reference crippled by that would be a strawman.
What Debezium does NOT do that we do: Kafka transactions (its sink is an idempotent, acks=all producer, and
offsets go to a local file every ``offset_flush_ms``) — say so next to any figure.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from pgcdc_dev import services  # download (SHA-1 checked), extract, java_home, the local services' endpoints
from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

# Newest 3.x Final on Maven Central as reached from here (2026-11-22) WITH a published .sha1: 3.6.1 to 3.6.3 have
# the tar.gz but no checksum files, and download() refuses what it cannot verify. `newest` re-checks.
DEBEZIUM_VERSION = "3.6.0.Final"
JAVA_MIN = 21  # Debezium Server 3.x (Quarkus 3) is built for Java 21
# Confluent's Avro converter and what it needs beyond lib/ (which has guava, jackson, kafka-clients):
# all shipped in the distribution's DSE connector directory.
CONFLUENT_JARS = (
    "kafka-connect-avro-converter-7.0.16.jar",
    "kafka-connect-avro-data-7.0.16.jar",
    "kafka-avro-serializer-7.0.16.jar",
    "kafka-schema-serializer-7.0.16.jar",
    "kafka-schema-registry-client-7.0.16.jar",
    "common-utils-7.0.16.jar",
    "avro-1.11.3.jar",
)
# Apicurio's converter is in lib/, Apache Avro is not (startup fails with NoClassDefFoundError
# org/apache/avro/io/Encoder); 1.12.1 is what Apicurio serde 3.1.7 is built on.
APICURIO_JARS = [("org.apache.avro", "avro", "1.12.1")]
# Java 24+ (the machine's JDK is Temurin 25) refuses jboss-threads' reflective access unless java.lang is opened;
# harmless on 21.
JVM_FLAGS = ("--add-opens=java.base/java.lang=ALL-UNNAMED",)


def home(version: str = DEBEZIUM_VERSION) -> Path:
    return Path(services.OPT) / f"debezium-server-{version}"


def install(version: str = DEBEZIUM_VERSION) -> Path:
    """Download (once, SHA-1 verified) and extract Debezium Server; return its directory."""
    archive = services.download(services.maven_url("io.debezium", "debezium-server-dist", version, "tar.gz"))
    return Path(services.extract(archive, home(version), "debezium-server"))


def newest_version() -> str:
    """The newest 3.x.y.Final whose server tar.gz and its .sha1 are both on Maven Central.

    The server's maven-metadata.xml here lists only some releases, so the version list comes from the
    connector's metadata too (same release train); only the few 3.x Finals are probed, newest first.
    """
    found: set[str] = set()
    for artifact in ("debezium-server-dist", "debezium-connector-postgres"):
        url = f"{services.MAVEN}/io/debezium/{artifact}/maven-metadata.xml"
        with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - the fixed https Maven URL
            found.update(re.findall(r"<version>(3\.\d+\.\d+\.Final)</version>", resp.read().decode()))
    for version in sorted(found, key=lambda v: tuple(int(p) for p in v.split(".")[:3]), reverse=True):
        url = services.maven_url("io.debezium", "debezium-server-dist", version, "tar.gz")
        if _exists(url) and _exists(url + ".sha1"):
            return version
    raise services.DeployError("no Debezium Server 3.x Final with a SHA-1 on Maven Central")


def _exists(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30):  # noqa: S310
            return True
    except urllib.error.URLError:
        return False


def endpoints() -> dict[str, str]:
    """Kafka bootstrap and the registry (ccompat URL, as `pgcdc_dev.services endpoints` prints them)."""
    return {
        "kafka": str(services.SERVICES["kafka"].endpoint()["bootstrap"]),
        "registry": str(services.SERVICES["registry"].endpoint()["url"]),
    }


def _native_registry_url(ccompat: str) -> str:
    # The Apicurio converter speaks the registry's own API, not the Confluent-compatible one.
    return re.sub(r"/apis/ccompat/v\d+/?$", "/apis/registry/v3", ccompat)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- process usage (psutil is not in the venv: /proc) ------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process so far."""
    found = _cpu.stat(Path(f"/proc/{pid}/stat"))
    return 0.0 if found is None else _cpu.own_cpu(found[1])


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the JVM's threads by kind: JIT compilers, garbage collector, the rest (Debezium's work).

    A short run of a cold JVM spends much of its CPU compiling; this says how much, so a figure can be read.
    """
    out = {"jit": 0.0, "gc": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found = _cpu.stat(task / "stat")
        if found is None:
            continue  # the thread ended meanwhile
        comm, fields = found
        kind = "jit" if comm.startswith(("C1 Compiler", "C2 Compiler")) else "other"
        if comm.startswith(("GC Thread", "G1 ")):
            kind = "gc"
        out[kind] += _cpu.own_cpu(fields)
    return out


def peak_rss_mb(pid: int) -> float:
    """The process's high-water resident set (VmHWM), in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


# --- Kafka: topics and watermarks --------------------------------------------------------------


def create_topics(bootstrap: str, topics: Sequence[str], partitions: int = 1) -> None:
    """Compacted topics like ours (the local broker does not auto-create): same layout, same broker work."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    conf = {"cleanup.policy": "compact"}
    new = [NewTopic(t, num_partitions=partitions, replication_factor=1, config=conf) for t in topics]
    for fut in admin.create_topics(new).values():
        fut.result(30)


def delete_subjects(registry: str, topics: Sequence[str]) -> None:
    """Forget the key and value subjects of topics (TopicNameStrategy) in the registry's ccompat API.

    The Apicurio converter also registers the row record as an artifact of its own, referenced by the value's.
    """
    for topic in topics:
        for subject in (f"{topic}-key", f"{topic}-value", f"{topic}.Value"):
            url = f"{registry}/subjects/{urllib.parse.quote(subject, safe='')}"
            for suffix in ("", "?permanent=true"):  # the Confluent API deletes softly first, then for good
                req = urllib.request.Request(url + suffix, method="DELETE")  # noqa: S310 - deploy's registry URL
                with contextlib.suppress(urllib.error.URLError), urllib.request.urlopen(req, timeout=10):  # noqa: S310
                    pass  # 404 (never registered, or already gone) is fine


def topic_records(consumer: Consumer, topic: str) -> int:
    """Records in topic, from watermarks: exact for a non-transactional producer like Debezium's sink.

    A transactional producer's topic also counts one commit marker per partition and transaction; count
    those by consuming (read_committed) instead.
    """
    md = consumer.list_topics(topic, timeout=10)
    total = 0
    for p in md.topics[topic].partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
        total += high - low
    return total


@dataclass
class Arrival:
    first_s: float  # from the start mark to the first record in the topic
    last_s: float  # from the start mark to `expected` records in the topic
    records: int


def wait_for_records(
    bootstrap: str, topic: str, expected: int, start: float, *, timeout: float = 600.0, poll_s: float = 0.05
) -> Arrival:
    """Wait until topic holds `expected` records; times are seconds after `start` (a time.monotonic() mark).

    Watermarks move when the broker has appended (acks=all on one broker), so this is "acknowledged in Kafka".
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "pgcdc-bench-watermarks"})
    try:
        first: float | None = None
        deadline = time.monotonic() + timeout
        while True:
            n = topic_records(consumer, topic)
            now = time.monotonic()
            if n > 0 and first is None:
                first = now - start
            if n >= expected:
                return Arrival(first_s=first if first is not None else now - start, last_s=now - start, records=n)
            if now > deadline:
                raise TimeoutError(f"{topic}: {n} of {expected} records after {timeout:.0f} s")
            time.sleep(poll_s)
    finally:
        consumer.close()


# --- running Debezium --------------------------------------------------------------------------


@dataclass
class Tuning:
    """Debezium's knobs, set for throughput on this 2-core box; defaults noted so the reference is fair.

    max_batch_size 8192 (default 2048) and max_queue_size 32768 (default 8192): fewer, larger hand-offs from the
    streaming thread to the sink; poll_interval_ms 50 (default 500) so a half-full batch does not wait half a
    second. The producer mirrors ours (cdc/_kafka.py): linger.ms 5, lz4, acks=all + idempotence, 64 MB of
    buffer; batch.size 1 MB instead of Java's 16 kB default, which would cap each request at ~100 small records
    (librdkafka's default, which we use, is 1 MB too).
    """

    max_batch_size: int = 8192
    max_queue_size: int = 32768
    poll_interval_ms: int = 50
    offset_flush_ms: int = 1000
    snapshot_fetch_size: int = 10240
    linger_ms: int = 5
    batch_bytes: int = 1 << 20
    buffer_bytes: int = 64 << 20
    compression: str = "lz4"
    java_opts: tuple[str, ...] = ()  # JVM defaults (G1, heap ergonomics) unless asked: what a user gets


@dataclass
class Debezium:
    proc: subprocess.Popen[bytes]
    work: Path
    log: Path
    dsn: str
    slot: str
    topics: dict[str, str]  # "schema.table" -> Kafka topic
    started: float = field(default_factory=time.monotonic)
    killed: bool = False  # set when it ignored SIGTERM for a minute: its last offsets may be lost

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.proc.pid)

    def thread_cpu(self) -> dict[str, float]:
        return thread_cpu(self.proc.pid)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"Debezium exited with {self.proc.returncode}:\n{self.log_tail()}")

    def wait_streaming(self, timeout: float = 180.0) -> float:
        """Block until Debezium streams from its slot (snapshot, if any, done); return seconds since launch.

        "Streaming" = its slot is active (the walsender serves it) and the connector logged that it is
        processing messages: rows committed from then on are measured as streaming, not as snapshot.
        """
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                self.check_alive()
                row = conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
                ).fetchone()
                if row and row[0] and "Processing messages" in self.log_tail(1 << 20):
                    return time.monotonic() - self.started
                time.sleep(0.2)
        raise TimeoutError(f"Debezium did not start streaming within {timeout:.0f} s:\n{self.log_tail()}")


@dataclass(frozen=True)
class RunOptions:
    """One Debezium Server run (see :func:`running`): its topics' prefix and scratch directory, its own slot and
    publication, the snapshot mode, the knobs, the version, whether its topics outlive it, and the converter."""

    topic_prefix: str
    work: Path
    slot: str = "bench_debezium"
    publication: str = "bench_debezium"
    snapshot: str = "no_data"
    tuning: Tuning = field(default_factory=Tuning)
    version: str = DEBEZIUM_VERSION
    keep_topics: bool = False
    avro: str = "confluent"


def _properties(
    dsn: str, tables: Sequence[str], options: RunOptions, ep: dict[str, str], http_port: int
) -> dict[str, str | int]:
    """application.properties of a run: Quarkus, the Kafka sink, the PostgreSQL source, the Avro converter."""
    props: dict[str, str | int] = {
        "quarkus.http.port": http_port,  # default 8080 may be taken; we only need the process
        "quarkus.log.console.json": "false",
        **_sink_properties(ep["kafka"], options.tuning),
        **_source_properties(dsn, tables, options),
        "debezium.format.key": "avro",
        "debezium.format.value": "avro",
    }
    for part in ("key", "value"):
        fmt = f"debezium.format.{part}."
        if options.avro == "apicurio":  # Debezium picks Apicurio's converter when this URL is set, else Confluent's
            props[f"{fmt}apicurio.registry.url"] = _native_registry_url(ep["registry"])
            props[f"{fmt}apicurio.registry.auto-register"] = "true"
            props[f"{fmt}apicurio.registry.find-latest"] = "true"
        else:
            props[f"{fmt}schema.registry.url"] = ep["registry"]
    return props


def _sink_properties(kafka: str, tuning: Tuning) -> dict[str, str | int]:
    """The Kafka sink: byte arrays (the converter made them), its producer set as ours is (see :class:`Tuning`)."""
    return {
        "debezium.sink.type": "kafka",
        "debezium.sink.kafka.producer.bootstrap.servers": kafka,
        "debezium.sink.kafka.producer.key.serializer": "org.apache.kafka.common.serialization.ByteArraySerializer",
        "debezium.sink.kafka.producer.value.serializer": "org.apache.kafka.common.serialization.ByteArraySerializer",
        "debezium.sink.kafka.producer.acks": "all",
        "debezium.sink.kafka.producer.enable.idempotence": "true",
        "debezium.sink.kafka.producer.linger.ms": tuning.linger_ms,
        "debezium.sink.kafka.producer.batch.size": tuning.batch_bytes,
        "debezium.sink.kafka.producer.buffer.memory": tuning.buffer_bytes,
        "debezium.sink.kafka.producer.compression.type": tuning.compression,
    }


def _source_properties(dsn: str, tables: Sequence[str], options: RunOptions) -> dict[str, str | int]:
    """The PostgreSQL connector on ``tables`` of dsn's database, its offsets in the run's scratch directory."""
    pg = conninfo_to_dict(dsn)
    src = "debezium.source."
    tuning = options.tuning
    return {
        f"{src}connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        f"{src}offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        f"{src}offset.storage.file.filename": str(options.work / "offsets.dat"),
        f"{src}offset.flush.interval.ms": tuning.offset_flush_ms,
        f"{src}database.hostname": pg.get("host") or "127.0.0.1",
        f"{src}database.port": pg.get("port") or 5432,
        f"{src}database.user": pg.get("user") or "postgres",
        f"{src}database.password": pg.get("password") or "",
        f"{src}database.dbname": pg.get("dbname") or "postgres",
        f"{src}topic.prefix": options.topic_prefix,
        f"{src}table.include.list": ",".join(tables),  # regexes; a dot matching any char is harmless
        f"{src}plugin.name": "pgoutput",
        f"{src}slot.name": options.slot,
        f"{src}slot.drop.on.stop": "true",
        f"{src}publication.name": options.publication,
        f"{src}publication.autocreate.mode": "filtered",  # a publication of just these tables, like ours
        f"{src}snapshot.mode": options.snapshot,
        f"{src}snapshot.fetch.size": tuning.snapshot_fetch_size,
        f"{src}max.batch.size": tuning.max_batch_size,
        f"{src}max.queue.size": tuning.max_queue_size,
        f"{src}poll.interval.ms": tuning.poll_interval_ms,
    }


def _drop_slot(dsn: str, slot: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for attempt in range(50):  # the walsender may still be exiting after the JVM; only OUR slot's backend
            row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            if row is None:
                return
            if row[0] is None:
                with contextlib.suppress(psycopg.errors.UndefinedObject, psycopg.errors.ObjectInUse):
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    return
            elif attempt >= 25:
                conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
            time.sleep(0.2)


@contextlib.contextmanager
def running(dsn: str, tables: Sequence[str], options: RunOptions) -> Iterator[Debezium]:
    """Run Debezium Server on `tables` ("schema.table") of dsn's database until the block ends.

    Its own slot and publication (never ours), created by Debezium and dropped here afterwards; topics
    ``<topic_prefix>.<schema>.<table>`` created compacted beforehand and deleted afterwards, with their registry
    subjects, unless ``options.keep_topics``.
    ``options.snapshot``: "initial" (copy the tables, then stream) or "no_data" (stream only; Debezium 3's name
    for "never"). ``options.avro``: "confluent" or "apicurio", the converter (see the module's docstring).
    """
    if options.avro not in ("confluent", "apicurio"):
        raise ValueError(f"avro must be 'confluent' or 'apicurio', not {options.avro!r}")
    java = services.java_home(JAVA_MIN)
    if java is None:
        raise services.DeployError(f"Debezium Server {options.version} needs Java {JAVA_MIN}+; none in /usr/lib/jvm")
    dhome = install(options.version)
    ep = endpoints()
    topics = {t: f"{options.topic_prefix}.{t}" for t in tables}
    create_topics(ep["kafka"], list(topics.values()))
    work = options.work
    work.mkdir(parents=True, exist_ok=True)
    (work / "config").mkdir(exist_ok=True)
    props = _properties(dsn, tables, options, ep, _free_port())
    # Quarkus reads ./config/application.properties: the run's own directory, not the install's.
    (work / "config" / "application.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    proc, log = _launch(java, dhome, options)
    dbz = Debezium(proc=proc, work=work, log=log, dsn=dsn, slot=options.slot, topics=topics)
    try:
        yield dbz
    finally:
        _stop(dbz)
        _drop_slot(dsn, options.slot)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(options.publication)))
        if not options.keep_topics:
            delete_topics(ep["kafka"], list(topics.values()))
            delete_subjects(ep["registry"], list(topics.values()))


def _launch(java: Path, dhome: Path, options: RunOptions) -> tuple[subprocess.Popen[bytes], Path]:
    """Debezium Server started in the run's directory, with the converter's jars on its class path; its log."""
    runner = next(dhome.glob("debezium-server-*runner.jar"))
    if options.avro == "apicurio":
        extra = [str(services.download(services.maven_url(g, a, v, "jar"))) for g, a, v in APICURIO_JARS]
    else:
        extra = [str(dhome / "connectors" / "debezium-connector-dse" / jar) for jar in CONFLUENT_JARS]
    classpath = ":".join([str(runner), str(dhome / "config" / "lib"), *extra, f"{dhome / 'lib'}/*"])
    log = options.work / "debezium.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(java / "bin" / "java"),
                *JVM_FLAGS,
                *options.tuning.java_opts,
                "-cp",
                classpath,
                "io.debezium.server.Main",
            ],
            cwd=options.work,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return proc, log


def _stop(dbz: Debezium) -> None:
    """SIGTERM, and SIGKILL a minute later if it still runs (``killed`` then says so)."""
    proc = dbz.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # Quarkus shuts the engine down: last offsets, slot dropped
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            dbz.killed = True
            proc.kill()
            proc.wait(10)


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        print(install())
        return 0
    if argv[:1] == ["newest"]:
        print(newest_version())
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
