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

A renamed column keeps its identity: each row field carries its column's number (``pgcdc.attnum``, from
``pg_attribute``) and, as Avro ``aliases``, the other field names that column had in the table's earlier
schemas. A reader of an event written before the rename with today's schema (the sinks, a rebuild from offset
zero, any Avro library that resolves aliases) then finds the value under the new name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from schemas._conv import nullable
from schemas._keys import carries, widest
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
    attnum: int | None = None  # its number in pg_attribute, which a rename keeps; None when unknown
    aliases: tuple[str, ...] = ()  # the field names the same column had in the table's earlier schemas


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
        if col.aliases:
            field["aliases"] = list(col.aliases)
        if col.attnum is not None:
            field["pgcdc.attnum"] = col.attnum
        fields.append(field)
    return fields


class ColumnHistory:
    """Every field name each column of one table (known by its attnum) has had in the table's value schemas,
    so that a new schema can name a renamed column's earlier names as its aliases.

    Learnt from the schemas already registered (their fields' ``pgcdc.attnum`` and ``aliases``) and from each
    new one; names only accumulate, so the order in which versions are built (the stream behind a snapshot that
    read the catalogs as they are now) does not matter: aliases say "the same column", in either direction."""

    def __init__(self, relid: int | None = None) -> None:
        self.relid = relid  # the table's oid: its column numbers mean nothing for another table
        self._names: dict[int, list[str]] = {}
        # From a schema of another oid (the table restored from a dump, or dropped and made again under its
        # name): each field's names by its name, taken on by the column that has that name now.
        self._by_name: dict[str, list[str]] = {}

    def learn(self, value_schema: Mapping[str, Any]) -> None:
        """Take in a table's value schema (an envelope as :func:`envelope_schema` writes it)."""
        record = _value_record(value_schema)
        same = record.get("pgcdc.relid") == self.relid
        for f in record.get("fields", ()):
            names = [f["name"], *f.get("aliases", ())]
            attnum = f.get("pgcdc.attnum")
            if not same:
                self._by_name[f["name"]] = names
            elif isinstance(attnum, int):
                for name in names:
                    self._add(attnum, name)

    def identify(self, columns: Sequence[ColumnShape]) -> list[ColumnShape]:
        """The columns with their aliases; a column whose attnum is unknown takes the one its field name had
        before (when exactly one column had it and no other column here claims it)."""
        names = field_names(columns)
        claimed = {c.attnum for c in columns if c.attnum is not None}
        out = []
        for col, name in zip(columns, names, strict=True):
            attnum = col.attnum
            if attnum is None:
                had = [a for a, seen in self._names.items() if name in seen and a not in claimed]
                attnum = had[0] if len(had) == 1 else None
            if attnum is not None:
                for known in self._by_name.pop(name, [name]):
                    self._add(attnum, known)
            out.append(replace(col, attnum=attnum))
        # An alias that is another field's name, or that two columns had, would make resolution ambiguous.
        owners: dict[str, int] = {}
        for seen in self._names.values():
            for name in seen:
                owners[name] = owners.get(name, 0) + 1
        taken = set(names)
        return [
            replace(c, aliases=tuple(a for a in self._names.get(c.attnum, ()) if a not in taken and owners[a] == 1))
            if c.attnum is not None
            else c
            for c in out
        ]

    def _add(self, attnum: int, name: str) -> None:
        seen = self._names.setdefault(attnum, [])
        if name not in seen:
            seen.append(name)


def _value_record(value_schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row record of an envelope schema (its ``before`` branch's record); empty for another shape."""
    for f in value_schema.get("fields", ()):
        if f.get("name") == "before" and isinstance(f.get("type"), list):
            for branch in f["type"]:
                if isinstance(branch, dict) and branch.get("type") == "record":
                    return branch
    return {}


def key_schema(
    namespace: str,
    key_columns: Sequence[ColumnShape],
    names: Sequence[str] | None = None,
    *,
    registered: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``Key`` record. ``names``: the key columns' field names in the ``Value`` record.

    Pass them whenever a name may have been sanitised: sanitising the key columns on their own could give
    a key column another field name than it has in ``Value`` (columns ``a_b``, ``a b`` keyed by ``a b``:
    ``a_b_2`` in ``Value`` but ``a_b`` in ``Key``, the name of another column there), and consumers that
    join key and row fields by name (the warehouse's MERGE, ``cdc verify``) would take the wrong column.

    Each field has the widest type of its column's family (schemas._keys): a widening ALTER leaves the key
    schema, and so every key's bytes, as they were. ``registered``: the key subject's latest schema, kept
    when it carries the columns with the same bytes (a subject registered before keys were widened).
    """
    names = field_names(key_columns) if names is None else names
    # No column numbers or aliases in Key: its schema id is in every framed key, and the bytes of a row's key
    # must stay the same (compaction and partitioning go by them) when a value schema gains them.
    plain = [replace(c, attnum=None, aliases=()) for c in key_columns]
    own = _single_definitions(_key_record(namespace, _row_fields(plain, names)))
    if registered is not None and carries(registered, own):
        return dict(registered)
    widened = [{**f, "type": widest(f["type"])} for f in own["fields"]]
    return _key_record(namespace, widened)


def _key_record(namespace: str, fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "record", "name": "Key", "namespace": namespace, "fields": fields}


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


def envelope_schema(namespace: str, columns: Sequence[ColumnShape], relid: int | None = None) -> dict[str, Any]:
    """``relid``: the table's oid, kept in the Value record (``pgcdc.relid``) so that the column numbers of a
    table dropped and made again under the same name are not taken for the old one's."""
    names = field_names(columns)
    value: dict[str, Any] = {"type": "record", "name": "Value", "namespace": namespace}
    value["fields"] = _row_fields(columns, names)
    if relid is not None:
        value["pgcdc.relid"] = relid
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
