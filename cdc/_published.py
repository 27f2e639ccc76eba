"""What the publication publishes of each captured table: its column list and its row filter (PostgreSQL 15+).

PostgreSQL applies both in the stream: a column not listed never leaves the database (the Relation message
omits it), and a change to a row outside the filter is not sent (an UPDATE that moves a row out of the filter
arrives as a DELETE, one that moves it in as an INSERT). Everything that reads the table itself (the snapshot,
backfills, repairs, `cdc verify`) must read the same: the captured table's description (:class:`TableInfo`)
carries only the published columns and the filter, which those readers add to their conditions.

The publication is the truth. pgcdc writes ``source.columns`` and ``source.row_filters`` into a publication it
created; a publication someone else manages is read as it is, and a configured list or filter it does not match
is refused with the statement that would make it match.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import sql

from cdc._catalog import TableInfo
from cdc.errors import SourceCheckError

_VAR = re.compile(r":varattno (\d+)")  # a column reference in a node tree's text (pg_publication_rel.prqual)


@dataclass(frozen=True, slots=True)
class Published:
    """One table's column list (None: every column) and row filter (None: every row)."""

    columns: tuple[str, ...] | None = None
    row_filter: str | None = None
    asked: bool = False  # the configuration names the table (source.columns or source.row_filters)
    exact: bool = True  # row_filter is as PostgreSQL writes it back, so it compares with a publication's

    @property
    def everything(self) -> bool:
        return self.columns is None and self.row_filter is None


def configured(
    columns: Mapping[tuple[str, str], Sequence[str]], filters: Mapping[tuple[str, str], str], info: TableInfo
) -> Published:
    """What the configuration asks of a table; SourceCheckError for a column it does not have."""
    listed = columns.get((info.schema, info.name))
    if listed is not None:
        have = {c.name for c in info.columns}
        unknown = [c for c in listed if c not in have]
        if unknown:
            raise SourceCheckError(
                f"source.columns for {info.qualified} names {', '.join(map(repr, unknown))}, which it does not "
                f"have (its columns: {', '.join(sorted(have))}); fix the list",
                check="publication-columns",
            )
    row_filter = filters.get((info.schema, info.name))
    asked = listed is not None or row_filter is not None
    return Published(tuple(listed) if listed is not None else None, row_filter, asked=asked)


def check_columns(info: TableInfo, wanted: Published, key: Sequence[str]) -> None:
    """A column list keeps the key and every replica identity column: without them the stream could not say
    which row changed, and PostgreSQL refuses the table's UPDATEs and DELETEs."""
    if wanted.columns is None:
        return
    needed = list(dict.fromkeys([*key, *info.identity_columns]))
    missing = [c for c in needed if c not in wanted.columns]
    if missing:
        raise SourceCheckError(
            f"source.columns for {info.qualified} leaves out {', '.join(map(repr, missing))}, a key or replica "
            "identity column (every row event needs it, and PostgreSQL would refuse the table's UPDATE and "
            "DELETE); add it to the list",
            check="publication-columns",
        )


def check_masks(info: TableInfo, wanted: Published, key: Sequence[str], masks: Mapping[str, str]) -> None:
    """A mask names a published column that is not a key column: a masked key could not say which row changed
    (two rows could even share a masked value's place), and a column not published needs no mask."""
    have = {c.name for c in info.columns}
    published_columns = set(wanted.columns) if wanted.columns is not None else have
    for column in masks:
        if column in key:
            raise SourceCheckError(
                f"source.masks masks {column!r} of {info.qualified}, a key column: events are keyed by it, so it "
                "cannot be hidden; remove the mask, or key the table by other columns (source.key_columns, with "
                "REPLICA IDENTITY FULL)",
                check="masks",
            )
        if column not in published_columns:
            where = "does not have" if column not in have else "does not publish (source.columns)"
            raise SourceCheckError(
                f"source.masks names {column!r}, which {info.qualified} {where}; fix source.masks",
                check="masks",
            )


def table_clause(info: TableInfo, wanted: Published) -> sql.Composable:
    """``schema.table [(columns)] [WHERE (filter)]``, as CREATE/ALTER PUBLICATION take it."""
    parts: list[sql.Composable] = [info.ident()]
    if wanted.columns is not None:
        parts.append(sql.SQL(" ({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in wanted.columns)))
    if wanted.row_filter is not None:
        parts.append(sql.SQL(" WHERE ({})").format(sql.SQL(wanted.row_filter)))
    return sql.Composed(parts)


def deparsed(conn: psycopg.Connection[Any], info: TableInfo, wanted: Published) -> Published:
    """``wanted`` with its row filter as PostgreSQL writes it back (``pg_publication_tables.rowfilter``), so that
    it compares with what a publication holds, and checked to read only replica identity columns: a publication
    made for the purpose and rolled back (it takes a lock on the table, for at most 5 s). When the role may not
    create publications, or the lock is not had, the filter stays as configured (``exact`` False) and is checked
    on the real publication. SourceCheckError when PostgreSQL refuses the filter or it reads other columns."""
    if wanted.row_filter is None:
        return wanted
    probe = f"pgcdc_probe_{os.getpid()}"
    clause = table_clause(info, Published(None, wanted.row_filter))
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL lock_timeout = '5s'")
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(probe), clause))
            row = conn.execute("SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s", (probe,)).fetchone()
            check_filter(conn, probe, info)
    except (
        psycopg.errors.InsufficientPrivilege,
        psycopg.errors.LockNotAvailable,
        psycopg.errors.ReadOnlySqlTransaction,
    ):
        return replace(wanted, exact=False)
    except psycopg.Error as exc:
        if is_refusal(exc):
            raise refused(exc) from exc
        raise
    return replace(wanted, row_filter=row[0]) if row is not None and row[0] else replace(wanted, exact=False)


def publishes(actual: Published | None, want: Published, info: TableInfo) -> bool:
    """Whether what a publication publishes of a table is what ``want`` asks (a column list naming every column
    is no list). A filter that could not be had as PostgreSQL writes it back is compared as text, spaces aside:
    a publication pgcdc owns is then written again, one someone else manages refused with its own filter shown,
    never taken as the same on a guess."""
    have = actual or Published()
    every = [c.name for c in info.columns]  # what the capture reads: a generated column is never published
    if {c for c in have.columns or every if c in every} != set(want.columns or every):
        return False
    if not want.exact and have.row_filter is not None and want.row_filter is not None:
        return " ".join(have.row_filter.split()) == " ".join(want.row_filter.split())
    return have.row_filter == want.row_filter


def is_refusal(exc: psycopg.Error) -> bool:
    """An error in what was asked (a name, a type, an expression PostgreSQL does not take in a row filter),
    not a missing privilege or a failing server."""
    state = exc.sqlstate or ""
    return state[:2] in ("42", "0A", "22") and state != "42501"


def refused(exc: psycopg.Error) -> SourceCheckError:
    """PostgreSQL's refusal of a column list or row filter, said as what to fix."""
    return SourceCheckError(
        f"PostgreSQL refused the publication's column lists or row filters: {exc.diag.message_primary}; fix "
        "source.columns or source.row_filters (a filter is a condition on the table's own columns, with "
        "built-in immutable functions only)",
        check="publication-filter",
    )


def published(conn: psycopg.Connection[Any], publication: str) -> dict[tuple[str, str], Published]:
    """What the publication publishes of each of its tables (its list of columns, its filter as deparsed)."""
    rows = conn.execute(
        "SELECT schemaname, tablename, attnames, rowfilter FROM pg_publication_tables WHERE pubname = %s",
        (publication,),
    ).fetchall()
    return {(schema, table): Published(tuple(names), rowfilter) for schema, table, names, rowfilter in rows}


def filter_columns(conn: psycopg.Connection[Any], publication: str, info: TableInfo) -> set[str]:
    """The columns the publication's row filter of ``info`` reads (from its stored expression)."""
    row = conn.execute(
        "SELECT r.prqual::text FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid "
        "WHERE p.pubname = %s AND r.prrelid = %s",
        (publication, info.oid),
    ).fetchone()
    if row is None or row[0] is None:
        return set()
    numbers = {int(n) for n in _VAR.findall(row[0])}
    names = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum = ANY(%s)", (info.oid, list(numbers))
    ).fetchall()
    return {n for (n,) in names}


def check_filter(conn: psycopg.Connection[Any], publication: str, info: TableInfo) -> None:
    """A row filter reads only replica identity columns: PostgreSQL refuses UPDATE and DELETE on the table
    otherwise (the old row it logs holds only those)."""
    read = filter_columns(conn, publication, info)
    outside = sorted(read - set(info.identity_columns))
    if outside:
        raise SourceCheckError(
            f"the row filter of {info.qualified} reads {', '.join(map(repr, outside))}, outside its replica "
            f"identity ({', '.join(info.identity_columns) or 'none'}); PostgreSQL would then refuse updates and "
            "deletes of its rows. Filter on key columns only, or give the table REPLICA IDENTITY FULL",
            check="publication-filter",
        )


def restrict(info: TableInfo, spec: Published | None) -> TableInfo:
    """The table as the capture reads it: the published columns only, and the row filter."""
    if spec is None or spec.everything:
        return info
    columns = info.columns
    if spec.columns is not None:
        columns = tuple(c for c in info.columns if c.name in spec.columns)
    return replace(info, columns=columns, row_filter=spec.row_filter)


def filter_condition(info: TableInfo) -> list[sql.Composable]:
    """The table's row filter as a condition for a reader's WHERE (none when it has none)."""
    if info.row_filter is None:
        return []
    return [sql.SQL("({})").format(sql.SQL(info.row_filter))]


__all__ = [
    "Published",
    "check_columns",
    "check_filter",
    "check_masks",
    "configured",
    "deparsed",
    "filter_columns",
    "filter_condition",
    "is_refusal",
    "published",
    "publishes",
    "refused",
    "restrict",
    "table_clause",
]
