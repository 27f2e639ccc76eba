"""The comparison behind `cdc verify` (sinks._verify), on Spark: counts, samples and the list of every key found,
with each way a store is read back (parts in tasks, read_table on the driver), over a source split in ranges."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pyspark import cloudpickle

from cdc import KeyRange
from sinks import TableRef
from sinks._storage import StorageConfig, location
from sinks._verify import SAMPLE, compare, key_texts
from tests.integration._sinks_helpers import SPARK_WORKER

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# The fakes below run in Spark's Python workers, which need not import this module: they travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]

pytestmark = SPARK_WORKER


_SCHEMA = {
    "type": "record",
    "name": "Value",
    "fields": [{"name": "id", "type": "int"}, {"name": "v", "type": ["null", "double"]}],
}


@dataclass
class _Source:
    """A source table as cdc.source_tables describes it (raw Avro values by field name)."""

    values: dict[int, float | None]
    topic: str = "p.public.t"
    qualified: str = "public.t"
    key_fields: tuple[str, ...] = ("id",)
    row_schema: dict[str, Any] = field(default_factory=lambda: _SCHEMA)

    unencodable: list[Any] = field(default_factory=list)  # rows with no event, as cdc.UnencodableRow

    @contextmanager
    def snapshot(self) -> Iterator[tuple[None, str]]:
        yield None, "the snapshot"

    def ranges(self, conn: None, parts: int, *, min_rows: int = 1) -> list[KeyRange]:
        return [KeyRange(None, ("50",)), KeyRange(("50",), None)]  # two tasks, as a split table has

    def rows(
        self,
        unencodable: Callable[[Any], None] | None = None,
        *,
        snapshot: str | None = None,
        within: KeyRange | None = None,
    ) -> Iterator[dict[str, Any]]:
        assert snapshot == "the snapshot"
        assert within is not None
        low = int(within.after[0]) if within.after else None
        high = int(within.upto[0]) if within.upto else None
        for bad in self.unencodable if low is None else ():
            assert unencodable is not None
            unencodable(bad)
        for k, v in sorted(self.values.items()):
            if (low is None or k > low) and (high is None or k <= high):
                yield {"id": k, "v": v}


@dataclass(frozen=True)
class _Unencodable:
    key_text: dict[str, str | None]
    key: dict[str, Any] | None
    error: str


@dataclass
class _Store:
    """A store read back on the driver (read_table only): verify stages it under the state dir."""

    rows: dict[int, dict[str, Any]]

    def read_table(self, ref: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        assert (ref.name, generation) == ("public.t", 3)
        for k, row in self.rows.items():
            yield json.dumps([k]), row


@dataclass(frozen=True)
class _Part:
    rows: tuple[tuple[str, dict[str, Any]], ...]

    def __call__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return iter(self.rows)


@dataclass
class _StoreInParts(_Store):
    """A store read back in executor tasks (sinks.ReadsInParts), one part per key parity."""

    def read_parts(self, ref: TableRef, generation: int, parts: int) -> list[_Part]:
        assert (ref.name, generation) == ("public.t", 3)
        every = [(json.dumps([k]), row) for k, row in self.rows.items()]
        return [_Part(tuple(every[0::2])), _Part(tuple(every[1::2]))]


_STORES = pytest.mark.parametrize("kind", [_Store, _StoreInParts], ids=["read_table", "read_parts"])


def _table_name(topic: str) -> str:
    return topic.removeprefix("p.")


@_STORES
def test_every_difference_is_counted_sampled_and_listed(
    spark: SparkSession, kind: type[_Store], tmp_path: Path
) -> None:
    source = _Source({i: float(i) for i in range(100)})
    store: dict[int, dict[str, Any]] = {i: {"id": i, "v": float(i)} for i in range(100)}
    for i in range(40):  # 40 missing, more than a sample
        del store[i]
    store[100] = {"id": 100, "v": 1.0}  # extra
    store[50]["v"] = 0.5  # different
    store[60]["extra column"] = "a dropped column, still in the store"  # not compared
    source.values[70] = -0.0  # equal to the store's 0.0 as a value, though not as bytes
    store[70]["v"] = 0.0
    reports = location(tmp_path / "state" / "cache" / "verify", StorageConfig())
    (drift,) = compare(spark, kind(store), [source], 3, table_name=_table_name, reports=reports)
    assert drift.counts == {"missing": 40, "extra": 1, "different": 1, "unencodable": 0}
    assert not drift.clean
    assert drift.missing == [json.dumps([i]) for i in sorted(range(40), key=lambda i: json.dumps([i]))][:SAMPLE]
    assert drift.extra == ["[100]"]
    assert drift.different == [("[50]", {"id": 50, "v": 50.0}, {"id": 50, "v": 0.5})]
    listed = [json.loads(line) for line in (tmp_path / "state/cache/verify/public.t.jsonl").read_text().splitlines()]
    assert len(listed) == 42
    # Each key also as PostgreSQL reads it: what a repair hands the capture.
    assert {"kind": "different", "key": "[50]", "columns": {"id": "50"}} in listed
    assert {"kind": "extra", "key": "[100]", "columns": {"id": "100"}} in listed
    assert drift.report == str(tmp_path / "state/cache/verify/public.t.jsonl")


@_STORES
def test_a_clean_comparison_removes_the_last_list(spark: SparkSession, kind: type[_Store], tmp_path: Path) -> None:
    reports = location(tmp_path / "verify", StorageConfig())
    source = _Source({1: 1.0, 2: None})
    (drift,) = compare(spark, kind({1: {"id": 1, "v": 2.0}}), [source], 3, table_name=_table_name, reports=reports)
    assert drift.counts == {"missing": 1, "extra": 0, "different": 1, "unencodable": 0}
    assert (tmp_path / "verify" / "public.t.jsonl").exists()
    (drift,) = compare(
        spark,
        kind({1: {"id": 1, "v": 1.0}, 2: {"id": 2, "v": None}}),
        [source],
        3,
        table_name=_table_name,
        reports=reports,
    )
    assert drift.clean
    assert drift.report is None
    assert not (tmp_path / "verify" / "public.t.jsonl").exists()


@_STORES
def test_a_source_row_with_no_event_is_reported_as_such_not_as_extra(
    spark: SparkSession, kind: type[_Store], tmp_path: Path
) -> None:
    """A row whose value Avro cannot hold has no event (capture.on_unencodable): verify names its key and why,
    and the older version of it the store may still hold is not called extra."""
    source = _Source({1: 1.0})
    late = "timestamp … is beyond what Avro's timestamp-micros can hold"
    source.unencodable = [
        _Unencodable({"id": "2"}, {"id": 2}, f"column 'ts': {late}"),  # the store holds its older version
        _Unencodable({"id": "294276-12-31 23:59:59"}, None, f"column 'id': {late}"),  # the key itself
    ]
    store = {1: {"id": 1, "v": 1.0}, 2: {"id": 2, "v": 2.0}, 3: {"id": 3, "v": 3.0}}
    reports = location(tmp_path / "verify", StorageConfig())
    (drift,) = compare(spark, kind(store), [source], 3, table_name=_table_name, reports=reports)
    assert drift.counts == {"missing": 0, "extra": 1, "different": 0, "unencodable": 2}
    assert drift.extra == ["[3]"]
    assert drift.unencodable == [
        ('{"id": "2"}', f"column 'ts': {late}"),
        ('{"id": "294276-12-31 23:59:59"}', f"column 'id': {late}"),
    ]
    assert not drift.clean
    listed = [json.loads(line) for line in (tmp_path / "verify/public.t.jsonl").read_text().splitlines()]
    assert {"kind": "unencodable", "key": '{"id": "2"}', "error": f"column 'ts': {late}"} in listed


def test_keys_are_listed_as_text_postgresql_reads_as_their_types() -> None:
    fields = [
        {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "raw", "type": "bytes"},
        {"name": "ok", "type": "boolean"},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}},
        {"name": "n_1", "type": "long", "pgcdc.column": "n-1"},
        {"name": "pair", "type": {"type": "record", "name": "Pair", "fields": [{"name": "a", "type": "int"}]}},
    ]
    schema = {"type": "record", "name": "Value", "fields": fields}
    source = _Source({}, key_fields=("at", "raw", "ok", "day", "amount", "n_1"), row_schema=schema)
    columns = key_texts(source)
    key = json.dumps(["2026-01-02T03:04:05.123456Z", "AAH/", True, "infinity", "12.50", 7])
    assert columns(key) == {
        "at": "2026-01-02T03:04:05.123456Z",
        "raw": "\\x0001ff",  # bytea's hex form: base64 in documents
        "ok": "true",
        "day": "infinity",
        "amount": "12.50",
        "n-1": "7",  # the column's name, not the Avro field's
    }
    # A timestamp a document holds as a number (beyond ISO 8601's years) and a composite are not written.
    assert key_texts(source)(json.dumps([1 << 62, "", False, "2026-01-01", "1", 1])) is None
    composite = _Source({}, key_fields=("pair",), row_schema=schema)
    assert key_texts(composite)(json.dumps([{"a": 1}])) is None


def test_a_store_key_that_is_no_key_of_the_table_is_extra_without_columns(spark: SparkSession, tmp_path: Path) -> None:
    """Keys in a store are whatever was written there (a document indexed by hand with its own id): such a key
    is reported as extra, with no columns to repair it by, and verify goes on."""

    class _Odd(_Store):
        def read_table(self, ref: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
            yield from super().read_table(ref, generation)
            for odd in ("not json", '["a", "b"]', '{"id": 1}', "[[[[[[[["):
                yield odd, {"id": 0, "v": None}

    reports = location(tmp_path / "verify", StorageConfig())
    (drift,) = compare(
        spark, _Odd({1: {"id": 1, "v": 1.0}}), [_Source({1: 1.0})], 3, table_name=_table_name, reports=reports
    )
    assert drift.counts["extra"] == 4
    listed = [json.loads(line) for line in (tmp_path / "verify" / "public.t.jsonl").read_text().splitlines()]
    assert all("columns" not in line for line in listed), listed


_FIELDS_SCHEMA = {
    "type": "record",
    "name": "Value",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "v", "type": ["null", "double"]},
        {"name": "m", "type": ["null", {"type": "map", "values": "string"}]},
        {"name": "t", "type": ["null", {"type": "long", "logicalType": "time-micros"}]},
    ],
}
_MIDNIGHT_AFTER = 86_400_000_000  # 24:00:00, which PostgreSQL's time holds and Spark's TIME does not


@dataclass
class _EncodedSource:
    """A source that gives its rows as the capture's encoder writes them (cdc.SourceTable.records)."""

    rows: dict[int, dict[str, Any]]
    unencodable: list[Any] = field(default_factory=list)
    topic: str = "p.public.t"
    qualified: str = "public.t"
    key_fields: tuple[str, ...] = ("id",)
    row_schema: dict[str, Any] = field(default_factory=lambda: _FIELDS_SCHEMA)

    @contextmanager
    def snapshot(self) -> Iterator[tuple[None, str]]:
        yield None, "the snapshot"

    def ranges(self, conn: None, parts: int, *, min_rows: int = 1) -> list[KeyRange]:
        return [KeyRange(None, ("3",)), KeyRange(("3",), None)]

    def records(self, *, snapshot: str, within: KeyRange) -> Iterator[tuple[list[bytes], list[Any]]]:
        import io

        import fastavro

        assert snapshot == "the snapshot"
        low = int(within.after[0]) if within.after else None
        high = int(within.upto[0]) if within.upto else None
        parsed = fastavro.parse_schema(self.row_schema)
        out = []
        for k, row in sorted(self.rows.items()):
            if (low is None or k > low) and (high is None or k <= high):
                buf = io.BytesIO()
                fastavro.schemaless_writer(buf, parsed, {"id": k, **row})
                out.append(buf.getvalue())
        yield out, list(self.unencodable) if low is None else []


@dataclass
class _FieldsStore:
    """A store Spark reads in the Value record's own columns (sinks.ReadsFields), as the warehouse is."""

    rows: dict[int, dict[str, Any]]

    def read_fields(self, ref: TableRef, generation: int) -> tuple[Any, Any]:
        from pyspark.sql import SparkSession

        from sinks._warehouse import WarehouseRows

        assert (ref.name, generation) == ("public.t", 3)
        spark = SparkSession.getActiveSession()
        assert spark is not None
        rows = [(k, r["v"], r["m"], r["t"]) for k, r in self.rows.items()]
        frame = spark.createDataFrame(rows, "id int, v double, m map<string, string>, t bigint")
        return frame, WarehouseRows(ref.row_schema, ref.key_fields)

    def read_frame(self, ref: TableRef, generation: int) -> tuple[Any, Any]:
        return self.read_fields(ref, generation)


def test_a_store_read_in_its_own_columns_is_compared_in_the_jvm(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The warehouse's way: the source's Avro bytes decoded by Spark and compared with the store's columns in
    the JVM. Maps in another order, -0.0 against 0.0 and 24:00:00 are equal; a changed map value, a missing and
    an extra row are found; a row with no event and the older version the store holds are not called extra."""
    caplog.set_level(logging.INFO, logger="sinks._verify")
    row: Callable[..., dict[str, Any]] = lambda v, m, t: {"v": v, "m": m, "t": t}  # noqa: E731
    source = _EncodedSource(
        {
            1: row(1.0, {"a": "1", "b": "2"}, 5),
            2: row(None, None, None),
            3: row(-0.0, {}, _MIDNIGHT_AFTER),
            4: row(4.0, {"x": "y"}, 1),
            7: row(7.0, None, 7),
        },
        unencodable=[_Unencodable({"id": "5"}, {"id": 5}, "column 't': out of range")],
    )
    store = {
        1: row(1.0, {"b": "2", "a": "1"}, 5),
        2: row(None, None, None),
        3: row(0.0, {}, _MIDNIGHT_AFTER),
        4: row(4.0, {"x": "z"}, 1),
        5: row(5.0, None, 5),  # the unencodable row's older version
        6: row(6.0, None, 6),
    }
    reports = location(tmp_path / "verify", StorageConfig())
    (drift,) = compare(spark, _FieldsStore(store), [source], 3, table_name=_table_name, reports=reports)
    assert "verify: public.t compared in the JVM" in caplog.text
    assert drift.counts == {"missing": 1, "extra": 1, "different": 1, "unencodable": 1}
    assert (drift.missing, drift.extra) == (["[7]"], ["[6]"])
    ((key, want, got),) = drift.different
    assert (key, want["m"], got["m"]) == ("[4]", {"x": "y"}, {"x": "z"})
    assert drift.unencodable == [('{"id": "5"}', "column 't': out of range")]
    listed = [json.loads(line) for line in (tmp_path / "verify" / "public.t.jsonl").read_text().splitlines()]
    assert sorted(line["kind"] for line in listed) == ["different", "extra", "missing", "unencodable"]
