"""Folded rows as Arrow, from raw Avro values (the Python fold's form), typed as Spark types them.

The warehouse's small batches are written by delta-rs on the driver (sinks._warehouse_live); its large ones,
and every batch of a frame plugin, reach Spark as frames built from these Arrow columns (sinks._frames). Both
must give a table the same column types, so these are the types Spark's ``from_avro`` reads the same schema
into, as Delta stores them (every field nullable, as Delta makes a table created from a frame);
:func:`spark_type` names each in Spark's DDL:

=========================================  ======================================
Avro                                        Arrow (Spark)
=========================================  ======================================
boolean, int, long, float, double, string   bool, int32, int64, float32, float64, string
bytes, fixed                                binary
enum, string with ``uuid``                  string
int with ``date``                           date32 (DateType)
long with ``timestamp-micros``              timestamp[us, UTC] (TimestampType)
long with ``local-timestamp-micros``        timestamp[us] (TimestampNTZType)
long with ``time-micros``                   int64 (the sinks read times of day as µs)
bytes/fixed with ``decimal``                decimal128(precision, scale)
record / array / map                        struct / list / map<string, …>
union of null and one type                  that type
union of several types                      struct<member0, member1, …>, one member set
=========================================  ======================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Context, Decimal
from typing import Any

import pyarrow as pa

from sinks._values import AvroType, Names

Convert = Callable[[Any], Any]

FIRST_DAY, LAST_DAY = -719_162, 2_932_896  # 0001-01-01 and 9999-12-31 in days since 1970
FIRST_US, LAST_US = FIRST_DAY * 86_400_000_000, (LAST_DAY + 1) * 86_400_000_000 - 1


# Decimal arithmetic rounds to its context's precision, 28 digits by default: a numeric(38, s) value would lose
# its last ten digits (and pyarrow then refuse it as wider than 38). This context holds every digit Spark can.
_EXACT = Context(prec=76)


class NotInArrowError(ValueError):
    """A schema or value the driver's path does not write (Spark's path does)."""


def arrow_field(avro: AvroType, names: Names, namespace: str | None = None) -> tuple[pa.DataType, Convert]:
    """The Arrow type of ``avro`` and the function from a raw Avro value to what ``pa.array`` takes for it."""
    avro = names.resolve(avro, namespace)
    if isinstance(avro, list):
        return _union(avro, names, namespace)
    if isinstance(avro, str):
        avro = {"type": avro}
    kind, logical = avro["type"], avro.get("logicalType")
    if isinstance(kind, (dict, list)):
        return arrow_field(kind, names, namespace)
    if logical == "decimal" and kind in ("bytes", "fixed"):
        precision, scale = int(avro["precision"]), int(avro.get("scale", 0))
        if precision > 38:
            raise NotInArrowError(f"decimal precision {precision} (Spark holds 38)")
        return pa.decimal128(precision, scale), _nullsafe(
            lambda b: Decimal(int.from_bytes(b, "big", signed=True)).scaleb(-scale, _EXACT)
        )
    simple = _SIMPLE.get((kind, logical)) or _SIMPLE.get((kind, None))
    if simple is not None and kind not in ("record", "array", "map"):
        return simple, _same
    if kind == "record":
        ns = avro.get("namespace", namespace)
        fields = [(f["name"], *arrow_field(f["type"], names, ns)) for f in avro["fields"]]
        arrow = pa.struct([pa.field(name, t) for name, t, _ in fields])

        def record(value: Any) -> Any:
            return None if value is None else {name: conv(value.get(name)) for name, _, conv in fields}

        return arrow, record
    if kind == "array":
        item, conv = arrow_field(avro["items"], names, namespace)
        return pa.list_(pa.field("element", item)), _nullsafe(lambda v: [conv(x) for x in v])
    if kind == "map":
        value, conv = arrow_field(avro["values"], names, namespace)
        return pa.map_(pa.string(), value), _nullsafe(lambda v: [(k, conv(x)) for k, x in v.items()])
    raise NotInArrowError(f"Avro type {kind!r}")


_SIMPLE: dict[tuple[str, str | None], pa.DataType] = {
    ("null", None): pa.null(),
    ("boolean", None): pa.bool_(),
    ("int", None): pa.int32(),
    ("long", None): pa.int64(),
    ("float", None): pa.float32(),
    ("double", None): pa.float64(),
    ("string", None): pa.string(),
    ("enum", None): pa.string(),
    ("bytes", None): pa.binary(),
    ("fixed", None): pa.binary(),
    ("int", "date"): pa.date32(),
    ("long", "timestamp-micros"): pa.timestamp("us", tz="UTC"),
    ("long", "local-timestamp-micros"): pa.timestamp("us"),
}


def _same(value: Any) -> Any:
    return value


def _nullsafe(convert: Convert) -> Convert:
    return lambda value: None if value is None else convert(value)


_KINDS: dict[str, type | tuple[type, ...]] = {
    "boolean": bool, "int": int, "long": int, "float": float, "double": float, "bytes": (bytes, bytearray),
    "fixed": (bytes, bytearray), "string": str, "enum": str, "record": dict, "map": dict, "array": list,
}  # fmt: skip


def _union(branches: list[AvroType], names: Names, namespace: str | None) -> tuple[pa.DataType, Convert]:
    real = [b for b in branches if b != "null"]
    if len(real) == 1:
        return arrow_field(real[0], names, namespace)
    members = [arrow_field(b, names, namespace) for b in real]
    kinds = []
    for b in real:
        resolved = names.resolve(b, namespace)
        kind = resolved if isinstance(resolved, str) else resolved["type"]
        kinds.append(_KINDS.get(kind if isinstance(kind, str) else "", object))
    arrow = pa.struct([pa.field(f"member{i}", t) for i, (t, _) in enumerate(members)])

    def member(value: Any) -> Any:
        if value is None:
            return None
        for i, (kind, (_, conv)) in enumerate(zip(kinds, members, strict=True)):
            if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
                return {f"member{j}": conv(value) if j == i else None for j in range(len(members))}
        raise NotInArrowError(f"a value of type {type(value).__name__} matches no branch of {real}")

    return arrow, member


def beyond_python(array: pa.Array) -> bool:
    """Whether a date or timestamp column holds a value outside years 1..9999 (PostgreSQL's infinities, BC
    dates): Delta's statistics of such a column are written by Spark's path, which keeps them readable
    (sinks._delta_stats)."""
    import pyarrow.compute as pc

    if pa.types.is_date32(array.type):
        low, high = FIRST_DAY, LAST_DAY
        values = array.cast(pa.int32())
    elif pa.types.is_timestamp(array.type):
        low, high = FIRST_US, LAST_US
        values = array.cast(pa.int64())
    else:
        return False
    if values.null_count == len(values):
        return False
    bounds = pc.min_max(values)
    return bool(bounds["min"].as_py() < low or bounds["max"].as_py() > high)


def rows_table(columns: Mapping[str, tuple[pa.DataType, list[Any]]]) -> pa.Table:
    """Columns of converted values (dates and timestamps as day and µs counts, which Arrow takes as they are)."""
    return pa.table({name: pa.array(values, arrow) for name, (arrow, values) in columns.items()})


def spark_type(arrow: pa.DataType) -> str:
    """``arrow`` (one of :func:`arrow_field`'s types) in Spark's DDL, the type Spark reads it into."""
    if pa.types.is_struct(arrow):
        fields = [arrow.field(i) for i in range(arrow.num_fields)]
        return "struct<" + ", ".join(f"`{f.name.replace('`', '``')}`: {spark_type(f.type)}" for f in fields) + ">"
    if pa.types.is_map(arrow):
        return f"map<{spark_type(arrow.key_type)}, {spark_type(arrow.item_type)}>"
    if pa.types.is_list(arrow):
        return f"array<{spark_type(arrow.value_type)}>"
    if pa.types.is_decimal(arrow):
        return f"decimal({arrow.precision}, {arrow.scale})"
    if pa.types.is_timestamp(arrow):
        return "timestamp" if arrow.tz is not None else "timestamp_ntz"
    for kind, ddl in _DDL:
        if arrow == kind:
            return ddl
    raise NotInArrowError(f"Arrow type {arrow} has no Spark type here")


_DDL = (
    (pa.null(), "void"),
    (pa.bool_(), "boolean"),
    (pa.int32(), "int"),
    (pa.int64(), "bigint"),
    (pa.float32(), "float"),
    (pa.float64(), "double"),
    (pa.string(), "string"),
    (pa.binary(), "binary"),
    (pa.date32(), "date"),
)
