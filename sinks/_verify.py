"""``cdc verify``'s comparison of a store with the source, on Spark's executors, in driver memory that does not
grow with the table.

Both sides are read in parallel tasks: the source in key ranges that all see one exported snapshot
(cdc.SourceTable.ranges and rows), converted by the capture's own codec and then to document form; the store as
its sink reads it back (:class:`sinks.ReadsFrame`, :class:`sinks.ReadsInParts`, or ``read_table`` on the
driver, staged as Parquet under the state dir). Each task turns a row into its key id, the row pickled, and a
digest of that; Spark joins the two sides by key and only the keys that differ come to the driver: missing from
the store, extra in it, or whose digests differ (those rows are compared again as values: two encodings of one
value, such as 0.0 and -0.0, are not a drift). Memory on the driver holds the first few keys of each kind.

Every key found is written to ``<state_dir>/<sink>/verify/<schema>.<table>.jsonl`` (docs/sinks.md), one JSON
object per line: ``{"kind": "missing" | "extra" | "different", "key": <key>, "columns": {<column>: <text>}}``
where ``<key>`` is the store's key of the row (the key fields' JSON) and ``columns`` the same key as PostgreSQL
reads it, each key column's value as text (what ``cdc verify --repair`` and ``cdc snapshot --keys`` hand the
capture; absent for a key type whose store form PostgreSQL cannot read back, such as a composite); a source row
with a value Avro cannot hold, which has no event (the capture dead-letters or stops on it:
capture.on_unencodable), is ``{"kind": "unencodable", "key": <its key columns as
PostgreSQL prints them, a JSON object>, "error": …}``. The file is replaced at each verify and removed when
there is no drift.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import pickle
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinks import _verify_fields as in_jvm
from sinks._api import FrameRows, ReadsFrame, ReadsInParts, StorePart, TableRef, key_id
from sinks._storage import Location
from sinks._values import Names, column_name, doc_converter

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

SAMPLE = 10  # keys of each kind kept for the report on the terminal
_BATCH = 5_000  # rows per Arrow batch a task hands back
_ROWS_PER_RANGE = 50_000  # a source range this small is not split further: a task's start costs more
_STAGED_ROWS = 100_000  # rows of a read_table-only store per Parquet file staged on the driver
# What each side's tasks produce: the key id, the row pickled (document form, the source's columns in order)
# and its digest; a source row with no event has its key as PostgreSQL prints it (JSON) and why instead.
_LEDGER = "key string, digest binary, row binary, bad string, error string"
_KINDS = ("missing", "extra", "unencodable", "different")  # the order of the report


@dataclass
class Drift:
    """One table's comparison: counts, the first keys of each kind, and where the full list is."""

    table: str
    missing: list[str] = field(default_factory=list)  # the first SAMPLE
    extra: list[str] = field(default_factory=list)
    different: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    # Source rows with a value Avro cannot hold: (the key as PostgreSQL prints it, why); the capture dead-letters
    # or stops on them (capture.on_unencodable), so no store has them.
    unencodable: list[tuple[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"missing": 0, "extra": 0, "different": 0, "unencodable": 0})
    report: str | None = None  # the file listing every key found
    location: Location | None = None  # the same, to read it back (a repair does)

    @property
    def clean(self) -> bool:
        return not any(self.counts.values())


def compare(
    spark: SparkSession,
    sink: Any,
    source_tables: Sequence[Any],
    generation: int,
    *,
    table_name: Callable[[str], str],
    reports: Location | None,
) -> list[Drift]:
    """Each source table against the sink's copy of generation ``generation``, key by key, in document form.

    ``table_name(topic)`` is the store's name of a table; ``reports`` the directory for the key lists. A source
    table is a cdc.SourceTable (or anything with its ``snapshot``, ``ranges`` and ``rows``, picklable).
    """
    drifts = []
    parallelism = max(1, spark.sparkContext.defaultParallelism)
    for src in source_tables:
        ref = TableRef(src.topic, table_name(src.topic), src.key_fields, src.row_schema)
        columns = [column_name(f) for f in src.row_schema["fields"]]
        drift = Drift(src.qualified)
        store = _StoreFrame(spark, sink, ref, generation, columns=columns, reports=reports)
        with src.snapshot() as (conn, exported), store:
            ranges = tuple(src.ranges(conn, parallelism * 2, min_rows=_ROWS_PER_RANGE))
            rows = None
            if in_jvm.comparable(sink, src):  # in the JVM, no per-row Python
                rows = in_jvm.differences(spark, sink, src, ref, generation, read=(exported, ranges))
            log.info("verify: %s compared %s", src.qualified, "in the JVM" if rows is not None else "in document form")
            if rows is None:
                source = spark.range(0, len(ranges), 1, len(ranges)).mapInArrow(
                    _SourceRanges(src, exported, ranges), _LEDGER
                )
                rows = _differences(source, store.frame())
            _collect(rows, drift, reports, ref.name, key_texts(src))
        drifts.append(drift)
    return drifts


def _ledger_rows(docs: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[pa.RecordBatch]:
    """(key id, document) -> Arrow batches of ledger rows."""
    rows: list[tuple[Any, ...]] = []
    for key, doc in docs:
        rows.append(_ledger_entry(key, doc))
        if len(rows) >= _BATCH:
            yield _ledger_batch(rows)
            rows = []
    if rows:
        yield _ledger_batch(rows)


def _ledger_entry(key: str, doc: dict[str, Any]) -> tuple[Any, ...]:
    """A row's ledger row: its key id, a digest of the row pickled, and the row pickled (to compare it again as
    values when the digests differ)."""
    blob = pickle.dumps(doc, protocol=pickle.HIGHEST_PROTOCOL)
    return key, hashlib.blake2b(blob, digest_size=16).digest(), blob, None, None


def _ledger_batch(rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    """Ledger rows (tuples in the order of ``_LEDGER``) as one Arrow batch."""
    import pyarrow as pa

    schema = _ledger_arrow()
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(schema)
    return pa.RecordBatch.from_arrays(
        [pa.array(c, t) for c, t in zip(columns, schema.types, strict=True)], schema=schema
    )


@dataclass(frozen=True)
class _SourceRanges:
    """The source side of one table, in an executor task: the key ranges its input ids name, in the snapshot
    the driver exported, each row in document form; a row with no event goes into the ledger's ``bad``."""

    src: Any  # cdc.SourceTable: pickles with its settings and resolved types
    snapshot: str
    ranges: tuple[Any, ...]  # cdc.KeyRange, one per task

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for part in batch.column(0).to_pylist():
                bad: list[tuple[Any, ...]] = []
                yield from _ledger_rows(self._docs(part, bad))
                if bad:
                    yield _ledger_batch(bad)

    def _docs(self, part: int, bad: list[tuple[Any, ...]]) -> Iterator[tuple[str, dict[str, Any]]]:
        names = Names()
        fields = self.src.row_schema["fields"]
        convs = {f["name"]: (column_name(f), doc_converter(f["type"], names, spark=False)) for f in fields}
        key_cols = [convs[k][0] for k in self.src.key_fields]
        bad_key = in_jvm.unencodable_key(self.src)

        def unencodable(row: Any) -> None:
            bad.append((bad_key(row), None, None, json.dumps(row.key_text, ensure_ascii=False), row.error))

        for raw in self.src.rows(unencodable=unencodable, snapshot=self.snapshot, within=self.ranges[part]):
            row = {col: conv(raw[name]) for name, (col, conv) in convs.items()}
            yield key_id({c: row[c] for c in key_cols}), row


@dataclass(frozen=True)
class _PartsRead:
    """The store side from :class:`sinks.ReadsInParts`, in an executor task: the parts its input ids name."""

    parts: tuple[StorePart, ...]
    columns: tuple[str, ...]

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for part in batch.column(0).to_pylist():
                yield from _ledger_rows(_projected(self.parts[part](), self.columns))


@dataclass(frozen=True)
class _FrameRead:
    """The store side from :class:`sinks.ReadsFrame`, in an executor task: its rows to ledger rows."""

    rows_to_docs: FrameRows
    columns: tuple[str, ...]

    def __call__(self, rows: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        for key, doc in _projected(self.rows_to_docs(iter(rows)), self.columns):
            yield _ledger_entry(key, doc)


def _projected(
    docs: Iterable[tuple[str, dict[str, Any]]], columns: Sequence[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The store's rows with the source's columns, in the source's order (a column dropped at the source but
    still in the store is not compared)."""
    for key, row in docs:
        yield key, {c: row.get(c) for c in columns}


class _StoreFrame:
    """The store side of one table as a ledger DataFrame, however the sink reads back; staged files removed on
    exit."""

    def __init__(
        self,
        spark: SparkSession,
        sink: Any,
        ref: TableRef,
        generation: int,
        *,
        columns: Sequence[str],
        reports: Location | None,
    ) -> None:
        self.spark, self.sink, self.ref, self.generation = spark, sink, ref, generation
        self.columns = tuple(columns)
        self.staged = reports / f"staged-{uuid.uuid4().hex}" if reports is not None else None

    def __enter__(self) -> _StoreFrame:
        return self

    def __exit__(self, *_: object) -> None:
        if self.staged is not None:
            self.staged.remove_tree()

    def frame(self) -> DataFrame:
        parallelism = max(1, self.spark.sparkContext.defaultParallelism)
        if isinstance(self.sink, ReadsFrame):
            read = self.sink.read_frame(self.ref, self.generation)
            if read is None:
                return self.spark.createDataFrame([], _LEDGER)
            frame, rows_to_docs = read
            if frame.rdd.getNumPartitions() < parallelism:  # a few large files: Parquet splits by row group
                frame = frame.repartition(parallelism * 2)
            return frame.rdd.mapPartitions(_FrameRead(rows_to_docs, self.columns)).toDF(_LEDGER)
        if isinstance(self.sink, ReadsInParts):
            parts = tuple(self.sink.read_parts(self.ref, self.generation, parallelism * 2))
            if not parts:
                return self.spark.createDataFrame([], _LEDGER)
            frame = self.spark.range(0, len(parts), 1, len(parts)).mapInArrow(_PartsRead(parts, self.columns), _LEDGER)
            return frame.dropDuplicates(["key"])  # a walk of the keys may see one twice (Redis's SCAN)
        return self._staged().dropDuplicates(["key"])

    def _staged(self) -> DataFrame:
        """A sink with only ``read_table``: read on the driver, a file of ledger rows at a time, under the state
        dir (which executors on a cluster share, as they do the checkpoints)."""

        if self.staged is None:
            raise ValueError("verify needs a state dir to stage a store read by read_table")
        rows = _projected(self.sink.read_table(self.ref, self.generation), self.columns)
        batches: list[pa.RecordBatch] = []
        for batch in _ledger_rows(rows):
            batches.append(batch)
            if sum(b.num_rows for b in batches) >= _STAGED_ROWS:
                self._stage(batches)
                batches = []
        self._stage(batches)  # the last rows, or an empty file: a table with no rows is still a table
        return self.spark.read.parquet(self.staged.uri)

    def _stage(self, batches: list[pa.RecordBatch]) -> None:
        import pyarrow as pa

        assert self.staged is not None
        frame = self.spark.createDataFrame(pa.Table.from_batches(batches, schema=_ledger_arrow()))
        frame.write.mode("append").parquet(self.staged.uri)


def _ledger_arrow() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("key", pa.string()),
            ("digest", pa.binary()),
            ("row", pa.binary()),
            ("bad", pa.string()),
            ("error", pa.string()),
        ]
    )


def _differences(source: DataFrame, store: DataFrame) -> Iterator[Any]:
    """The joined rows that differ, by kind in the report's order, then by key."""
    from pyspark.sql import functions as F

    s, d = source.alias("s"), store.alias("d")
    kind = (
        F.when(F.col("s.bad").isNotNull(), 2)
        .when(F.col("d.key").isNull(), 0)
        .when(F.col("s.key").isNull(), 1)
        .otherwise(3)
    )
    differ = F.col("s.bad").isNotNull() | F.col("s.key").isNull() | F.col("d.key").isNull()
    differ = differ | (F.col("s.digest") != F.col("d.digest"))
    joined = s.join(d, F.col("s.key") == F.col("d.key"), "full_outer").where(differ)
    return (
        joined.select(
            kind.alias("kind"),
            F.coalesce(F.col("s.key"), F.col("d.key")).alias("key"),
            F.col("s.bad"),
            F.col("s.error"),
            F.when(kind == 3, F.col("s.row")).alias("want"),
            F.when(kind == 3, F.col("d.row")).alias("got"),
        )
        .orderBy("kind", F.coalesce(F.col("bad"), F.col("key")))
        .toLocalIterator()
    )


def key_texts(src: Any) -> Callable[[str], dict[str, str] | None]:
    """A function from a key id (the key's document-form values, JSON) to the key's columns as text PostgreSQL
    reads as their types (None when one cannot be written so)."""
    names = Names()
    fields = {f["name"]: f for f in src.row_schema["fields"]}
    for f in src.row_schema["fields"]:
        names.resolve(f["type"], None)  # named types defined before the key fields refer to them
    texts = [(column_name(fields[k]), _text_of(fields[k]["type"], names)) for k in src.key_fields]

    def columns(key: str) -> dict[str, str] | None:
        try:  # an extra key is the store's: whatever was written there by hand
            values = json.loads(key)
            if not isinstance(values, list) or len(values) != len(texts):
                return None
            out = {}
            for (column, text), value in zip(texts, values, strict=True):
                written = text(value)
                if written is None:
                    return None
                out[column] = written
        except (ValueError, TypeError, RecursionError, binascii.Error):
            return None
        return out

    return columns


def _text_of(avro: Any, names: Names) -> Callable[[Any], str | None]:
    """Document form -> PostgreSQL's text for one key field's type: numbers, text, UUIDs, dates and times (ISO
    8601) as they are, booleans as true/false, bytes (base64 in documents) as bytea's hex."""
    avro = names.resolve(avro, None)
    if isinstance(avro, list):
        real = [b for b in avro if b != "null"]
        return _text_of(real[0], names) if len(real) == 1 else lambda _: None
    kind = avro if isinstance(avro, str) else avro["type"]
    if isinstance(kind, (dict, list)):
        return _text_of(kind, names)
    logical = None if isinstance(avro, str) else avro.get("logicalType")
    if kind in ("record", "array", "map"):
        return lambda _: None
    if kind in ("bytes", "fixed") and logical != "decimal":
        return lambda v: None if not isinstance(v, str) else "\\x" + base64.b64decode(v).hex()
    if logical in ("timestamp-micros", "local-timestamp-micros", "date"):
        return lambda v: v if isinstance(v, str) else None  # an int: out of what a document writes as a date
    if kind == "boolean":
        return lambda v: "true" if v else "false"
    return lambda v: None if v is None else str(v)


def _collect(
    rows: Iterable[Any],
    drift: Drift,
    reports: Location | None,
    name: str,
    columns: Callable[[str], dict[str, str] | None],
) -> None:
    """Count and sample each kind of difference; list every one in the table's report (removed when none)."""
    with tempfile.TemporaryDirectory(prefix="pgcdc-verify-") as tmp:
        scratch = Path(tmp) / "report.jsonl"
        with scratch.open("w") as lines:
            for r in rows:
                line = _found(r, drift, columns)
                if line is not None:
                    lines.write(json.dumps(line) + "\n")
        if reports is None:
            return
        report = reports / f"{name}.jsonl"
        if drift.clean:
            report.remove()
        else:
            report.write_from(scratch)
            drift.report, drift.location = report.uri, report


def _found(r: Any, drift: Drift, columns: Callable[[str], dict[str, str] | None]) -> dict[str, Any] | None:
    """One differing row counted and sampled; its report line (None: equal values, encoded differently)."""
    kind = _KINDS[r["kind"]]
    if kind == "unencodable":
        if len(drift.unencodable) < SAMPLE:
            drift.unencodable.append((r["bad"], r["error"]))
        drift.counts[kind] += 1
        return {"kind": kind, "key": r["bad"], "error": r["error"]}
    key = r["key"]
    if kind == "different":
        want, got = pickle.loads(r["want"]), pickle.loads(r["got"])  # noqa: S301 - pickled by our own tasks
        if all(got.get(c) == v for c, v in want.items()):
            return None
        if len(drift.different) < SAMPLE:
            drift.different.append((key, want, got))
    else:
        sample = drift.missing if kind == "missing" else drift.extra
        if len(sample) < SAMPLE:
            sample.append(key)
    drift.counts[kind] += 1
    line: dict[str, Any] = {"kind": kind, "key": key}
    if (text := columns(key)) is not None:
        line["columns"] = text
    return line


__all__ = ["SAMPLE", "Drift", "compare", "key_texts"]
