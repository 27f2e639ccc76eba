"""The ``sql`` sink: each captured table kept as a table of a SQL database, through SQLAlchemy Core.

Layout, in ``sinks.sql.schema`` (the database's default schema when unset):

    "<schema>.<table>"            a view: what readers query (the served generation's data columns)
    "<schema>.<table>__g<N>"      generation N's table: the columns, plus __pgcdc_key (the primary key: the key
                                  as one string, as document ids and cache keys are written), __pgcdc_commit_lsn,
                                  __pgcdc_lsn, __pgcdc_op, __pgcdc_ts_ms
    pgcdc_sql_generations         the served generation of each sink writing here
    pgcdc_sql_columns             each generation's tables and their columns (name and kind), as last migrated

A name longer than the dialect allows keeps its start and gets ``~`` and 8 hex digits of its SHA-256.

Rows are written by :class:`SqlWriter` inside executor tasks (or on the driver for small live batches): an
``INSERT … ON CONFLICT (__pgcdc_key) DO UPDATE … WHERE`` the stored position is not newer, so a replayed or
late event never moves a row backwards; deletes are guarded the same way; a truncate deletes every row older
than its position. Columns PostgreSQL did not send (unchanged TOAST) are left out of the update.

Schema changes arrive as a new Avro schema; :meth:`SqlSink.prepare` migrates the table before the batch's
writes: a new field is ADD COLUMN, a field gone is DROP COLUMN, and a field that replaces another at the same
place with the same kind is RENAME COLUMN (PostgreSQL puts an added column last, so a column replaced in place
is a rename; a last column dropped and one of the same kind added in one step looks the same, and is taken
as a rename; a batch sees only the newest schema of its events, so a rename is recognised when it is the one
change between the schemas two batches see). A field whose kind changed is dropped and added again. The view
is made again in the same transaction. Values already stored in a re-created column are gone until their rows
change: the log says so and ``cdc verify sql --repair`` mends them.

Dialects: PostgreSQL, SQLite and MariaDB (tested); any other (MySQL too) is refused when the sink opens, with the
list. MariaDB has no ``ON CONFLICT … WHERE``: its upsert is ``ON DUPLICATE KEY UPDATE`` with each column set to
the new value only where the guard holds, the position columns last (MariaDB assigns left to right, and the guard
reads them). Its DDL is not transactional: a migration's statements are written to be run again (``IF EXISTS``,
``IF NOT EXISTS``, ``CHANGE COLUMN IF EXISTS``) and recorded after them, views are replaced in one statement each,
and a swap re-points the views one table at a time.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import psycopg
import psycopg.sql
import pymysql
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from sinks._api import BaseSink, Change, Rejected, SinkContext, TableInfo, TableRef
from sinks._sqltypes import (
    DIALECTS,
    ColumnKind,
    UnstorableError,
    column_kind,
    register_pg_loaders,
    sql_type,
    to_doc,
    to_sql,
    widens_kind,
)
from sinks._values import Names, column_name
from sinks.errors import SinkConfigError, SinkTerminalError, SinkTransientError

log = logging.getLogger(__name__)

KEY, COMMIT, LSN, OP, TS = "__pgcdc_key", "__pgcdc_commit_lsn", "__pgcdc_lsn", "__pgcdc_op", "__pgcdc_ts_ms"
META = (KEY, COMMIT, LSN, OP, TS)
GENERATIONS, COLUMNS = "pgcdc_sql_generations", "pgcdc_sql_columns"
_MAX_PARTS = 8  # verify's readers of one table
MARIADB_KEY_CHARS = 768  # a longer key cannot be stored in MariaDB: its change is a dead letter
_SQLITE_WAIT_S = 60  # a SQLite writer waits this long for another's lock (tasks of one batch write at once)


def check_dialect(url: str) -> str:
    """The URL's dialect name, or a SinkConfigError naming the ones the sink supports."""
    try:
        parsed = sa.engine.make_url(url)
        dialect = parsed.get_dialect().name
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise SinkConfigError(f"sinks.sql.url is not a SQLAlchemy URL this install can use: {exc}") from exc
    if dialect == "postgresql" and parsed.get_driver_name() != "psycopg":
        raise SinkConfigError(
            f"sinks.sql.url uses the {parsed.get_driver_name()!r} driver; the sql sink talks to PostgreSQL with "
            "psycopg (3), which pgcdc installs: write postgresql+psycopg://…"
        )
    if dialect == "mariadb" and parsed.get_driver_name() != "pymysql":
        raise SinkConfigError(
            f"sinks.sql.url uses the {parsed.get_driver_name()!r} driver; the sql sink talks to MariaDB with "
            "PyMySQL, which pgcdc's sinks install: write mariadb+pymysql://…"
        )
    if dialect == "mysql":
        raise SinkConfigError(
            "sinks.sql.url names the 'mysql' dialect; the sql sink is tested on MariaDB (mariadb+pymysql://…), "
            f"not on MySQL; it supports {', '.join(DIALECTS)}"
        )
    if dialect not in DIALECTS:
        raise SinkConfigError(
            f"sinks.sql.url names the {dialect!r} dialect; the sql sink supports {', '.join(DIALECTS)} "
            "(its upsert, guard and transactional schema changes are tested on those only)"
        )
    return dialect


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg driver) of a libpq connection string, password included: a PostgreSQL
    target named as the capture names its source."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(dsn)
    url = sa.engine.URL.create(
        "postgresql+psycopg",
        username=str(info.get("user", "postgres")),
        password=str(info["password"]) if info.get("password") else None,
        host=str(info.get("host", "127.0.0.1")),
        port=int(str(info.get("port", 5432))),
        database=str(info["dbname"]),
    )
    return url.render_as_string(hide_password=False)


def make_engine(url: SecretStr) -> Engine:
    """An engine of its own, connecting anew each time (the driver's, for set-up and swaps)."""
    return _engine(url, sa.pool.NullPool)


_ENGINES: dict[tuple[int, str], Engine] = {}


def shared_engine(url: SecretStr) -> Engine:
    """This process's engine for ``url``, keeping one connection open between calls: Spark's Python workers
    (and the driver's live batches) write batch after batch, and a connection (with its session set-up) per
    batch would cost more than a small batch's rows. Keyed by process too: a forked worker never shares its
    parent's connections."""
    key = (os.getpid(), url.get_secret_value())
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = _engine(url, sa.pool.QueuePool, pool_size=1, max_overflow=4, pool_pre_ping=True)
    return engine


def _engine(url: SecretStr, pool: Any, **options: Any) -> Engine:
    text = url.get_secret_value()
    if check_dialect(text) == "sqlite":
        engine = sa.create_engine(text, poolclass=pool, connect_args={"timeout": _SQLITE_WAIT_S}, **options)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if check_dialect(text) == "mariadb":
        # utf8mb4: every character PostgreSQL text holds; UTC: DATETIME holds UTC wall time (timestamptz).
        engine = sa.create_engine(
            text, poolclass=pool, connect_args={"charset": "utf8mb4", "init_command": _MARIADB_SESSION}, **options
        )
        return engine
    engine = sa.create_engine(text, poolclass=pool, **options)
    sa.event.listen(engine, "connect", _pg_session)
    return engine


# Strict: a value a column cannot hold is an error (a dead letter), never truncated or zeroed.
_MARIADB_SESSION = "SET time_zone = '+00:00', sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION,NO_ZERO_DATE'"


def _pg_session(dbapi_connection: Any, _record: Any) -> None:
    register_pg_loaders(dbapi_connection)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL: readers (verify, users) never block the writers, nor they the readers.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def fitted(name: str, limit: int) -> str:
    """``name``, or its start with ``~`` and 8 hex digits of its SHA-256 when longer than ``limit`` characters."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9]}~{digest}"


@dataclass(frozen=True)
class Layout:
    """Where a sink's tables live in the database; picklable (settings only), shared by driver and tasks."""

    url: SecretStr
    schema: str | None
    sink: str
    dialect: str
    name_limit: int

    def table_name(self, table: str, generation: int) -> str:
        suffix = f"__g{generation}"
        return fitted(table, self.name_limit - len(suffix)) + suffix

    def view_name(self, table: str) -> str:
        return fitted(table, self.name_limit)

    def columns_of(self, key_schema: dict[str, Any], row_schema: dict[str, Any]) -> list[tuple[str, ColumnKind]]:
        """The data columns of a table (PostgreSQL's names, in field order) and what each holds."""
        names = Names()
        names.resolve(key_schema, None)  # defines the named types of both
        names.resolve(row_schema, None)
        ns = row_schema.get("namespace")
        out = [(column_name(f), column_kind(f["type"], names, ns)) for f in row_schema["fields"]]
        if self.dialect == "mariadb":
            folded: dict[str, str] = {}
            for c, _ in out:
                if c.casefold() in folded:
                    raise SinkConfigError(
                        f"columns {folded[c.casefold()]!r} and {c!r} differ only in case, which MariaDB's column "
                        "names do not tell apart; rename one at the source or leave the table out of sinks.tables"
                    )
                folded[c.casefold()] = c
        clash = [c for c, _ in out if c in META]
        if clash:
            raise SinkConfigError(
                f"column {clash[0]!r} is named like one of the sql sink's own; rename it at the source or leave "
                "the table out of sinks.tables"
            )
        return out

    def table(self, table: str, generation: int, columns: Sequence[tuple[str, ColumnKind]]) -> sa.Table:
        metadata = sa.MetaData(schema=self.schema)
        return sa.Table(
            self.table_name(table, generation),
            metadata,
            sa.Column(KEY, self.key_type(), primary_key=True),
            *(sa.Column(c, sql_type(k, self.dialect), nullable=True, quote=True) for c, k in columns),
            sa.Column(COMMIT, sa.BigInteger(), nullable=False),
            sa.Column(LSN, sa.BigInteger(), nullable=False),
            sa.Column(OP, sa.String(1), nullable=False),
            sa.Column(TS, sa.BigInteger()),
            mariadb_charset="utf8mb4",
        )

    def key_type(self) -> sa.types.TypeEngine[Any]:
        """The key column's type: text, but in MariaDB a VARCHAR that an index takes (768 characters of utf8mb4
        fill InnoDB's 3,072 bytes), compared byte by byte (its default collation folds case: "A" and "a" would
        be one key)."""
        if self.dialect == "mariadb":
            return sa.String(MARIADB_KEY_CHARS, collation="utf8mb4_bin")
        return sa.Text()

    def state_tables(self) -> tuple[sa.Table, sa.Table]:
        metadata = sa.MetaData(schema=self.schema)
        generations = sa.Table(
            GENERATIONS,
            metadata,
            sa.Column("sink", _name(200), primary_key=True),
            sa.Column("generation", sa.Integer(), nullable=False),
            mariadb_charset="utf8mb4",
        )
        columns = sa.Table(
            COLUMNS,
            metadata,
            sa.Column("sink", _name(200), primary_key=True),
            sa.Column("table_name", _name(500), primary_key=True),
            sa.Column("generation", sa.Integer(), primary_key=True),
            # JSON: [[column, [kind, precision, scale]], …]
            sa.Column("columns", sa.Text().with_variant(mysql.LONGTEXT(), "mariadb"), nullable=False),
            mariadb_charset="utf8mb4",
        )
        return generations, columns

    def quoted(self, conn: Connection, name: str) -> str:
        prep = conn.dialect.identifier_preparer
        return f"{prep.quote_schema(self.schema)}.{prep.quote(name)}" if self.schema else prep.quote(name)


def _name(length: int) -> sa.types.TypeEngine[Any]:
    """A name column of the state tables: compared byte by byte in MariaDB (its default collation would take
    "public.Notes" and "public.notes" for one table)."""
    return sa.String(length).with_variant(mysql.VARCHAR(length, collation="utf8mb4_bin"), "mariadb")


class SqlSink(BaseSink):
    """Generations, schema changes and read-back on the driver; rows are written by :class:`SqlWriter`."""

    name = "sql"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        options = context.options
        url = options.get("url")
        if not url:
            raise SinkConfigError(
                "sinks.sql.url is not set: a SQLAlchemy URL (postgresql+psycopg://…, sqlite:///…, mariadb+pymysql://…)"
            )
        secret = url if isinstance(url, SecretStr) else SecretStr(str(url))
        self.engine = make_engine(secret)
        self.layout = Layout(
            secret,
            options.get("schema_", options.get("schema")),  # SqlConfig's field, or a plugin section's key
            context.name,
            self.engine.dialect.name,
            self.engine.dialect.max_identifier_length or 63,
        )
        self._migrated: dict[tuple[str, int], str] = {}  # (table, generation) -> the schemas last migrated to
        self._ensure_state()

    def close(self) -> None:
        self.engine.dispose()

    def _ensure_state(self) -> None:
        generations, columns = self.layout.state_tables()
        try:
            with self.engine.begin() as conn:
                generations.metadata.create_all(conn, checkfirst=True)
                columns.metadata.create_all(conn, checkfirst=True)
        except sa.exc.OperationalError as exc:
            raise SinkTransientError(f"sql: cannot reach the database: {_first_line(exc)}") from exc

    # --- writes ----------------------------------------------------------------------------------------

    def prepare(self, tables: Sequence[TableInfo]) -> None:
        """Create or migrate each table of the batch (and its view, when served) before the writes."""
        todo = [t for t in tables if self._migrated.get((t.name, t.generation)) != _fingerprint(t)]
        if not todo:
            return
        served = self.current_generation()
        with _transient(), self.engine.begin() as conn:
            for table in todo:
                migrate(conn, self.layout, table, served)
        for table in todo:
            self._migrated[table.name, table.generation] = _fingerprint(table)

    def partition_writer(self) -> SqlWriter:
        return SqlWriter(self.layout)

    # --- generations -----------------------------------------------------------------------------------

    def current_generation(self) -> int | None:
        generations, _ = self.layout.state_tables()
        with _transient(), self.engine.connect() as conn:
            row = conn.execute(
                sa.select(generations.c.generation).where(generations.c.sink == self.layout.sink)
            ).first()
        return None if row is None else int(row[0])

    def prepare_generation(self, generation: int) -> None:
        # Tables appear with their first batch; leftovers of an earlier, failed rebuild to this number go first.
        self.drop_generation(generation)

    def drop_generation(self, generation: int) -> None:
        with _transient(), self.engine.begin() as conn:
            _drop_generation(conn, self.layout, generation)
        self._migrated = {k: v for k, v in self._migrated.items() if k[1] != generation}

    def swap(self, generation: int) -> None:
        old = self.current_generation()
        generations, _ = self.layout.state_tables()
        with _transient(), self.engine.begin() as conn:
            point_views(conn, self.layout, generation)
            updated = conn.execute(
                generations.update().where(generations.c.sink == self.layout.sink).values(generation=generation)
            )
            if updated.rowcount == 0:
                conn.execute(generations.insert().values(sink=self.layout.sink, generation=generation))
        if old is not None and old != generation:
            time.sleep(self.context.settings.sinks.swap_grace_s)  # queries that began on the old tables end first
            self.drop_generation(old)

    # --- read back (verify) ----------------------------------------------------------------------------

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        return SqlPart(self.layout, table.name, generation, None, None)()

    def read_parts(self, table: TableRef, generation: int, parts: int) -> list[SqlPart]:
        name = self.layout.table_name(table.name, generation)
        with _transient(), self.engine.connect() as conn:
            if not sa.inspect(conn).has_table(name, schema=self.layout.schema):
                return []
            t = sa.Table(name, sa.MetaData(schema=self.layout.schema), sa.Column(KEY, sa.Text()))
            count = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
            n = max(1, min(parts, _MAX_PARTS, count // 10_000 + 1))
            bounds: list[str | None] = [None]
            for i in range(1, n):
                at = conn.execute(sa.select(t.c[KEY]).order_by(t.c[KEY]).offset(count * i // n).limit(1)).first()
                if at is not None and at[0] != bounds[-1]:
                    bounds.append(at[0])
        bounds.append(None)
        return [SqlPart(self.layout, table.name, generation, lo, hi) for lo, hi in pairwise(bounds)]


def _fingerprint(table: TableInfo) -> str:
    return json.dumps([table.key_schema, table.row_schema], sort_keys=True)


@contextmanager
def _transient() -> Iterator[None]:
    """Connection-level failures of the database as SinkTransientError (the query restarts with backoff).

    SQLite reports a lock held too long ("database is locked") as an OperationalError too: it passes."""
    try:
        yield
    except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        if _mariadb_code(exc) not in (None, *_MARIADB_TRANSIENT):  # the statement's fault: a retry meets it again
            raise SinkTerminalError(
                f"sql: MariaDB refused a statement of the sink: {_first_line(exc)} (see docs/sinks.md for what a "
                "MariaDB target holds)"
            ) from exc
        raise SinkTransientError(f"sql: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


# --- schema: tables, migrations, views -------------------------------------------------------------------


def _recorded(conn: Connection, layout: Layout, table: str, generation: int) -> list[tuple[str, ColumnKind]] | None:
    _, columns = layout.state_tables()
    row = conn.execute(
        sa.select(columns.c.columns).where(
            columns.c.sink == layout.sink, columns.c.table_name == table, columns.c.generation == generation
        )
    ).first()
    return None if row is None else [(c, ColumnKind.from_json(k)) for c, k in json.loads(row[0])]


def _record(
    conn: Connection, layout: Layout, table: str, generation: int, cols: Sequence[tuple[str, ColumnKind]]
) -> None:
    _, columns = layout.state_tables()
    text = json.dumps([[c, k.to_json()] for c, k in cols])
    where = (columns.c.sink == layout.sink, columns.c.table_name == table, columns.c.generation == generation)
    if conn.execute(columns.update().where(*where).values(columns=text)).rowcount == 0:
        conn.execute(columns.insert().values(sink=layout.sink, table_name=table, generation=generation, columns=text))


@dataclass(frozen=True)
class Migration:
    renames: list[tuple[str, str]]
    drops: list[str]
    adds: list[tuple[str, ColumnKind]]
    renamed_kinds: tuple[tuple[str, ColumnKind], ...] = ()  # each renamed column's (new name, kind)
    widened: tuple[tuple[str, ColumnKind, ColumnKind], ...] = ()  # (column, kind before, kind now)

    def __bool__(self) -> bool:
        return bool(self.renames or self.drops or self.adds or self.widened)


def plan_migration(old: Sequence[tuple[str, ColumnKind]], new: Sequence[tuple[str, ColumnKind]]) -> Migration:
    """From the columns a table has to the columns a schema asks for (see the module doc for the rules); a
    column widened at the source (``int`` → ``bigint``, a wider ``numeric``, ``timestamp`` → ``timestamptz``)
    keeps its values in its new type."""
    old_kinds, new_kinds = dict(old), dict(new)
    widened = tuple((c, old_kinds[c], k) for c, k in new if c in old_kinds and widens_kind(old_kinds[c], k))
    if widened:
        wider = dict((c, k) for c, _, k in widened)
        old = [(c, wider.get(c, k)) for c, k in old]
        return replace(plan_migration(old, new), widened=widened)
    gone = [c for c, k in old if new_kinds.get(c) != k]
    came = [(c, k) for c, k in new if old_kinds.get(c) != k]
    renames: list[tuple[str, str]] = []
    if len(gone) == 1 and len(came) == 1 and gone[0] not in new_kinds and came[0][0] not in old_kinds:
        at_old = [c for c, _ in old].index(gone[0])
        at_new = [c for c, _ in new].index(came[0][0])
        if at_old == at_new and old_kinds[gone[0]] == came[0][1]:
            renames.append((gone[0], came[0][0]))
    if renames:
        return Migration(renames, [], [], ((came[0][0], came[0][1]),))
    return Migration([], gone, came)


def migrate(conn: Connection, layout: Layout, info: TableInfo, served: int | None) -> None:
    """Create the table of ``info`` (its generation's), or bring its columns to ``info``'s row schema; make its
    view again when that generation is served. One transaction (the caller's)."""
    table, generation = info.name, info.generation
    columns = layout.columns_of(info.key_schema, info.row_schema)
    had = _recorded(conn, layout, table, generation)
    physical = layout.table_name(table, generation)
    if had is None:
        layout.table(table, generation, columns).create(conn, checkfirst=True)
        change = Migration([], [], [])
    else:
        change = plan_migration(had, columns)
    is_served = served == generation
    if change or had is None:
        if is_served and layout.dialect != "mariadb":  # MariaDB replaces the view in one statement below
            _ddl(conn, f"DROP VIEW IF EXISTS {layout.quoted(conn, layout.view_name(table))}")
        _alter(conn, layout, physical, change)
        _record(conn, layout, table, generation, columns)
        if change.drops or change.adds:
            log.warning(
                "sql: %s (generation %d) changed columns: dropped %s, added %s; rows stored before hold null in "
                "the added ones until they change (`cdc verify sql --repair` re-reads them)",
                table,
                generation,
                change.drops or "none",
                [c for c, _ in change.adds] or "none",
            )
    if is_served:
        _create_view(conn, layout, table, physical, columns)


def _ddl(conn: Connection, statement: str) -> None:
    """A statement built with the dialect's quoting (names), run as it is. SQLAlchemy's MariaDB quoting doubles a
    name's ``%`` for PyMySQL's formatting, which PyMySQL does only when given parameters: it is given none."""
    conn.exec_driver_sql(statement, () if conn.dialect.name == "mariadb" else None)


def _alter(conn: Connection, layout: Layout, physical: str, change: Migration) -> None:
    prep = conn.dialect.identifier_preparer
    target = layout.quoted(conn, physical)
    # MariaDB commits each DDL statement at once: written so that a migration cut short can run again whole.
    again = layout.dialect == "mariadb"
    exists, not_exists = (" IF EXISTS", " IF NOT EXISTS") if again else ("", "")
    for old, new in change.renames:
        if again:
            kind = dict(change.renamed_kinds)[new]
            ddl = sql_type(kind, layout.dialect).compile(dialect=conn.dialect)
            _ddl(conn, f"ALTER TABLE {target} CHANGE COLUMN IF EXISTS {prep.quote(old)} {prep.quote(new)} {ddl}")
        else:
            _ddl(conn, f"ALTER TABLE {target} RENAME COLUMN {prep.quote(old)} TO {prep.quote(new)}")
    for name in change.drops:
        _ddl(conn, f"ALTER TABLE {target} DROP COLUMN{exists} {prep.quote(name)}")
    for name, kind in change.adds:
        ddl = sql_type(kind, layout.dialect).compile(dialect=conn.dialect)
        _ddl(conn, f"ALTER TABLE {target} ADD COLUMN{not_exists} {prep.quote(name)} {ddl}")
    for name, before, now in change.widened:
        _widen(conn, layout, target, name, (before, now))


def _widen(conn: Connection, layout: Layout, target: str, name: str, kinds: tuple[ColumnKind, ColumnKind]) -> None:
    """A column in its wider type. SQLite's columns take any value of their affinity: nothing to do there."""
    column = conn.dialect.identifier_preparer.quote(name)
    ddl = sql_type(kinds[1], layout.dialect).compile(dialect=conn.dialect)
    if layout.dialect == "postgresql":
        # A timestamp without time zone is read as UTC, as the capture's events give it.
        using = f" USING {column} AT TIME ZONE 'UTC'" if kinds[0].kind == "local_timestamp" else ""
        _ddl(conn, f"ALTER TABLE {target} ALTER COLUMN {column} TYPE {ddl}{using}")
    elif layout.dialect == "mariadb":
        _ddl(conn, f"ALTER TABLE {target} MODIFY COLUMN {column} {ddl}")


def _create_view(
    conn: Connection, layout: Layout, table: str, physical: str, columns: Sequence[tuple[str, ColumnKind]]
) -> None:
    prep = conn.dialect.identifier_preparer
    view = layout.quoted(conn, layout.view_name(table))
    listed = ", ".join(prep.quote(c) for c, _ in columns) or prep.quote(KEY)
    source = layout.quoted(conn, physical)
    if layout.dialect == "mariadb":  # its DDL is not transactional: never a moment without the view
        _ddl(conn, f"CREATE OR REPLACE VIEW {view} AS SELECT {listed} FROM {source}")  # noqa: S608
        return
    _ddl(conn, f"DROP VIEW IF EXISTS {view}")
    _ddl(conn, f"CREATE VIEW {view} AS SELECT {listed} FROM {source}")  # noqa: S608 - quoted names


def point_views(conn: Connection, layout: Layout, generation: int) -> None:
    """Every table's view over ``generation``'s table; views of tables that generation lacks are dropped."""
    _, columns = layout.state_tables()
    rows = conn.execute(
        sa.select(columns.c.table_name, columns.c.generation, columns.c.columns).where(columns.c.sink == layout.sink)
    ).all()
    kept = {r.table_name for r in rows if r.generation == generation}
    for r in rows:
        if r.generation == generation:
            cols = [(c, ColumnKind.from_json(k)) for c, k in json.loads(r.columns)]
            _create_view(conn, layout, r.table_name, layout.table_name(r.table_name, generation), cols)
        elif r.table_name not in kept:
            _ddl(conn, f"DROP VIEW IF EXISTS {layout.quoted(conn, layout.view_name(r.table_name))}")


def _drop_generation(conn: Connection, layout: Layout, generation: int) -> None:
    _, columns = layout.state_tables()
    where = (columns.c.sink == layout.sink, columns.c.generation == generation)
    for (table,) in conn.execute(sa.select(columns.c.table_name).where(*where)).all():
        _ddl(conn, f"DROP TABLE IF EXISTS {layout.quoted(conn, layout.table_name(table, generation))}")
    conn.execute(columns.delete().where(*where))


# --- the writer, in executor tasks ---------------------------------------------------------------------


@dataclass(frozen=True)
class SqlWriter:
    """Writes one partition of a table's changes in one transaction, with an engine of its own."""

    layout: Layout

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        layout = self.layout
        columns = layout.columns_of(table.key_schema, table.row_schema)
        target = layout.table(table.name, table.generation, columns)
        convert = {c: to_sql(k, layout.dialect) for c, k in columns}
        upserts: dict[tuple[str, ...], list[dict[str, Any]]] = {}  # by the columns PostgreSQL did not send
        deletes: list[dict[str, Any]] = []
        blind: list[dict[str, Any]] = []  # deletes known from a tombstone alone: no position to guard with
        rejected: list[Rejected] = []
        truncate: tuple[int, int] | None = None
        origin: dict[str, Change] = {}
        for change in changes:
            if change.op == "t":
                truncate = change.position
                continue
            key = change.doc_id
            origin[key] = change
            if layout.dialect == "mariadb" and len(key) > MARIADB_KEY_CHARS:
                reason = f"sql: a key of {len(key)} characters; MariaDB's key column holds {MARIADB_KEY_CHARS}"
                rejected.append(Rejected(table.topic, change.partition, change.offset, reason))
                continue
            if change.row is None:
                (blind if change.position is None else deletes).append(_position({"k": key}, change))
                continue
            try:
                values = {c: convert[c](change.row.get(c)) for c in convert if c not in change.unchanged}
            except UnstorableError as exc:
                rejected.append(Rejected(table.topic, change.partition, change.offset, f"sql: {exc}"))
                continue
            upserts.setdefault(change.unchanged, []).append(
                {KEY: key, **values, COMMIT: change.commit_lsn, LSN: change.lsn, OP: change.op, TS: change.ts_ms}
            )
        with _transient(), shared_engine(layout.url).begin() as conn:
            for rows in upserts.values():
                rejected += _upsert(conn, target, rows=rows, origin=origin, topic=table.topic)
            _deletes(conn, target, deletes, blind)
            if truncate is not None:
                conn.execute(target.delete().where(_older(target, *truncate)))
        return rejected


def _position(values: dict[str, Any], change: Change) -> dict[str, Any]:
    return {**values, "c": change.commit_lsn, "l": change.lsn}


def _older(target: sa.Table, commit_lsn: Any, lsn: Any) -> sa.ColumnElement[bool]:
    """Rows whose stored position is lower than (commit_lsn, lsn)."""
    c, lsn_col = target.c[COMMIT], target.c[LSN]
    return sa.or_(c < commit_lsn, sa.and_(c == commit_lsn, lsn_col < lsn))


def _upsert(
    conn: Connection,
    target: sa.Table,
    *,
    rows: list[dict[str, Any]],
    origin: dict[str, Change],
    topic: str,
) -> list[Rejected]:
    """Insert, or update where the stored row is not newer; a refused batch is retried row by row. The rows
    share their columns: those PostgreSQL did not send (unchanged TOAST) are left out, and so left as stored."""
    stmt = _upsert_statement(conn, target, list(rows[0]), source=None)
    refused: list[Rejected] = []
    batches = [rows]
    if conn.dialect.name == "mariadb":
        batches, oversized = _mariadb_batches(conn, rows)
        for row, reason in oversized:
            change = origin[row[KEY]]
            refused.append(Rejected(topic, change.partition, change.offset, f"sql: {reason}"))
    for batch in batches:
        try:
            _write_batch(conn, target, stmt, batch)
            continue
        except (sa.exc.DBAPIError, psycopg.Error) as exc:
            if not _row_fault(exc):
                raise
            log.info("sql: a batch of %d rows was refused (%s); writing them one by one", len(batch), _first_line(exc))
        for row in batch:  # an upsert is idempotent: rows the batch wrote before it failed are written again alike
            try:
                _isolated(conn, stmt, [row])
            except (sa.exc.DBAPIError, psycopg.Error) as exc:
                if not _row_fault(exc):
                    raise
                change = origin[row[KEY]]
                refused.append(Rejected(topic, change.partition, change.offset, f"sql: {_first_line(exc)}"))
    return refused


def _write_batch(conn: Connection, target: sa.Table, stmt: Any, rows: list[dict[str, Any]]) -> None:
    if conn.dialect.name == "postgresql":
        _staged(conn, target, rows)
    elif conn.dialect.name == "mariadb":
        # One multi-row INSERT of SQLAlchemy's making, not PyMySQL's executemany, whose rewrite leaves a "%" in
        # the ON DUPLICATE KEY UPDATE clause doubled (a column named with one is then not found). A refused
        # statement is undone whole (InnoDB), and the caller retries row by row.
        conn.execute(_mariadb_upsert(mysql.insert(target).values(rows), target, list(rows[0])))
    else:
        _isolated(conn, stmt, rows)


# MariaDB's errors of the connection or of contention, which a later attempt may not meet; any other an upsert
# meets is the row's (PyMySQL reports most of both kinds as OperationalError).
_MARIADB_TRANSIENT = frozenset(
    {1040, 1053, 1152, 1158, 1159, 1160, 1161, 1205, 1213, 1927, 2002, 2003, 2006, 2013, 2014, 2055}
)


def _row_fault(exc: Exception) -> bool:
    """Whether a refused write is the row's fault (a dead letter), not the connection's (retried). A COPY runs on
    the driver's connection, so psycopg's own errors come here too."""
    if isinstance(exc, _REFUSED):
        return True
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    return isinstance(exc.orig, _REFUSED) or _mariadb_code(exc) not in (None, *_MARIADB_TRANSIENT)


def _mariadb_code(exc: sa.exc.DBAPIError) -> int | None:
    """MariaDB's error number of an error PyMySQL reports as OperationalError; None for any other error."""
    orig = exc.orig
    if isinstance(orig, pymysql.err.OperationalError) and orig.args and isinstance(orig.args[0], int):
        return int(orig.args[0])
    return None


def _mariadb_batches(
    conn: Connection, rows: list[dict[str, Any]]
) -> tuple[list[list[dict[str, Any]]], list[tuple[dict[str, Any], str]]]:
    """The rows in INSERTs that fit MariaDB's max_allowed_packet (past it the server drops the connection, and a
    retry would meet the same), and the rows no INSERT can carry, with why. Sizes are estimated at twice the
    values' lengths (escaping) plus room for each field."""
    packet = int(conn.exec_driver_sql("SELECT @@max_allowed_packet", ()).scalar_one())
    budget = min(packet // 2, _MARIADB_BATCH_BYTES)
    batches: list[list[dict[str, Any]]] = [[]]
    oversized: list[tuple[dict[str, Any], str]] = []
    used = 0
    for row in rows:
        size = sum(2 * len(v) + 8 if isinstance(v, str | bytes) else 32 for v in row.values())
        if size > packet * 0.9:
            oversized.append((row, f"a row of about {size} bytes; MariaDB's max_allowed_packet is {packet}"))
            continue
        if batches[-1] and (used + size > budget or len(batches[-1]) >= _MULTI_ROW):
            batches.append([])
            used = 0
        batches[-1].append(row)
        used += size
    return [b for b in batches if b], oversized


_MULTI_ROW = 500  # rows per MariaDB INSERT at most
_MARIADB_BATCH_BYTES = 4 << 20  # and bytes, about


def _upsert_statement(conn: Connection, target: sa.Table, columns: list[str], *, source: sa.Select[Any] | None) -> Any:
    """INSERT of ``columns`` (their values bound per row, or selected by ``source``) that updates a stored row
    only where it is not newer than the new one (the position guard)."""
    if conn.dialect.name == "mariadb":
        return _mariadb_upsert(mysql.insert(target), target, columns)
    insert: Any = postgresql.insert(target) if conn.dialect.name == "postgresql" else sqlite.insert(target)
    if source is not None:
        insert = insert.from_select(columns, source)
    return insert.on_conflict_do_update(
        index_elements=[target.c[KEY]],
        set_={c: insert.excluded[c] for c in columns if c != KEY},
        where=sa.or_(
            _older(target, insert.excluded[COMMIT], insert.excluded[LSN]),
            sa.and_(target.c[COMMIT] == insert.excluded[COMMIT], target.c[LSN] == insert.excluded[LSN]),
        ),
    )


def _mariadb_upsert(insert: Any, target: sa.Table, columns: list[str]) -> Any:
    """MariaDB's form of the guarded upsert: ON DUPLICATE KEY UPDATE has no WHERE, so each column takes the new
    value where the guard holds and keeps its own elsewhere. MariaDB assigns left to right and a later
    assignment reads the values earlier ones set: the guard's own columns go last, __pgcdc_lsn before
    __pgcdc_commit_lsn (once __pgcdc_lsn holds the new value, the guard still holds for __pgcdc_commit_lsn
    exactly when it held before)."""
    # VALUES(name) written out: SQLAlchemy's own (insert.inserted) escapes a "%" in the name twice for PyMySQL.
    new: dict[str, sa.ColumnElement[Any]] = {c: sa.literal_column(f"VALUES(`{c.replace('`', '``')}`)") for c in columns}
    guard = sa.or_(
        _older(target, new[COMMIT], new[LSN]),
        sa.and_(target.c[COMMIT] == new[COMMIT], target.c[LSN] == new[LSN]),
    )
    order = [c for c in columns if c not in (KEY, LSN, COMMIT)] + [LSN, COMMIT]
    return insert.on_duplicate_key_update([(c, sa.case((guard, new[c]), else_=target.c[c])) for c in order])


def _staged(conn: Connection, target: sa.Table, rows: list[dict[str, Any]]) -> None:
    """PostgreSQL: the rows COPYed into a temporary table, then one INSERT … SELECT … ON CONFLICT from it.

    Why: psycopg's executemany runs the upsert once per row; COPY and one set-based statement are 4-5x faster
    for the same rows (measured here: 40,000 rows, ~40,000/s against ~190,000/s). Values go through the
    columns' SQLAlchemy bind processors, as bound parameters would. Savepointed like _isolated: a refusal
    leaves the transaction usable and the caller retries row by row."""
    columns = list(rows[0])
    processors = [target.c[c].type.dialect_impl(conn.dialect).bind_processor(conn.dialect) for c in columns]
    stage = f"pgcdc_stage_{next(_STAGES)}"
    names = psycopg.sql.SQL(", ").join(map(psycopg.sql.Identifier, columns))
    source = psycopg.sql.Identifier(*([target.schema] if target.schema else []), target.name)
    with conn.begin_nested():
        raw = conn.connection.driver_connection
        assert raw is not None  # an open connection's
        with raw.cursor() as cursor:
            cursor.execute(
                psycopg.sql.SQL("CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                    psycopg.sql.Identifier(stage), names, source
                )
            )
            with cursor.copy(
                psycopg.sql.SQL("COPY {} ({}) FROM STDIN").format(psycopg.sql.Identifier(stage), names)
            ) as copy:
                for row in rows:
                    copy.write_row([v if f is None else f(v) for f, v in zip(processors, row.values(), strict=True)])
        staged = sa.table(stage, *(sa.column(c) for c in columns))
        newest = (
            sa.select(*staged.c)
            .ext(postgresql.distinct_on(staged.c[KEY]))  # a key twice in the rows: its newest (ON CONFLICT takes one)
            .order_by(staged.c[KEY], staged.c[COMMIT].desc(), staged.c[LSN].desc())
        )
        conn.execute(_upsert_statement(conn, target, columns, source=newest))


_STAGES = itertools.count()  # temporary tables' names: unique within a transaction, dropped at its commit
# The row's fault, not the connection's (a COPY runs on the driver's connection: its own errors too).
_REFUSED = (sa.exc.DataError, sa.exc.IntegrityError, psycopg.errors.DataError, psycopg.errors.IntegrityError)


def _isolated(conn: Connection, stmt: Any, rows: list[dict[str, Any]]) -> None:
    """``stmt`` over ``rows``, such that a refusal leaves the transaction usable: PostgreSQL aborts a transaction
    at its first error, so the statement runs in a savepoint there; SQLite undoes only the failed statement."""
    if conn.dialect.name == "postgresql":
        with conn.begin_nested():
            conn.execute(stmt, rows)
    else:
        conn.execute(stmt, rows)


def _deletes(conn: Connection, target: sa.Table, guarded: list[dict[str, Any]], blind: list[dict[str, Any]]) -> None:
    key = target.c[KEY]
    if guarded:
        not_newer = sa.or_(
            _older(target, sa.bindparam("c"), sa.bindparam("l")),
            sa.and_(target.c[COMMIT] == sa.bindparam("c"), target.c[LSN] == sa.bindparam("l")),
        )
        conn.execute(target.delete().where(key == sa.bindparam("k"), not_newer), guarded)
    if blind:
        conn.execute(target.delete().where(key == sa.bindparam("k")), blind)


# --- read back, in executor tasks (verify) ---------------------------------------------------------------


@dataclass(frozen=True)
class SqlPart:
    """The rows of a key range of a generation's table (``lo`` inclusive, ``hi`` exclusive; None: open)."""

    layout: Layout
    table: str
    generation: int
    lo: str | None
    hi: str | None

    def __call__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        engine = make_engine(self.layout.url)
        try:
            with _transient(), engine.connect() as conn:
                columns = _recorded(conn, self.layout, self.table, self.generation)
                if columns is None:
                    return
                t = self.layout.table(self.table, self.generation, columns)
                docs = [(c, to_doc(k, self.layout.dialect)) for c, k in columns]
                query = sa.select(t.c[KEY], *(t.c[c] for c, _ in columns)).order_by(t.c[KEY])
                if self.lo is not None:
                    query = query.where(t.c[KEY] >= self.lo)
                if self.hi is not None:
                    query = query.where(t.c[KEY] < self.hi)
                result = conn.execution_options(stream_results=True, yield_per=5_000).execute(query)
                for row in result:
                    yield row[0], {c: conv(v) for (c, conv), v in zip(docs, row[1:], strict=True)}
        finally:
            engine.dispose()
