"""Applying one planned micro-batch to a sink: the executor-side path and the frame-based path.

**Executor-side** (:class:`sinks.PartitionSink`: search, cache, plugins that write row by row): one Spark
action per batch. Each table's fold feeds ``mapInArrow``, whose tasks run the sink's
:class:`sinks.PartitionWriter` on their partition and return only what was refused, plus the fold's poison
rows; the action collects those (rare, and nothing else reaches the driver). Only when there are some does a
second action join them (broadcast) with the raw records and write them to the dead-letter topic. Counts
come from ``observe`` in the first action, not from jobs of their own.

**Frame-based** (:class:`sinks.Sink`: the warehouse): each table's decoded records are cached, one small job
reads the batch's marks (records, newest commit time, truncates, poison), the sink writes its frames with
Spark (Delta MERGE), and the dead letters are written by one more action when there are any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks._api import Batch, ChangeMaker, PartitionWriter, Rejected, TableChanges, TableInfo, projected
from sinks._fold import APPLY_OPS, POISON, TRUNCATE, fold, truncate_position
from sinks._reader import PlannedTable, dead_letters, union_all, write_dead_letters

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame

    from sinks._config import SinkSettings

REJECTED = "topic string, partition int, offset long, error string"


@dataclass
class Outcome:
    """What a batch did, for the status file and the metrics."""

    records: int = 0
    dead_letters: int = 0
    newest_ts_ms: int | None = None


def _observed(table: PlannedTable, name: str) -> tuple[DataFrame, Any]:
    """The table's decoded records, counted (and their newest commit time) by the action that reads them."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    seen = Observation(name)
    frame = table.decoded.observe(seen, F.count(F.lit(1)).alias("n"), F.max("ts_ms").alias("ts"))
    return frame, seen


def _folded(table: PlannedTable, decoded: DataFrame) -> DataFrame:
    """The fold of a table; a topic without schemas gives its records as poison rows only."""
    from pyspark.sql import functions as F

    if not table.schemas.registered:
        return decoded.select("topic", "partition", "offset", F.lit(POISON).alias("op"), "error")
    return fold(decoded, table.row_schema, truncate_position(table.decoded))


def _partition_task(
    writer: PartitionWriter | None, info: TableInfo | None
) -> Callable[[Iterable[pa.RecordBatch]], Iterable[pa.RecordBatch]]:
    """The function each executor task runs over its partition of a table's fold (pickled with ``writer``)."""

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        refused: list[Rejected] = []

        def changes() -> Iterator[Any]:
            make = ChangeMaker(info.key_schema, info.row_schema) if info is not None else None
            for batch in batches:
                for r in batch.to_pylist():
                    if r["op"] == POISON or make is None:
                        refused.append(Rejected(r["topic"], r["partition"], r["offset"], r["error"]))
                    else:
                        yield make(r)

        if writer is not None and info is not None:
            refused.extend(writer.write(info, changes()))
        else:
            for _ in changes():
                pass
        if refused:
            schema = pa.schema(
                [("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("error", pa.string())]
            )
            yield pa.RecordBatch.from_pylist([r._asdict() for r in refused], schema=schema)

    return run


def on_executors(
    sink: Any, tables: Sequence[PlannedTable], raw: DataFrame, settings: SinkSettings, batch: tuple[int, int]
) -> Outcome:
    """One action: every table written by the sink's partition writers, refusals and poison to dead letters.

    ``batch``: (batch id, generation).
    """
    batch_id, generation = batch
    infos = [
        TableInfo(t.topic, t.name, t.key_schema, t.row_schema, generation, batch_id)
        for t in tables
        if t.schemas.registered
    ]
    if infos:
        sink.prepare(infos)
    writer: PartitionWriter = sink.partition_writer()
    by_topic = {i.topic: i for i in infos}
    outs, seen = [], []
    for n, table in enumerate(tables):
        decoded, observation = _observed(table, f"pgcdc-{sink.name}-{batch_id}-{n}")
        seen.append(observation)
        folded = _folded(table, decoded)
        info = by_topic.get(table.topic)
        if info is not None:
            folded = projected(folded, info.key_schema, info.row_schema, extra=("error",))
        outs.append(folded.mapInArrow(_partition_task(writer if info else None, info), REJECTED))
    rejected = union_all(outs)
    # The action: the tasks write, and only what was refused (rare) comes back to the driver.
    found = [] if rejected is None else [tuple(r) for r in rejected.collect()]
    dead = 0
    if found:
        refused = raw.sparkSession.createDataFrame(found, REJECTED)
        dead = write_dead_letters(settings, sink.name, dead_letters(raw, refused), len(found))
    return _outcome(seen, dead)


def _outcome(seen: list[Any], dead: int) -> Outcome:
    out = Outcome(dead_letters=dead)
    for observation in seen:
        got = observation.get or {}
        out.records += int(got.get("n") or 0)
        if got.get("ts") is not None:
            out.newest_ts_ms = max(out.newest_ts_ms or 0, int(got["ts"]))
    return out


# --- frame-based sinks -----------------------------------------------------------------------------------


def _truncate_literal(position: tuple[int, int] | None) -> Column:
    from pyspark.sql import functions as F

    if position is None:
        return F.lit(None).cast("struct<commit_lsn:bigint,lsn:bigint>")
    return F.struct(F.lit(position[0]).cast("long").alias("commit_lsn"), F.lit(position[1]).cast("long").alias("lsn"))


def _marks(tables: Sequence[PlannedTable]) -> dict[str, Any]:
    """One small job over the cached decoded records: per topic, records, newest time, truncate, poison."""
    from pyspark.sql import functions as F

    frames = [
        t.decoded.select(
            "topic",
            F.col("ts_ms"),
            F.when(
                F.col("error").isNull() & ~F.col("tombstone") & (F.col("op") == TRUNCATE),
                F.struct("commit_lsn", "lsn"),
            ).alias("t"),
            F.col("error").isNotNull().cast("int").alias("b"),
        )
        for t in tables
    ]
    union = union_all(frames)
    if union is None:
        return {}
    rows = union.groupBy("topic").agg(
        F.count(F.lit(1)).alias("n"), F.max("ts_ms").alias("ts"), F.max("t").alias("t"), F.sum("b").alias("b")
    )
    return {r["topic"]: r for r in rows.collect()}


def on_driver_plan(
    sink: Any, tables: Sequence[PlannedTable], raw: DataFrame, settings: SinkSettings, batch: tuple[int, int]
) -> Outcome:
    """A frame-based sink: ``sink.write(Batch)`` with each table's fold as a frame (see the module doc)."""
    from pyspark.sql import functions as F

    batch_id, generation = batch
    spark = raw.sparkSession
    cached = [t.decoded.persist() for t in tables]
    try:
        marks = _marks(tables)
        changes, poison = [], []
        for table in tables:
            mark = marks.get(table.topic)
            if mark is None:
                continue
            if mark["b"]:
                poison.append(
                    table.decoded.filter(F.col("error").isNotNull()).select("topic", "partition", "offset", "error")
                )
            if not table.schemas.registered or mark["n"] == mark["b"]:
                continue
            truncate = None if mark["t"] is None else (int(mark["t"]["commit_lsn"]), int(mark["t"]["lsn"]))
            folded = fold(table.decoded, table.row_schema, _truncate_literal(truncate))
            kept = table.decoded.filter(
                F.col("error").isNull() & ~F.col("tombstone") & F.col("op").isin(*APPLY_OPS)
            ).drop("tombstone", "error")
            if truncate is not None:
                kept = kept.filter(F.struct("commit_lsn", "lsn") > _truncate_literal(truncate))
            frame = folded.filter(F.col("op").isin(*APPLY_OPS)).drop("error")
            changes.append(
                TableChanges(table.topic, table.name, table.key_schema, table.row_schema, frame, truncate, kept)
            )
        refused: list[Rejected] = []
        if changes:
            sink.write(Batch(batch_id, generation, changes, spark, refused.extend))
        if refused:
            poison.append(spark.createDataFrame([tuple(r) for r in refused], REJECTED))
        rejected = union_all(poison)
        count = sum(int(m["b"]) for m in marks.values()) + len(refused)
        dead = 0 if rejected is None else write_dead_letters(settings, sink.name, dead_letters(raw, rejected), count)
    finally:
        for frame in cached:
            frame.unpersist()
    newest = [int(m["ts"]) for m in marks.values() if m["ts"] is not None]
    return Outcome(sum(int(m["n"]) for m in marks.values()), dead, max(newest) if newest else None)
