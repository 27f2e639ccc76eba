"""Avro names for PostgreSQL types and attributes, and defining each named type once per schema.

Avro names match ``[A-Za-z_][A-Za-z0-9_]*``; PostgreSQL identifiers can hold anything. A name that needs
changing gets its invalid characters replaced by ``_`` plus a short hash of the original, so that two
identifiers that sanitise alike (``"my type"``, ``my_type``) still get different Avro names, and the same
identifier always gets the same one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from schemas._conv import AvroSchema

_INVALID = re.compile(r"[^A-Za-z0-9_]")
# Avro forbids defining a named type with a primitive type's name, in any namespace.
_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_NAMED = frozenset({"record", "error", "enum", "fixed"})


def avro_name(identifier: str) -> str:
    """A valid Avro name for a PostgreSQL identifier: itself when already valid, else a sanitised form."""
    name = _INVALID.sub("_", identifier)
    if name == identifier and name and not name[0].isdigit() and name not in _PRIMITIVES:
        return name
    if not name or name[0].isdigit():
        name = "_" + name
    return f"{name}_{hashlib.sha256(identifier.encode()).hexdigest()[:8]}"


def avro_fullname(namespace: str, name: str) -> str:
    """The Avro full name (``namespace.name``) of the PostgreSQL type ``namespace.name``."""
    return f"{avro_name(namespace)}.{avro_name(name)}"


def dedupe_named_types(schemas: Iterable[AvroSchema]) -> list[AvroSchema]:
    """The schemas, with every named type defined at its first use and referenced by name afterwards.

    Avro allows one definition per name in a schema, yet each column's mapping defines the named types it
    uses (a composite type's record, ``pg_catalog.interval``…) in full. Pass the columns' schemas in
    field order — or the whole row record, or the whole envelope, as a one-element list — and this
    returns them ready to be combined. The walk follows Avro's parsing order (depth first, fields in
    order), so each reference comes after its definition. Two different definitions under one name are
    an error (:class:`ValueError`), never silently merged.
    """
    seen: dict[str, str] = {}
    return [_dedupe(schema, None, seen) for schema in schemas]


def _fullname(schema: dict[str, Any], enclosing: str | None) -> str:
    name: str = schema["name"]
    if "." in name:
        return name
    namespace = schema.get("namespace", enclosing)
    return f"{namespace}.{name}" if namespace else name


def _namespace_of(fullname: str) -> str | None:
    return fullname.rpartition(".")[0] or None


def _dedupe(schema: AvroSchema, enclosing: str | None, seen: dict[str, str]) -> AvroSchema:
    if isinstance(schema, list):
        return [_dedupe(branch, enclosing, seen) for branch in schema]
    if isinstance(schema, str):
        return schema
    kind = schema["type"]
    if kind in _NAMED:
        fullname = _fullname(schema, enclosing)
        inner = _namespace_of(fullname)
        shape = _shallow(schema, inner)
        if fullname in seen:
            if seen[fullname] != shape:
                raise ValueError(f"two different Avro types are named {fullname!r}")
            return fullname
        seen[fullname] = shape
        if kind in ("record", "error"):
            fields = [{**field, "type": _dedupe(field["type"], inner, seen)} for field in schema["fields"]]
            return {**schema, "fields": fields}
        return schema
    if kind == "array":
        return {**schema, "items": _dedupe(schema["items"], enclosing, seen)}
    if kind == "map":
        return {**schema, "values": _dedupe(schema["values"], enclosing, seen)}
    if isinstance(kind, (dict, list)):  # {"type": {...}} wraps a schema
        return {**schema, "type": _dedupe(kind, enclosing, seen)}
    return schema


def _shallow(schema: AvroSchema, enclosing: str | None) -> str:
    """A canonical JSON text of a named type's definition in which nested named types are references.

    Two uses of one type compare equal this way whether a nested type was defined inline in one of them
    and referenced in the other.
    """

    def walk(node: AvroSchema, ns: str | None, top: bool) -> Any:
        if isinstance(node, list):
            return [walk(branch, ns, False) for branch in node]
        if isinstance(node, str):
            return node if node in _PRIMITIVES or "." in node or not ns else f"{ns}.{node}"
        kind = node["type"]
        if kind in _NAMED:
            fullname = _fullname(node, ns)
            if not top:
                return fullname
            inner = _namespace_of(fullname)
            out = {k: v for k, v in node.items() if k not in ("name", "namespace", "fields")}
            out["name"] = fullname
            if "fields" in node:
                out["fields"] = [{**f, "type": walk(f["type"], inner, False)} for f in node["fields"]]
            return out
        if kind == "array":
            return {**node, "items": walk(node["items"], ns, False)}
        if kind == "map":
            return {**node, "values": walk(node["values"], ns, False)}
        if isinstance(kind, (dict, list)):
            return {**node, "type": walk(kind, ns, False)}
        return node

    return json.dumps(walk(schema, enclosing, True), sort_keys=True)
