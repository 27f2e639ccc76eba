"""The warehouse's small batches, merged into Delta by delta-rs on the driver instead of by a Spark MERGE.

A Spark MERGE of a few hundred changes into a 200k-row table costs ~2.5 s of both cores on a quiet machine
(planning the join, two jobs, rewriting the touched files) and ten times that beside the other sinks under
load; delta-rs merges the same changes into the same table in ~0.3 s of one core (measured side by side, same
table and batch). So a live batch of the warehouse (up to ``sinks._fold.DRIVER_FOLD_RECORDS`` offsets) is read,
folded by the Python fold (sinks._fold) and written here; larger batches (backlogs, replays, rebuilds)
keep Spark's path. Both write the same tables by the same rules (sinks._warehouse): the columns'
types (sinks._delta_arrow), the MERGE's position guard, the truncate's delete before it, a new table created
by a plain append, histories appended under the same Delta transaction ids, so a batch replayed on the other
path is a no-op.

What this path leaves to Spark's, by raising :class:`NotOnDriverError` before it writes: a store that is not a
local directory, a table whose columns this path cannot type, and a date or timestamp outside years 1..9999
in a column Delta keeps statistics for (Spark's path takes it out of the statistics first: sinks._delta_stats).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sinks._api import TableInfo, TableWrite
from sinks._delta_arrow import NotInArrowError, arrow_field, beyond_python, rows_table, spark_type
from sinks._delta_names import create_app, delta_columns, history_app
from sinks._delta_widen import widens
from sinks._values import Names

_STRING_LIST = pa.list_(pa.field("element", pa.string()))


class NotOnDriverError(Exception):
    """This batch goes Spark's path (the reason is logged)."""


def quoted(name: str) -> str:
    """A delta-rs (DataFusion) SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _string(text: str) -> str:
    """A delta-rs (DataFusion) SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


class DeltaWriter:
    """Writes :class:`TableWrite`\\ s to the tables of one warehouse (sinks._warehouse's layout)."""

    def __init__(self, sink: str, history: bool) -> None:
        self.sink, self.history = sink, history

    def write(self, path: str, history_path: str, table: TableWrite) -> bool:
        """Everything is built and checked before the first commit: a batch that must go Spark's path leaves
        nothing behind. True when this write created the table."""
        existing = _table(path)
        target = pa.schema(existing.schema().to_arrow()) if existing is not None else None
        names = target.names if target is not None else []  # the columns' names follow the table's
        source, keys, toasted = self._source(table.info, table.rows, target, names)
        history = self._history(history_path, table, names) if self.history and table.events else None
        if existing is None:
            self._create(path, table, source)
        else:
            self._merge(existing, table=table, source=source, keys=keys, toasted=toasted, target=target)
        if history is not None:
            self._append(history_path, table.info, history)
        return existing is None

    def _source(
        self, info: TableInfo, rows: Sequence[dict[str, Any]], target: pa.Schema | None, existing: Sequence[str]
    ) -> tuple[pa.Table, list[str], dict[str, str]]:
        """``rows`` as the table's columns and ours, cast to ``target``'s types where it has the column; the
        key's columns; the columns some row left unchanged (TOAST), by their fields' names."""
        fields = info.row_schema["fields"]
        delta = delta_columns([f["name"] for f in fields], existing)
        key_names = [f["name"] for f in info.key_schema["fields"]]
        names = Names()
        try:
            typed = [(f["name"], *arrow_field(f["type"], names)) for f in fields]
        except NotInArrowError as exc:
            raise NotOnDriverError(f"{info.name}: {exc}") from exc
        columns: dict[str, tuple[pa.DataType, list[Any]]] = {}
        for name, arrow, conv in typed:
            if name in key_names:
                values = [conv((r["key"] or {}).get(name)) for r in rows]
            else:
                values = [None if r["row"] is None else conv(r["row"].get(name)) for r in rows]
            columns[delta[name]] = (arrow, values)
        applied = int(time.time() * 1000)
        columns["__op"] = (pa.string(), [r["op"] for r in rows])
        columns["__commit_lsn"] = (pa.int64(), [r["commit_lsn"] for r in rows])
        columns["__lsn"] = (pa.int64(), [r["lsn"] for r in rows])
        columns["__ts_ms"] = (pa.int64(), [r["ts_ms"] for r in rows])
        columns["__applied_ms"] = (pa.int64(), [applied] * len(rows))
        columns["__unchanged"] = (_STRING_LIST, [list(r["unchanged"] or ()) for r in rows])
        try:
            source = rows_table(columns)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise NotOnDriverError(f"{info.name}: {exc}") from exc
        for name, _, _ in typed:
            if beyond_python(source.column(delta[name]).combine_chunks()):
                raise NotOnDriverError(f"{info.name}: column {delta[name]} holds a date beyond years 1..9999")
        source = _cast_to(source, target, info.name)
        toasted = {delta[u]: u for r in rows for u in (r["unchanged"] or ()) if u in delta}  # column -> field
        return source, [delta[k] for k in key_names], toasted

    def _create(self, path: str, table: TableWrite, source: pa.Table) -> None:
        """As Spark's path creates a table: its non-delete rows appended, under the create's transaction id."""
        from deltalake import CommitProperties, Transaction, write_deltalake

        info = table.info
        rows = source.filter(pc.not_equal(source.column("__op"), "d")).drop_columns(["__unchanged"])
        app = create_app(self.sink, info.name, info.generation)
        write_deltalake(
            path,
            rows,
            mode="append",
            commit_properties=CommitProperties(app_transactions=[Transaction(app, info.batch_id)]),
        )

    def _merge(
        self,
        existing: Any,
        *,
        table: TableWrite,
        source: pa.Table,
        keys: list[str],
        toasted: dict[str, str],
        target: pa.Schema | None,
    ) -> None:
        from deltalake import DeltaTable, Field, Schema

        assert target is not None
        added = [f for f in source.schema if f.name not in target.names and f.name != "__unchanged"]
        if added:  # ALTER TABLE ADD COLUMN at the source: the table gains the column (older rows: null)
            fields = Schema.from_arrow(pa.schema(added)).fields
            existing.alter.add_columns([Field(f.name, f.type, nullable=True) for f in fields])
            existing = DeltaTable(existing.table_uri)
        if table.truncate is not None:
            c, lsn = table.truncate
            existing.delete(f'"__commit_lsn" < {c} OR ("__commit_lsn" = {c} AND "__lsn" < {lsn})')
        if source.num_rows == 0:
            return
        newer = "(s.__commit_lsn > t.__commit_lsn OR (s.__commit_lsn = t.__commit_lsn AND s.__lsn >= t.__lsn))"
        data = [n for n in source.column_names if n != "__unchanged"]
        kept = {
            quoted(c): (
                f"CASE WHEN array_has(s.__unchanged, {_string(toasted[c])}) THEN t.{quoted(c)} ELSE s.{quoted(c)} END"
                if c in toasted
                else f"s.{quoted(c)}"
            )
            for c in data
        }
        inserted = {quoted(c): f"s.{quoted(c)}" for c in data}
        (
            existing.merge(
                source,
                " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in keys),
                source_alias="s",
                target_alias="t",
            )
            .when_matched_delete(f"s.__op = 'd' AND (s.__commit_lsn IS NULL OR {newer})")
            .when_matched_update(kept, f"s.__op <> 'd' AND {newer}")
            .when_not_matched_insert(inserted, "s.__op <> 'd'")
            .execute()
        )

    def _history(self, path: str, table: TableWrite, existing: Sequence[str]) -> pa.Table | None:
        """The batch's events as the history's rows; None when this batch's history is there already (Delta's
        transaction id of the table's history = the batch id, as Spark's path writes it)."""
        info = table.info
        history = _table(path)
        if history is not None:
            done = history.transaction_version(history_app(self.sink, info.name, info.generation))
            if done is not None and done >= info.batch_id:
                return None
        target = pa.schema(history.schema().to_arrow()) if history is not None else None
        return self._source(info, table.events or (), target, existing)[0]

    def _append(self, path: str, info: TableInfo, events: pa.Table) -> None:
        from deltalake import CommitProperties, Transaction, write_deltalake

        app = Transaction(history_app(self.sink, info.name, info.generation), info.batch_id)
        write_deltalake(
            path, events, mode="append", schema_mode="merge", commit_properties=CommitProperties(app_transactions=[app])
        )


def _table(path: str) -> Any:
    """The Delta table at ``path``, or None."""
    from deltalake import DeltaTable

    return DeltaTable(path) if DeltaTable.is_deltatable(path) else None


def _cast_to(source: pa.Table, target: pa.Schema | None, table: str) -> pa.Table:
    """The columns the table has, in its types (struct fields, list items named as Delta names them)."""
    if target is None:
        return source
    columns = []
    for name in source.column_names:
        array = source.column(name)
        if name in target.names and array.type != target.field(name).type:
            if _widened(target.field(name).type, array.type):
                raise NotOnDriverError(
                    f"{table}: column {name} widened at the source ({target.field(name).type} in Delta, "
                    f"{array.type} now): Spark's path rewrites the table with it"
                )
            try:
                array = array.cast(target.field(name).type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise NotOnDriverError(f"{table}: column {name} is {target.field(name).type} in Delta: {exc}") from exc
        columns.append(array)
    return pa.table(columns, names=source.column_names)


def _widened(stored: pa.DataType, now: pa.DataType) -> bool:
    """A number's or a timestamp's type the source widened (sinks._delta_widen)."""
    scalar = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_timestamp, pa.types.is_struct)
    if not any(test(stored) and test(now) for test in scalar):
        return False
    try:
        return widens(spark_type(stored), spark_type(now))
    except NotInArrowError:  # a type the sinks never write (int8, int16): not theirs to widen
        return False
