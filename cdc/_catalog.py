"""Reading what capture needs from PostgreSQL's catalogs: tables, their keys, and column types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from schemas import PgType


@dataclass(frozen=True, slots=True)
class ColumnInfo:
    name: str
    type_oid: int
    typmod: int
    not_null: bool
    attnum: int


@dataclass(frozen=True, slots=True)
class TableInfo:
    """A table as the catalogs describe it right now."""

    oid: int
    schema: str
    name: str
    columns: tuple[ColumnInfo, ...]
    primary_key: tuple[str, ...]
    replica_identity: str  # 'd' default (primary key), 'n' nothing, 'f' full, 'i' index
    identity_columns: tuple[str, ...]  # the columns PostgreSQL logs as the old key for updates/deletes
    relkind: str
    # The publication's row filter (SQL over the table's columns), which every reader of the table adds to its
    # conditions; ``columns`` are then the published ones only (cdc._published).
    row_filter: str | None = None

    @property
    def qualified(self) -> str:
        """'schema.table', parts quoted when they hold a dot or a quote: unambiguous, and what config uses."""
        return qualified_name(self.schema, self.name)

    def ident(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.name))


def qualified_name(schema: str, table: str) -> str:
    """'schema.table', each part quoted when it holds a dot or a quote (so the result is unambiguous)."""
    return f"{_part(schema)}.{_part(table)}"


def _part(name: str) -> str:
    return name if name and "." not in name and '"' not in name else '"' + name.replace('"', '""') + '"'


def load_table(conn: psycopg.Connection[Any], schema: str, table: str) -> TableInfo | None:
    """The table's description, or None when there is no such table."""
    row = conn.execute(
        """
        SELECT c.oid, c.relreplident, c.relkind
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
        """,
        (schema, table),
    ).fetchone()
    if row is None:
        return None
    oid, replident, relkind = row
    columns = tuple(
        ColumnInfo(name, type_oid, typmod, not_null, attnum)
        for name, type_oid, typmod, not_null, attnum in conn.execute(
            """
            SELECT attname, atttypid, atttypmod, attnotnull, attnum FROM pg_attribute
            WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
            ORDER BY attnum
            """,
            (oid,),
        ).fetchall()
    )
    primary_key = _index_columns(conn, oid, "indisprimary")
    identity = primary_key if replident == "d" else ()
    if replident == "i":
        identity = _index_columns(conn, oid, "indisreplident")
    elif replident == "f":
        identity = tuple(c.name for c in columns)
    return TableInfo(oid, schema, table, columns, primary_key, replident, identity, relkind)


def _index_columns(conn: psycopg.Connection[Any], table_oid: int, flag: str) -> tuple[str, ...]:
    query = sql.SQL(
        """
        SELECT a.attname FROM pg_index i
        CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = %s AND i.{}
        ORDER BY k.ord
        """
    ).format(sql.Identifier(flag))
    return tuple(r[0] for r in conn.execute(query, (table_oid,)).fetchall())


class TypeResolver:
    """Builds PgType descriptions from pg_type and friends, caching them for the connection's life."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._cache: dict[int, PgType] = {}

    def invalidate(self, oid: int | None = None) -> None:
        """Forget one type (after a Type message says it changed) or all of them."""
        if oid is None:
            self._cache.clear()
        else:
            self._cache.pop(oid, None)

    def column_numbers(self, table_oid: int) -> dict[str, tuple[int, int]]:
        """The table's live columns' (attnum, type oid) by name, as the catalogs say now."""
        rows = self._conn.execute(
            "SELECT attname, attnum, atttypid FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped",
            (table_oid,),
        ).fetchall()
        return {name: (attnum, type_oid) for name, attnum, type_oid in rows}

    def resolve(self, oid: int) -> PgType:
        cached = self._cache.get(oid)
        if cached is not None:
            return cached
        row = self._conn.execute(
            """
            SELECT t.typname, n.nspname, t.typtype, t.typcategory, t.typelem, t.typbasetype, t.typtypmod,
                   t.typdelim, t.typrelid, t.typlen
            FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = %s
            """,
            (oid,),
        ).fetchone()
        if row is None:
            raise LookupError(f"type oid {oid} is not in pg_type")
        name, namespace, typtype, category, elem, basetype, typtypmod, delim, relid, typlen = row
        pgtype: PgType
        if category == "A" and elem and typlen == -1:
            pgtype = PgType(oid, name, namespace, "array", element=self.resolve(elem), delimiter=delim)
        elif typtype == "d":
            pgtype = PgType(oid, name, namespace, "domain", base=self.resolve(basetype), base_typmod=typtypmod)
        elif typtype == "e":
            labels = tuple(
                r[0]
                for r in self._conn.execute(
                    "SELECT enumlabel FROM pg_enum WHERE enumtypid = %s ORDER BY enumsortorder", (oid,)
                ).fetchall()
            )
            pgtype = PgType(oid, name, namespace, "enum", labels=labels)
        elif typtype == "c":
            attrs = self._conn.execute(
                """
                SELECT attname, atttypid, atttypmod FROM pg_attribute
                WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum
                """,
                (relid,),
            ).fetchall()
            fields = tuple((a, self.resolve(t), m) for a, t, m in attrs)
            pgtype = PgType(oid, name, namespace, "composite", fields=fields)
        elif typtype == "r":
            (sub,) = self._must(
                self._conn.execute("SELECT rngsubtype FROM pg_range WHERE rngtypid = %s", (oid,)).fetchone(), oid
            )
            pgtype = PgType(oid, name, namespace, "range", element=self.resolve(sub))
        elif typtype == "m":
            (sub,) = self._must(
                self._conn.execute("SELECT rngsubtype FROM pg_range WHERE rngmultitypid = %s", (oid,)).fetchone(),
                oid,
            )
            pgtype = PgType(oid, name, namespace, "multirange", element=self.resolve(sub))
        elif typtype == "p":
            pgtype = PgType(oid, name, namespace, "pseudo")
        else:
            pgtype = PgType(oid, name, namespace, "base")
        self._cache[oid] = pgtype
        return pgtype

    @staticmethod
    def _must(row: tuple[Any, ...] | None, oid: int) -> tuple[Any, ...]:
        if row is None:
            raise LookupError(f"type oid {oid} has no pg_range entry")
        return row
