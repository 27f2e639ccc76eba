"""What a sink is: the contract between the sinks runtime and each store (built-in or plugin).

A sink is a class with a ``name``, ``open``/``write``/``close``, announced under the entry-point group
``cdc.sinks``. The runtime reads the change topics, decodes them, keeps the last event per key of each
micro-batch, and calls ``write`` once per micro-batch with one :class:`TableChanges` per table. Writes must be
idempotent and must not go backwards: a batch is replayed after a crash, and the same key may arrive again
with an older position (keep the newer one; positions order by ``(commit_lsn, lsn)``).

Sinks that can be rebuilt and verified also implement :class:`Rebuildable`: numbered *generations* of the
store, one of them served, and a way to read a table back in document form.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from sinks._values import Names, column_name, doc_converter, spark_projection

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
    return json.dumps(list(key.values()), separators=(",", ":"), ensure_ascii=False)


@dataclass
class TableChanges:
    """One table's share of a micro-batch: the latest event per key, and a truncate if there was one.

    ``frame`` columns: ``key`` (struct of key fields), ``row`` (struct of the row's fields, null for deletes),
    ``op``, ``commit_lsn``, ``lsn``, ``ts_ms``, ``unchanged`` (array of field names), ``partition``, ``offset``.
    Field names are Avro names; :attr:`columns` maps them to PostgreSQL column names.
    """

    topic: str
    name: str  # "<schema>.<table>" as in the topic name (sanitised parts)
    key_schema: dict[str, Any]
    row_schema: dict[str, Any]
    frame: DataFrame
    truncate: tuple[int, int] | None  # delete rows older than this (commit_lsn, lsn) before applying frame
    events: DataFrame | None = None  # every change event of the batch in offset order (same columns), for histories
    # The changes already on the driver: a small batch for a sink that reads changes() alone (its frame is
    # then None; see sinks._reader.LocalDecoder).
    rows: list[Change] | None = None

    @property
    def columns(self) -> dict[str, str]:
        return {f["name"]: column_name(f) for f in self.row_schema["fields"]}

    @property
    def key_columns(self) -> dict[str, str]:
        return {f["name"]: column_name(f) for f in self.key_schema["fields"]}

    def changes(self) -> Iterator[Change]:
        """The frame's rows in document form, on the driver (one Arrow transfer per table and batch)."""
        if self.rows is not None:
            yield from self.rows
            return
        from pyspark.sql import functions as F

        names = Names()
        key_conv = doc_converter(self.key_schema, names, spark=True)
        row_conv = doc_converter(self.row_schema, names, spark=True)
        frame = self.frame.select(
            spark_projection(self.key_schema, F.col("key"), names).alias("key"),
            spark_projection(self.row_schema, F.col("row"), names).alias("row"),
            "op",
            "commit_lsn",
            "lsn",
            "ts_ms",
            "unchanged",
            "partition",
            "offset",
        )
        columns = self.columns
        for r in _arrow_rows(frame):
            yield Change(
                key_conv(r["key"]),
                row_conv(r["row"]),
                r["op"],
                r["commit_lsn"],
                r["lsn"],
                r["ts_ms"],
                tuple(columns.get(u, u) for u in (r["unchanged"] or ())),
                r["partition"],
                r["offset"],
            )


def _arrow_rows(frame: DataFrame) -> Iterator[dict[str, Any]]:
    """The frame's rows as dicts, through Arrow (pickled Rows cost several times more per row)."""
    for batch in frame.toArrow().to_batches(max_chunksize=10_000):
        yield from batch.to_pylist()


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
    """A derived store kept by one Structured Streaming query."""

    name: str

    def open(self, context: SinkContext) -> None: ...

    def write(self, batch: Batch) -> None: ...

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
