"""A frame sink's batch in Spark tasks (the warehouse's larger batches, every batch of a frame plugin): the
Python fold (sinks._fold) where the records are, its rows handed to the sink as Spark frames.

The batch's records are arranged as a partition sink's larger batch is (sinks._write.in_tasks: one task, a
task per Kafka partition, or a shuffle by key, so that a task holds every event of its keys). Each task folds
its records and yields them as Arrow record batches of one layout (:class:`Layout`):

* ``kind = 'row'``: a key's folded change, its key and row in the columns of its topic (``k<i>``, ``r<i>``);
* ``'event'``: with a history, every decoded change event of the batch, in the same columns;
* the task's marks: ``'seen'`` (its count of the topic's records, in ``offset``, and the newest commit time),
  ``'rejected'`` (poison, with its ``error``) and ``'truncate'`` (the topic's newest truncate in the task).

Key and row columns are typed as Spark's ``from_avro`` reads the same schemas (sinks._delta_arrow), so the
frames a sink is given are those Spark's own decode would give. The tasks' output is cached: one small job
collects the marks, then the sink writes its frames from the cache, so the batch is read and folded once.

A task drops nothing older than a truncate another task saw: the table's truncate is the newest of all, given
to the sink before it writes, and its frames keep only the changes after it (and lone tombstones, which have
no position), as a fold over the whole batch in one task would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from sinks._api import Batch, Rejected, TableChanges
from sinks._delta_arrow import Convert, arrow_field, spark_type
from sinks._fold import APPLY_OPS, POISON, TRUNCATE, Folded, Folding, TopicFold, TopicSchemas, collector_paused
from sinks._reader import dead_letters, write_dead_letters
from sinks._values import Names
from sinks._write import REJECTED, Outcome, by_key, forget_zip_finders, infos_of, newest_per_topic, tally

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from sinks._config import SinkSettings

_MARKS = ("kind", "topic", "partition", "offset", "error", "commit_lsn", "lsn", "ts_ms")  # sinks._write.RETURNED
_FRAME = ("topic", "partition", "offset", "key", "row", "op", "commit_lsn", "lsn", "ts_ms", "unchanged")
_COMMON: tuple[tuple[str, pa.DataType], ...] = (
    ("kind", pa.string()),
    ("topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("error", pa.string()),
    ("commit_lsn", pa.int64()),
    ("lsn", pa.int64()),
    ("ts_ms", pa.int64()),
    ("op", pa.string()),
    ("unchanged", pa.list_(pa.field("element", pa.string()))),
)
_ROWS_PER_ARROW_BATCH = 10_000  # what a task hands Spark at a time (Spark's own Arrow batch size)


@dataclass(frozen=True)
class Layout:
    """The columns of a batch's folded output: :data:`_COMMON`, then each registered topic's key and row
    structs (``k<i>``, ``r<i>``, in the order of :attr:`topics`). Pickled to the tasks; the Arrow types and
    converters are built where they are used."""

    topics: tuple[TopicSchemas, ...]

    def index(self, topic: str) -> int | None:
        return next((i for i, s in enumerate(self.topics) if s.topic == topic), None)

    def typed(self) -> list[tuple[tuple[pa.DataType, Convert], tuple[pa.DataType, Convert]]]:
        """Each topic's (key, row) Arrow types and converters from raw Avro values."""
        return [(arrow_field(s.key_schema, Names()), arrow_field(s.row_schema, Names())) for s in self.topics]

    def arrow_schema(self) -> pa.Schema:
        fields = [pa.field(name, kind) for name, kind in _COMMON]
        for i, ((key, _), (row, _)) in enumerate(self.typed()):
            fields += [pa.field(f"k{i}", key), pa.field(f"r{i}", row)]
        return pa.schema(fields)

    def ddl(self) -> str:
        """The output's schema in Spark's DDL (``mapInArrow``'s)."""
        return ", ".join(f"`{f.name}` {spark_type(f.type)}" for f in self.arrow_schema())


class _Out:
    """A task's output in the batch's :class:`Layout`: its record batches, built a bounded slice at a time."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.schema = layout.arrow_schema()
        self.typed = layout.typed()

    def marks(self, rows: list[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        yield from self.rows(None, rows)

    def rows(self, index: int | None, rows: list[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        """``rows`` (:data:`_COMMON`'s fields, and ``key``/``row`` of topic ``index``); a row whose values do
        not fit the column's type comes back as a ``'rejected'`` mark, with why."""
        for start in range(0, len(rows), _ROWS_PER_ARROW_BATCH):
            part = rows[start : start + _ROWS_PER_ARROW_BATCH]
            try:
                yield self._batch(index, part)
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                yield from self._one_by_one(index, part)

    def _one_by_one(self, index: int | None, rows: list[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        refused = []
        for r in rows:
            try:
                yield self._batch(index, [r])
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
                error = f"a value does not fit its Spark type ({type(exc).__name__}: {exc})"
                refused.append(_mark("rejected", r, error=error))
        if refused:
            yield self._batch(None, refused)

    def _batch(self, index: int | None, rows: list[dict[str, Any]]) -> pa.RecordBatch:
        arrays = [pa.array([r.get(name) for r in rows], kind) for name, kind in _COMMON]
        for i, ((key, to_key), (row, to_row)) in enumerate(self.typed):
            if i == index:
                arrays.append(pa.array([to_key(r["key"]) for r in rows], key))
                arrays.append(pa.array([to_row(r["row"]) for r in rows], row))
            else:
                arrays += [pa.nulls(len(rows), key), pa.nulls(len(rows), row)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _mark(kind: str, r: dict[str, Any], **values: Any) -> dict[str, Any]:
    return {**{name: r.get(name) for name in _MARKS}, "kind": kind, **values}


def _task(
    layout: Layout, folds: dict[str, TopicFold], *, events: bool
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """What each task runs (pickled with the layout and the folds' schemas)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        forget_zip_finders()  # for the next task in this worker: see there
        out = _Out(layout)
        folding: dict[str, Folding] = {}
        with collector_paused():
            for batch in batches:
                for r in batch.to_pylist():
                    topic = r["topic"]
                    if topic not in folding:
                        fold = folds.get(topic, TopicFold(TopicSchemas(topic)))
                        folding[topic] = Folding(fold, events=events)
                    folding[topic].add(r)
            for topic, state in sorted(folding.items()):
                yield from _topic_out(out, layout.index(topic), state.finish(), state.events)

    return run


def _topic_out(
    out: _Out, index: int | None, folded: Folded, events: list[dict[str, Any]] | None
) -> Iterator[pa.RecordBatch]:
    """One topic's share of a task's output: its marks, its folded rows and its events."""
    topic = folded.topic
    marks = [_mark("seen", {"topic": topic}, offset=folded.records, ts_ms=folded.newest_ts_ms)]
    rows = []
    for r in folded.rows:
        if r["op"] == POISON or index is None:
            marks.append(_mark("rejected", r, error=r["error"] or f"no schema registered for {topic}"))
        elif r["op"] == TRUNCATE:
            marks.append(_mark("truncate", r))
        else:
            rows.append({**r, "kind": "row"})
    yield from out.marks(marks)
    yield from out.rows(index, rows)
    if events and index is not None:
        yield from out.rows(index, [{**e, "topic": topic, "kind": "event"} for e in events])


def folded_frames(folds: Sequence[TopicFold], raw: DataFrame, tasks: int, *, events: bool) -> tuple[Layout, DataFrame]:
    """The batch's records (``raw``: topic, partition, offset, key, value) folded in tasks arranged for
    ``tasks`` (see sinks._write.in_tasks), in one frame of :class:`Layout`: a plan, nothing has run."""
    layout = Layout(tuple(f.schemas for f in folds if f.schemas.registered))
    task = _task(layout, {f.schemas.topic: f for f in folds}, events=events)
    return layout, by_key(raw, folds, tasks).mapInArrow(task, layout.ddl())


def table_frame(out: DataFrame, layout: Layout, topic: str, kind: str, truncate: tuple[int, int] | None) -> DataFrame:
    """One topic's rows of ``kind`` ('row' or 'event') in ``out``, as :class:`sinks.TableChanges` has them;
    only those after ``truncate`` (and lone tombstones, without a position)."""
    from pyspark.sql import functions as F

    i = layout.index(topic)
    assert i is not None
    rows = out.filter((F.col("kind") == kind) & (F.col("topic") == topic) & F.col("op").isin(*APPLY_OPS))
    if truncate is not None:
        rows = rows.filter(F.col("commit_lsn").isNull() | (F.struct("commit_lsn", "lsn") > _position(truncate)))
    return rows.select(*[F.col(f"k{i}" if c == "key" else f"r{i}" if c == "row" else c).alias(c) for c in _FRAME])


def _position(position: tuple[int, int]) -> Column:
    from pyspark.sql import functions as F

    return F.struct(F.lit(position[0]).cast("long").alias("commit_lsn"), F.lit(position[1]).cast("long").alias("lsn"))


def in_frames(
    sink: Any,
    folds: Sequence[TopicFold],
    raw: DataFrame,
    settings: SinkSettings,
    batch: tuple[int, int],
    *,
    tasks: int,
) -> Outcome:
    """A frame sink's batch: folded in tasks, cached, its marks collected, then ``sink.write(Batch)`` with each
    table's frames; dead letters (poison and what the sink refused) written by one more action when there are
    any. ``batch``: (batch id, generation)."""
    from pyspark.sql import functions as F

    events = bool(getattr(sink, "history", True))  # the warehouse writes events only with a history
    layout, out = folded_frames(folds, raw, tasks, events=events)
    out = out.persist()
    try:
        marks = [r.asDict() for r in out.filter(~F.col("kind").isin("row", "event")).select(*_MARKS).collect()]
        outcome = tally(marks)
        newest = newest_per_topic(_kind(marks, "truncate"))
        truncates = {r["topic"]: (int(r["commit_lsn"]), int(r["lsn"])) for r in newest}
        rejected: list[tuple[Any, ...]] = [
            (r["topic"], r["partition"], r["offset"], r["error"]) for r in _kind(marks, "rejected")
        ]
        changes = []
        for topic, info in infos_of(folds, settings, batch).items():
            kept = _kept(marks, topic)
            if not kept and topic not in truncates:
                continue
            truncate = truncates.get(topic)
            frame = table_frame(out, layout, topic, "row", truncate)
            history = table_frame(out, layout, topic, "event", truncate) if events else None
            changes.append(TableChanges(topic, info.name, info.key_schema, info.row_schema, frame, truncate, history))
        refused: list[Rejected] = []
        if changes:
            sink.write(Batch(batch[0], batch[1], changes, raw.sparkSession, refused.extend))
        rejected += [tuple(r) for r in refused]
        if rejected:
            found = raw.sparkSession.createDataFrame(rejected, REJECTED)
            outcome.dead_letters = write_dead_letters(settings, sink.name, dead_letters(raw, found), len(rejected))
    finally:
        out.unpersist()
    return outcome


def _kind(marks: list[Any], kind: str) -> list[Any]:
    return [r for r in marks if r["kind"] == kind]


def _kept(marks: list[Any], topic: str) -> int:
    """How many of the topic's records were not poison."""
    seen = sum(int(r["offset"]) for r in marks if r["kind"] == "seen" and r["topic"] == topic)
    return seen - sum(1 for r in marks if r["kind"] == "rejected" and r["topic"] == topic)


def rehearse(folds: Sequence[TopicFold], raw: DataFrame) -> None:
    """A frame sink's batch path over ``raw`` (a few records read from Kafka) up to its frames, writing
    nothing: the Python workers import the fold and parse the schemas, the JVM loads the Arrow path, before the
    query's first batch."""
    _, out = folded_frames(folds, raw, 1, events=False)
    out.count()
