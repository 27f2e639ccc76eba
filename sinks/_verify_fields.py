"""``cdc verify``'s comparison inside the JVM, for a store Spark reads in the Value record's own columns
(:class:`sinks.ReadsFields`: the warehouse).

The source side is read as the capture writes it: each task reads its key ranges with binary COPY and encodes
them with the capture's own encoder (``cdc.SourceTable.records``, in C where it is built) into the Value
record's Avro bytes, which Spark's ``from_avro`` decodes. The store side is the sink's frame. Both sides are
projected alike (:func:`sinks._values.spark_projection`, each map as its entries sorted by key, since Spark
compares no maps), joined by key and compared column by column with null-safe equality in the JVM (where -0.0
equals 0.0 and NaN equals NaN, as in document form). No per-row
Python runs on either side: only the rows that differ reach the driver, where they take document form and go
the way of the ledger comparison's (sinks._verify), which compares them again as values.
"""

from __future__ import annotations

import functools
import json
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sinks._api import FrameRows, ReadsFields, TableRef, key_id
from sinks._values import Names, column_name, doc_converter, spark_projection

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession

_RECORDS = "record binary, bad string, error string, bad_key string"
_UNENCODABLE = 2  # the ledger comparison's kinds: 0 missing, 1 extra, 2 unencodable, 3 different


def comparable(sink: Any, src: Any) -> bool:
    """Whether this comparison takes ``src`` (a cdc.SourceTable) against ``sink``'s copy."""
    return isinstance(sink, ReadsFields) and hasattr(src, "records")


def differences(
    spark: SparkSession, sink: Any, src: Any, ref: TableRef, generation: int, *, read: tuple[str, tuple[Any, ...]]
) -> Iterator[dict[str, Any]] | None:
    """The rows that differ, as sinks._verify's ledger comparison gives them (kind, key, bad, error, want and
    got pickled), unencodable ones first; ``read`` is the exported snapshot and the key ranges. None when the
    store has no copy of the table (the ledger comparison then reports every row missing)."""
    store = sink.read_fields(ref, generation)
    if store is None:
        return None
    frame, rows_to_docs = store
    fields = src.row_schema["fields"]
    keys = [[f["name"] for f in fields].index(k) for k in src.key_fields]
    source = _source(spark, src, *read)
    s = _sides(source, fields, source.columns[len(fields) :])
    d = _sides(frame.select(*[frame[f["name"]] for f in fields], _present()), fields, ["present"])
    joined = _joined(s.alias("s"), d.alias("d"), [f["name"] for f in fields], keys)
    return _as_ledger(joined.toLocalIterator(), rows_to_docs)


def _present() -> Column:
    from pyspark.sql import functions as F

    return F.lit(True).alias("present")


def _source(spark: SparkSession, src: Any, snapshot: str, ranges: tuple[Any, ...]) -> DataFrame:
    """The source's rows decoded by ``from_avro``, a column per field as it types them, then ``present`` and
    the unencodable rows' ``bad``, ``error`` and ``bad_key``."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    records = spark.range(0, len(ranges), 1, len(ranges)).mapInArrow(_SourceRecords(src, snapshot, ranges), _RECORDS)
    parsed = records.select(
        from_avro(F.col("record"), json.dumps(_times_as_longs(src.row_schema))).alias("r"), "bad", "error", "bad_key"
    )
    raw = [F.col("r").getField(f["name"]).alias(f"raw{i}") for i, f in enumerate(src.row_schema["fields"])]
    return parsed.select(*raw, _present(), "bad", "error", "bad_key")


def _sides(frame: DataFrame, fields: list[dict[str, Any]], rest: list[str]) -> DataFrame:
    """One side's fields (its first columns, as from_avro types them) as c0, c1, … projected for document form
    and as m0, m1, … projected for comparing (maps as sorted entries), with its ``rest`` columns."""
    shown, compared = Names(), Names()  # named types are defined by the first field that uses them
    raw = [frame[name] for name in frame.columns[: len(fields)]]
    return frame.select(
        *[
            spark_projection(f["type"], c, shown).alias(f"c{i}")
            for i, (f, c) in enumerate(zip(fields, raw, strict=True))
        ],
        *[
            spark_projection(f["type"], c, compared, maps_as_entries=True).alias(f"m{i}")
            for i, (f, c) in enumerate(zip(fields, raw, strict=True))
        ],
        *rest,
    )


def _times_as_longs(avro: Any) -> Any:
    """The schema with each ``time-micros`` a plain long: the same bytes, which ``from_avro`` then reads as the
    stores keep a time of day (µs, sinks._delta_arrow), not as Spark's TIME (which has no 24:00:00)."""
    if isinstance(avro, list):
        return [_times_as_longs(b) for b in avro]
    if not isinstance(avro, dict):
        return avro
    if avro.get("logicalType") == "time-micros":
        return "long"
    return {k: _times_as_longs(v) if k in ("type", "fields", "items", "values") else v for k, v in avro.items()}


def _joined(s: DataFrame, d: DataFrame, fields: list[str], keys: list[int]) -> DataFrame:
    """The full outer join of both sides by key, only the rows that differ, in the report's order (unencodable
    rows first: an extra row with an unencodable row's key is the older version of that row, not extra)."""
    from pyspark.sql import functions as F

    def side(alias: str, i: int, form: str = "c") -> Column:
        return F.col(f"{alias}.{form}{i}")

    same = functools.reduce(
        lambda a, b: a & b, [side("s", i, "m").eqNullSafe(side("d", i, "m")) for i in range(len(fields))]
    )
    missing, extra, bad = F.col("d.present").isNull(), F.col("s.present").isNull(), F.col("s.bad").isNotNull()
    kind = F.when(bad, _UNENCODABLE).when(missing, 0).when(extra, 1).otherwise(3)
    joined = s.join(d, [side("s", i) == side("d", i) for i in keys], "full_outer").where(bad | missing | extra | ~same)

    def row(alias: str, present: Column) -> Column:
        return F.when(present, F.struct(*[side(alias, i).alias(name) for i, name in enumerate(fields)]))

    return joined.select(
        kind.alias("kind"),
        F.col("s.bad"),
        F.col("s.error"),
        F.col("s.bad_key"),
        row("s", ~extra & ~bad).alias("want"),
        row("d", ~missing).alias("got"),
        *[F.coalesce(side("s", i), side("d", i)).alias(f"k{n}") for n, i in enumerate(keys)],
    ).orderBy(F.col("kind") != _UNENCODABLE, "kind", *[f"k{n}" for n in range(len(keys))])


def _as_ledger(rows: Iterable[Any], rows_to_docs: FrameRows) -> Iterator[dict[str, Any]]:
    """The JVM's differing rows as the ledger comparison's: each side in document form, pickled."""

    def doc(row: Any) -> tuple[str, dict[str, Any]] | None:
        return None if row is None else next(iter(rows_to_docs(iter([row]))))

    bad_keys: set[str] = set()
    for r in rows:
        if r["kind"] == _UNENCODABLE:
            if r["bad_key"] is not None:
                bad_keys.add(r["bad_key"])
            yield {"kind": _UNENCODABLE, "key": None, "bad": r["bad"], "error": r["error"], "want": None, "got": None}
            continue
        want, got = doc(r["want"]), doc(r["got"])
        key = (want or got or ("", {}))[0]
        if r["kind"] == 1 and key in bad_keys:
            continue
        yield {
            "kind": r["kind"],
            "key": key,
            "bad": None,
            "error": None,
            "want": None if want is None else pickle.dumps(want[1], protocol=pickle.HIGHEST_PROTOCOL),
            "got": None if got is None else pickle.dumps(got[1], protocol=pickle.HIGHEST_PROTOCOL),
        }


@dataclass(frozen=True)
class _SourceRecords:
    """The source side of one table, in an executor task: the key ranges its input ids name, in the snapshot the
    driver exported, as the Value record's Avro bytes; a row with no event as its key and why."""

    src: Any  # cdc.SourceTable: pickles with its settings and resolved types
    snapshot: str
    ranges: tuple[Any, ...]  # cdc.KeyRange, one per task

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        bad_key = unencodable_key(self.src)
        for batch in batches:
            for part in batch.column(0).to_pylist():
                for records, refused in self.src.records(snapshot=self.snapshot, within=self.ranges[part]):
                    yield _records_batch(records, [None] * len(records), [None] * len(records), [None] * len(records))
                    if refused:
                        yield _records_batch(
                            [None] * len(refused),
                            [json.dumps(r.key_text, ensure_ascii=False) for r in refused],
                            [r.error for r in refused],
                            [bad_key(r) for r in refused],
                        )


def unencodable_key(src: Any) -> Callable[[Any], str | None]:
    """A function from a cdc.UnencodableRow to its key id (document form, as a store's row of that key has it),
    None when its key has no encoding: both comparisons use it."""
    names = Names()
    fields = {f["name"]: f for f in src.row_schema["fields"]}
    convs = {}
    for f in src.row_schema["fields"]:  # named types are defined in field order
        conv = doc_converter(f["type"], names, spark=False)
        if f["name"] in src.key_fields:
            convs[f["name"]] = (column_name(fields[f["name"]]), conv)

    def key(row: Any) -> str | None:
        if row.key is None:
            return None
        return key_id({convs[k][0]: convs[k][1](row.key[k]) for k in src.key_fields})

    return key


def _records_batch(records: list[Any], bad: list[Any], errors: list[Any], keys: list[Any]) -> pa.RecordBatch:
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [
            pa.array(records, pa.binary()),
            pa.array(bad, pa.string()),
            pa.array(errors, pa.string()),
            pa.array(keys, pa.string()),
        ],
        names=["record", "bad", "error", "bad_key"],
    )
