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
import math
import threading
from collections.abc import Iterable
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


def _undecodable(kid: int | None, vid: int | None) -> str:
    """The dead-letter reason of a framed record that its writer schemas do not decode."""
    return f"Avro decoding failed with the writer schema ids key {kid} / value {vid}"


@dataclass(frozen=True)
class _GroupPlan:
    """Decoder.plan's answer for one group of records."""

    reject_all: str | None = None  # every record of the group is poison, for this reason
    reject_values: str | None = None  # records with a value are poison, for this reason
    keep_tombstones: bool = True  # after reject_values: the group's tombstones are still read
    key_reader: str = ""
    value_reader: str = ""
    key_writer: str | None = None
    value_writer: str | None = None

    def schemas(self) -> tuple[str, str, str, str]:
        """Key reader, value reader, key writer, value writer of a group that is read."""
        assert self.key_writer is not None
        assert self.value_writer is not None
        return self.key_reader, self.value_reader, self.key_writer, self.value_writer


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

    def readers(self, topic: str, writer_ids: Iterable[int | None]) -> tuple[str, str] | None:
        """The subject's latest key and value schemas, which read every writer id seen; None if unregistered.

        ``writer_ids``: every key and value schema id of ``topic`` in the batch. All of them, not the first group's:
        a batch may hold events of the previous schema version before the first of a new one, and readers chosen
        from the old ids alone would drop the new version's added columns (found by test_sinks_local_decoder).
        """
        ids = {i for i in writer_ids if i is not None}
        cached = self._readers.get(topic)
        if cached is not None and ids <= cached[2]:
            return cached[0], cached[1]  # no new writer schema since they were fetched
        key_reader, value_reader = self._latest(f"{topic}-key"), self._latest(f"{topic}-value")
        seen = set(self._by_id)
        if key_reader is None or value_reader is None:
            return None
        # The latest versions, fetched after these ids were registered, can read all of them.
        self._readers[topic] = (key_reader, value_reader, seen | ids)
        return key_reader, value_reader

    def plan(
        self,
        topic: str,
        kid: int | None,
        vid: int | None,
        topic_ids: Iterable[int | None],
        readers: dict[str, tuple[str, str]],
    ) -> _GroupPlan:
        """How the records of one (topic, key schema id, value schema id) group of a batch are read, or why
        (some of) them are poison — one rule for the Spark and the driver path. ``topic_ids``: every writer id of
        the topic in the batch (see :meth:`readers`); ``readers``: the batch's choice per topic, filled here."""
        if kid is None:
            return _GroupPlan(reject_all="key is not Confluent-framed Avro (magic byte 0)")
        if topic not in readers:
            found = self.readers(topic, topic_ids)
            if found is None:
                return _GroupPlan(reject_all=f"no schema registered for {topic}")
            readers[topic] = found
        key_reader, value_reader = readers[topic]
        key_writer = self._schema(kid)
        value_writer = value_reader if vid is None else self._schema(vid)
        bad = None
        if key_writer is None:
            bad = f"key schema id {kid} is unknown to the registry"
        elif vid is None:
            bad = "value is not Confluent-framed Avro (magic byte 0)"
        elif value_writer is None:
            bad = f"value schema id {vid} is unknown to the registry"
        return _GroupPlan(
            reject_values=bad,
            # Without a value id the group's tombstones (null values) are still deletes of their keys.
            keep_tombstones=vid is None and key_writer is not None,
            key_reader=key_reader,
            value_reader=value_reader,
            key_writer=key_writer,
            value_writer=value_writer,
        )

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
            plan = self.plan(
                topic, kid, vid, (i for g2 in groups if g2["topic"] == topic for i in (g2["_kid"], g2["_vid"])), readers
            )
            if plan.reject_all is not None:
                suspect = True
                poison.append(subset.withColumn("error", F.lit(plan.reject_all)))
                continue
            if plan.reject_values is not None:
                # A null value (tombstone) has no id and is fine; anything else without an id is poison.
                suspect = suspect or not plan.keep_tombstones or bool(g["unframed"])
                poison.append(subset.filter(F.col("value").isNotNull()).withColumn("error", F.lit(plan.reject_values)))
                if not plan.keep_tombstones:
                    continue
                subset = subset.filter(F.col("value").isNull())
            key_reader, value_reader, key_writer, value_writer = plan.schemas()
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
            poison.append(
                decoded.filter(F.col("_bad"))
                .select("topic", "partition", "offset", "key", "value")
                .withColumn("error", F.lit(_undecodable(kid, vid)))
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
                **{k: v for k, v in kafka_options(settings).items() if k not in _CONSUMER_ONLY}
            ).save()
            log.warning(
                "sink %s: %d record(s) sent to the dead-letter topic %s", sink, count, settings.dead_letter_topic
            )
        return int(count)
    finally:
        out.unpersist()


# --- small batches on the driver --------------------------------------------------------------
#
# A Spark job costs a few hundred milliseconds on a small machine, several seconds when three sinks share
# two cores; the Spark path above runs four or five per micro-batch (schema ids, marks, last per key, the
# transfer), so a single-row change waited many seconds. A sink that reads only ``TableChanges.changes()``
# (``reads_changes_only = True``: search, cache) gets small micro-batches decoded here instead: one Spark job
# reads the raw records, and the same steps run on the driver — Confluent framing, each record decoded with
# the schema it was written with and resolved to the subject's latest (fastavro, the capture's own Avro
# library), poison to the dead-letter topic, truncates, unchanged-TOAST filling, the newest event per key by
# (commit_lsn, lsn, offset), lone tombstones. Values come out as Avro values (no logical-type conversion), the
# form ``doc_converter(spark=False)`` takes, which is also how `cdc verify` reads the source: the documents
# are the same as the Spark path's. Large batches (a replay, a rebuild) keep the Spark path.

LOCAL_MAX_RECORDS = 5000  # offsets (records and transaction markers) up to which a batch is decoded here


def _strip_logical(avro: Any) -> Any:
    """The schema without logical types: fastavro then returns the Avro values themselves."""
    if isinstance(avro, list):
        return [_strip_logical(a) for a in avro]
    if isinstance(avro, dict):
        return {k: _strip_logical(v) for k, v in avro.items() if k != "logicalType"}
    return avro


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a key's value, equal where Spark's grouping finds struct values equal."""
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, float):
        if math.isnan(value):  # NaN: one group, as Spark normalises it
            return ("NaN",)
        return value + 0.0  # -0.0 and 0.0: one group
    if isinstance(value, bytearray):
        return bytes(value)
    return value


def _newest_first(e: dict[str, Any]) -> tuple[Any, ...]:
    # The Spark path's window order: commit_lsn, lsn, offset, each descending with nulls last.
    c, lsn = e["commit_lsn"], e["lsn"]
    return (c is not None, c or 0, lsn is not None, lsn or 0, e["offset"])


class LocalDecoder:
    """The Spark path's decode and last-event-per-key, on the driver, for small batches (see above)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self._parsed: dict[str, Any] = {}

    def _avro(self, schema: str) -> Any:
        parsed = self._parsed.get(schema)
        if parsed is None:
            import fastavro

            parsed = fastavro.parse_schema(_strip_logical(json.loads(schema)))
            self._parsed[schema] = parsed
        return parsed

    def _read(self, data: bytes, writer: str, reader: str) -> Any:
        import io

        import fastavro

        return fastavro.schemaless_reader(io.BytesIO(data[5:]), self._avro(writer), self._avro(reader))

    def decode(self, rows: list[dict[str, Any]], spark: SparkSession) -> Decoded:
        from sinks._api import Change

        dec = self.decoder
        poison: list[tuple[Any, ...]] = []
        by_topic: dict[str, list[dict[str, Any]]] = {}
        readers: dict[str, tuple[str, str]] = {}
        newest_ts: int | None = None

        def framed_id(data: bytes | None) -> int | None:
            if data is None or len(data) < 5 or data[0] != 0:
                return None
            return int.from_bytes(data[1:5], "big")

        def reject(r: dict[str, Any], error: str) -> None:
            poison.append((r["topic"], r["partition"], r["offset"], r["key"], r["value"], error))

        groups: dict[tuple[str, int | None, int | None], list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault((r["topic"], framed_id(r["key"]), framed_id(r["value"])), []).append(r)
        for (topic, kid, vid), group in groups.items():
            subset = group
            plan = dec.plan(topic, kid, vid, (i for t, k, v in groups if t == topic for i in (k, v)), readers)
            if plan.reject_all is not None:
                for r in subset:
                    reject(r, plan.reject_all)
                continue
            if plan.reject_values is not None:
                for r in subset:
                    if r["value"] is not None:
                        reject(r, plan.reject_values)
                if not plan.keep_tombstones:
                    continue
                subset = [r for r in subset if r["value"] is None]
            key_reader, value_reader, key_writer, value_writer = plan.schemas()
            undecodable = _undecodable(kid, vid)
            for r in subset:
                try:
                    k = self._read(r["key"], key_writer, key_reader)
                    v = None if r["value"] is None else self._read(r["value"], value_writer, value_reader)
                except Exception:  # PERMISSIVE, as from_avro: a record that does not decode is poison
                    k = v = None
                if k is None or (r["value"] is not None and (v is None or v.get("op") is None)):
                    reject(r, undecodable)
                    continue
                source = (v or {}).get("source") or {}
                if source.get("ts_ms") is not None:
                    newest_ts = max(newest_ts or 0, int(source["ts_ms"]))
                by_topic.setdefault(topic, []).append(
                    {
                        "topic": topic,
                        "partition": r["partition"],
                        "offset": r["offset"],
                        "key": k,
                        "row": None if v is None else v.get("after"),
                        "op": None if v is None else v["op"],
                        "commit_lsn": source.get("commit_lsn"),
                        "lsn": source.get("lsn"),
                        "ts_ms": source.get("ts_ms"),
                        "unchanged": list((v or {}).get("unchanged_toast") or ()),
                        "tombstone": v is None,
                    }
                )
        tables = []
        for topic, events in sorted(by_topic.items()):
            truncate: tuple[int, int] | None = None
            for e in events:
                if e["op"] == "t" and e["commit_lsn"] is not None and e["lsn"] is not None:
                    position = (int(e["commit_lsn"]), int(e["lsn"]))
                    truncate = position if truncate is None else max(truncate, position)
            tables.append(self._table(topic, events, readers[topic], truncate, Change))
        frame = None
        if poison:
            frame = spark.createDataFrame(
                poison, "topic string, partition int, offset long, key binary, value binary, error string"
            )
        return Decoded(tables, frame, len(rows), [], newest_ts)

    def _table(
        self,
        topic: str,
        events: list[dict[str, Any]],
        readers: tuple[str, str],
        truncate: tuple[int, int] | None,
        change_type: Any,
    ) -> TableChanges:
        from sinks._values import Names, column_name, doc_converter

        changes = [e for e in events if not e["tombstone"] and e["op"] in _APPLY_OPS]
        if truncate is not None:
            changes = [
                e
                for e in changes
                if e["commit_lsn"] is not None and e["lsn"] is not None and (e["commit_lsn"], e["lsn"]) > truncate
            ]
        key_schema = json.loads(readers[0])
        envelope = json.loads(readers[1])
        row_schema = envelope["fields"][0]["type"][1]  # before: ["null", Value]: Value is defined there
        fields = [f["name"] for f in row_schema["fields"]]
        by_key: dict[Any, list[dict[str, Any]]] = {}
        for e in changes:
            by_key.setdefault(_freeze(e["key"]), []).append(e)
        latest: dict[Any, dict[str, Any]] = {}
        for frozen, group in by_key.items():
            group.sort(key=_newest_first)
            if any(e["unchanged"] for e in group):
                _fill_unchanged_local(group, fields)
            latest[frozen] = group[-1]
        lone: dict[Any, dict[str, Any]] = {}
        for e in events:
            if e["tombstone"]:
                frozen = _freeze(e["key"])
                if frozen in by_key:
                    continue  # its delete event is in the batch: nothing new
                best = lone.get(frozen)
                if best is None or (e["offset"], e["partition"], e["topic"]) > (
                    best["offset"],
                    best["partition"],
                    best["topic"],
                ):
                    lone[frozen] = e
        names = Names()
        key_conv = doc_converter(key_schema, names, spark=False)
        row_conv = doc_converter(row_schema, names, spark=False)
        columns = {f["name"]: column_name(f) for f in row_schema["fields"]}
        out = []
        for e in latest.values():
            op = e["op"]
            out.append(
                change_type(
                    key_conv(e["key"]),
                    None if op == "d" else row_conv(e["row"]),
                    op,
                    e["commit_lsn"],
                    e["lsn"],
                    e["ts_ms"],
                    tuple(columns.get(u, u) for u in e["unchanged"]),
                    e["partition"],
                    e["offset"],
                )
            )
        for e in lone.values():
            out.append(change_type(key_conv(e["key"]), None, "d", None, None, None, (), e["partition"], e["offset"]))
        return TableChanges(
            topic=topic,
            name=self.decoder.settings.table_name(topic),
            key_schema=key_schema,
            row_schema=row_schema,
            frame=None,  # type: ignore[arg-type]  # only for sinks that read changes() alone
            truncate=truncate,
            rows=out,
        )


def _fill_unchanged_local(group: list[dict[str, Any]], fields: list[str]) -> None:
    """:func:`_fill_unchanged` for one key's events in position order (oldest first), in place."""
    known: dict[str, Any] = {}
    for e in group:
        missing = e["unchanged"]
        row = e["row"]
        if e["op"] != "d" and row is not None:
            for name in fields:
                if name not in missing:
                    known[name] = row.get(name)
        if row is None or not missing:
            continue
        e["row"] = {n: known[n] if n in missing and n in known else row.get(n) for n in fields}
        e["unchanged"] = [n for n in missing if n not in known]
