"""The one reader every sink shares: Spark's Kafka source over the change topics, decoded per micro-batch.

Decoding is Spark's own ``from_avro`` (on the executors), once per writer schema present in the batch: each
record is read with the schema it was written with (``jsonFormatSchema``) and resolved to the subject's
latest schema (the ``avroSchema`` option), so events written before an ALTER TABLE decode into today's
shape. The capture registers every schema before writing with it and the registry enforces FULL
compatibility, so the latest version fetched after the batch's ids were seen can read all of them.

Records that are not Confluent-framed Avro, name a schema the registry does not know, or fail to decode
are *poison*: they go to the dead-letter topic with the reason, the rest of the batch goes on.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from sinks._api import Rejected, TableChanges
from sinks.errors import SinkConfigError, SinkTransientError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

_APPLY_OPS = ("c", "u", "r", "d")
_RAW = ("topic", "partition", "offset", "key", "value")


def kafka_options(settings: SinkSettings) -> dict[str, str]:
    options = {
        "kafka.bootstrap.servers": settings.kafka.bootstrap_servers,
        # Only committed capture transactions: an aborted one must never reach a store.
        "kafka.isolation.level": "read_committed",
        # TLS and SASL as the capture uses them (Spark redacts sasl.jaas.config in its logs and UI).
        **{f"kafka.{k}": v for k, v in settings.kafka.java().items()},
    }
    options.update({f"kafka.{k}": str(v) for k, v in settings.kafka.consumer.items()})
    return options


def open_stream(spark: SparkSession, settings: SinkSettings) -> DataFrame:
    """The streaming DataFrame of change records (from offset zero unless a checkpoint says otherwise)."""
    reader = spark.readStream.format("kafka").options(**kafka_options(settings))
    reader = reader.option("subscribePattern", settings.topic_pattern())
    reader = reader.option("startingOffsets", "earliest")
    # Compaction removes records below a checkpointed offset now and then; that is expected, not data loss.
    reader = reader.option("failOnDataLoss", "false")
    # New tables (topics) are picked up within seconds rather than the consumer's default five minutes.
    reader = reader.option("kafka.metadata.max.age.ms", "5000")
    if settings.sinks.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(settings.sinks.max_offsets_per_trigger))
    return reader.load().select("topic", "partition", "offset", "key", "value")


def _schema_id(column: Column) -> Column:
    from pyspark.sql import functions as F

    framed = (F.length(column) >= 5) & (F.hex(F.substring(column, 1, 1)) == F.lit("00"))
    return F.when(framed, F.conv(F.hex(F.substring(column, 2, 4)), 16, 10).cast("int"))


def _body(column: Column) -> Column:
    from pyspark.sql import functions as F

    return column.substr(F.lit(6), F.length(column) - 5)


@dataclass
class Decoded:
    tables: list[TableChanges]
    poison: DataFrame | None  # raw records with an ``error`` column; None when the batch cannot hold any
    records: int = 0
    persisted: list[DataFrame] = field(default_factory=list)
    newest_ts_ms: int | None = None  # the source commit time of the newest change event in the batch

    def release(self) -> None:
        for frame in self.persisted:
            frame.unpersist()


class Decoder:
    """Turns one micro-batch of raw records into per-table changes; caches schemas by id."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings
        self._client = SchemaRegistryClient(settings.registry_conf())
        self._by_id: dict[int, str | None] = {}
        # topic -> (latest key schema, latest value schema, writer ids known when they were fetched)
        self._readers: dict[str, tuple[str, str, set[int]]] = {}
        self._lock = threading.Lock()

    def _schema(self, schema_id: int) -> str | None:
        with self._lock:
            if schema_id not in self._by_id:
                try:
                    self._by_id[schema_id] = self._client.get_schema(schema_id).schema_str
                except SchemaRegistryError as exc:
                    if exc.http_status_code != 404:
                        raise SinkTransientError(f"schema registry: cannot fetch schema id {schema_id}: {exc}") from exc
                    self._by_id[schema_id] = None  # unknown: the records naming it are poison
            return self._by_id[schema_id]

    def _latest(self, subject: str) -> str | None:
        try:
            return str(self._client.get_latest_version(subject).schema.schema_str)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                return None
            raise SinkTransientError(f"schema registry: cannot fetch the latest {subject}: {exc}") from exc
        except Exception as exc:  # connection refused, timeouts
            raise SinkTransientError(f"schema registry at {self.settings.registry.url} unreachable: {exc}") from exc

    def decode(self, raw: DataFrame) -> Decoded:
        from pyspark.sql import functions as F
        from pyspark.sql.avro.functions import from_avro

        framed = raw.withColumn("_kid", _schema_id(F.col("key"))).withColumn("_vid", _schema_id(F.col("value")))
        unframed = F.col("value").isNotNull() & F.col("_vid").isNull()
        groups = (
            framed.groupBy("topic", "_kid", "_vid")
            .agg(F.count(F.lit(1)).alias("n"), F.sum(unframed.cast("int")).alias("unframed"))
            .collect()
        )
        records = sum(int(g["n"]) for g in groups)
        suspect = False  # whether any record may be poison: only then is the dead-letter job run
        persisted: list[DataFrame] = []
        poison: list[DataFrame] = []
        by_topic: dict[str, list[DataFrame]] = {}
        readers: dict[str, tuple[str, str]] = {}
        for g in groups:
            topic, kid, vid = g["topic"], g["_kid"], g["_vid"]
            subset = framed.filter(
                (F.col("topic") == topic) & F.col("_kid").eqNullSafe(kid) & F.col("_vid").eqNullSafe(vid)
            )
            if kid is None:
                suspect = True
                poison.append(subset.withColumn("error", F.lit("key is not Confluent-framed Avro (magic byte 0)")))
                continue
            if topic not in readers:
                cached = self._readers.get(topic)
                key_reader_: str | None
                value_reader_: str | None
                if cached is not None and {kid, vid} - {None} <= cached[2]:
                    key_reader_, value_reader_ = cached[0], cached[1]  # no new writer schema since it was fetched
                else:
                    key_reader_, value_reader_ = self._latest(f"{topic}-key"), self._latest(f"{topic}-value")
                    seen = set(self._by_id)
                    if key_reader_ is not None and value_reader_ is not None:
                        # The latest versions, fetched after these ids were registered, can read all of them.
                        self._readers[topic] = (key_reader_, value_reader_, seen | ({kid, vid} - {None}))
                if key_reader_ is None or value_reader_ is None:
                    suspect = True
                    poison.append(subset.withColumn("error", F.lit(f"no schema registered for {topic}")))
                    continue
                readers[topic] = (key_reader_, value_reader_)
            key_reader, value_reader = readers[topic]
            key_writer = self._schema(kid)
            value_writer = value_reader if vid is None else self._schema(vid)
            bad = (
                "value is not Confluent-framed Avro (magic byte 0)"
                if vid is None
                else None
                if value_writer
                else f"value schema id {vid} is unknown to the registry"
            )
            if key_writer is None:
                bad = f"key schema id {kid} is unknown to the registry"
            if bad is not None:
                # A null value (tombstone) has no id and is fine; anything else without an id is poison.
                suspect = suspect or vid is not None or key_writer is None or bool(g["unframed"])
                poison.append(subset.filter(F.col("value").isNotNull()).withColumn("error", F.lit(bad)))
                if vid is not None or key_writer is None:
                    continue
                subset = subset.filter(F.col("value").isNull())
            assert value_writer is not None
            assert key_writer is not None
            permissive = {"mode": "PERMISSIVE"}
            decoded = subset.select(
                "topic",
                "partition",
                "offset",
                "key",
                "value",
                from_avro(_body(F.col("key")), key_writer, {**permissive, "avroSchema": key_reader}).alias("k"),
                from_avro(_body(F.col("value")), value_writer, {**permissive, "avroSchema": value_reader}).alias("v"),
            )
            broken = (F.col("value").isNotNull() & F.col("v.op").isNull()) | F.col("k").isNull()
            # Decoded once per batch: the marks below, each sink's write and the dead letters all read it.
            decoded = decoded.withColumn("_bad", broken).persist()
            persisted.append(decoded)
            where = f"schema ids key {kid} / value {vid}"
            poison.append(
                decoded.filter(F.col("_bad"))
                .select("topic", "partition", "offset", "key", "value")
                .withColumn("error", F.lit(f"Avro decoding failed with the writer {where}"))
            )
            by_topic.setdefault(topic, []).append(decoded)
        # Truncates, which tables have partial (unchanged TOAST) updates, for every table in one job (a job
        # per table costs about a second each on a small machine).
        marks = _union(
            [
                f.select(
                    "topic",
                    F.when(
                        ~F.col("_bad") & (F.col("v.op") == "t"),
                        F.struct(F.col("v.source.commit_lsn").alias("c"), F.col("v.source.lsn").alias("l")),
                    ).alias("t"),
                    (F.col("v").isNotNull() & (F.size(F.col("v.unchanged_toast")) > 0)).cast("int").alias("p"),
                    F.col("_bad").cast("int").alias("b"),
                    F.col("v.source.ts_ms").alias("ts"),
                )
                for frames in by_topic.values()
                for f in frames
            ]
        )
        truncates: dict[str, tuple[int, int]] = {}
        partial: set[str] = set()
        newest_ts: int | None = None
        if marks is not None:
            for m in (
                marks.groupBy("topic")
                .agg(F.max("t").alias("t"), F.max("p").alias("p"), F.max("b").alias("b"), F.max("ts").alias("ts"))
                .collect()
            ):
                suspect = suspect or bool(m["b"])
                if m["ts"] is not None:
                    newest_ts = max(newest_ts or 0, int(m["ts"]))
                if m["t"] is not None:
                    truncates[m["topic"]] = (int(m["t"]["c"]), int(m["t"]["l"]))
                if m["p"]:
                    partial.add(m["topic"])
        tables = [
            self._table(topic, frames, readers[topic], truncates.get(topic), partial=topic in partial)
            for topic, frames in sorted(by_topic.items())
        ]
        return Decoded(tables, _union(poison, (*_RAW, "error")) if suspect else None, records, persisted, newest_ts)

    def _table(
        self,
        topic: str,
        frames: list[DataFrame],
        readers: tuple[str, str],
        truncate: tuple[int, int] | None,
        *,
        partial: bool = False,
    ) -> TableChanges:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        frame = frames[0]
        for more in frames[1:]:
            frame = frame.unionByName(more)
        frame = frame.filter(~F.col("_bad"))
        events = frame.select(
            "topic",
            "partition",
            "offset",
            F.col("k").alias("key"),
            F.col("v.after").alias("row"),
            F.col("v.op").alias("op"),
            F.col("v.source.commit_lsn").alias("commit_lsn"),
            F.col("v.source.lsn").alias("lsn"),
            F.col("v.source.ts_ms").alias("ts_ms"),
            F.col("v.unchanged_toast").alias("unchanged"),
            F.col("v").isNull().alias("tombstone"),
        )
        changes = events.filter(~F.col("tombstone") & F.col("op").isin(*_APPLY_OPS))
        if truncate is not None:
            c, lsn = truncate
            changes = changes.filter((F.col("commit_lsn") > c) | ((F.col("commit_lsn") == c) & (F.col("lsn") > lsn)))
        if partial:
            changes = _fill_unchanged(changes)
        newest = Window.partitionBy("key").orderBy(
            F.col("commit_lsn").desc(), F.col("lsn").desc(), F.col("offset").desc()
        )
        latest = changes.withColumn("_n", F.row_number().over(newest)).filter(F.col("_n") == 1).drop("_n")
        # A tombstone whose delete event is in the batch says nothing new; one alone (its delete was
        # compacted away before we read it) is a delete without a position.
        lone = (
            events.filter(F.col("tombstone"))
            .join(changes.select("key"), on="key", how="left_anti")
            .groupBy("key")
            .agg(F.max(F.struct("offset", "partition", "topic")).alias("m"))
            .select(
                F.col("m.topic").alias("topic"),
                F.col("m.partition").alias("partition"),
                F.col("m.offset").alias("offset"),
                "key",
                F.lit(None).cast(latest.schema["row"].dataType).alias("row"),
                F.lit("d").alias("op"),
                F.lit(None).cast("long").alias("commit_lsn"),
                F.lit(None).cast("long").alias("lsn"),
                F.lit(None).cast("long").alias("ts_ms"),
                F.array().cast("array<string>").alias("unchanged"),
                F.lit(True).alias("tombstone"),
            )
        )
        result = latest.unionByName(lone).drop("tombstone")
        result = result.withColumn("row", F.when(F.col("op") == "d", F.lit(None)).otherwise(F.col("row")))
        envelope = json.loads(readers[1])
        row_schema = envelope["fields"][0]["type"][1]  # before: ["null", Value]: Value is defined there
        return TableChanges(
            topic=topic,
            name=self.settings.table_name(topic),
            key_schema=json.loads(readers[0]),
            row_schema=row_schema,
            frame=result,
            truncate=truncate,
            events=changes.drop("tombstone"),
        )


def _fill_unchanged(changes: DataFrame) -> DataFrame:
    """Unchanged-TOAST columns of a partial update take the key's latest value from earlier in the batch.

    Only the last event per key is applied, so a partial update must carry what an earlier event of the same
    batch set (otherwise a row inserted and then updated within one batch would lose its large values).
    Values still unknown stay listed in ``unchanged``: the store keeps what it holds.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    fields = [f.name for f in changes.schema["row"].dataType.fields]  # type: ignore[attr-defined]
    upto = (
        Window.partitionBy("key")
        .orderBy("commit_lsn", "lsn", "offset")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    known = {}
    for name in fields:
        # Wrapped in a struct so that a real NULL counts as a known value and "unknown" is the only null.
        sent = F.when(
            (F.col("op") != "d") & ~F.array_contains(F.col("unchanged"), name),
            F.struct(F.col("row").getField(name).alias("v")),
        )
        known[name] = F.last(sent, ignorenulls=True).over(upto)
    filled = changes.select("*", *[known[n].alias(f"_k{i}") for i, n in enumerate(fields)])
    missing = F.col("unchanged")
    row = F.struct(
        *[
            F.when(F.array_contains(missing, n) & F.col(f"_k{i}").isNotNull(), F.col(f"_k{i}.v"))
            .otherwise(F.col("row").getField(n))
            .alias(n)
            for i, n in enumerate(fields)
        ]
    )
    still = F.filter(
        missing,
        lambda x: F.coalesce(*[F.when(x == n, F.col(f"_k{i}").isNull()) for i, n in enumerate(fields)], F.lit(True)),
    )
    out = filled.withColumn("row", F.when(F.col("row").isNull(), F.lit(None)).otherwise(row))
    out = out.withColumn("unchanged", still)
    return out.drop(*[f"_k{i}" for i in range(len(fields))])


def _union(frames: list[DataFrame], columns: tuple[str, ...] | None = None) -> DataFrame | None:
    if not frames:
        return None
    if columns is not None:
        frames = [f.select(*columns) for f in frames]
    out = frames[0]
    for more in frames[1:]:
        out = out.unionByName(more)
    return out


def ensure_dead_letter_topic(settings: SinkSettings) -> None:
    """Create the dead-letter topic if it is missing (brokers often refuse to create topics implicitly)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    # kafka.consumer holds Java names for Spark; this librdkafka client takes only brokers and security.
    # It is the app's first contact with Kafka: refused credentials or an untrusted certificate, which
    # librdkafka reports only to error_cb, end the app here with the key to fix instead of a retry loop.
    security: list[Any] = []

    def on_error(err: Any) -> None:
        if _security_error(err):
            security.append(err)

    conf: dict[str, Any] = {**settings.kafka.client_conf(), "error_cb": on_error}
    admin = AdminClient(conf)
    topic = settings.dead_letter_topic
    try:
        try:
            found = admin.list_topics(timeout=30).topics
        except KafkaException:
            admin.poll(0)  # serves error_cb
            if security:
                raise SinkConfigError(_security_message(security[-1])) from None
            raise
        if topic in found:
            return
        # delete, not compact: dead letters are a log to inspect and replay, not state (and keys may be garbage).
        future = admin.create_topics([NewTopic(topic, num_partitions=1, config={"cleanup.policy": "delete"})])[topic]
        future.result(30)
        log.info("created the dead-letter topic %s", topic)
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" in str(exc):
            return
        raise SinkTransientError(f"cannot create the dead-letter topic {topic}: {exc}") from exc


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


def send_to_dead_letter(
    settings: SinkSettings, sink: str, poison: DataFrame | None, rejected: list[Rejected], raw: DataFrame
) -> int:
    """Write poison records and store rejections to the dead-letter topic; returns how many were written.

    Each record keeps its original key and value bytes; headers say why and where it came from.
    """
    from pyspark.sql import functions as F

    frames = [] if poison is None else [poison]
    if rejected:
        spark = raw.sparkSession
        refused = spark.createDataFrame(
            [tuple(r) for r in rejected], "topic string, partition int, offset long, error string"
        )
        frames.append(raw.join(refused, on=["topic", "partition", "offset"]))
    out = _union([f.select("topic", "partition", "offset", "key", "value", "error") for f in frames])
    if out is None:
        return 0
    out = out.persist()
    try:
        count = out.count()
        if count:
            out.select(
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
            ).write.format("kafka").options(
                **{k: v for k, v in kafka_options(settings).items() if k != "kafka.isolation.level"}
            ).save()
            log.warning(
                "sink %s: %d record(s) sent to the dead-letter topic %s", sink, count, settings.dead_letter_topic
            )
        return int(count)
    finally:
        out.unpersist()
