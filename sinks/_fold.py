"""The fold: one micro-batch of raw change records to the latest change per key, as Spark operations.

Everything here builds a plan; nothing runs on the driver and nothing is collected. The rules, which exist
only here:

* **Decoding.** A record is Confluent-framed Avro; it is read with the schema it was written with (its id is
  one of the subject's versions, known from the registry before the batch is planned) and resolved to the
  subject's latest version, so events written before an ALTER TABLE read in today's shape.
* **Poison.** A record that is not framed, names a schema id that is not a version of its subject, or does not
  decode gets an ``error``; it comes out of the fold as a row of its own with ``op = '!'`` (and goes to the
  dead-letter topic); the rest of the batch goes on.
* **Last event per key** by ``(commit_lsn, lsn, offset, partition)``.
* **Truncates** (``op = 't'``, a key whose fields are all null): the table's newest truncate in the batch
  comes out as one row with ``op = 't'`` and its position, which a store applies as "remove every row older
  than this" after the batch's other writes (so whatever of the batch is older goes too). A frame-based sink
  is given the position before it writes, and the fold then drops the events at or before it.
* **Unchanged TOAST**: a partial update takes each missing column from the key's latest earlier event in the
  batch that sent it; columns still unknown stay listed in ``unchanged`` (the store keeps its value).
* **Lone tombstones**: a tombstone whose delete event is not in the batch (compacted away) is a delete
  without a position.

Output columns of :func:`fold`: ``topic, partition, offset, key, row, op, commit_lsn, lsn, ts_ms, unchanged,
error``. ``partition``/``offset`` are those of the record the row came from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sinks._values import Names, envelope_row, spark_projection

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

APPLY_OPS = ("c", "u", "r", "d")
TRUNCATE = "t"
POISON = "!"
KEY_UNFRAMED = "key is not Confluent-framed Avro (magic byte 0)"
VALUE_UNFRAMED = "value is not Confluent-framed Avro (magic byte 0)"
# Avro types whose values never live out of line (PostgreSQL TOASTs only variable-length values): no
# unchanged-TOAST filling is planned for them.
_FIXED_WIDTH = {"boolean", "int", "long", "float", "double"}
# Spark reads these as its TIME type, which its aggregations refuse (spark.sql.timeType.enabled is off) and
# Delta Lake cannot store: the fold reads a time of day as the number it is encoded as (µs since midnight).
_TIME_OF_DAY = ("time-micros", "time-millis")


@dataclass(frozen=True)
class TopicSchemas:
    """What the registry holds for one topic when a batch is planned: the readers and every writer by id."""

    topic: str
    key_reader: str | None = None  # the subject's latest version; None when the subject is not registered
    value_reader: str | None = None
    key_writers: Mapping[int, str] = field(default_factory=dict)
    value_writers: Mapping[int, str] = field(default_factory=dict)

    @property
    def registered(self) -> bool:
        return self.key_reader is not None and self.value_reader is not None

    @property
    def key_schema(self) -> dict[str, Any]:
        """The key's reader schema, parsed."""
        assert self.key_reader is not None
        return dict(json.loads(self.key_reader))

    @property
    def row_schema(self) -> dict[str, Any]:
        """The row's record schema inside the envelope's reader schema."""
        assert self.value_reader is not None
        return envelope_row(json.loads(self.value_reader))


def schema_id(column: Column) -> Column:
    """The Confluent schema id of a framed record (magic byte 0, then 4 bytes big-endian); null otherwise."""
    from pyspark.sql import functions as F

    framed = (F.length(column) >= 5) & (F.hex(F.substring(column, 1, 1)) == F.lit("00"))
    return F.when(framed, F.conv(F.hex(F.substring(column, 2, 4)), 16, 10).cast("int"))


def _body(column: Column) -> Column:
    from pyspark.sql import functions as F

    return column.substr(F.lit(6), F.length(column) - 5)


def _decoded(body: Column, ids: Column, writers: Mapping[int, str], reader: str) -> Column:
    """``body`` read with its writer schema (by id) and resolved to ``reader``; null where it does not decode."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    options = {"mode": "PERMISSIVE", "avroSchema": _without_times_of_day(reader)}
    out: Column | None = None
    for schema_id_, writer in sorted(writers.items()):
        branch = from_avro(body, writer, options)
        out = F.when(ids == schema_id_, branch) if out is None else out.when(ids == schema_id_, branch)
    assert out is not None  # a registered subject has at least one version
    return out


def _without_times_of_day(schema: str) -> str:
    """``schema`` with the time-of-day logical types dropped (see _TIME_OF_DAY): their longs and ints stay."""

    def plain(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: plain(v) for k, v in node.items() if not (k == "logicalType" and v in _TIME_OF_DAY)}
        return [plain(v) for v in node] if isinstance(node, list) else node

    return json.dumps(plain(json.loads(schema)))


def _unknown(ids: Column, known: Mapping[int, str], what: str, subject: str) -> Column:
    from pyspark.sql import functions as F

    message = F.concat(F.lit(f"{what} schema id "), ids.cast("string"), F.lit(f" is not a version of {subject}"))
    return F.when(~ids.isin(*known), message) if known else message


def decode_steps(schemas: TopicSchemas) -> list[list[Column]]:
    """The projections that decode one topic's records, applied in order: the result has ``topic, partition,
    offset, key, row, op, commit_lsn, lsn, ts_ms, unchanged, tombstone, error`` (``error`` set, and the rest
    null, for poison)."""
    from pyspark.sql import functions as F

    kid, vid = schema_id(F.col("key")), schema_id(F.col("value"))
    framed = [F.col(c) for c in ("topic", "partition", "offset", "key", "value")] + [
        kid.alias("_kid"),
        vid.alias("_vid"),
    ]
    if not schemas.registered:
        return [framed, _poison_only(f"no schema registered for {schemas.topic}")]
    assert schemas.key_reader is not None
    assert schemas.value_reader is not None
    kid, vid, value = F.col("_kid"), F.col("_vid"), F.col("value")
    cheap = F.coalesce(
        F.when(kid.isNull(), F.lit(KEY_UNFRAMED)).otherwise(
            _unknown(kid, schemas.key_writers, "key", f"{schemas.topic}-key")
        ),
        F.when(value.isNotNull() & vid.isNull(), F.lit(VALUE_UNFRAMED)),
        F.when(value.isNotNull(), _unknown(vid, schemas.value_writers, "value", f"{schemas.topic}-value")),
    )
    ok = F.col("_cheap").isNull()
    k = F.when(ok, _decoded(_body(F.col("key")), kid, schemas.key_writers, schemas.key_reader))
    v = F.when(ok & value.isNotNull(), _decoded(_body(value), vid, schemas.value_writers, schemas.value_reader))
    undecodable = F.concat(
        F.lit("Avro decoding failed with the writer schema ids key "),
        F.coalesce(kid.cast("string"), F.lit("None")),
        F.lit(" / value "),
        F.coalesce(vid.cast("string"), F.lit("None")),
    )
    # A row's key never has a null field; only a truncate's has them all null. Avro bytes that are not of the
    # key's schema can still decode (to nulls), so a null field outside a truncate is poison too.
    key_fields = [f["name"] for f in json.loads(schemas.key_reader)["fields"]]
    holed = F.lit(False)
    for name in key_fields:
        holed = holed | F.col("k").getField(name).isNull()
    broken = (
        F.col("k").isNull()
        | (value.isNotNull() & F.col("v.op").isNull())
        | (holed & (value.isNull() | (F.col("v.op") != TRUNCATE)))
    )
    error = F.coalesce(F.col("_cheap"), F.when(broken, undecodable))
    final = [
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("k").alias("key"),
        F.col("v.after").alias("row"),
        F.col("v.op").alias("op"),
        F.col("v.source.commit_lsn").alias("commit_lsn"),
        F.col("v.source.lsn").alias("lsn"),
        F.col("v.source.ts_ms").alias("ts_ms"),
        F.col("v.unchanged_toast").alias("unchanged"),
        value.isNull().alias("tombstone"),
        error.alias("error"),
    ]
    return [framed, [F.col("*"), cheap.alias("_cheap")], [F.col("*"), k.alias("k"), v.alias("v")], final]


def decode(raw: DataFrame, schemas: TopicSchemas) -> DataFrame:
    """:func:`decode_steps` applied to ``raw`` (records of one topic)."""
    return apply_steps(raw, decode_steps(schemas))


def apply_steps(frame: DataFrame, steps: list[list[Column]]) -> DataFrame:
    for step in steps:
        frame = frame.select(*step)
    return frame


def _poison_only(reason: str) -> list[Column]:
    from pyspark.sql import functions as F

    return [
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.lit(None).cast("binary").alias("key"),
        F.lit(None).cast("binary").alias("row"),
        F.lit(None).cast("string").alias("op"),
        F.lit(None).cast("long").alias("commit_lsn"),
        F.lit(None).cast("long").alias("lsn"),
        F.lit(None).cast("long").alias("ts_ms"),
        F.lit(None).cast("array<string>").alias("unchanged"),
        F.col("value").isNull().alias("tombstone"),
        F.lit(reason).alias("error"),
    ]


def _is_truncate() -> Column:
    from pyspark.sql import functions as F

    return F.col("error").isNull() & ~F.col("tombstone") & (F.col("op") == TRUNCATE)


def fillable_fields(row_schema: Mapping[str, Any]) -> list[str]:
    """The row's fields whose values PostgreSQL may leave out as unchanged TOAST (variable-length ones)."""
    out = []
    for f in row_schema["fields"]:
        kinds = f["type"] if isinstance(f["type"], list) else [f["type"]]
        real = [k for k in kinds if k != "null"]
        if not (len(real) == 1 and isinstance(real[0], str) and real[0] in _FIXED_WIDTH) and not (
            len(real) == 1 and isinstance(real[0], dict) and real[0].get("type") in _FIXED_WIDTH
        ):
            out.append(f["name"])
    return out


@dataclass(frozen=True)
class FoldSteps:
    """The fold's expressions: group by ``keys``, aggregate ``aggregates``, keep ``keep``, project ``rows``."""

    keys: list[Column]
    aggregates: list[Column]
    keep: Column
    rows: list[Column]

    def apply(self, decoded: DataFrame) -> DataFrame:
        return decoded.groupBy(*self.keys).agg(*self.aggregates).filter(self.keep).select(*self.rows)


def fold_steps(row_schema: Mapping[str, Any], truncate: Column | None = None) -> FoldSteps:
    """The fold of one table (module doc), plus its truncate and its poison rows.

    ``truncate``: the table's truncate position, ``struct(commit_lsn, lsn)``: events at or before it are
    dropped. Without it nothing is dropped, and the store's truncate, applied after the batch's other writes,
    removes what is older.
    """
    from pyspark.sql import functions as F

    bad = F.col("error").isNotNull()
    change = ~bad & ~F.col("tombstone") & F.col("op").isin(*APPLY_OPS)
    if truncate is not None:
        change = change & (truncate.isNull() | (F.struct("commit_lsn", "lsn") > truncate))
    pos = F.struct("commit_lsn", "lsn", "offset", "partition")
    fill = fillable_fields(row_schema)
    known = [
        F.max_by(
            F.struct(F.col("row").getField(name).alias("v")),
            F.when(change & (F.col("op") != "d") & ~F.array_contains("unchanged", name), pos),
        ).alias(f"_k{i}")
        for i, name in enumerate(fill)
    ]
    source = F.struct("topic", "partition", "offset")
    keys = [F.col("key").alias("_key"), F.when(bad, source).alias("_poison")]  # each poison record: its own group
    aggregates = [
        F.max_by(
            F.struct("row", "op", "commit_lsn", "lsn", "ts_ms", "unchanged", "topic", "partition", "offset"),
            F.when(change, pos),
        ).alias("_last"),
        F.max_by(
            F.struct("commit_lsn", "lsn", "ts_ms", "topic", "partition", "offset"), F.when(_is_truncate(), pos)
        ).alias("_trunc"),
        F.max_by(source, F.when(~bad & F.col("tombstone"), F.struct("offset", "partition", "topic"))).alias("_tomb"),
        F.first(F.when(bad, F.struct("topic", "partition", "offset", "error")), ignorenulls=True).alias("_bad"),
        *known,
    ]
    keep, rows = _folded_rows(row_schema, fill)
    return FoldSteps(keys, aggregates, keep, rows)


def fold(decoded: DataFrame, row_schema: Mapping[str, Any], truncate: Column | None = None) -> DataFrame:
    """:func:`fold_steps` applied to one table's decoded records."""
    return fold_steps(row_schema, truncate).apply(decoded)


def _folded_rows(row_schema: Mapping[str, Any], fill: list[str]) -> tuple[Column, list[Column]]:
    """Which groups give a row, and its columns: poison, else the latest change, else the truncate, else a lone
    tombstone."""
    from pyspark.sql import functions as F

    last, trunc, tomb, poison = F.col("_last"), F.col("_trunc"), F.col("_tomb"), F.col("_bad")
    is_bad, is_change, is_trunc = poison.isNotNull(), last.isNotNull(), trunc.isNotNull()

    def source(name: str, cast: str) -> Column:
        """topic, partition or offset of the record this group's row comes from."""
        return (
            F.when(is_bad, poison.getField(name))
            .when(is_change, last.getField(name))
            .when(is_trunc, trunc.getField(name))
            .otherwise(tomb.getField(name))
            .cast(cast)
        )

    def position(name: str) -> Column:
        """commit_lsn, lsn or ts_ms: a change's or a truncate's; null for poison and lone tombstones."""
        return F.when(is_change, last.getField(name)).when(is_trunc, trunc.getField(name)).cast("long")

    op = (
        F.when(is_bad, F.lit(POISON))
        .when(is_change, last.getField("op"))
        .when(is_trunc, F.lit(TRUNCATE))
        .otherwise(F.lit("d"))
    )
    row, unchanged = _filled(last, row_schema, fill)
    # A key whose events were all dropped (older than the truncate) has nothing to say.
    keep = is_bad | is_change | is_trunc | tomb.isNotNull()
    return keep, [
        source("topic", "string").alias("topic"),
        source("partition", "int").alias("partition"),
        source("offset", "long").alias("offset"),
        F.when(~is_bad, F.col("_key")).alias("key"),
        F.when(is_change & (last.getField("op") != "d"), row).alias("row"),
        op.alias("op"),
        position("commit_lsn").alias("commit_lsn"),
        position("lsn").alias("lsn"),
        position("ts_ms").alias("ts_ms"),
        F.when(is_change, unchanged).otherwise(F.array().cast("array<string>")).alias("unchanged"),
        F.when(is_bad, poison.getField("error")).alias("error"),
    ]


def _filled(last: Column, row_schema: Mapping[str, Any], fill: list[str]) -> tuple[Column, Column]:
    """The latest event's row with unchanged-TOAST columns taken from earlier events, and what stays unknown."""
    from pyspark.sql import functions as F

    missing = last.getField("unchanged")
    row = last.getField("row")
    if not fill:
        return row, missing
    index = {name: i for i, name in enumerate(fill)}
    parts = []
    for f in row_schema["fields"]:
        name = f["name"]
        value = row.getField(name)
        if name in index:
            k = F.col(f"_k{index[name]}")
            value = F.when(F.array_contains(missing, name) & k.isNotNull(), k.getField("v")).otherwise(value)
        parts.append(value.alias(name))
    filled = F.when(F.size(missing) > 0, F.struct(*parts)).otherwise(row)
    still = F.filter(
        missing,
        lambda x: F.coalesce(*[F.when(x == name, F.col(f"_k{i}").isNull()) for name, i in index.items()], F.lit(True)),
    )
    return filled, still


def projection(
    key_schema: Mapping[str, Any], row_schema: Mapping[str, Any], extra: tuple[str, ...] = ()
) -> list[Column]:
    """A folded frame's columns with dates and timestamps as numbers: the form ``sinks.ChangeMaker`` reads."""
    from pyspark.sql import functions as F

    names = Names()
    return [
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        spark_projection(dict(key_schema), F.col("key"), names).alias("key"),
        spark_projection(dict(row_schema), F.col("row"), names).alias("row"),
        *[F.col(c) for c in ("op", "commit_lsn", "lsn", "ts_ms", "unchanged", *extra)],
    ]


@dataclass(frozen=True)
class TopicPlan:
    """One topic's decode, fold and projection for the executor-side writers, built once per set of schema
    versions: building the expressions costs the driver far more than applying them to a batch."""

    schemas: TopicSchemas
    decode: list[list[Column]]
    fold: FoldSteps | None  # None when the topic has no schemas: its records are all poison
    project: list[Column] | None

    @classmethod
    def build(cls, schemas: TopicSchemas) -> TopicPlan:
        if not schemas.registered:
            return cls(schemas, decode_steps(schemas), None, None)
        assert schemas.key_reader is not None
        assert schemas.value_reader is not None
        key_schema = json.loads(schemas.key_reader)
        row_schema = envelope_row(json.loads(schemas.value_reader))
        return cls(
            schemas,
            decode_steps(schemas),
            fold_steps(row_schema),
            projection(key_schema, row_schema, ("error",)),
        )

    def changes(self, decoded: DataFrame) -> DataFrame:
        """The folded, projected rows of a batch (poison rows: ``op = '!'`` with their ``error``)."""
        from pyspark.sql import functions as F

        if self.fold is None or self.project is None:
            return decoded.select("topic", "partition", "offset", F.lit(POISON).alias("op"), "error")
        return self.fold.apply(decoded).select(*self.project)
