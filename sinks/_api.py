"""What a sink is: the contract between the sinks runtime and each store (built-in or plugin).

A sink is a class with a ``name`` and ``open``/``close``, announced under the entry-point group ``cdc.sinks``.
The runtime reads the change topics and folds each micro-batch (sinks._fold: decode, last event per key,
truncates, unchanged TOAST). Then, per micro-batch, either

* a :class:`PartitionSink` gets ``prepare`` on the driver and its :class:`PartitionWriter` writes the folded
  changes where they were folded: on the driver for a small batch, else inside the executor tasks (search,
  cache, SQL); or
* a frame-based :class:`Sink` gets ``write`` with one :class:`TableChanges` per table, the folded changes as a
  Spark frame typed as Spark reads the Avro schemas, and writes it with Spark (the warehouse's Delta MERGE).

Writes must be idempotent and must not go backwards: a batch is replayed after a crash, a task may be retried,
and the same key may arrive again with an older position (keep the newer one; positions order by
``(commit_lsn, lsn)``).

Sinks that can be rebuilt and verified also implement :class:`Rebuildable`: numbered *generations* of the
store, one of them served, and a way to read a table back in document form.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from sinks._values import Names, column_name, doc_converter

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sinks._config import SinkSettings


class Change(NamedTuple):
    """The last change of one key in a micro-batch, in document form (see docs/sinks.md)."""

    key: dict[str, Any]  # key column -> value
    row: dict[str, Any] | None  # column -> value; None for a delete
    op: str  # c, u, r or d
    commit_lsn: int | None  # None only for a delete known from a tombstone alone (its event was compacted away)
    lsn: int | None
    ts_ms: int | None  # commit time at the source
    unchanged: tuple[str, ...]  # columns PostgreSQL did not send (unchanged TOAST): keep the stored value
    partition: int
    offset: int

    @property
    def doc_id(self) -> str:
        return key_id(self.key)  # callers that need it twice keep it (json.dumps is not free)

    @property
    def position(self) -> tuple[int, int] | None:
        return None if self.commit_lsn is None or self.lsn is None else (self.commit_lsn, self.lsn)


def key_id(key: Mapping[str, Any]) -> str:
    """A key as one string: the JSON array of its values in key order (document ids, cache keys)."""
    values = list(key.values())
    if all(type(v) is int for v in values):  # most keys: the same text as json.dumps, at 2.5x its speed
        return "[" + ",".join(map(str, values)) + "]"
    return json.dumps(values, separators=(",", ":"), ensure_ascii=False)


class _Columns:
    """Avro field name -> PostgreSQL column name, for a table's row and key."""

    key_schema: dict[str, Any]
    row_schema: dict[str, Any]

    @property
    def columns(self) -> dict[str, str]:
        return {f["name"]: column_name(f) for f in self.row_schema["fields"]}

    @property
    def key_columns(self) -> dict[str, str]:
        return {f["name"]: column_name(f) for f in self.key_schema["fields"]}


@dataclass(frozen=True)
class TableInfo(_Columns):
    """A table as a batch's writers know it: what an executor-side :class:`PartitionWriter` is handed."""

    topic: str
    name: str  # "<schema>.<table>" as in the topic name (sanitised parts)
    key_schema: dict[str, Any]
    row_schema: dict[str, Any]
    generation: int
    batch_id: int


def projected(
    frame: DataFrame, key_schema: dict[str, Any], row_schema: dict[str, Any], extra: Sequence[str] = ()
) -> DataFrame:
    """A folded frame with dates and timestamps as numbers: the form :class:`ChangeMaker` reads."""
    from pyspark.sql import functions as F

    from sinks._values import spark_projection

    names = Names()
    return frame.select(
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        spark_projection(key_schema, F.col("key"), names).alias("key"),
        spark_projection(row_schema, F.col("row"), names).alias("row"),
        *[F.col(c) for c in ("op", "commit_lsn", "lsn", "ts_ms", "unchanged", *extra)],
    )


class ChangeMaker:
    """Rows of a :func:`projected` frame (as Arrow gives them) to :class:`Change` in document form."""

    def __init__(self, key_schema: dict[str, Any], row_schema: dict[str, Any], *, spark: bool = True) -> None:
        """``spark``: rows as a projected frame gives them; else raw Avro values (as sinks._fold folds them)."""
        names = Names()
        self._key = doc_converter(key_schema, names, spark=spark)
        self._row = doc_converter(row_schema, names, spark=spark)
        self._columns = {f["name"]: column_name(f) for f in row_schema["fields"]}

    def __call__(self, r: Mapping[str, Any]) -> Change:
        if r["op"] == "t":  # the table's truncate: no key, no row, only its position
            return Change({}, None, "t", r["commit_lsn"], r["lsn"], r["ts_ms"], (), r["partition"], r["offset"])
        return Change(
            self._key(r["key"]),
            self._row(r["row"]),
            r["op"],
            r["commit_lsn"],
            r["lsn"],
            r["ts_ms"],
            tuple(self._columns.get(u, u) for u in (r["unchanged"] or ())),
            r["partition"],
            r["offset"],
        )


@dataclass
class TableChanges(_Columns):
    """One table's share of a micro-batch for a frame-based sink: the latest event per key, and a truncate.

    ``frame`` columns: ``key`` (struct of key fields), ``row`` (struct of the row's fields, null for deletes),
    ``op``, ``commit_lsn``, ``lsn``, ``ts_ms``, ``unchanged`` (array of field names), ``topic``, ``partition``,
    ``offset``. Field names are Avro names; :attr:`columns` maps them to PostgreSQL column names. A sink that
    writes this frame with Spark (as the warehouse merges it into Delta) does its per-row work on the
    executors; a sink that writes row by row implements :class:`PartitionWriter` instead.
    """

    topic: str
    name: str  # "<schema>.<table>" as in the topic name (sanitised parts)
    key_schema: dict[str, Any]
    row_schema: dict[str, Any]
    frame: DataFrame
    truncate: tuple[int, int] | None  # delete rows older than this (commit_lsn, lsn) before applying frame
    events: DataFrame | None = None  # every change event of the batch in offset order (same columns), for histories

    def changes(self) -> Iterator[Change]:
        """The frame's rows in document form, **on the driver** (deprecated: see :class:`PartitionWriter`).

        Every row crosses to the driver and is converted there, so adding Spark executors adds nothing to
        such a sink. It keeps working; a sink written this way is warned about once per process.
        """
        _warn_driver_side()
        make = ChangeMaker(self.key_schema, self.row_schema)
        for batch in projected(self.frame, self.key_schema, self.row_schema).toArrow().to_batches(10_000):
            for r in batch.to_pylist():
                yield make(r)


_WARNED: list[bool] = []


def _warn_driver_side() -> None:
    if not _WARNED:
        _WARNED.append(True)
        message = (
            "TableChanges.changes() moves every row to the Spark driver; write from the executors instead "
            "(implement sinks.PartitionWriter: docs/sinks.md, 'Write a sink')"
        )
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        logging.getLogger(__name__).warning(message)


@dataclass(frozen=True)
class TableWrite:
    """One table's share of a batch as the driver folded it (:class:`WritesFolded`)."""

    info: TableInfo
    rows: Sequence[dict[str, Any]]  # the fold's rows: c/u/r/d (raw Avro values), truncates apart
    truncate: tuple[int, int] | None
    events: Sequence[dict[str, Any]] | None  # the decoded events in offset order, for the history


class Rejected(NamedTuple):
    """A change the store refused: it goes to the dead-letter topic with the reason."""

    topic: str
    partition: int
    offset: int
    error: str


@dataclass
class Batch:
    batch_id: int
    generation: int
    tables: list[TableChanges]
    spark: SparkSession
    reject: Callable[[list[Rejected]], None]  # send refused changes to the dead-letter topic


@dataclass
class SinkContext:
    """What a sink is opened with."""

    name: str
    settings: SinkSettings
    options: dict[str, Any]  # the sink's own section: [sinks.<name>] for built-ins, [sinks.plugins.<name>]
    generation: int  # the generation this instance writes (Rebuildable sinks); 1 for others
    spark: SparkSession


@runtime_checkable
class Sink(Protocol):
    """A derived store kept by one Structured Streaming query, written from the driver's plan (a frame-based
    sink: :class:`TableChanges`); a sink that writes row by row is a :class:`PartitionSink`."""

    name: str

    def open(self, context: SinkContext) -> None: ...

    def write(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class PartitionWriter(Protocol):
    """Writes one partition of a table's changes, **inside a Spark executor task** (one call per task).

    It is pickled to the executors with its attributes: hold settings, not clients; open clients in
    :meth:`write` and close them before it returns, or keep one per process for the settings (search and
    cache take theirs from sinks._clients: small batches call :meth:`write` often). ``changes`` holds the
    latest change per key (each key in one partition only). A table's truncate comes in a call of its own,
    after every task of the batch has written: one :class:`Change` with ``op == "t"`` and no key or row,
    meaning "remove every stored row whose position is lower than this one's" (so the batch's changes older
    than the truncate go too). Writes must be idempotent and never go backwards (a task can be retried or run
    twice). Changes the store refuses are returned; they go to the dead-letter topic.
    """

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]: ...


@runtime_checkable
class PartitionSink(Protocol):
    """A sink whose rows are written by :class:`PartitionWriter`\\ s on the executors."""

    name: str

    def open(self, context: SinkContext) -> None: ...

    def prepare(self, tables: Sequence[TableInfo]) -> None:
        """On the driver, before a batch's writes: create what the tables need (indices, mappings)."""
        ...

    def partition_writer(self) -> PartitionWriter: ...

    def close(self) -> None: ...


@runtime_checkable
class Rebuildable(Protocol):
    """A sink with generations: rebuilt beside the served copy, verified, then swapped in atomically."""

    def current_generation(self) -> int | None:
        """The served generation; None before the first run."""
        ...

    def prepare_generation(self, generation: int) -> None:
        """Create an empty copy (indices, key space, tables) for ``generation``; idempotent."""
        ...

    def swap(self, generation: int) -> None:
        """Atomically serve ``generation``; then drop the copy it replaced. Idempotent: the runtime calls it
        with the served generation at every start, to complete a swap a crash interrupted."""
        ...

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every stored row of ``table`` in ``generation``: (key_id, row in document form by column)."""
        ...


class StorePart(Protocol):
    """One part of a stored table, read in an executor task: picklable (a frozen dataclass of settings)."""

    def __call__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """This part's rows, as :meth:`Rebuildable.read_table` yields them: (key_id, row in document form)."""
        ...


@runtime_checkable
class DropsGeneration(Protocol):
    """A :class:`Rebuildable` sink whose replaced copy the serving app drops once more after it switches.

    A batch of the served generation that began just before a rebuild's swap can end after the swap dropped
    that copy, and writing it creates part of the copy anew (an index, keys, a table's files). The app stops
    that generation's query before it starts the new one's, so a drop then leaves nothing behind."""

    def drop_generation(self, generation: int) -> None:
        """Delete everything stored for ``generation`` (never the served one); idempotent."""
        ...


@runtime_checkable
class ReadsInParts(Protocol):
    """A :class:`Rebuildable` sink whose copy ``cdc verify`` reads in parallel executor tasks (search: sliced
    scrolls; cache: a share of the keys each). Without it, verify reads ``read_table`` on the driver."""

    def read_parts(self, table: TableRef, generation: int, parts: int) -> Sequence[StorePart]:
        """On the driver: at most ``parts`` readers that together yield every stored row of ``table`` once."""
        ...


class FrameRows(Protocol):
    """Rows of a :class:`ReadsFrame` sink's frame to document form, in an executor task: picklable."""

    def __call__(self, rows: Iterator[Any]) -> Iterator[tuple[str, dict[str, Any]]]: ...


@runtime_checkable
class WritesFolded(Protocol):
    """A frame-based sink that also writes its small batches whole on the driver, folded there (the warehouse,
    with delta-rs: sinks._warehouse_live). Internal to the built-in sinks, not a plugin contract."""

    folds_on_driver: bool  # whether this instance's store takes the driver's writes (else: Spark's path only)
    history: bool  # whether it wants each table's decoded events as well

    def write_folded(self, tables: Sequence[TableWrite]) -> None:
        """Raises sinks._warehouse_live.NotOnDriverError when the batch must go Spark's path."""
        ...


@runtime_checkable
class ReadsFrame(Protocol):
    """A :class:`Rebuildable` sink whose copy Spark reads itself (the warehouse: a Delta table)."""

    def read_frame(self, table: TableRef, generation: int) -> tuple[DataFrame, FrameRows] | None:
        """The stored table as a DataFrame and the function from its rows (pyspark Rows, in an executor task) to
        (key_id, row in document form); None when ``generation`` has no copy of ``table``."""
        ...


@runtime_checkable
class ChangesUnderRead(Protocol):
    """A :class:`Rebuildable` sink whose running query can change a table's shape while ``cdc verify`` reads it
    (the warehouse widens a Delta column when a type change arrives, and Spark's read of the table then fails):
    verify reads again, a few times, when the sink recognises the failure as that."""

    def changed_under_read(self, error: BaseException) -> bool:
        """Whether ``error``, raised while the store was read, means the store changed under the read."""
        ...


@runtime_checkable
class ReadsFields(Protocol):
    """A :class:`ReadsFrame` sink whose copy Spark reads as the table's Value record: a column per field, by its
    Avro name, typed as Spark's ``from_avro`` reads the field (a ``time-micros`` as the long it is; the warehouse:
    its Delta columns are those types). ``cdc verify`` then compares it with the source inside the JVM, and only
    the rows that differ reach Python."""

    def read_fields(self, table: TableRef, generation: int) -> tuple[DataFrame, FrameRows] | None:
        """The frame in that form, and the function from its rows, projected by sinks._values.spark_projection,
        to (key_id, row in document form); None when ``generation`` has no copy of ``table``."""
        ...


@dataclass(frozen=True)
class TableRef:
    """A table as verify knows it from the source."""

    topic: str
    name: str  # "<schema>.<table>" as in the topic name
    key_fields: tuple[str, ...]
    row_schema: dict[str, Any]


class BaseSink:
    """Convenience base: settings kept on ``self.context``; ``close`` does nothing."""

    name = "base"
    context: SinkContext

    def open(self, context: SinkContext) -> None:
        self.context = context

    def write(self, batch: Batch) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None
