"""The source database: connecting, checking it is ready for capture, creating the publication.

``attach`` never drops or alters anything the user made; ``detach`` (an explicit command) drops the
slot and the publication.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import psycopg
from psycopg import sql

from cdc._catalog import TableInfo, load_table
from cdc._config import Settings, SourceConfig
from cdc._published import (
    Published,
    check_columns,
    check_filter,
    check_masks,
    configured,
    deparsed,
    is_refusal,
    published,
    publishes,
    refused,
    restrict,
    table_clause,
)
from cdc.errors import AuthenticationError, ConfigError, SourceCheckError, StreamError, TransientError
from pgcdc_common.topics import split_table_name

log = logging.getLogger(__name__)

# SQLSTATE classes that mean "your credentials or privileges", never worth retrying.
_AUTH_STATES = {"28000", "28P01", "42501"}
# libpq's words for TLS set-up that cannot succeed as configured (sslmode, sslrootcert, the server's certificate).
_TLS_FAILURE = re.compile(
    r"root certificate file .* does not exist|certificate verify failed|does not match host name"
    r"|server does not support SSL|could not read root certificate file|SSL error: (?:tlsv1 alert|unsupported)"
)


def translate_pg_error(exc: psycopg.Error, where: str) -> Exception:
    """One place that maps psycopg's errors to ours (the message never includes the password)."""
    state = getattr(exc, "sqlstate", None) or ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "pg_hba.conf rejects connection" in text and "no encryption" in text:
        return AuthenticationError(
            f"PostgreSQL at {where} accepts this user only over TLS: {text}; add sslmode=verify-full and "
            "sslrootcert=<the CA's PEM file> (or at least sslmode=require) to source.dsn"
        )
    if _TLS_FAILURE.search(text):
        # Retrying cannot make an untrusted certificate trusted or a missing CA file appear.
        return ConfigError(
            f"TLS to PostgreSQL at {where} failed: {text}; check source.dsn's sslmode and sslrootcert (the PEM "
            "file of the CA that signed the server's certificate) and that its host is one the certificate names"
        )
    if state in _AUTH_STATES or "password authentication failed" in text or "no password supplied" in text:
        return AuthenticationError(
            f"PostgreSQL at {where} refused the login: {text}; check source.dsn's user and the password "
            "(source.password, source.password_file or CDC_SOURCE__PASSWORD)"
        )
    if state == "3D000" or re.search(r'database "[^"]*" does not exist', text):
        # Not a blip: the DSN names a database the server does not have.
        return SourceCheckError(f"{text} (at {where}); fix the database name in source.dsn", check="database")
    if isinstance(exc, psycopg.OperationalError):
        return TransientError(f"cannot reach PostgreSQL at {where}: {text}")
    return StreamError(f"PostgreSQL at {where} refused a statement of pgcdc: {text}")


def connect(settings: Settings, *, autocommit: bool = True, **extra: str) -> psycopg.Connection[Any]:
    where = settings.source.display_dsn()
    try:
        return psycopg.connect(settings.source.conninfo(**extra), autocommit=autocommit)
    except psycopg.Error as exc:
        raise translate_pg_error(exc, where) from exc


@dataclass
class AttachReport:
    """What attach found and did (or, in a dry run, would do)."""

    tables: list[TableInfo] = field(default_factory=list)
    key_columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    slot_exists: bool = False
    publication_exists: bool = False


def check_and_prepare(
    conn: psycopg.Connection[Any],
    settings: Settings,
    *,
    dry_run: bool,
    allow_active_slot: bool = False,
    writer: psycopg.Connection[Any] | None = None,
    as_published: bool = False,
) -> AttachReport:
    """Run every check; create the publication if absent (unless dry_run). Raises SourceCheckError.

    ``allow_active_slot``: `cdc run` passes True: a slot held by another instance is then waited for (that
    instance is fenced by our Kafka transactional id and stops), instead of being an error. ``writer``: where
    the publication is made and read, when ``conn`` is a standby (its primary; cdc._standby). ``as_published``
    (a dry run beside a running capture: its publication watcher, `cdc verify`): each table is described as the
    publication publishes it now, which the stream follows, rather than as the next `cdc run` would make it.
    """
    src = settings.source
    report = AttachReport()
    pub = writer if writer is not None else conn
    _check_wal_level(conn)
    _check_standby_slots(conn)
    _check_privileges(conn)
    report.slot_exists = _check_slot(conn, src.slot, allow_active=allow_active_slot)
    report.publication_exists = _publication_exists(pub, src.publication)
    wanted = _load_tables(conn, src, report, pub)
    _check_topic_names(settings, report.tables)
    if dry_run:
        actual = _planned_publication(pub, src.publication, report, wanted)
        if as_published and report.publication_exists:
            actual = published(pub, src.publication)
    else:
        # One transaction: a publication refused below (a filter outside the replica identity) is left as it was.
        with pub.transaction():
            _prepare_publication(pub, src.publication, report, wanted)
            for info in report.tables:
                if wanted[(info.schema, info.name)].row_filter is not None:
                    check_filter(pub, src.publication, info)
            actual = published(pub, src.publication)
    report.tables = [restrict(info, actual.get((info.schema, info.name))) for info in report.tables]
    if not report.slot_exists:
        report.notes.append(
            f"replication slot {src.slot!r} will be created by `cdc run`, together with the initial snapshot, "
            "so that both start from the same consistent point"
        )
    return report


def _load_tables(
    conn: psycopg.Connection[Any], src: SourceConfig, report: AttachReport, pub: psycopg.Connection[Any]
) -> dict[tuple[str, str], Published]:
    """Each captured table into the report with its key; what the configuration asks its publication to publish
    of it (checked against the table)."""
    configured_keys = {split_table_name(k): v for k, v in src.key_columns.items()}
    masks = {split_table_name(k): v for k, v in src.masks.items()}
    columns = {split_table_name(k): v for k, v in src.columns.items()}
    filters = {split_table_name(k): v for k, v in src.row_filters.items()}
    wanted = {}
    for schema, table in _captured_names(pub, src, publication_exists=report.publication_exists):
        info = load_table(conn, schema, table)
        if info is None:
            raise SourceCheckError(
                f"table {schema}.{table} does not exist (or is not a table) in {conn.info.dbname!r}; fix source.tables",
                check="table-exists",
            )
        report.tables.append(info)
        key = report.key_columns[info.qualified] = _key_columns(info, configured_keys.get((schema, table)))
        wanted[(schema, table)] = spec = deparsed(pub, info, configured(columns, filters, info))
        check_columns(info, spec, key)
        check_masks(info, spec, key, masks.get((schema, table), {}))
    named: dict[str, Mapping[tuple[str, str], Any]] = {
        "source.columns": columns,
        "source.row_filters": filters,
        "source.masks": masks,
    }
    _check_named_tables(conn, report, named, publication_driven=not src.tables)
    return wanted


def _check_named_tables(
    conn: psycopg.Connection[Any],
    report: AttachReport,
    settings: dict[str, Mapping[tuple[str, str], Any]],
    *,
    publication_driven: bool,
) -> None:
    """Every table a per-table setting names is captured: a misspelt name would otherwise publish the columns
    it was meant to leave out or mask. When the publication decides what is captured, a mask of a table it does
    not hold (yet, or any more) is only noted, if the table exists: pgcdc applies it once the table is published.
    A column list or filter is the publication's to apply, so one for a table it does not hold is refused."""
    captured = {(t.schema, t.name) for t in report.tables}
    for key, per_table in settings.items():
        unknown = [(schema, table) for schema, table in per_table if (schema, table) not in captured]
        if publication_driven and key == "source.masks":  # applied by pgcdc itself, whatever publishes it
            outside = [name for name in unknown if load_table(conn, *name) is not None]
            for schema, table in outside:
                report.notes.append(
                    f"{key} names {schema}.{table}, which the publication does not hold: it applies once the table "
                    "is published"
                )
            unknown = [name for name in unknown if name not in outside]
        if unknown:
            raise SourceCheckError(
                f"{key} names {', '.join(f'{schema}.{table}' for schema, table in unknown)}, which is not "
                f"captured (captured: {', '.join(t.qualified for t in report.tables)}); fix the name (schema.table, "
                "as in source.tables)",
                check="table-settings",
            )


def _planned_publication(
    conn: psycopg.Connection[Any], publication: str, report: AttachReport, wanted: dict[tuple[str, str], Published]
) -> dict[tuple[str, str], Published]:
    """A dry run's view of the publication: the statements that would create or align it (not run), and what it
    would publish of each table (the configuration's, where pgcdc writes it; else the publication's own, which
    the stream follows)."""
    if not report.publication_exists:
        report.actions += _create_publication(conn, publication, report.tables, wanted, dry_run=True)
        return wanted
    actual = published(conn, publication)
    if _owned(conn, publication):
        actions, _, _ = _align_publication(conn, publication, report.tables, wanted, dry_run=True)
        report.actions += actions
        _check_publication_options(conn, publication, report.tables)  # what aligning does not change
        return {**actual, **wanted}
    _check_publication(conn, publication, report.tables, wanted)
    return actual


def _prepare_publication(
    conn: psycopg.Connection[Any],
    publication: str,
    report: AttachReport,
    wanted: dict[tuple[str, str], Published],
) -> None:
    """Create the publication, or align one pgcdc created and check it publishes what is captured."""
    try:
        if not report.publication_exists:
            report.actions += _create_publication(conn, publication, report.tables, wanted, dry_run=False)
            return
        actions, added, changed = _align_publication(conn, publication, report.tables, wanted, dry_run=False)
    except psycopg.Error as exc:
        if not is_refusal(exc) or all(w.everything for w in wanted.values()):
            raise
        raise refused(exc) from exc
    report.actions += actions
    if added and report.slot_exists:
        report.notes.append(
            f"{', '.join(added)} will be backfilled by `cdc run` while it streams (capture.backfill_new_tables)"
        )
    if changed:
        report.notes.append(
            f"what is published of {', '.join(changed)} changed: rows a wider filter or list now publishes reach "
            "the topics as they change (`cdc snapshot " + " ".join(changed) + "` brings every row in), and rows a "
            "narrower one leaves out stay in the topics and views until `cdc verify --repair` deletes them"
        )
    _check_publication(conn, publication, report.tables, wanted)


def _captured_names(
    conn: psycopg.Connection[Any], src: SourceConfig, *, publication_exists: bool
) -> list[tuple[str, str]]:
    """(schema, table) of each table to capture: source.tables, or else the existing publication's tables."""
    names = [split_table_name(t) for t in src.tables]
    if names:
        return names
    if not publication_exists:
        raise SourceCheckError(
            'no tables to capture: list them in source.tables (e.g. tables = ["public.orders"]), '
            f"or create the publication {src.publication!r} yourself",
            check="tables",
        )
    names = publication_tables(conn, src.publication)
    if not names:
        raise SourceCheckError(
            f"publication {src.publication!r} contains no tables; add some or list them in source.tables",
            check="tables",
        )
    return names


def _check_topic_names(settings: Settings, tables: list[TableInfo]) -> None:
    """Each table's topic is a name Kafka takes, and no two tables share one."""
    topics: dict[str, str] = {}
    for captured in tables:
        topic = settings.topic_for(captured.schema, captured.name)
        if len(topic) > 249:
            raise SourceCheckError(
                f"the topic name for {captured.qualified} would be longer than Kafka's 249 characters; "
                "use a shorter kafka.topic_prefix",
                check="topic-name",
            )
        if topic in topics:
            raise SourceCheckError(
                f"tables {topics[topic]} and {captured.qualified} would share topic {topic!r} (characters Kafka "
                "refuses become '_'); rename one or capture them with separate topic prefixes",
                check="topic-name",
            )
        topics[topic] = captured.qualified


def _check_publication(
    conn: psycopg.Connection[Any],
    publication: str,
    tables: list[TableInfo],
    wanted: dict[tuple[str, str], Published],
) -> None:
    """An existing publication publishes every captured table, partitioned ones through their root, every
    kind of change, and the columns and rows the configuration asks for."""
    ident = sql.Identifier(publication).as_string(conn)
    _check_publication_options(conn, publication, tables)
    present = set(publication_tables(conn, publication))
    missing = [t for t in tables if (t.schema, t.name) not in present]
    if missing:
        listing = ", ".join(_quoted(t) for t in missing)
        raise SourceCheckError(
            f"publication {publication!r} lacks {', '.join(t.qualified for t in missing)}; run "
            f"ALTER PUBLICATION {ident} ADD TABLE {listing} (pgcdc alters only a publication it created); "
            "`cdc run` then backfills them while it streams",
            check="publication-tables",
        )
    actual = published(conn, publication)
    for t in tables:
        want = wanted[(t.schema, t.name)]
        if want.asked and not publishes(actual.get((t.schema, t.name)), want, t):
            have = actual.get((t.schema, t.name)) or Published()
            now = f"columns {', '.join(have.columns or ())}" + (
                f", rows where {have.row_filter}" if have.row_filter else ""
            )
            raise SourceCheckError(
                f"publication {publication!r} does not publish {t.qualified} as source.columns/source.row_filters "
                f"say (it publishes {now}); run BEGIN; ALTER "
                f"PUBLICATION {ident} DROP TABLE {t.ident().as_string(conn)}; ALTER PUBLICATION {ident} ADD TABLE "
                f"{table_clause(t, want).as_string(conn)}; COMMIT; (pgcdc alters only a publication it created), "
                "or write the configuration as the publication has it",
                check="publication-tables",
            )


def _check_publication_options(conn: psycopg.Connection[Any], publication: str, tables: list[TableInfo]) -> None:
    """Partitioned tables published through their root, and every kind of change published: what pgcdc never
    alters, even in a publication it created."""
    ident = sql.Identifier(publication).as_string(conn)
    partitioned = any(t.relkind == "p" for t in tables)
    if partitioned and not _one(conn, "SELECT pubviaroot FROM pg_publication WHERE pubname = %s", (publication,))[0]:
        raise SourceCheckError(
            f"publication {publication!r} publishes partitioned tables through their partitions, so "
            f"changes would not reach the parent's topic: run ALTER PUBLICATION {ident} "
            "SET (publish_via_partition_root = true)",
            check="publication-partitions",
        )
    _check_publication_actions(conn, publication)


# What pgcdc writes as the comment of a publication it creates: only such a publication does it ever alter.
OWNED_COMMENT = "created by pgcdc: it adds and drops the tables of source.tables"


def _create_publication(
    conn: psycopg.Connection[Any],
    publication: str,
    tables: list[TableInfo],
    wanted: dict[tuple[str, str], Published],
    *,
    dry_run: bool,
) -> list[str]:
    """The statements that create the publication of ``tables`` and mark it as pgcdc's, run unless ``dry_run``."""
    # Changes of a partitioned table then arrive as the parent's, matching its snapshot and topic.
    partitioned = any(t.relkind == "p" for t in tables)
    create = sql.SQL("CREATE PUBLICATION {} FOR TABLE {}{}").format(
        sql.Identifier(publication),
        sql.SQL(", ").join(table_clause(t, wanted[(t.schema, t.name)]) for t in tables),
        sql.SQL(" WITH (publish_via_partition_root = true)") if partitioned else sql.SQL(""),
    )
    mark = sql.SQL("COMMENT ON PUBLICATION {} IS {}").format(sql.Identifier(publication), sql.Literal(OWNED_COMMENT))
    if not dry_run:
        conn.execute(create)
        conn.execute(mark)
        log.info("created publication %s", publication)
    return [create.as_string(conn), mark.as_string(conn)]


def _align_publication(
    conn: psycopg.Connection[Any],
    publication: str,
    tables: list[TableInfo],
    wanted: dict[tuple[str, str], Published],
    *,
    dry_run: bool,
) -> tuple[list[str], list[str], list[str]]:
    """A publication pgcdc created (its comment says so; never one FOR ALL TABLES) gets the captured tables it
    lacks, loses those no longer captured, and publishes of each what the configuration asks. The statements
    (run unless ``dry_run``), the tables added and the tables whose columns or filter changed."""
    if not _owned(conn, publication):
        return [], [], []
    actual = published(conn, publication)
    ident = sql.Identifier(publication)
    stmts = []
    added = [t for t in tables if (t.schema, t.name) not in actual]
    changed = [
        t for t in tables if t not in added and not publishes(actual[(t.schema, t.name)], wanted[(t.schema, t.name)], t)
    ]
    if changed:  # dropped and added again in this transaction: the stream follows from its commit on
        names = sql.SQL(", ").join(t.ident() for t in changed)
        stmts.append(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(ident, names))
    if added or changed:
        clauses = sql.SQL(", ").join(table_clause(t, wanted[(t.schema, t.name)]) for t in [*added, *changed])
        stmts.append(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(ident, clauses))
    dropped = sorted(set(actual) - {(t.schema, t.name) for t in tables})
    if dropped:
        names = sql.SQL(", ").join(sql.Identifier(schema, table) for schema, table in dropped)
        stmts.append(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(ident, names))
    for stmt in stmts if not dry_run else []:
        conn.execute(stmt)
        log.info("%s", stmt.as_string(conn))
    return [stmt.as_string(conn) for stmt in stmts], [t.qualified for t in added], [t.qualified for t in changed]


def _owned(conn: psycopg.Connection[Any], publication: str) -> bool:
    """Whether pgcdc created the publication (its comment says so) and may alter it; never one FOR ALL TABLES."""
    row = conn.execute(
        "SELECT puballtables, obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = %s",
        (publication,),
    ).fetchone()
    return row is not None and not row[0] and row[1] == OWNED_COMMENT


def _quoted(t: TableInfo) -> str:
    return f"{sql.Identifier(t.schema).as_string(None)}.{sql.Identifier(t.name).as_string(None)}"


def _check_wal_level(conn: psycopg.Connection[Any]) -> None:
    (level,) = _one(conn, "SHOW wal_level")
    if level != "logical":
        raise SourceCheckError(
            f"wal_level is {level!r}; logical decoding needs 'logical': run ALTER SYSTEM SET wal_level = logical "
            "and restart PostgreSQL (on managed services, enable logical replication in the parameter group)",
            check="wal_level",
        )


def _check_standby_slots(conn: psycopg.Connection[Any]) -> None:
    """PostgreSQL 17+ sends a primary's logical decoding nothing until every physical slot that
    synchronized_standby_slots lists has confirmed the WAL; a listed slot that does not exist (or was
    invalidated) holds it back for ever. A standby copied from a primary that had the setting in its
    configuration files keeps it, and once promoted it names the slot it was fed through on the old primary."""
    if conn.info.server_version < 170000:
        return
    in_recovery, value = _one(conn, "SELECT pg_is_in_recovery(), current_setting('synchronized_standby_slots', true)")
    listed = [name.strip() for name in (value or "").split(",") if name.strip()]
    if in_recovery or not listed:  # only a primary's decoding waits for them
        return
    rows = conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND invalidation_reason IS NULL "
        "AND slot_name = ANY(%s)",
        (listed,),
    ).fetchall()
    missing = [name for name in listed if name not in {row[0] for row in rows}]
    if missing:
        raise SourceCheckError(
            f"synchronized_standby_slots on this server lists {', '.join(repr(m) for m in missing)}, which "
            "is not a valid physical replication slot here: PostgreSQL holds every logical decoding back until "
            "each listed slot has confirmed the WAL, so the capture would wait for ever (a standby keeps the "
            "setting of the primary it was copied from, naming the slot it was fed through there). List this "
            "server's own standbys' slots, or none: ALTER SYSTEM RESET synchronized_standby_slots; SELECT "
            "pg_reload_conf(); (docs/operations.md, High availability)",
            check="synchronized-standby-slots",
        )


def _check_privileges(conn: psycopg.Connection[Any]) -> None:
    user, can_replicate = _one(
        conn, "SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
    )
    if not can_replicate:
        raise SourceCheckError(
            f"role {user!r} lacks the REPLICATION attribute; run ALTER ROLE "
            f"{sql.Identifier(user).as_string(conn)} WITH REPLICATION",
            check="replication-privilege",
        )


SLOT_INVALIDATED = {  # pg_replication_slots.invalidation_reason (17+) -> what the server did
    "wal_removed": "max_slot_wal_keep_size: the WAL it needed is gone",
    "idle_timeout": "idle_replication_slot_timeout: it had no consumer for longer than that",
    "rows_removed": "on a standby: rows it needed were vacuumed on the primary; set hot_standby_feedback = on",
    "wal_level_insufficient": "wal_level was lowered below logical",
}


def slot_invalidation(info: dict[str, Any]) -> str | None:
    """Why the server invalidated a slot (a ``pg_replication_slots`` row as JSON), or None: WAL removed
    (``wal_status`` "lost", every version) or, on 17+, the ``invalidation_reason`` it gives."""
    reason = info.get("invalidation_reason") or ("wal_removed" if info.get("wal_status") == "lost" else None)
    return str(reason) if reason is not None else None


def _check_slot(conn: psycopg.Connection[Any], slot: str, *, allow_active: bool) -> bool:
    # to_jsonb: the columns differ between versions (invalidation_reason exists from 17 on).
    row = conn.execute("SELECT to_jsonb(s) FROM pg_replication_slots s WHERE slot_name = %s", (slot,)).fetchone()
    if row is not None:
        info = row[0]
        plugin, database, active, active_pid = (info.get(k) for k in ("plugin", "database", "active", "active_pid"))
        reason = slot_invalidation(info)
        if plugin != "pgoutput":
            raise SourceCheckError(
                f"replication slot {slot!r} uses plugin {plugin!r}, not pgoutput; choose another source.slot",
                check="slot-plugin",
            )
        if database != conn.info.dbname:
            raise SourceCheckError(
                f"replication slot {slot!r} belongs to database {database!r}, not {conn.info.dbname!r}; "
                "choose another source.slot",
                check="slot-database",
            )
        if active and not allow_active:
            raise SourceCheckError(
                f"replication slot {slot!r} is in use by another process (pid {active_pid}); stop that consumer "
                "or choose another source.slot",
                check="slot-in-use",
            )
        if reason is not None:
            cause = SLOT_INVALIDATED.get(reason, f"invalidation_reason {reason}")
            raise SourceCheckError(
                f"replication slot {slot!r} was invalidated ({cause}). "
                "Changes were lost; run `cdc detach --yes` and `cdc run --new-slot` to re-snapshot (the re-snapshot "
                "writes a delete event and a tombstone for each row deleted meanwhile, so the topics and the "
                "stores end equal to the source)",
                check="slot-lost",
            )
        return True
    used, limit = _one(
        conn,
        "SELECT (SELECT count(*) FROM pg_replication_slots), current_setting('max_replication_slots')::int",
    )
    if used >= limit:
        raise SourceCheckError(
            f"all {limit} replication slots are in use; drop an unused one (SELECT pg_drop_replication_slot(...)) "
            "or raise max_replication_slots and restart PostgreSQL",
            check="free-slot",
        )
    return False


def _publication_exists(conn: psycopg.Connection[Any], publication: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone() is not None


def publication_tables(conn: psycopg.Connection[Any], publication: str) -> list[tuple[str, str]]:
    rows = conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1, 2", (publication,)
    ).fetchall()
    return [(s, t) for s, t in rows]


def _check_publication_actions(conn: psycopg.Connection[Any], publication: str) -> None:
    ins, upd, dele, trunc = _one(
        conn,
        "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = %s",
        (publication,),
    )
    missing = [n for n, on in (("insert", ins), ("update", upd), ("delete", dele), ("truncate", trunc)) if not on]
    if missing:
        raise SourceCheckError(
            f"publication {publication!r} does not publish {', '.join(missing)}: changes would be lost; run "
            f"ALTER PUBLICATION {sql.Identifier(publication).as_string(conn)} "
            "SET (publish = 'insert, update, delete, truncate')",
            check="publication-actions",
        )


def _key_columns(info: TableInfo, configured: tuple[str, ...] | None) -> tuple[str, ...]:
    names = {c.name for c in info.columns}
    if configured:
        unknown = [c for c in configured if c not in names]
        if unknown:
            raise SourceCheckError(
                f"source.key_columns for {info.qualified} names {unknown}, which are not columns of the table",
                check="key-columns",
            )
        nullable = [c.name for c in info.columns if c.name in configured and not c.not_null]
        if nullable:
            raise SourceCheckError(
                f"source.key_columns for {info.qualified} names nullable column(s) {nullable}; a key must never "
                "be null: make them NOT NULL (and unique)",
                check="key-columns",
            )
        if info.replica_identity != "f" and not set(configured) <= set(info.identity_columns):
            raise SourceCheckError(
                f"table {info.qualified} uses configured key columns, so deletes must carry them: run "
                f"ALTER TABLE {_quoted(info)} REPLICA IDENTITY FULL",
                check="replica-identity",
            )
        return configured
    if info.primary_key:
        if info.replica_identity != "f" and not set(info.primary_key) <= set(info.identity_columns):
            # Deletes (and key-changing updates) would carry other columns than the key: events of
            # deleted rows could not be keyed.
            raise SourceCheckError(
                f"table {info.qualified} has a primary key, but its REPLICA IDENTITY "
                f"({ {'n': 'NOTHING', 'i': 'USING INDEX'}.get(info.replica_identity, info.replica_identity) }) "
                f"does not log it for deletes: run ALTER TABLE {_quoted(info)} REPLICA IDENTITY DEFAULT",
                check="replica-identity",
            )
        return info.primary_key
    if info.replica_identity == "i" and info.identity_columns:
        return info.identity_columns
    raise SourceCheckError(
        f"table {info.qualified} has no primary key, so its events would have no key: add a primary key, "
        f"or ALTER TABLE {_quoted(info)} REPLICA IDENTITY USING INDEX <unique index>, or set "
        f'source.key_columns."{info.qualified}" and ALTER TABLE {_quoted(info)} REPLICA IDENTITY FULL',
        check="table-key",
    )


def _one(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None, query
    return cast(tuple[Any, ...], row)


def detach(
    conn: psycopg.Connection[Any], settings: Settings, *, dry_run: bool, writer: psycopg.Connection[Any] | None = None
) -> list[str]:
    """Drop the slot and the publication (only on the explicit `cdc detach` command); ``writer``: where the
    publication is, when ``conn`` is a standby (its primary)."""
    src = settings.source
    done = []
    row = conn.execute(
        "SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = %s", (src.slot,)
    ).fetchone()
    if row is not None:
        if row[0]:
            raise SourceCheckError(
                f"replication slot {src.slot!r} is in use (pid {row[1]}); stop `cdc run` first",
                check="slot-in-use",
            )
        done.append(f"SELECT pg_drop_replication_slot('{src.slot}')")
        if not dry_run:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (src.slot,))
    if writer is None and _one(conn, "SELECT pg_is_in_recovery()")[0]:
        # A standby's publication is its primary's, out of reach here: the slot alone is dropped.
        left = sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(src.publication))
        log.warning(
            "source.dsn is a standby and source.primary_dsn is unset or does not answer: the publication is left; "
            "run %s on the primary",
            left.as_string(conn),
        )
        return done
    pub = writer if writer is not None else conn
    if _publication_exists(pub, src.publication):
        stmt = sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(src.publication))
        done.append(stmt.as_string(pub))
        if not dry_run:
            pub.execute(stmt)
    return done
