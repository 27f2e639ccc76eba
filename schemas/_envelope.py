"""Key and value (envelope) schemas of a table's change events, Debezium-compatible.

Key: a record of the key columns. Every key field is nullable: a truncate is written as a key whose fields
are all null (compacted topics reject null keys, and a truncate names no row), one per partition.

Value: the Debezium envelope ``{before, after, source, transaction, op, ts_ms, ts_us}`` plus
``unchanged_toast``: the names of ``after`` fields whose values PostgreSQL did not send because they
were stored out of line and did not change (pgoutput's ``u``). Such a field is null in ``after`` and
listed there; it is never filled with a placeholder. A sink applies the event as a partial update.

Every row field is nullable with a null default, whatever the column's NOT NULL: that keeps ADD COLUMN,
DROP COLUMN and RENAME compatible in both directions (a registry with FULL compatibility accepts them),
and it is what makes ``unchanged_toast`` possible. Column names that are not valid Avro names are
sanitised; the original PostgreSQL name is kept in the field's ``pgcdc.column`` attribute.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas._conv import nullable
from schemas._names import dedupe_named_types
from schemas._pgtype import PgType

AvroSchema = dict[str, Any] | list[Any] | str

CONNECTOR = "postgresql"
SOURCE_NAMESPACE = "io.debezium.connector.postgresql"

_INVALID = re.compile(r"[^A-Za-z0-9_]")


def avro_name(name: str) -> str:
    """A valid Avro name for ``name``: invalid characters become '_', a leading digit gets a '_'."""
    clean = _INVALID.sub("_", name) or "_"
    return f"_{clean}" if clean[0].isdigit() else clean


def avro_namespace(*parts: str) -> str:
    return ".".join(avro_name(p) for p in parts)


@dataclass(frozen=True, slots=True)
class ColumnShape:
    """A column as the event schemas need it; ``schema`` is the Avro type of a non-null value."""

    name: str
    pgtype: PgType
    typmod: int
    schema: AvroSchema


def field_names(columns: Sequence[ColumnShape]) -> tuple[str, ...]:
    """Avro field names for the columns, sanitised and made unique ('a b' and 'a_b' -> 'a_b', 'a_b_2')."""
    seen: set[str] = set()
    names = []
    for col in columns:
        base = avro_name(col.name)
        name, n = base, 1
        while name in seen:
            n += 1
            name = f"{base}_{n}"
        seen.add(name)
        names.append(name)
    return tuple(names)


def _row_fields(columns: Sequence[ColumnShape], names: Sequence[str]) -> list[dict[str, Any]]:
    fields = []
    for col, name in zip(columns, names, strict=True):
        field: dict[str, Any] = {"name": name, "type": nullable(col.schema), "default": None}
        if name != col.name:
            field["pgcdc.column"] = col.name
        fields.append(field)
    return fields


def key_schema(
    namespace: str, key_columns: Sequence[ColumnShape], names: Sequence[str] | None = None
) -> dict[str, Any]:
    """The ``Key`` record. ``names``: the key columns' field names in the ``Value`` record.

    Pass them whenever a name may have been sanitised: sanitising the key columns on their own could give
    a key column another field name than it has in ``Value`` (columns ``a_b``, ``a b`` keyed by ``a b``:
    ``a_b_2`` in ``Value`` but ``a_b`` in ``Key``, the name of another column there), and consumers that
    join key and row fields by name (the warehouse's MERGE, ``cdc verify``) would take the wrong column.
    """
    names = field_names(key_columns) if names is None else names
    key = {"type": "record", "name": "Key", "namespace": namespace, "fields": _row_fields(key_columns, names)}
    return _single_definitions(key)


def _single_definitions(schema: dict[str, Any]) -> dict[str, Any]:
    """Each column mapping defines its named types in full; Avro allows one definition per name."""
    deduped = dedupe_named_types([schema])[0]
    assert isinstance(deduped, dict)
    return deduped


def source_schema() -> dict[str, Any]:
    opt_long = ["null", "long"]
    return {
        "type": "record",
        "name": "Source",
        "namespace": SOURCE_NAMESPACE,
        "fields": [
            {"name": "version", "type": "string"},
            {"name": "connector", "type": "string"},
            {"name": "name", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "snapshot", "type": ["string", "null"], "default": "false"},
            {"name": "db", "type": "string"},
            {"name": "sequence", "type": ["null", "string"], "default": None},
            {"name": "ts_us", "type": opt_long, "default": None},
            {"name": "schema", "type": "string"},
            {"name": "table", "type": "string"},
            {"name": "txId", "type": opt_long, "default": None},
            {"name": "lsn", "type": opt_long, "default": None},
            {"name": "xmin", "type": opt_long, "default": None},
            # Not in Debezium: the commit LSN of the change's transaction (the consistent point for snapshot
            # reads). Changes of one key are ordered by (commit_lsn, lsn); lsn alone is not enough, since a
            # transaction that commits later may have written its change earlier.
            {"name": "commit_lsn", "type": opt_long, "default": None},
        ],
    }


def transaction_schema() -> dict[str, Any]:
    return {
        "type": "record",
        "name": "block",
        "namespace": "event",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "total_order", "type": "long"},
            {"name": "data_collection_order", "type": "long"},
        ],
    }


def envelope_schema(namespace: str, columns: Sequence[ColumnShape]) -> dict[str, Any]:
    names = field_names(columns)
    value = {"type": "record", "name": "Value", "namespace": namespace, "fields": _row_fields(columns, names)}
    return _single_definitions(
        {
            "type": "record",
            "name": "Envelope",
            "namespace": namespace,
            "fields": [
                {"name": "before", "type": ["null", value], "default": None},
                {"name": "after", "type": ["null", "Value"], "default": None},
                {"name": "source", "type": source_schema()},
                {"name": "transaction", "type": ["null", transaction_schema()], "default": None},
                {"name": "op", "type": "string"},
                {"name": "ts_ms", "type": ["null", "long"], "default": None},
                {"name": "ts_us", "type": ["null", "long"], "default": None},
                {"name": "unchanged_toast", "type": {"type": "array", "items": "string"}, "default": []},
            ],
        }
    )


def message_key_schema(namespace: str) -> dict[str, Any]:
    """Key of a logical decoding message event (``pg_logical_emit_message``): its prefix."""
    return {
        "type": "record",
        "name": "MessageKey",
        "namespace": namespace,
        "fields": [{"name": "prefix", "type": "string"}],
    }


def message_value_schema(namespace: str) -> dict[str, Any]:
    """Value of a logical decoding message event, shaped like Debezium's (``op`` is ``m``)."""
    return {
        "type": "record",
        "name": "MessageValue",
        "namespace": namespace,
        "fields": [
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
            {"name": "source", "type": source_schema()},
            {
                "name": "message",
                "type": {
                    "type": "record",
                    "name": "Message",
                    "fields": [
                        {"name": "prefix", "type": "string"},
                        {"name": "content", "type": "bytes"},
                        {"name": "transactional", "type": "boolean"},
                    ],
                },
            },
        ],
    }


def transaction_key_schema(namespace: str) -> dict[str, Any]:
    """Key of a transaction metadata event (Debezium's ``<prefix>.transaction`` topic)."""
    return {
        "type": "record",
        "name": "TransactionKey",
        "namespace": namespace,
        "fields": [{"name": "id", "type": "string"}],
    }


def transaction_value_schema(namespace: str) -> dict[str, Any]:
    """BEGIN and END of a transaction: END carries how many events it wrote, in total and per table."""
    collection = {
        "type": "record",
        "name": "DataCollection",
        "fields": [{"name": "data_collection", "type": "string"}, {"name": "event_count", "type": "long"}],
    }
    return {
        "type": "record",
        "name": "TransactionValue",
        "namespace": namespace,
        "fields": [
            {"name": "status", "type": "string"},
            {"name": "id", "type": "string"},
            {"name": "event_count", "type": ["null", "long"], "default": None},
            {"name": "data_collections", "type": ["null", {"type": "array", "items": collection}], "default": None},
            {"name": "ts_ms", "type": "long"},
        ],
    }
