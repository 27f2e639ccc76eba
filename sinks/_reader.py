"""The one reader every sink shares: Spark's Kafka source over the change topics, and the registry's schemas
each batch is decoded with (sinks._fold decodes it, wherever the batch runs).

Each record is read with the schema it was written with and resolved to the subject's latest schema, so
events written before an ALTER TABLE decode into today's shape. The capture registers every schema before
writing with it and the registry enforces FULL compatibility, so the latest version fetched after the batch's
ids were seen can read all of them.

Records that are not Confluent-framed Avro, name a schema the registry does not know, or fail to decode
are *poison*: they go to the dead-letter topic with the reason, the rest of the batch goes on.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from pgcdc_common.kafka_refusals import refused
from sinks._fold import TopicFold, TopicSchemas, framed_ids, knows
from sinks._progress import TopicEnds
from sinks.errors import SinkConfigError, SinkTransientError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from sinks._config import SinkSettings
    from sinks._served import ServedTopics

log = logging.getLogger(__name__)

_FETCH_WAIT = "kafka.fetch.max.wait.ms"
_CONSUMER_ONLY = ("kafka.isolation.level", _FETCH_WAIT)  # not for the dead-letter producer
_RAW = ("topic", "partition", "offset", "key", "value")


def kafka_options(settings: SinkSettings) -> dict[str, str]:
    options = {
        "kafka.bootstrap.servers": settings.kafka.bootstrap_servers,
        # Only committed capture transactions: an aborted one must never reach a store.
        "kafka.isolation.level": "read_committed",
        # TLS and SASL as the capture uses them (Spark redacts sasl.jaas.config in its logs and UI).
        **{f"kafka.{k}": v for k, v in settings.kafka.java().items()},
        # A live batch ends at the commit marker of the capture's last transaction, which read_committed
        # never returns: Spark's consumer then fetches at the log's end, where the broker waits this long for
        # data that is not coming (the default, 500 ms, was a quarter of the search and cache freshness).
        _FETCH_WAIT: "50",
    }
    options.update({f"kafka.{k}": str(v) for k, v in settings.kafka.consumer.items()})
    return options


def open_stream(
    spark: SparkSession, settings: SinkSettings, *, rebuild: bool = False, served: ServedTopics | None = None
) -> DataFrame:
    """The streaming DataFrame of change records (from offset zero unless a checkpoint says otherwise).

    A rebuild reads in larger batches (``rebuild_max_offsets_per_trigger``): a new generation has no reader,
    so latency does not matter, and each batch's fold dedupes across everything it read. Its first batch is a
    bulk load (the warehouse appends instead of merging), and every later one pays a guarded write against
    a growing copy (a MERGE rewrites the files its keys fall in), so fewer, larger batches cost less.
    """
    reader = spark.readStream.format("kafka").options(**kafka_options(settings))
    reader = reader.option("subscribePattern", settings.topic_pattern())
    reader = reader.option("startingOffsets", "earliest")
    # Compaction removes records below a checkpointed offset now and then; that is expected, not data loss.
    reader = reader.option("failOnDataLoss", "false")
    # New tables (topics) are picked up within seconds rather than the consumer's default five minutes.
    reader = reader.option("kafka.metadata.max.age.ms", "5000")
    most = settings.sinks.rebuild_max_offsets_per_trigger if rebuild else settings.sinks.max_offsets_per_trigger
    if most:
        reader = reader.option("maxOffsetsPerTrigger", str(most))
    frame = reader.load().select("topic", "partition", "offset", "key", "value")
    # A table is read from one topic generation (pgcdc_common.topics.superseded): its newest, or the one its store
    # generation reads (``served``: sinks._served). Topics made after the start are left out by the batches.
    ends = TopicEnds(settings, served=served)
    try:
        old = sorted(ends.superseded())
    finally:
        ends.close()
    return frame.where(~frame["topic"].isin(old)) if old else frame


def tail_ranges(settings: SinkSettings, per_partition: int) -> dict[tuple[str, int], tuple[int, int]]:
    """The last ``per_partition`` committed offsets of each change topic's non-empty partitions, as
    (topic, partition) -> [start, end)."""
    ends = TopicEnds(settings)
    try:
        marks = ends.read()
    finally:
        ends.close()
    return {tp: (max(low, high - per_partition), high) for tp, (low, high) in marks.items() if high > low}


def tail_records(spark: SparkSession, settings: SinkSettings, per_partition: int) -> tuple[DataFrame, set[str]] | None:
    """The last ``per_partition`` committed offsets of each change topic's partitions (a batch read, the same
    columns as :func:`open_stream`) and the topics they are in; None when the topics hold nothing."""
    start: dict[str, dict[str, int]] = {}
    end: dict[str, dict[str, int]] = {}
    for (topic, partition), (low, high) in tail_ranges(settings, per_partition).items():
        start.setdefault(topic, {})[str(partition)] = low
        end.setdefault(topic, {})[str(partition)] = high
    if not start:
        return None
    reader = spark.read.format("kafka").options(**kafka_options(settings))
    reader = reader.option("assign", json.dumps({t: [int(p) for p in parts] for t, parts in start.items()}))
    reader = reader.option("startingOffsets", json.dumps(start)).option("endingOffsets", json.dumps(end))
    return reader.option("failOnDataLoss", "false").load().select(*_RAW), set(start)


class Decoder:
    """The registry's side of decoding, on the driver: each topic's reader and writer schemas.

    Writer ids come from the subjects' versions, fetched when a batch is planned (two small requests per
    topic, versions cached): the capture registers a schema before it writes with it, so every id in a batch
    whose offsets are already fixed is among them, and no Spark job has to look for ids in the data.
    """

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings
        self._client = SchemaRegistryClient(settings.registry_conf())
        self._versions: dict[str, dict[int, tuple[int, str]]] = {}  # subject -> version -> (id, schema)

    def _subject(self, subject: str) -> dict[int, tuple[int, str]] | None:
        try:
            versions = self._client.get_versions(subject)
            known = self._versions.setdefault(subject, {})
            for version in versions:
                if version not in known:
                    found = self._client.get_version(subject, version)
                    known[version] = (int(found.schema_id or 0), str(found.schema.schema_str))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return None
            raise SinkTransientError(f"schema registry: cannot read the versions of {subject}: {exc}") from exc
        except Exception as exc:  # connection refused, timeouts
            raise SinkTransientError(f"schema registry at {self.settings.registry.url} unreachable: {exc}") from exc
        return {v: known[v] for v in versions}

    def schemas(self, topic: str) -> TopicSchemas:
        keys, values = self._subject(f"{topic}-key"), self._subject(f"{topic}-value")
        if not keys or not values:
            return TopicSchemas(topic)
        return TopicSchemas(
            topic,
            # The latest versions can read every earlier one (the registry enforces FULL compatibility).
            key_reader=keys[max(keys)][1],
            value_reader=values[max(values)][1],
            key_writers=dict(keys.values()),
            value_writers=dict(values.values()),
        )


class RegistryFolds:
    """Each topic's fold for some records, with the registry's schemas asked again only when a record is framed
    with an id they do not hold (a new version): records of known ids make no registry request."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self._schemas: dict[str, TopicSchemas] = {}  # the registry's, by topic
        self._lock = threading.Lock()  # a query's batches and the lanes' feed ask from their own threads

    def __call__(self, records: list[dict[str, Any]]) -> list[TopicFold]:
        folds = []
        for topic, ids in sorted(framed_ids(records).items()):
            with self._lock:
                known = self._schemas.get(topic)
            if known is None or not knows(known, ids):
                known = self.decoder.schemas(topic)
                with self._lock:
                    self._schemas[topic] = known
            folds.append(TopicFold(known))
        return folds


def union_all(frames: list[DataFrame], columns: tuple[str, ...] | None = None) -> DataFrame | None:
    if not frames:
        return None
    if columns is not None:
        frames = [f.select(*columns) for f in frames]
    out = frames[0]
    for more in frames[1:]:
        out = out.unionByName(more)
    return out


def ensure_dead_letter_topic(settings: SinkSettings, timeout_s: float = 30) -> None:
    """Create the dead-letter topic if it is missing (brokers often refuse to create topics implicitly).

    Kafka not answering within ``timeout_s`` (no broker reached, the controller moving) is a
    :class:`SinkTransientError` naming the topic and the brokers: the app retries it. A refusal retrying cannot
    mend (no permission to create topics, a policy, an invalid setting) is a :class:`SinkConfigError` saying how
    to go on."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import NewTopic

    admin, security = _admin(settings)
    topic = settings.dead_letter_topic
    try:
        try:
            found = admin.list_topics(timeout=timeout_s).topics
        except KafkaException:
            admin.poll(0)  # serves error_cb
            if security:
                raise SinkConfigError(_security_message(security[-1])) from None
            raise
        if topic in found:
            return
        # delete, not compact: dead letters are a log to inspect and replay, not state (and keys may be garbage).
        future = admin.create_topics([NewTopic(topic, num_partitions=1, config={"cleanup.policy": "delete"})])[topic]
        future.result(timeout_s)
        log.info("created the dead-letter topic %s", topic)
    except (KafkaException, TimeoutError) as exc:  # concurrent.futures' TimeoutError is the builtin one
        if "TOPIC_ALREADY_EXISTS" in str(exc):
            return
        where = f"the dead-letter topic {topic} on {settings.kafka.bootstrap_servers}"
        raise _topic_error(where, exc, timeout_s) from exc


def _admin(settings: SinkSettings) -> tuple[Any, list[Any]]:
    """An admin client of the sinks' brokers, and the security errors librdkafka reports to it (it reports
    refused credentials and untrusted certificates only to ``error_cb``: they end the app with the key to fix)."""
    from confluent_kafka.admin import AdminClient

    security: list[Any] = []

    def on_error(err: Any) -> None:
        if _security_error(err):
            security.append(err)

    # kafka.consumer holds Java names for Spark; this librdkafka client takes only brokers and security.
    conf: dict[str, Any] = {**settings.kafka.client_conf(), "error_cb": on_error}
    return AdminClient(conf), security


def _topic_error(where: str, exc: Exception, timeout_s: float) -> SinkConfigError | SinkTransientError:
    """What Kafka's answer to checking or creating ``where`` means: a refusal to act on (pgcdc_common's rule, as
    the capture judges its own topics), or anything else, to retry."""
    from confluent_kafka import KafkaError

    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    if err is None:
        return SinkTransientError(f"cannot check or create {where}: no answer within {timeout_s:g} s")
    if not refused(err.name(), fatal=err.fatal()):
        return SinkTransientError(f"cannot check or create {where}: {err.str()}")
    return SinkConfigError(
        f"Kafka refused to create {where} ({err.str()}): create it yourself (cleanup.policy=delete), let the "
        "sinks' principal create topics, or name an existing topic in sinks.dead_letter_topic"
    )


def _security_error(err: Any) -> bool:
    from confluent_kafka import KafkaError

    return bool(err.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL))


def _security_message(err: Any) -> str:
    from confluent_kafka import KafkaError

    if err.code() == KafkaError._AUTHENTICATION:
        return (
            f"Kafka refused the sinks' credentials ({err.str()}); check kafka.sasl_mechanism, kafka.sasl_username "
            "and the password (kafka.sasl_password, CDC_KAFKA__SASL_PASSWORD or kafka.sasl_password_file)"
        )
    return (
        f"the TLS connection to Kafka failed ({err.str()}); check kafka.security_protocol, kafka.ssl_ca_location "
        "(the CA that signed the broker's certificate) and that bootstrap_servers names a host it is for"
    )


def _header(name: str, value: Column) -> Column:
    from pyspark.sql import functions as F

    return F.struct(F.lit(name).alias("key"), value.cast("binary").alias("value"))


def dead_letters(raw: DataFrame, rejected: DataFrame) -> DataFrame:
    """The raw records named by ``rejected`` (topic, partition, offset, error), with their reason.

    ``rejected`` is small (poison and store refusals are rare) and broadcast.
    """
    from pyspark.sql import functions as F

    return raw.select(*_RAW).join(F.broadcast(rejected), on=["topic", "partition", "offset"])


def write_dead_letters(settings: SinkSettings, sink: str, dead: DataFrame, count: int) -> int:
    """Write ``dead`` (topic, partition, offset, key, value, error; ``count`` records, known to the caller)
    to the dead-letter topic; returns ``count``.

    Each record keeps its original key and value bytes; headers say why and where it came from.
    """
    from pyspark.sql import functions as F

    out = dead.select(
        F.lit(settings.dead_letter_topic).alias("topic"),
        "key",
        "value",
        F.array(
            _header("pgcdc.error", F.col("error")),
            _header("pgcdc.sink", F.lit(sink)),
            _header("pgcdc.topic", F.col("topic")),
            _header("pgcdc.partition", F.col("partition").cast("string")),
            _header("pgcdc.offset", F.col("offset").cast("string")),
        ).alias("headers"),
    )
    out.write.format("kafka").options(
        **{k: v for k, v in kafka_options(settings).items() if k not in _CONSUMER_ONLY}
    ).save()
    log.warning("sink %s: %d record(s) sent to the dead-letter topic %s", sink, count, settings.dead_letter_topic)
    return count
