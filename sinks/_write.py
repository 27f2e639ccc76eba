"""Applying one planned micro-batch to a sink: the Python fold's paths and the frame-based path.

**On the driver** (a :class:`sinks.PartitionSink`'s batch of up to ``sinks._ranges.DRIVER_RECORDS`` offsets:
every live batch of a sink that keeps up): the driver reads the batch's offset ranges itself
(sinks._ranges), folds them in Python (sinks._fold) and runs the sink's :class:`sinks.PartitionWriter` on
them, truncates last; no Spark job runs unless there are dead letters to write.

**In tasks** (a larger batch of a :class:`sinks.PartitionSink`: see :func:`in_tasks`): the same fold and
writer in Spark tasks, each over records that hold every event of their keys: one task up to
``sinks._fold.ONE_TASK_RECORDS`` offsets, else a task per Kafka partition, or, when the batch has fewer
partitions than its size could use, a shuffle by key into that many tasks. One Spark action; only refusals,
truncates and each table's counts come back. Only when the batch has them does another action apply the
truncates (several tasks) and another join the refused records (broadcast) with the raw ones and write them to
the dead-letter topic.

**Frame sinks** (:class:`sinks.Sink`: the warehouse, frame plugins): the warehouse's batch of up to one task's
worth on the driver, written by delta-rs (:func:`folded_on_driver`); a larger one, and every batch of a frame
plugin, folded in tasks arranged as above and handed to the sink as Spark frames (sinks._frames).
"""

from __future__ import annotations

import sys
import zipimport
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks._api import (
    Change,
    ChangeMaker,
    PartitionWriter,
    Rejected,
    TableInfo,
    TableWrite,
    WritesFolded,
)
from sinks._fold import APPLY_OPS, POISON, TRUNCATE, Folded, Folding, TopicFold, TopicSchemas, collector_paused
from sinks._reader import dead_letters, write_dead_letters

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from sinks._config import SinkSettings

REJECTED = "topic string, partition int, offset long, error string"
# What an executor task hands back: a record to dead-letter ("rejected"), the table's truncate ("truncate"), or
# a table's count of records (in ``offset``) and newest commit time ("seen").
RETURNED = "kind string, topic string, partition int, offset long, error string, commit_lsn long, lsn long, ts_ms long"
_RETURNED_ARROW = (
    ("kind", "string"),
    ("topic", "string"),
    ("partition", "int32"),
    ("offset", "int64"),
    ("error", "string"),
    ("commit_lsn", "int64"),
    ("lsn", "int64"),
    ("ts_ms", "int64"),
)


@dataclass
class Outcome:
    """What a batch did, for the status file and the metrics."""

    records: int = 0
    dead_letters: int = 0
    newest_ts_ms: int | None = None


def forget_zip_finders() -> None:
    """Drop the zip archives' finders from ``sys.path_importer_cache`` in this Python worker.

    Spark's Python worker calls ``importlib.invalidate_caches()`` before every task, and on Python 3.10 and
    3.11 that makes every cached ``zipimporter`` read its whole archive's directory again (CPython gh-103200,
    lazy since 3.12). A worker's path holds pyspark.zip, Spark's core jar and, on a cluster, the PEX file, with
    one finder per package directory inside them: ~0.2-0.3 s before each task does anything, most of a
    one-row batch's time. Dropped finders are not invalidated; a later import makes a new one from zipimport's
    module-level directory cache, without reading the archive. The archives do not change under a worker
    (Spark ships new files under new names).
    """
    if sys.version_info >= (3, 12):
        return
    for path, finder in list(sys.path_importer_cache.items()):
        if isinstance(finder, zipimport.zipimporter):
            del sys.path_importer_cache[path]


def _returned(rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    import pyarrow as pa

    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in _RETURNED_ARROW])
    return pa.RecordBatch.from_pylist([dict(zip(schema.names, r, strict=True)) for r in rows], schema=schema)


def _truncate_task(
    writer: PartitionWriter, infos: dict[str, TableInfo]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Applies tables' truncates in an executor task (one change with ``op = 't'`` per table)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        forget_zip_finders()
        back: list[tuple[Any, ...]] = []
        for batch in batches:
            for r in batch.to_pylist():
                change = Change(
                    {}, None, TRUNCATE, r["commit_lsn"], r["lsn"], r["ts_ms"], (), r["partition"], r["offset"]
                )
                refused = writer.write(infos[r["topic"]], iter([change]))
                back.extend(("rejected", *x, None, None, None) for x in refused)
        if back:
            yield _returned(back)

    return run


def in_tasks(
    sink: Any,
    folds: Sequence[TopicFold],
    raw: DataFrame,
    settings: SinkSettings,
    batch: tuple[int, int],
    *,
    tasks: int,
) -> Outcome:
    """A batch of a partition sink too large for the driver: each task reads its share, folds it and writes it;
    only what was refused, the truncates and each table's counts come back. ``batch``: (batch id, generation).

    Each task must hold every event of its keys. ``tasks`` = 1 (a medium batch): one task holds the whole
    batch and applies its truncates itself. 0: a task per Kafka partition, without a shuffle (the capture
    partitions by key). More: the records are shuffled by key into that many tasks (a batch with fewer
    partitions than the cores it could use). With several tasks a truncate is applied after every task has
    written (tasks are not ordered), so the changes of the batch older than it, written a moment before, are
    removed with the rest; a topic that may hold one key under two byte strings, in two partitions (its key
    schema changed, or its key has a floating-point field: :func:`_keys_may_move`), is folded in one task of
    its own. Dead letters are written by one more action, only
    when there are some.
    """
    infos = infos_of(folds, settings, batch)
    if infos:
        sink.prepare(list(infos.values()))
    writer: PartitionWriter = sink.partition_writer()
    task = _one_task(writer, infos, {f.schemas.topic: f for f in folds}, truncates_later=tasks != 1)
    rows = by_key(raw, folds, tasks).mapInArrow(task, RETURNED).collect()
    truncates = newest_per_topic([r for r in rows if r["kind"] == "truncate"])
    if truncates:
        todo = raw.sparkSession.createDataFrame([tuple(r)[1:] for r in truncates], _TRUNCATES)
        rows += todo.mapInArrow(_truncate_task(writer, infos), RETURNED).collect()
    return _finished(sink, raw, settings, rows)


def by_key(raw: DataFrame, folds: Sequence[TopicFold], tasks: int) -> DataFrame:
    """The batch's records arranged as :func:`in_tasks` says for ``tasks``."""
    from pyspark.sql import functions as F

    records = raw.select("topic", "partition", "offset", "key", "value")
    if tasks == 1:
        return records.coalesce(1)
    moving = sorted(f.schemas.topic for f in folds if _keys_may_move(f.schemas))
    rest = records.filter(~F.col("topic").isin(*moving)) if moving else records
    # The fold orders a key's events by their positions, not by arrival: a shuffle may interleave them.
    out = rest.repartition(tasks, "topic", "key") if tasks > 1 else rest
    for topic in moving:
        out = out.union(records.filter(F.col("topic") == topic).coalesce(1))
    return out


def _keys_may_move(schemas: TopicSchemas) -> bool:
    """Whether one key of the topic may come under two byte strings, so in two partitions, where a fold by
    key bytes would see two keys: its key bytes carry the schema id, so a new key schema version (a key
    column's type changed) moves the key's later events; and a floating-point key field's -0.0 and 0.0, or
    NaNs, are one key (to PostgreSQL's unique index and to the fold) under different bytes."""
    if len(schemas.key_writers) > 1:
        return True
    return schemas.registered and _has_floats(schemas.key_schema)


def _has_floats(avro: Any) -> bool:
    if isinstance(avro, list):
        return any(_has_floats(a) for a in avro)
    if isinstance(avro, dict):
        return any(_has_floats(avro.get(k)) for k in ("type", "fields", "items", "values"))
    return avro in ("float", "double")


_TRUNCATES = "topic string, partition int, offset long, error string, commit_lsn long, lsn long, ts_ms long"


def infos_of(folds: Sequence[TopicFold], settings: SinkSettings, batch: tuple[int, int]) -> dict[str, TableInfo]:
    """Each registered topic's :class:`sinks.TableInfo` for ``batch`` ((batch id, generation))."""
    batch_id, generation = batch
    return {
        s.topic: TableInfo(s.topic, settings.table_name(s.topic), s.key_schema, s.row_schema, generation, batch_id)
        for s in (f.schemas for f in folds)
        if s.registered
    }


def tally(rows: Iterable[Mapping[str, Any]]) -> Outcome:
    """The records counted and the newest commit time in :data:`RETURNED`'s rows (no dead letters written)."""
    out = Outcome()
    for r in rows:
        if r["kind"] == "seen":
            out.records += int(r["offset"])
            if r["ts_ms"] is not None:
                out.newest_ts_ms = max(out.newest_ts_ms or 0, int(r["ts_ms"]))
    return out


def _finished(sink: Any, raw: DataFrame, settings: SinkSettings, rows: list[Any]) -> Outcome:
    """The outcome of :func:`in_tasks`'s actions: the dead letters written, the counts added up."""
    out = tally(rows)
    found = [(r["topic"], r["partition"], r["offset"], r["error"]) for r in rows if r["kind"] == "rejected"]
    if found:
        refused = raw.sparkSession.createDataFrame(found, REJECTED)
        out.dead_letters = write_dead_letters(settings, sink.name, dead_letters(raw, refused), len(found))
    return out


def _one_task(
    writer: PartitionWriter,
    infos: dict[str, TableInfo],
    folds: dict[str, TopicFold],
    *,
    truncates_later: bool = False,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The task of :func:`in_tasks` (pickled with ``writer`` and the folds' schemas)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        forget_zip_finders()  # for the next task in this worker: see there
        # Arrow batches of Spark's size (10,000 rows): the raw records are not kept.
        records = (r for batch in batches for r in batch.to_pylist())
        back = fold_and_write(writer, infos, folds, records, truncates_later=truncates_later)
        if back:
            yield _returned(back)

    return run


def fold_and_write(
    writer: PartitionWriter,
    infos: dict[str, TableInfo],
    folds: dict[str, TopicFold],
    records: Iterable[Mapping[str, Any]],
    *,
    truncates_later: bool = False,
) -> list[tuple[Any, ...]]:
    """A whole batch's raw records (topic, partition, offset, key, value) folded per topic and written, in a
    task or on the driver; what comes back (:data:`RETURNED`'s rows): each topic's count and what was refused,
    and, when ``truncates_later`` (one of several tasks), each table's truncate instead of applying it."""
    folding: dict[str, Folding] = {}
    back: list[tuple[Any, ...]] = []
    with collector_paused():
        for r in records:
            topic = r["topic"]
            if topic not in folding:
                folding[topic] = Folding(folds.get(topic, TopicFold(TopicSchemas(topic))))
            folding[topic].add(r)
        for topic, state in sorted(folding.items()):
            folded = state.finish()
            back.append(("seen", topic, None, folded.records, None, None, None, folded.newest_ts_ms))
            back.extend(_written(writer, infos.get(topic), folded.rows, truncates_later=truncates_later))
    return back


def on_driver(
    sink: Any,
    folds: Sequence[TopicFold],
    records: list[dict[str, Any]],
    raw: DataFrame,
    settings: SinkSettings,
    *,
    batch: tuple[int, int],
) -> Outcome:
    """A small batch read by the driver (sinks._ranges) folded and written here, as :func:`in_tasks` does
    in a task; Spark runs a job only for dead letters, when there are some."""
    return _finished(sink, raw, settings, written_on_driver(sink, folds, records, settings, batch))


def written_on_driver(
    sink: Any, folds: Sequence[TopicFold], records: list[dict[str, Any]], settings: SinkSettings, batch: tuple[int, int]
) -> list[dict[str, Any]]:
    """``records`` read by the driver (topic, partition, offset, key, value), folded and written with the
    sink's writer: a batch's (:func:`on_driver`), the lane's and the bridge's path. What came back, as
    :data:`RETURNED`'s rows: each topic's count and what was refused (see :func:`tally`)."""
    infos = infos_of(folds, settings, batch)
    if infos:
        sink.prepare(list(infos.values()))
    back = fold_and_write(sink.partition_writer(), infos, {f.schemas.topic: f for f in folds}, records)
    names = [name for name, _ in _RETURNED_ARROW]
    return [dict(zip(names, r, strict=True)) for r in back]


@dataclass(frozen=True)
class Prepared:
    """One topic's records of a chunk folded and made into changes once, for every writer that takes them
    (sinks._feed: each lane's sink writes the same changes)."""

    schemas: TopicSchemas
    folded: Folded
    changes: list[Change]  # the folded rows in document form, truncate and poison apart
    truncates: list[Change]


def prepare(folds: Sequence[TopicFold], records: list[dict[str, Any]]) -> dict[str, Prepared]:
    """``records`` (topic, partition, offset, key, value) folded per topic and made into changes (a topic whose
    subject is not registered keeps only its folded rows: every writer refuses them)."""
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_topic.setdefault(r["topic"], []).append(r)
    fold_of = {f.schemas.topic: f for f in folds}
    out = {}
    with collector_paused():
        for topic, rs in by_topic.items():
            fold = fold_of.get(topic, TopicFold(TopicSchemas(topic)))
            folded = fold.fold(rs)
            changes: list[Change] = []
            truncates: list[Change] = []
            if fold.schemas.registered:
                make = ChangeMaker(fold.schemas.key_schema, fold.schemas.row_schema, spark=False)
                changes = [make(r) for r in folded.rows if r["op"] not in (POISON, TRUNCATE)]
                truncates = [make(r) for r in folded.rows if r["op"] == TRUNCATE]
            out[topic] = Prepared(fold.schemas, folded, changes, truncates)
    return out


def prepared_written(
    sink: Any, prepared: Sequence[Prepared], settings: SinkSettings, batch: tuple[int, int]
) -> list[dict[str, Any]]:
    r""":func:`written_on_driver` for topics already :func:`prepare`\ d: the same writes and the same rows back."""
    batch_id, generation = batch
    infos = {
        p.schemas.topic: TableInfo(
            p.schemas.topic,
            settings.table_name(p.schemas.topic),
            p.schemas.key_schema,
            p.schemas.row_schema,
            generation,
            batch_id,
        )
        for p in prepared
        if p.schemas.registered
    }
    if infos:
        sink.prepare(list(infos.values()))
    writer = sink.partition_writer()
    back: list[tuple[Any, ...]] = []
    for p in sorted(prepared, key=lambda p: p.schemas.topic):
        topic, folded, info = p.schemas.topic, p.folded, infos.get(p.schemas.topic)
        back.append(("seen", topic, None, folded.records, None, None, None, folded.newest_ts_ms))
        refused = [(r["topic"], r["partition"], r["offset"], r["error"]) for r in folded.rows if r["op"] == POISON]
        if info is None:
            refused += [(r["topic"], r["partition"], r["offset"], r["error"]) for r in folded.rows if r["op"] != POISON]
        else:
            refused.extend(writer.write(info, iter(p.changes)))
            for truncate in p.truncates:  # one per table; after the batch's other writes
                refused.extend(writer.write(info, iter([truncate])))
        back.extend(("rejected", *r, None, None, None) for r in refused)
    names = [name for name, _ in _RETURNED_ARROW]
    return [dict(zip(names, r, strict=True)) for r in back]


def folded_on_driver(
    sink: WritesFolded,
    folds: Sequence[TopicFold],
    records: list[dict[str, Any]],
    raw: DataFrame,
    settings: SinkSettings,
    *,
    batch: tuple[int, int],
) -> Outcome:
    """A small batch of a sink that writes whole folded tables on the driver (the warehouse: delta-rs), as
    :func:`on_driver` does for a partition sink; see :func:`folded_written`."""
    back = folded_written(sink, folds, records, settings, batch, history=sink.history)
    return _finished(sink, raw, settings, back)


def folded_written(
    sink: WritesFolded,
    folds: Sequence[TopicFold],
    records: list[dict[str, Any]],
    settings: SinkSettings,
    batch: tuple[int, int],
    *,
    history: bool,
) -> list[dict[str, Any]]:
    """``records`` written whole by ``sink.write_folded``: each topic folded by the Python fold, its truncate
    apart (the newest; rows at or before it are not written, as sinks._frames leaves them out), and, when
    ``history``, its decoded events after the truncate in offset order: a batch's path and the bridge's (which
    leaves the history to the batches: their Delta transaction ids keep each batch's events there once). What
    came back, as :data:`RETURNED`'s rows (see :func:`tally`). Raises what ``sink.write_folded`` raises when the
    batch must go Spark's path (sinks._frames; before anything is written, or after writes that path repeats as
    no-ops)."""
    infos = infos_of(folds, settings, batch)
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_topic.setdefault(r["topic"], []).append(r)
    fold_of = {f.schemas.topic: f for f in folds}
    back: list[tuple[Any, ...]] = []
    writes: list[TableWrite] = []
    for topic, rs in sorted(by_topic.items()):
        fold = fold_of.get(topic, TopicFold(TopicSchemas(topic)))
        folded = fold.fold(rs)
        back.append(("seen", topic, None, folded.records, None, None, None, folded.newest_ts_ms))
        info = infos.get(topic)
        refused = [r for r in folded.rows if r["op"] == POISON or info is None]
        back.extend(
            ("rejected", r["topic"], r["partition"], r["offset"], r["error"], None, None, None) for r in refused
        )
        if info is None:
            continue
        truncates = [(r["commit_lsn"], r["lsn"]) for r in folded.rows if r["op"] == TRUNCATE]
        truncate = max(truncates) if truncates else None
        rows = [r for r in folded.rows if r["op"] in APPLY_OPS and _after(r, truncate)]
        events = None
        if history:
            decoded = (fold.decode(r) for r in rs)
            events = [e for e in decoded if e["error"] is None and not e["tombstone"] and e["op"] in APPLY_OPS]
            events = [e for e in events if _after(e, truncate)]
        writes.append(TableWrite(info, rows, truncate, events))
    sink.write_folded(writes)
    names = [name for name, _ in _RETURNED_ARROW]
    return [dict(zip(names, r, strict=True)) for r in back]


def _after(row: Mapping[str, Any], truncate: tuple[int, int] | None) -> bool:
    """Whether a change outlives the batch's truncate (a lone tombstone, without a position, does)."""
    if truncate is None or row["commit_lsn"] is None:
        return True
    return (row["commit_lsn"], row["lsn"]) > truncate


def _written(
    writer: PartitionWriter, info: TableInfo | None, rows: list[dict[str, Any]], *, truncates_later: bool = False
) -> list[tuple[Any, ...]]:
    """A table's folded rows through the writer, its truncate after them (or returned, ``truncates_later``);
    what was refused, as returned rows."""
    refused = [(r["topic"], r["partition"], r["offset"], r["error"]) for r in rows if r["op"] == POISON or info is None]
    back: list[tuple[Any, ...]] = []
    if info is not None:
        make = ChangeMaker(info.key_schema, info.row_schema, spark=False)
        refused.extend(writer.write(info, (make(r) for r in rows if r["op"] not in (POISON, TRUNCATE))))
        for r in rows:  # one per table; after the batch's other writes
            if r["op"] == TRUNCATE and truncates_later:
                back.append(
                    ("truncate", r["topic"], r["partition"], r["offset"], None, r["commit_lsn"], r["lsn"], r["ts_ms"])
                )
            elif r["op"] == TRUNCATE:
                refused.extend(writer.write(info, iter([make(r)])))
    return back + [("rejected", *r, None, None, None) for r in refused]


def newest_per_topic(rows: list[Any]) -> list[Any]:
    """One truncate per table: the newest (every partition of a topic carries a copy of each)."""
    newest: dict[str, Any] = {}
    for r in rows:
        best = newest.get(r["topic"])
        if best is None or (r["commit_lsn"], r["lsn"]) > (best["commit_lsn"], best["lsn"]):
            newest[r["topic"]] = r
    return list(newest.values())


@dataclass(frozen=True)
class _Draining:
    """A sink's own writer, pickled to the tasks like it (so they import its store's client), that writes nothing."""

    inner: PartitionWriter

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        for _ in changes:
            pass
        return ()


def rehearse_on_driver(
    sink: Any, folds: Sequence[TopicFold], records: list[dict[str, Any]], settings: SinkSettings, generation: int
) -> None:
    """A live batch's path (:func:`on_driver`) over ``records`` (a few read from Kafka), to the sink's writer
    wrapped so that it drops what it is given: the fold's and the writer's modules are imported and the
    schemas parsed before the query's first batch."""
    infos = infos_of(folds, settings, (-1, generation))
    fold_and_write(_Draining(sink.partition_writer()), infos, {f.schemas.topic: f for f in folds}, records)
