"""The sql sink's store contract on real databases (a second PostgreSQL database, a SQLite file, a MariaDB
database), without Spark:
the position guard, deletes, truncates, unchanged TOAST, every column kind both ways, schema changes,
generations and their swap, and the read-back verify uses. Each store is read back with its plain client
(psycopg, sqlite3, PyMySQL) as well as through the sink."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sinks import Change, SinkContext, TableInfo, TableRef
from sinks._sql import SqlSink, check_dialect, plan_migration, sqlalchemy_url
from sinks._sqltypes import ColumnKind
from sinks.errors import SinkConfigError
from tests.integration._capture_helpers import mariadb_rows, scratch_database, scratch_mariadb

pytestmark = pytest.mark.integration

TABLE = "public.items"
KEY_SCHEMA = {
    "type": "record",
    "name": "Key",
    "namespace": "t.public.items",
    "fields": [{"name": "id", "type": "long"}],
}


def _row_schema(*fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "record", "name": "Value", "namespace": "t.public.items", "fields": list(fields)}


ID = {"name": "id", "type": "long"}
NAME = {"name": "name", "type": ["null", "string"], "default": None}
BODY = {"name": "body", "type": ["null", "string"], "default": None}
QTY = {"name": "qty", "type": ["null", "int"], "default": None}
ROW = _row_schema(ID, NAME, BODY)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def url(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'views.db'}"
        return
    if request.param == "mariadb":
        with scratch_mariadb(request.getfixturevalue("mariadb_url"), f"sqlsink_{unique}") as url:
            yield url
        return
    pg_dsn = request.getfixturevalue("pg_dsn")
    with scratch_database(pg_dsn, f"sqlsink_{unique}") as dsn:
        yield sqlalchemy_url(dsn)


def _sink(url: str) -> SqlSink:
    sink = SqlSink()
    settings: Any = SimpleNamespace(sinks=SimpleNamespace(swap_grace_s=0.0))
    sink.open(SinkContext("sql", settings, {"url": url}, 1, None))  # type: ignore[arg-type]
    return sink


def _change(
    key: int,
    row: dict[str, Any] | None,
    pos: tuple[int, int] | None,
    *,
    unchanged: tuple[str, ...] = (),
    offset: int = 0,
) -> Change:
    op = "d" if row is None else "u"
    commit, lsn = pos if pos is not None else (None, None)
    return Change({"id": key}, row, op, commit, lsn, 1_700_000_000_000, unchanged, 0, offset)


def _write(sink: SqlSink, changes: list[Change], row_schema: dict[str, Any] = ROW, generation: int = 1) -> list[Any]:
    info = TableInfo("t.public.items", TABLE, KEY_SCHEMA, row_schema, generation, 0)
    sink.prepare([info])
    return list(sink.partition_writer().write(info, iter(changes)))


def _served(sink: SqlSink) -> None:
    sink.prepare_generation(1)
    sink.swap(1)


def _view(url: str, columns: str = "id, name, body") -> list[tuple[Any, ...]]:
    """The served view, read with the database's plain client (not through SQLAlchemy)."""
    query = f'SELECT {columns} FROM "public.items" ORDER BY id'
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return list(conn.execute(query).fetchall())
    parsed = sa.engine.make_url(url)
    if url.startswith("mariadb"):
        return mariadb_rows(url, query)
    with psycopg.connect(
        host=parsed.host, port=parsed.port, user=parsed.username, password=parsed.password, dbname=parsed.database
    ) as conn:
        return list(conn.execute(query).fetchall())


def test_a_late_or_replayed_change_never_moves_a_row_backwards(url: str) -> None:
    sink = _sink(url)
    try:
        _served(sink)
        _write(sink, [_change(1, {"id": 1, "name": "new", "body": "b"}, (10, 5))])
        _write(sink, [_change(1, {"id": 1, "name": "old", "body": "b"}, (9, 99))])  # older commit
        _write(sink, [_change(1, {"id": 1, "name": "older", "body": "b"}, (10, 4))])  # same commit, earlier
        assert _view(url) == [(1, "new", "b")]
        _write(sink, [_change(1, {"id": 1, "name": "new", "body": "b"}, (10, 5))])  # the same event again
        _write(sink, [_change(1, None, (9, 1))])  # an older delete
        assert _view(url) == [(1, "new", "b")]
        _write(sink, [_change(1, {"id": 1, "name": "newer", "body": "c"}, (11, 1))])
        assert _view(url) == [(1, "newer", "c")]
        _write(sink, [_change(1, None, (12, 1)), _change(2, {"id": 2, "name": "x", "body": None}, (12, 2))])
        assert _view(url) == [(2, "x", None)]
        _write(sink, [_change(2, None, None)])  # a delete known from a tombstone alone
        assert _view(url) == []
    finally:
        sink.close()


def test_a_key_twice_in_one_write_keeps_its_newest_change(url: str) -> None:
    sink = _sink(url)
    try:
        _served(sink)
        newer, older = (
            _change(1, {"id": 1, "name": "newer", "body": "b"}, (10, 6)),
            _change(1, {"id": 1, "name": "older", "body": "b"}, (10, 5)),
        )
        _write(sink, [newer, older])
        assert _view(url) == [(1, "newer", "b")]
        _write(
            sink,
            [
                _change(1, {"id": 1, "name": "old", "body": "b"}, (11, 1)),
                _change(1, {"id": 1, "name": "new", "body": "c"}, (11, 2)),
            ],
        )
        assert _view(url) == [(1, "new", "c")]
    finally:
        sink.close()


def test_unchanged_toast_keeps_the_stored_value_and_a_truncate_removes_what_is_older(url: str) -> None:
    sink = _sink(url)
    try:
        _served(sink)
        _write(sink, [_change(k, {"id": k, "name": f"n{k}", "body": "long text"}, (10, k)) for k in (1, 2, 3)])
        partial = _change(1, {"id": 1, "name": "renamed", "body": None}, (11, 1), unchanged=("body",))
        _write(sink, [partial])
        assert _view(url)[0] == (1, "renamed", "long text")
        info = TableInfo("t.public.items", TABLE, KEY_SCHEMA, ROW, 1, 0)
        truncate = Change({}, None, "t", 10, 50, 0, (), 0, 9)
        list(sink.partition_writer().write(info, iter([truncate])))
        assert _view(url) == [(1, "renamed", "long text")]  # written after the truncate's position
    finally:
        sink.close()


KINDS = _row_schema(
    ID,
    {"name": "flag", "type": ["null", "boolean"]},
    {"name": "small", "type": ["null", "int"]},
    {"name": "real", "type": ["null", "float"]},
    {"name": "dbl", "type": ["null", "double"]},
    {
        "name": "price",
        "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}, "string"],
    },
    {"name": "raw", "type": ["null", "bytes"]},
    {"name": "day", "type": ["null", {"type": "int", "logicalType": "date"}]},
    {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    {"name": "local", "type": ["null", {"type": "long", "logicalType": "local-timestamp-micros"}]},
    {"name": "tod", "type": ["null", {"type": "long", "logicalType": "time-micros"}]},
    {"name": "tags", "type": ["null", {"type": "array", "items": ["null", "string"]}]},
    {"name": "Odd name.%", "type": ["null", "string"], "pgcdc.column": "Odd name.%"},
)


def test_every_column_kind_reads_back_as_its_document_form(url: str) -> None:
    doc: dict[str, Any] = {
        "id": 1,
        "flag": True,
        "small": -7,
        "real": 1.5,
        "dbl": "Infinity",
        "price": "12.50",
        "raw": "AAEC/w==",
        "day": "2024-02-29",
        "at": "2024-02-29T23:59:59.123456Z",
        "local": "0001-01-01T00:00:00.000000",
        "tod": "13:14:15.000001",
        "tags": ["a", None],
        "Odd name.%": "yes",
    }
    nulls: dict[str, Any] = {k: None for k in doc} | {"id": 2}
    # PostgreSQL's edges, which Python's date and time have no room for: every one is kept.
    edges = {
        **doc,
        "id": 3,
        "real": "NaN",
        "dbl": "-Infinity",
        "price": "NaN",
        "day": "infinity",
        "at": -62_198_755_200_000_000,  # 1 January 2 BC (µs since 1970: ISO 8601 cannot print it)
        "local": "-infinity",
        "tod": "24:00:00.000000",
    }
    far = {**doc, "id": 4, "day": 2_932_897, "at": "infinity", "local": 253_402_300_800_000_000}  # years past 9999
    rows: tuple[dict[str, Any], ...] = (doc, nulls, edges, far)
    refused: tuple[dict[str, Any], ...] = ()
    if url.startswith("mariadb"):
        # Narrower types: each value outside them sends its change to the dead letters, saying why; the rest is
        # kept, floats exactly (0.1 as a real, 0.1 + 0.2 as a double) and 24:00:00 too.
        doc = {**doc, "real": 0.10000000149011612, "dbl": 0.1 + 0.2, "local": "1000-01-01T00:00:00.000000"}
        midnight = {**doc, "id": 5, "tod": "24:00:00.000000"}
        rows = (doc, nulls, midnight)
        bad = {"real": "NaN", "price": "NaN", "day": "infinity", "at": edges["at"], "local": far["local"]}
        refused = tuple({**doc, "id": 10 + i, name: value} for i, (name, value) in enumerate(bad.items()))
    sink = _sink(url)
    try:
        _served(sink)
        changes = [_change(r["id"], r, (10, r["id"]), offset=100 + r["id"]) for r in (*rows, *refused)]
        rejected = _write(sink, changes, KINDS)
        assert sorted((r.offset, r.error.split(":")[0]) for r in rejected) == [(100 + r["id"], "sql") for r in refused]
        assert all("MariaDB's" in r.error for r in rejected), [r.error for r in rejected]
        ref = TableRef("t.public.items", TABLE, ("id",), KINDS)
        back = dict(sink.read_table(ref, 1))
        assert back == {f"[{r['id']}]": r for r in rows}
        parts = sink.read_parts(ref, 1, 4)
        assert sorted(k for part in parts for k, _ in part()) == sorted(back)
        if url.startswith("postgresql"):  # stored as PostgreSQL's own values, as its plain client sees them
            seen = _view(url, "id, day::text, at::text, tod::text, real::text")
            assert seen[2] == (3, "infinity", "0002-01-01 00:00:00+00 BC", "24:00:00", "NaN")
        if url.startswith("mariadb"):  # as MariaDB's own types, as its plain client sees them
            seen = _view(url, "id, CAST(day AS CHAR), CAST(at AS CHAR), CAST(price AS CHAR), dbl, CAST(tod AS CHAR)")
            assert seen[0] == (1, "2024-02-29", "2024-02-29 23:59:59.123456", "12.50", 0.1 + 0.2, "13:14:15.000001")
            assert seen[2][5] == "24:00:00.000000"
    finally:
        sink.close()


def test_a_row_the_database_refuses_goes_to_the_dead_letters_and_the_others_are_written(
    unique: str, pg_dsn: str
) -> None:
    with scratch_database(pg_dsn, f"sqlsink_{unique}") as dsn:
        url = sqlalchemy_url(dsn)
        sink = _sink(url)
        try:
            _served(sink)
            price = _row_schema(ID, KINDS["fields"][5])  # numeric(12,2)
            good, bad = {"id": 1, "price": "1.50"}, {"id": 2, "price": "1" + "0" * 20}
            rejected = _write(sink, [_change(1, good, (10, 1), offset=7), _change(2, bad, (10, 2), offset=8)], price)
            assert [(r.topic, r.offset) for r in rejected] == [("t.public.items", 8)]
            assert "numeric field overflow" in rejected[0].error
            assert _view(url, "id, price") == [(1, Decimal("1.50"))]
        finally:
            sink.close()


def test_mariadb_writes_fit_its_packet_limit_and_a_row_past_it_is_a_dead_letter(mariadb_url: str, unique: str) -> None:
    """MariaDB drops the connection of a statement past max_allowed_packet (16 MiB here), and a retry would meet
    the same: large rows go in INSERTs of a few MiB (here one each), and a row no INSERT can carry goes to the dead
    letters."""
    with scratch_mariadb(mariadb_url, f"sqlsink_{unique}") as url:
        sink = _sink(url)
        try:
            _served(sink)
            big = [_change(k, {"id": k, "name": f"n{k}", "body": str(k) * (6 << 20)}, (10, k)) for k in (1, 2, 3)]
            huge = _change(4, {"id": 4, "name": "n4", "body": "4" * (12 << 20)}, (10, 4), offset=44)
            rejected = _write(sink, [*big, huge])
            assert [(r.offset, "max_allowed_packet" in r.error) for r in rejected] == [(44, True)], rejected
            assert _view(url, "id, name, length(body)") == [(k, f"n{k}", 6 << 20) for k in (1, 2, 3)]
        finally:
            sink.close()


def test_schema_changes_add_drop_and_rename_columns_behind_the_view(url: str) -> None:
    sink = _sink(url)
    try:
        _served(sink)
        _write(sink, [_change(1, {"id": 1, "name": "a", "body": "b"}, (10, 1))])
        with_qty = _row_schema(ID, NAME, BODY, QTY)
        _write(sink, [_change(2, {"id": 2, "name": "c", "body": "d", "qty": 3}, (11, 1))], with_qty)
        assert _view(url, "id, name, body, qty") == [(1, "a", "b", None), (2, "c", "d", 3)]
        renamed = _row_schema(ID, {**NAME, "name": "title"}, BODY, QTY)  # name -> title, in place
        _write(sink, [_change(3, {"id": 3, "title": "e", "body": "f", "qty": 4}, (12, 1))], renamed)
        assert _view(url, "id, title, body, qty") == [(1, "a", "b", None), (2, "c", "d", 3), (3, "e", "f", 4)]
        dropped = _row_schema(ID, {**NAME, "name": "title"}, QTY)
        _write(sink, [_change(4, {"id": 4, "title": "g", "qty": 5}, (13, 1))], dropped)
        assert _view(url, "*") == [(1, "a", None), (2, "c", 3), (3, "e", 4), (4, "g", 5)]
    finally:
        sink.close()


def test_a_generation_is_built_beside_the_served_one_and_swapped_in(url: str) -> None:
    sink = _sink(url)
    try:
        _served(sink)
        _write(sink, [_change(1, {"id": 1, "name": "served", "body": None}, (10, 1))])
        sink.prepare_generation(2)
        _write(sink, [_change(1, {"id": 1, "name": "rebuilt", "body": None}, (10, 1))], generation=2)
        assert _view(url) == [(1, "served", None)]  # readers see the served copy until the swap
        sink.swap(2)
        assert sink.current_generation() == 2
        assert _view(url) == [(1, "rebuilt", None)]
        ref = TableRef("t.public.items", TABLE, ("id",), ROW)
        assert list(sink.read_table(ref, 1)) == []  # the replaced copy is gone
    finally:
        sink.close()


def test_unsupported_dialects_are_refused_with_the_supported_ones() -> None:
    with pytest.raises(SinkConfigError, match=r"'mssql' dialect; the sql sink supports postgresql, sqlite, mariadb"):
        check_dialect("mssql+pyodbc://user:secret@host/db")
    with pytest.raises(SinkConfigError, match=r"tested on MariaDB \(mariadb\+pymysql://…\), not on MySQL"):
        check_dialect("mysql+pymysql://user:secret@host/db")
    with pytest.raises(SinkConfigError, match=r"sinks\.sql\.url is not set"):
        _sink("")


def test_the_migration_rules() -> None:
    text, long = ColumnKind("text"), ColumnKind("long")
    old = [("id", long), ("name", text), ("body", text)]
    assert plan_migration(old, [("id", long), ("title", text), ("body", text)]).renames == [("name", "title")]
    added = plan_migration(old, [*old, ("qty", long)])
    assert (added.renames, added.drops, [c for c, _ in added.adds]) == ([], [], ["qty"])
    retyped = plan_migration(old, [("id", long), ("name", long), ("body", text)])
    assert (retyped.drops, [c for c, _ in retyped.adds]) == (["name"], ["name"])
    moved = plan_migration(old, [("id", long), ("body", text), ("title", text)])
    assert (moved.renames, moved.drops, [c for c, _ in moved.adds]) == ([], ["name"], ["title"])
