"""PostgreSQL types to Avro: the schema of a column and fast converters of its wire values.

:func:`avro_mapping` is called once per column when a relation is (re)described; the converters it returns
run once per value, so they are built here, once, as plain closures over precompiled structs. Every
value a PostgreSQL type can hold comes through exactly — see docs/types.md for the table and the reasons.

Text-format values must come from a session with :data:`TEXT_OUTPUT_SETTINGS` (PostgreSQL's defaults but
for the time zone); binary values are the types' send formats, as pgoutput's ``binary`` option sends them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from schemas import _containers, _datetime, _numeric, _scalars
from schemas._conv import AvroSchema, Conv, UnsupportedTypeError
from schemas._geometric import GEOMETRIC
from schemas._names import avro_fullname, avro_name, dedupe_named_types
from schemas._pgtype import PgType
from schemas._textsearch import TSQUERY, TSVECTOR

TEXT_OUTPUT_SETTINGS: Mapping[str, str] = MappingProxyType(
    {
        # The text parsers read these formats and refuse others rather than guess.
        "DateStyle": "ISO",
        "IntervalStyle": "postgres",
        # >= 1 selects the shortest text that round-trips a float exactly; 0 and below lose digits.
        "extra_float_digits": "1",
        # Avro strings are UTF-8; binary text values are sent in the client encoding too.
        "client_encoding": "UTF8",
        # Both bytea formats are parsed; hex is the faster one.
        "bytea_output": "hex",
        # Not needed for correctness (offsets are printed and applied), but UTC keeps the text short.
        "TimeZone": "UTC",
    }
)
"""Session settings under which text-format values are parsed exactly (set them on the replication
connection, e.g. ``options='-c DateStyle=ISO …'``, and on any connection whose text output is converted)."""


@dataclass(frozen=True, slots=True)
class AvroMapping:
    """How one column's values become Avro.

    ``schema`` is the Avro type of a non-null value; a nullable column's field type is
    ``nullable(schema)``, which also flattens a union schema (numeric(p,s) maps to one) into the
    nullable union, as Avro forbids nested unions. Named types (records) are defined in full here: when
    combining several columns into one schema, pass them through :func:`dedupe_named_types`.
    ``from_text`` converts the type's text output, ``from_binary`` its send format, to the same
    Avro-ready value (what fastavro writes without further conversion); ``from_binary`` is None for the
    few types whose send format cannot be converted to that value (see docs/types.md): ask for text then.
    """

    schema: AvroSchema
    from_text: Callable[[bytes], Any]
    from_binary: Callable[[bytes], Any] | None
    # For fixed-width types whose Avro value is the send format read as is (int4, float8…): the struct code
    # that reads it. The capture's fast path reads such columns straight from the frame.
    fixed: str | None = None
    # The send format's shape for the fast path, when it has a common case written without from_binary
    # (Conv.wire says which).
    wire: str | None = None


# Built-in types by pg_catalog name. Types whose mapping depends on the typmod are in _build.
_BUILTIN: dict[str, Conv] = {
    "bool": _scalars.BOOL,
    "int2": _scalars.INT2,
    "int4": _scalars.INT4,
    "int8": _scalars.INT8,
    "oid": _scalars.UINT4,
    "xid": _scalars.UINT4,
    "cid": _scalars.UINT4,
    "xid8": _scalars.XID8,
    "float4": _scalars.FLOAT4,
    "float8": _scalars.FLOAT8,
    "money": _scalars.MONEY,
    "text": _scalars.TEXT,
    "varchar": _scalars.TEXT,
    "bpchar": _scalars.TEXT,
    "name": _scalars.TEXT,
    "char": _scalars.CHAR,
    "json": _scalars.TEXT,
    "xml": _scalars.TEXT,
    "refcursor": _scalars.TEXT,
    "unknown": _scalars.TEXT,
    "pg_node_tree": _scalars.TEXT,
    "jsonb": _scalars.JSONB,
    "jsonpath": _scalars.VERSIONED_TEXT,
    "bytea": _scalars.BYTEA,
    "uuid": _scalars.UUID,
    "date": _datetime.DATE,
    "time": _datetime.TIME,
    "timetz": _datetime.TIMETZ,
    "timestamp": _datetime.TIMESTAMP,
    "timestamptz": _datetime.TIMESTAMPTZ,
    "interval": _datetime.INTERVAL,
    "inet": _scalars.INET,
    "cidr": _scalars.CIDR,
    "macaddr": _scalars.MACADDR,
    "macaddr8": _scalars.MACADDR,
    "varbit": _scalars.BITS,
    "tsvector": TSVECTOR,
    "tsquery": TSQUERY,
    "pg_lsn": _scalars.PG_LSN,
    "tid": _scalars.TID,
    "int2vector": _scalars.INT_VECTOR,
    "oidvector": _scalars.INT_VECTOR,
    "pg_snapshot": _scalars.SNAPSHOT,
    "txid_snapshot": _scalars.SNAPSHOT,
    # An OID printed as a name: the name cannot be derived from the OID the send format carries.
    **dict.fromkeys(
        (
            "regproc",
            "regprocedure",
            "regoper",
            "regoperator",
            "regclass",
            "regtype",
            "regconfig",
            "regdictionary",
            "regnamespace",
            "regrole",
            "regcollation",
        ),
        _scalars.TEXT_ONLY,
    ),
    "aclitem": _scalars.TEXT_ONLY,  # no send function: pgoutput sends it as text even in binary mode
    **GEOMETRIC,
}

# Extension types recognised by name in any schema.
_EXTENSIONS: dict[str, Conv] = {
    "hstore": _containers.HSTORE,
    "citext": _scalars.TEXT,  # sends as text
    "ltree": _scalars.VERSIONED_TEXT,  # ltree, lquery, ltxtquery send a version byte and their text
    "lquery": _scalars.VERSIONED_TEXT,
    "ltxtquery": _scalars.VERSIONED_TEXT,
}

# Unknown types: their text, as a string. Their send format is unknown, so text only.
_FALLBACK = _scalars.TEXT_ONLY

# The range type of each built-in multirange (a multirange PgType names only the subtype).
_BUILTIN_MULTIRANGES = {
    "int4multirange": "int4range",
    "int8multirange": "int8range",
    "nummultirange": "numrange",
    "datemultirange": "daterange",
    "tsmultirange": "tsrange",
    "tstzmultirange": "tstzrange",
}

_MAX_DEPTH = 64  # composites cannot contain themselves, but a corrupt PgType could; fail, don't recurse


def avro_mapping(pgtype: PgType, typmod: int = -1) -> AvroMapping:
    """The Avro schema and converters for a column of ``pgtype`` with type modifier ``typmod``.

    ``typmod`` is the column's ``atttypmod`` (-1 when none; a domain's own modifier comes from
    ``pgtype.base_typmod``). Types this module does not know — extensions other than hstore, citext and
    ltree — map losslessly to their text output as an Avro string, text format only.
    """
    built = _build(pgtype, typmod, 0)
    # A copy: the schemas of built-in types are shared module constants, and callers may annotate theirs.
    (schema,) = dedupe_named_types([copy.deepcopy(built.schema)])
    return AvroMapping(schema, built.from_text, built.from_binary, built.fixed, built.wire)


def _build(pgtype: PgType, typmod: int, depth: int) -> Conv:
    if depth > _MAX_DEPTH:
        raise UnsupportedTypeError(f"type {pgtype.qualified_name} nests more than {_MAX_DEPTH} levels deep")
    kind, name = pgtype.kind, pgtype.name
    # Name first for pg_catalog: some base types have an element type and subscripting (point, name) or
    # even the array category (int2vector, oidvector) yet their own formats: never take them for arrays.
    if pgtype.namespace == "pg_catalog" and name[:1] != "_":
        if name == "numeric":
            return _numeric.numeric(typmod)
        if name == "bit":
            return _scalars.BIT1 if typmod == 1 else _scalars.BITS
        if name in _BUILTIN:
            return _BUILTIN[name]
    if kind == "domain":
        base = _require(pgtype, pgtype.base, "base")
        return _build(base, typmod if typmod != -1 else pgtype.base_typmod, depth + 1)
    if kind == "enum":
        # A string, not an Avro enum: ALTER TYPE … ADD VALUE would make new values unreadable.
        return _scalars.TEXT
    if kind == "array":
        element_type = _require(pgtype, pgtype.element, "element")
        element = _build(element_type, typmod, depth + 1)
        return _containers.array(_array_name(pgtype, element_type, typmod, element), element, pgtype.delimiter)
    if kind == "composite":
        fields: list[tuple[str, Conv]] = []
        for attname, atttype, atttypmod in pgtype.fields:
            fields.append((avro_name(attname), _build(atttype, atttypmod, depth + 1)))
        return _containers.composite(_type_name(pgtype), pgtype.qualified_name, fields)
    if kind == "range":
        subtype = _build(_require(pgtype, pgtype.element, "element"), -1, depth + 1)
        return _containers.range_(_type_name(pgtype), subtype)
    if kind == "multirange":
        subtype_pg = _require(pgtype, pgtype.element, "element")
        if subtype_pg.kind == "range":  # tolerate being given the range type rather than its subtype
            range_name, subtype_pg = _type_name(subtype_pg), _require(subtype_pg, subtype_pg.element, "element")
        elif pgtype.namespace == "pg_catalog" and name in _BUILTIN_MULTIRANGES:
            range_name = avro_fullname("pg_catalog", _BUILTIN_MULTIRANGES[name])
        else:
            range_name = avro_fullname(pgtype.namespace, f"{name}_range")
        return _containers.multirange(range_name, _build(subtype_pg, -1, depth + 1))
    if name in _EXTENSIONS and kind == "base":
        return _EXTENSIONS[name]
    return _FALLBACK


def _require(pgtype: PgType, value: PgType | None, what: str) -> PgType:
    if value is None:
        raise UnsupportedTypeError(
            f"{pgtype.kind} type {pgtype.qualified_name} has no {what} type: describe it in PgType.{what}"
        )
    return value


def _type_name(pgtype: PgType) -> str:
    return avro_fullname(pgtype.namespace, pgtype.name)


def _array_name(pgtype: PgType, element_type: PgType, typmod: int, element: Conv) -> str:
    """The array's record name; it carries the typmod when the typmod changes the element's schema
    (numeric(10,2)[] and numeric(12,4)[] in one table are different records).
    """
    name = _type_name(pgtype)
    if typmod == -1 or _build(element_type, -1, 0).schema == element.schema:
        return name
    constraint = _numeric.numeric_typmod(typmod) if element_type.name == "numeric" else None
    label = f"{constraint[0]}_{constraint[1]}".replace("-", "m") if constraint else str(typmod)
    return f"{name}_{label}"
