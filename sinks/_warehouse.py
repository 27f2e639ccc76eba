"""The ``warehouse`` sink: one Delta Lake table per source table, kept by MERGE guarded by position.

Layout under ``sinks.warehouse.path`` (docs/sinks.md):

    _cdc_current                    the served generation N (replaced atomically)
    current -> g<N>                 a symlink to it, where the base path is a local directory
    g<N>/<schema>.<table>/          the table: the row's columns (Spark's types from the Avro schema)
                                    plus __op, __commit_lsn, __lsn, __ts_ms
    g<N>/<schema>.<table>.history/  with ``history = true``: every change appended, in order

A batch of up to 100,000 records on local files is folded on the driver and merged by delta-rs
(sinks._warehouse_live); a larger one, or one on an object store, by a Spark MERGE of the Spark fold. Both
follow the same rules, below.

Columns are named by the Avro field names (``[A-Za-z0-9_]``, so Delta needs no column mapping mode), except
where Delta would refuse them (:func:`delta_columns`). MERGE applies a change only when its (commit_lsn, lsn)
is at least the stored one, so replays are no-ops and nothing goes backwards; history appends use Delta's
idempotent writes (txnAppId/txnVersion = batch id).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinks._api import BaseSink, Batch, SinkContext, TableChanges, TableRef, TableWrite, key_id
from sinks._delta_names import META as _META
from sinks._delta_names import UNCHANGED as _UNCHANGED
from sinks._delta_names import create_app, delta_columns, history_app
from sinks._delta_stats import BatchDates, StatsColumns, has_dates, quoted, sql_string
from sinks._delta_widen import rewrite, widened, widens
from sinks._preflight import check_writable
from sinks._values import Names, column_name, doc_converter, spark_projection
from sinks._warehouse_live import DeltaWriter, NotOnDriverError

if TYPE_CHECKING:
    from delta.tables import DeltaTable
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)

_READ_PIECE_BYTES = 4 << 20  # compressed Parquet per partition when the table is read back (verify)
_CURRENT = "_cdc_current"  # the served generation's number


@dataclass(frozen=True)
class WarehouseRows:
    """Rows of a table read back from Delta (as Spark hands them to Python) to document form, in a task."""

    row_schema: dict[str, Any]
    key_fields: tuple[str, ...]

    def __call__(self, rows: Iterator[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        names = Names()
        fields = self.row_schema["fields"]
        convs = [(f["name"], column_name(f), doc_converter(f["type"], names, spark=True)) for f in fields]
        key_fields = {f["name"]: column_name(f) for f in fields if f["name"] in self.key_fields}
        for r in rows:
            row = {col: conv(r[name]) for name, col, conv in convs}
            yield key_id({key_fields[k]: row[key_fields[k]] for k in self.key_fields}), row


class WarehouseSink(BaseSink):
    name = "warehouse"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        self.base = context.settings.warehouse_root
        self.history = context.settings.sinks.warehouse.history
        self.stats = StatsColumns()
        check_writable(self.base, "sinks.warehouse.path")
        self.live = DeltaWriter(context.name, self.history)
        # Small batches are merged by delta-rs on the driver (sinks._warehouse_live) where the tables are local
        # files; on an object store they go Spark's path, whose storage settings are Hadoop's.
        self.folds_on_driver = self.base.local

    def path(self, table: str, generation: int) -> str:
        return (self.base / f"g{generation}" / table).uri

    # --- generations -----------------------------------------------------------------------

    def current_generation(self) -> int | None:
        text = (self.base / _CURRENT).read_text()
        return int(text.strip()) if text is not None else None

    def prepare_generation(self, generation: int) -> None:
        # Leftovers of an earlier, failed rebuild to this number go first.
        self.drop_generation(generation)
        (self.base / f"g{generation}").make_dirs()

    def drop_generation(self, generation: int) -> None:
        (self.base / f"g{generation}").remove_tree()

    def swap(self, generation: int) -> None:
        old = self.current_generation()
        (self.base / _CURRENT).write_text(f"{generation}\n")  # readers see the old or the new number
        if self.base.local:  # a symlink for readers that take a path: <path>/current/<schema>.<table>
            base = Path(self.base.path)
            link = base / "current.tmp"
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            link.symlink_to(f"g{generation}")
            os.replace(link, base / "current")
        if old is not None and old != generation:
            time.sleep(self.context.settings.sinks.swap_grace_s)  # readers of the old copy finish first
            self.drop_generation(old)

    def changed_under_read(self, error: BaseException) -> bool:
        # Delta's error for a table altered during a read: the query widened a column (sinks._delta_widen).
        return "DELTA_SCHEMA_CHANGE_SINCE_ANALYSIS" in str(error)

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        read = self.read_frame(table, generation)
        if read is None:
            return
        from delta.tables import DeltaTable

        frame, rows_to_docs = read
        # toLocalIterator brings one partition at a time into the driver, whole. A partition read from the files
        # is at least a Parquet row group, and Spark writes row groups of a whole file's rows up to ~128 MB and
        # more (1.25M rows in one). Shuffled into pieces of ~4 MB of Parquet each, the driver's memory stays
        # flat with the table's size.
        detail = DeltaTable.forPath(self.context.spark, self.path(table.name, generation)).detail().first()
        size = int(detail["sizeInBytes"]) if detail is not None else 0
        yield from rows_to_docs(frame.repartition(max(1, -(-size // _READ_PIECE_BYTES))).toLocalIterator())

    def read_frame(self, table: TableRef, generation: int) -> tuple[DataFrame, WarehouseRows] | None:
        read = self.read_fields(table, generation)
        if read is None:
            return None
        frame, rows = read
        names = Names()
        fields = table.row_schema["fields"]
        return frame.select(
            *[spark_projection(f["type"], frame[f["name"]], names).alias(f["name"]) for f in fields]
        ), rows

    def read_fields(self, table: TableRef, generation: int) -> tuple[DataFrame, WarehouseRows] | None:
        """The table's Delta columns by their Avro names, as from_avro types them (sinks._delta_arrow); a column
        the table does not have yet is null of its type."""
        from pyspark.sql import functions as F

        from sinks._delta_arrow import arrow_field, spark_type

        path = self.path(table.name, generation)
        if not (self.base / f"g{generation}" / table.name / "_delta_log").exists():
            return None
        frame = self._committed(path)
        if frame is None:
            return None
        present = set(frame.columns)
        stored = {f.name: f.dataType.simpleString() for f in frame.schema.fields}
        names = Names()
        fields = table.row_schema["fields"]
        delta = delta_columns([f["name"] for f in fields], frame.columns)
        columns = []
        for f in fields:
            names.resolve(f["type"], None)  # named types are defined by the first field that uses them
            column = delta[f["name"]]
            typ = spark_type(arrow_field(f["type"], names)[0])
            if column not in present:
                columns.append(F.lit(None).cast(typ).alias(f["name"]))
            elif widens(stored[column], typ):  # widened at the source, not yet in the table: as it will be
                columns.append(F.col(quoted(column)).cast(typ).alias(f["name"]))
            else:
                columns.append(F.col(quoted(column)).alias(f["name"]))
        return frame.select(*columns), WarehouseRows(table.row_schema, table.key_fields)

    def _committed(self, path: str) -> DataFrame | None:
        """The table at ``path``, or None while its first commit is still being written: Delta makes
        ``_delta_log`` before version 0 lands, so a reader racing the sink's first batch sees a log with
        no commit in it."""
        from pyspark.errors import AnalysisException

        try:
            return self.context.spark.read.format("delta").load(path)
        except AnalysisException as error:
            if error.getCondition() == "DELTA_TABLE_NOT_FOUND":
                return None
            raise

    # --- writes ----------------------------------------------------------------------------

    def write_folded(self, tables: Sequence[TableWrite]) -> None:
        """A small batch folded on the driver, merged by delta-rs (sinks._warehouse_live). Raises
        :class:`NotOnDriverError` when the batch must go Spark's path, which repeats what was written as no-ops."""
        for table in tables:
            path = str(Path(self.base.path) / f"g{table.info.generation}" / table.info.name)
            try:
                # A table made anew at a path seen before has Delta's default properties again.
                if self.live.write(path, history_path(path), table):
                    self.stats.forget(path)
            except NotOnDriverError:
                raise
            except ImportError as exc:  # an install without pgcdc[sinks]'s deltalake: Spark's MERGE still writes
                raise NotOnDriverError(
                    f"delta-rs is not installed ({exc}), so every batch takes a Spark MERGE (seconds where delta-rs "
                    "takes milliseconds); install it: pip install 'pgcdc[sinks]'"
                ) from exc
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # delta-rs's Rust panics surface as a BaseException (pyo3)
                raise NotOnDriverError(f"{table.info.name}: delta-rs: {type(exc).__name__}: {exc}") from exc

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            self._write_table(batch, table)

    def _source(self, table: TableChanges, frame: DataFrame, delta: dict[str, str]) -> DataFrame:
        from pyspark.sql import functions as F

        key_names = [f["name"] for f in table.key_schema["fields"]]
        cols = [
            (F.col(f"key.{quoted(f['name'])}") if f["name"] in key_names else F.col(f"row.{quoted(f['name'])}")).alias(
                delta[f["name"]]
            )
            for f in table.row_schema["fields"]
        ]
        return frame.select(
            *cols,
            F.col("op").alias("__op"),
            F.col("commit_lsn").alias("__commit_lsn"),
            F.col("lsn").alias("__lsn"),
            F.col("ts_ms").alias("__ts_ms"),
            F.expr("unix_millis(current_timestamp())").alias("__applied_ms"),  # freshness = applied - ts_ms
            F.col("unchanged").alias(_UNCHANGED),
        )

    def _write_table(self, batch: Batch, table: TableChanges) -> None:
        from delta.tables import DeltaTable
        from pyspark.sql import functions as F

        spark = batch.spark
        path = self.path(table.name, batch.generation)
        target = DeltaTable.forPath(spark, path) if DeltaTable.isDeltaTable(spark, path) else None
        schema = target.toDF().schema if target is not None else None
        delta = delta_columns([f["name"] for f in table.row_schema["fields"]], schema.names if schema else [])
        source = self._source(table, table.frame, delta)
        columns = list(delta.items())  # (Avro field, Delta column)
        keys = [delta[f["name"]] for f in table.key_schema["fields"]]
        changes = table.events if table.events is not None else table.frame
        dates = BatchDates(lambda: self._source(table, changes, delta))  # built only for tables with dates
        if target is None or schema is None:
            self._create(batch, table, source, path, delta=delta, dates=dates)
            return
        types = {f.name: f.dataType.simpleString() for f in source.drop(_UNCHANGED).schema.fields}
        if wider := widened(((f.name, f.dataType.simpleString()) for f in schema.fields), types):
            target, schema = self._widen(spark, path, wider)
        existing = {c.lower() for c in schema.names}  # Delta's names ignore case
        added = [f for f in source.drop(_UNCHANGED).schema.fields if f.name.lower() not in existing]
        if added:  # ALTER TABLE ADD COLUMN at the source: the Delta table gains the column (older rows: null)
            ddl = ", ".join(f"{quoted(f.name)} {f.dataType.simpleString()}" for f in added)
            spark.sql(f"ALTER TABLE delta.{quoted(path)} ADD COLUMNS ({ddl})")
            target = DeltaTable.forPath(spark, path)  # the handle above still has the old schema
            schema = target.toDF().schema
        self.stats.guard(spark, path, schema, dates, new=False)
        if table.truncate is not None:
            c, lsn = table.truncate
            target.delete((F.col("__commit_lsn") < c) | ((F.col("__commit_lsn") == c) & (F.col("__lsn") < lsn)))
        newer = "(s.__commit_lsn > t.__commit_lsn OR (s.__commit_lsn = t.__commit_lsn AND s.__lsn >= t.__lsn))"
        on = " AND ".join(f"t.{quoted(k)} <=> s.{quoted(k)}" for k in keys)
        kept = {  # unchanged_toast names Avro fields
            quoted(
                c
            ): f"CASE WHEN array_contains(s.{_UNCHANGED}, {sql_string(f)}) THEN t.{quoted(c)} ELSE s.{quoted(c)} END"
            for f, c in columns
        }
        meta = {quoted(m): f"s.{m}" for m in _META}
        (
            target.alias("t")
            .merge(source.alias("s"), on)
            .whenMatchedDelete(f"s.__op = 'd' AND (s.__commit_lsn IS NULL OR {newer})")
            .whenMatchedUpdate(f"s.__op <> 'd' AND {newer}", {**kept, **meta})
            .whenNotMatchedInsert("s.__op <> 'd'", {**{quoted(c): f"s.{quoted(c)}" for _, c in columns}, **meta})
            .execute()
        )
        if self.history and table.events is not None:
            self._append_history(batch, table, path, delta, dates)

    def _widen(self, spark: SparkSession, path: str, columns: dict[str, str]) -> tuple[DeltaTable, StructType]:
        """The table (and its history) rewritten with ``columns`` in their new, wider types (sinks._delta_widen);
        the table's handle and schema after it."""
        from delta.tables import DeltaTable

        log.info("%s: column(s) widened at the source, table rewritten: %s", path, columns)
        rewrite(spark, path, columns)
        history = history_path(path)
        if self.history and DeltaTable.isDeltaTable(spark, history):
            rewrite(spark, history, columns)
        self.stats.forget(path)
        target = DeltaTable.forPath(spark, path)
        return target, target.toDF().schema

    def _append_history(
        self, batch: Batch, table: TableChanges, path: str, delta: dict[str, str], dates: BatchDates
    ) -> None:
        from delta.tables import DeltaTable

        assert table.events is not None
        spark, history = batch.spark, history_path(path)
        events = self._source(table, table.events, delta)
        guard: dict[str, str] = {}
        if has_dates(events.schema):  # the history table's schema is read only when a date could need it
            new = not DeltaTable.isDeltaTable(spark, history)
            schema = events.schema if new else DeltaTable.forPath(spark, history).toDF().schema
            guard = self.stats.guard(spark, history, schema, dates, new=new)
        (
            events.write.format("delta")
            .mode("append")
            .option("mergeSchema", "true")
            .options(**guard)
            .option("txnAppId", history_app(self.context.name, table.name, batch.generation))
            .option("txnVersion", str(batch.batch_id))
            .save(history)
        )

    def _create(
        self,
        batch: Batch,
        table: TableChanges,
        source: DataFrame,
        path: str,
        *,
        delta: dict[str, str],
        dates: BatchDates,
    ) -> None:
        """The batch that creates a table writes its rows as a plain append: into an empty table a MERGE would
        insert exactly the batch's last non-delete event per key (what the fold left), at a join's cost.

        A first run and every table of a rebuild's generation start this way. Idempotent by Delta's
        transaction ids: a replay of the batch after this commit finds the table and takes the MERGE path
        (a no-op for rows already there); a replay of this commit itself is skipped by txnAppId/txnVersion.
        """
        rows = source.filter("__op <> 'd'").drop(_UNCHANGED)
        (
            rows.write.format("delta")
            .mode("append")
            .options(**self.stats.guard(batch.spark, path, rows.schema, dates, new=True))
            .option("txnAppId", create_app(self.context.name, table.name, batch.generation))
            .option("txnVersion", str(batch.batch_id))
            .save(path)
        )
        if self.history and table.events is not None:
            self._append_history(batch, table, path, delta, dates)


def history_path(path: str) -> str:
    """Where the history of the table at ``path`` goes: ``<path>.history``.

    Table directories are ``<schema>.<table>`` with dots never inside a part (topic names have none), so a
    second dot cannot be another table's directory. ``<path>__history`` was: a captured table ``x__history``
    and the history of ``x`` shared one Delta table.
    """
    return f"{path}.history"
