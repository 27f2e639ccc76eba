"""Hostile PostgreSQL identifiers and tables built from them, for the property tests of test_hostile_names.py.

Names hold double and single quotes, spaces, backslashes, ``%``, ``;``, dots, tabs and newlines, accents, CJK
and emoji (within PostgreSQL's 63-byte limit; NUL is never allowed), reserved words, mixed case and leading
digits; tables get columns whose names differ only in case, and keys of one or two hostile columns.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from hypothesis import strategies as st
from psycopg import sql
from psycopg.types.json import Jsonb

MAX_IDENT_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL truncates longer names (and says so with a NOTICE)
RESERVED = ("select", "user", "order", "table", "from", "group", "SELECT", "Order", "null", "all")
_ALPHABET = [*"\"' \\%;.$:{}*?[]-/,#\t\n", *"éßİ中文字😀🐘", *"aAbBzZ019_"]
# The column types: enough to see every kind of value go through with hostile names around it.
TYPES = ("int", "text", "numeric(12,3)", "timestamptz", "jsonb", "bytea")
KEY_TYPES = ("int", "text", "numeric(12,3)", "timestamptz", "bytea")


def _fits(name: str) -> bool:
    return 0 < len(name.encode()) <= MAX_IDENT_BYTES and "\x00" not in name


identifiers = (
    st.lists(
        st.one_of(st.sampled_from(RESERVED), st.text(alphabet=st.sampled_from(_ALPHABET), min_size=1, max_size=6)),
        min_size=1,
        max_size=4,
    )
    .map("".join)
    .filter(_fits)
)
# PostgreSQL reserves schema names starting with pg_ for itself; public is shared by every test.
schema_names = identifiers.filter(lambda s: not s.startswith("pg_") and s not in ("public", "information_schema"))


@dataclass(frozen=True)
class Column:
    name: str
    type: str


@dataclass(frozen=True)
class Table:
    schema: str
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]  # column names, in key order

    @property
    def config_name(self) -> str:
        """How source.tables names it: both parts quoted, quotes doubled (docs/configuration.md)."""
        return f"{_quote(self.schema)}.{_quote(self.name)}"

    def ident(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.name))

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@st.composite
def tables(draw: st.DrawFn, schema: str, name: str) -> Table:
    names = draw(st.lists(identifiers, min_size=1, max_size=5, unique=True))
    if draw(st.booleans()):  # a column whose name differs from another only in case
        twin = names[0].swapcase()
        if twin not in names and _fits(twin):
            names.append(twin)
    types = [draw(st.sampled_from(TYPES)) for _ in names]
    nkey = draw(st.integers(1, min(2, len(names))))
    key = draw(st.permutations(range(len(names))))[:nkey]
    for i in key:  # key columns need a type with a btree order; jsonb has one but keep keys to these
        if types[i] not in KEY_TYPES:
            types[i] = draw(st.sampled_from(KEY_TYPES))
    columns = tuple(Column(n, t) for n, t in zip(names, types, strict=True))
    return Table(schema, name, columns, tuple(names[i] for i in key))


def _not_in(taken: set[str]) -> Callable[[str], bool]:
    return lambda name: name not in taken


@st.composite
def table_sets(draw: st.DrawFn, max_tables: int = 3) -> list[Table]:
    """One or two hostile schemas with up to ``max_tables`` tables, names unique per schema."""
    schemas = draw(st.lists(schema_names, min_size=1, max_size=2, unique=True))
    out: list[Table] = []
    seen: set[tuple[str, str]] = set()
    for _ in range(draw(st.integers(1, max_tables))):
        schema = draw(st.sampled_from(schemas))
        name = draw(identifiers.filter(_not_in({n for s, n in seen if s == schema})))
        seen.add((schema, name))
        out.append(draw(tables(schema, name)))
    return out


# --- rows ---------------------------------------------------------------------------------------------

_TEXT = "v{i} '\"\\ %s ; é 中 😀\t\n\\N"


def value(type_: str, i: int, *, key: bool) -> Any:
    """A deterministic value of ``type_`` for row ``i`` (non-key columns are null every fourth row)."""
    if not key and i % 4 == 3:
        return None
    match type_:
        case "int":
            return i * 7 + 1
        case "text":
            return _TEXT.format(i=i)
        case "numeric(12,3)":
            return Decimal(i) + Decimal("0.125")
        case "timestamptz":
            return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i, microseconds=i)
        case "jsonb":
            return Jsonb({"k": i, "q": "\"'\\", "ü": [i, None]})
        case "bytea":
            return bytes([i % 256, 0, 255]) + b"\\'\""
    raise AssertionError(type_)


def create(conn: psycopg.Connection[Any], tables_: Sequence[Table]) -> None:
    for schema in dict.fromkeys(t.schema for t in tables_):
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    for t in tables_:
        cols = [sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.type)) for c in t.columns]
        key = sql.SQL(", ").join(sql.Identifier(k) for k in t.key)
        conn.execute(sql.SQL("CREATE TABLE {} ({}, PRIMARY KEY ({}))").format(t.ident(), sql.SQL(", ").join(cols), key))


def insert(conn: psycopg.Connection[Any], table: Table, rows: range) -> None:
    for i in rows:
        conn.execute(
            sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                table.ident(),
                sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns),
                sql.SQL(", ").join(sql.Literal(value(c.type, i, key=c.name in table.key)) for c in table.columns),
            )
        )


# Values are inlined as literals, never passed as parameters: psycopg looks for %s placeholders in the whole
# query text, quoted identifiers included, so a column named "1st %s col" would take a parameter's place.
def _assign(names: Sequence[str], values: Sequence[Any]) -> sql.Composed:
    return sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(n), sql.Literal(v)) for n, v in zip(names, values, strict=True)
    )


def _where_key(table: Table, i: int) -> sql.Composed:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v))
        for k, v in zip(table.key, key_of(table, i), strict=True)
    )


def key_of(table: Table, i: int) -> list[Any]:
    return [value(table.column(k).type, i, key=True) for k in table.key]


def stream_changes(conn: psycopg.Connection[Any], table: Table, *, first: int, count: int) -> None:
    """After a snapshot of rows ``0..first-1``: inserts, an update of every column, a key update, a delete."""
    insert(conn, table, range(first, first + count))
    others = [c for c in table.columns if c.name not in table.key]
    if others:
        conn.execute(
            sql.SQL("UPDATE {} SET {} WHERE {}").format(
                table.ident(),
                _assign([c.name for c in others], [value(c.type, 100, key=False) for c in others]),
                _where_key(table, 1),
            )
        )
    # Row 2 moves to key 1000 (a delete of the old key and an insert of the new one in the topic).
    conn.execute(
        sql.SQL("UPDATE {} SET {} WHERE {}").format(
            table.ident(), _assign(table.key, key_of(table, 1000)), _where_key(table, 2)
        )
    )
    conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(table.ident(), _where_key(table, 0)))


def source_rows(conn: psycopg.Connection[Any], table: Table) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The table now: key values (in key order) -> {column name: value}; jsonb as its text, as Avro has it."""
    cols = [
        sql.SQL("{}::text").format(sql.Identifier(c.name)) if c.type == "jsonb" else sql.Identifier(c.name)
        for c in table.columns
    ]
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in conn.execute(sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(cols), table.ident())).fetchall():
        row = {c.name: v for c, v in zip(table.columns, r, strict=True)}
        out[tuple(row[k] for k in table.key)] = row
    return out
