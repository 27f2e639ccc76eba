"""Column values in *document form*: the JSON-ready shape the search index and the cache store.

One definition, reached from two directions, so that a stored document can be compared with PostgreSQL:

* from the values of a Spark frame (a frame sink's folded rows, typed as ``from_avro`` types them, or a
  Delta table read back), after :func:`spark_projection` has turned dates and timestamps into plain numbers
  (PySpark cannot collect a date in year 5 874 897 or an ``infinity`` timestamp into Python's
  ``date``/``datetime``);
* from raw Avro values, as the Avro writer takes them (``cdc verify``'s PostgreSQL side).

Document form, by Avro type (docs/sinks.md has the table): numbers stay numbers except NaN/±Infinity
(strings, JSON has none); decimals are exact strings; bytes are base64; dates ``YYYY-MM-DD``; timestamps ISO
8601 with microseconds (``Z`` for ``timestamp-micros``); ``infinity``/``-infinity`` for PostgreSQL's
infinities; times ``HH:MM:SS.ffffff``; records are objects, arrays lists. Values outside what ISO 8601
can print (BC dates, years past 9999) stay numbers (days / µs since 1970), so nothing is lost.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
from collections.abc import Callable, Mapping
from decimal import Context, Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column

Convert = Callable[[Any], Any]
AvroType = Any  # a parsed-JSON Avro schema: str | dict | list

_INT32_MAX, _INT32_MIN = 2**31 - 1, -(2**31)
_INT64_MAX, _INT64_MIN = 2**63 - 1, -(2**63)
_EPOCH_ORDINAL = dt.date(1970, 1, 1).toordinal()
_MIN_DAYS = dt.date(1, 1, 1).toordinal() - _EPOCH_ORDINAL
_MAX_DAYS = dt.date(9999, 12, 31).toordinal() - _EPOCH_ORDINAL
_DAY_US = 86_400_000_000


def column_name(field: Mapping[str, Any]) -> str:
    """The PostgreSQL column behind an Avro field (names that are not valid Avro names were sanitised)."""
    return str(field.get("pgcdc.column") or field["name"])


class Names:
    """Named Avro types seen so far: later uses refer to an earlier definition by name.

    A definition comes back with its namespace made explicit: a type referred to from elsewhere resolves
    the names inside it in its own namespace, not in the referrer's. Registries print schemas with names
    relative to the enclosing namespace (Java's ``Schema.toString``), so both forms occur.
    """

    def __init__(self) -> None:
        self.types: dict[str, dict[str, Any]] = {}

    def resolve(self, avro: AvroType, namespace: str | None) -> AvroType:
        """``avro`` itself, or the definition it names; every definition inside it is known afterwards.

        Walkers that stop at a record (a search mapping does) still leave its inner types defined for the
        columns after it, which may refer to them by name.
        """
        if isinstance(avro, str) and avro not in _PRIMITIVES:
            full = avro if "." in avro else f"{namespace}.{avro}" if namespace else avro
            return self.types.get(full) or self.types[avro]
        if isinstance(avro, dict) and avro.get("type") in ("record", "enum", "fixed"):
            name = avro["name"]
            ns = avro.get("namespace", namespace)
            full = name if "." in name else f"{ns}.{name}" if ns else name
            own = full.rpartition(".")[0]
            avro = {**avro, "namespace": own} if own else {k: v for k, v in avro.items() if k != "namespace"}
            if full not in self.types:
                self.types[full] = avro
                for f in avro.get("fields", ()):
                    self._define(f["type"], own or None)
        elif isinstance(avro, (dict, list)):
            self._define(avro, namespace)
        return avro

    def _define(self, avro: AvroType, namespace: str | None) -> None:
        if isinstance(avro, list):
            for branch in avro:
                self.resolve(branch, namespace)
        elif isinstance(avro, dict):
            kind = avro["type"]
            inner = avro.get("items") if kind == "array" else avro.get("values") if kind == "map" else kind
            if isinstance(inner, (dict, list)) or kind in ("record", "enum", "fixed"):
                self.resolve(avro if kind in ("record", "enum", "fixed") else inner, namespace)


def envelope_row(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The row record of an envelope schema, standalone: its namespace, inherited from the envelope, explicit."""
    row = dict(envelope["fields"][0]["type"][1])  # before: ["null", Value]: Value is defined there
    if "namespace" not in row and "." not in row["name"]:
        name, ns = envelope["name"], envelope.get("namespace")
        ns = name.rpartition(".")[0] if "." in name else ns
        if ns:
            row["namespace"] = ns
    return row


_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


def _float(value: float) -> Any:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _date(days: int) -> Any:
    if days == _INT32_MAX:
        return "infinity"
    if days == _INT32_MIN:
        return "-infinity"
    if _MIN_DAYS <= days <= _MAX_DAYS:
        return dt.date.fromordinal(days + _EPOCH_ORDINAL).isoformat()
    return days


def _time(micros: int) -> str:
    seconds, us = divmod(micros, 1_000_000)
    minutes, sec = divmod(seconds, 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours:02d}:{minute:02d}:{sec:02d}.{us:06d}"


def _timestamp(micros: int, suffix: str) -> Any:
    if micros == _INT64_MAX:
        return "infinity"
    if micros == _INT64_MIN:
        return "-infinity"
    days, rest = divmod(micros, _DAY_US)
    if not _MIN_DAYS <= days <= _MAX_DAYS:
        return micros
    return f"{_date(days)}T{_time(rest)}{suffix}"


_WIDE = Context(prec=80)  # more digits than any decimal Spark holds (38): quantize never rounds or raises


def _decimal_text(value: Decimal) -> str:
    return format(value, "f")


def _decimal_at(scale: int) -> Convert:
    """A decimal of Avro scale ``scale`` as Spark hands it to Python, as text with exactly that many decimals.

    The number is right but its exponent is not always the type's: collected rows cross from the JVM as
    Java's engineering notation (a decimal(38,10) holding 1E-10 arrives as ``Decimal('100E-12')``), which
    would print as 0.000000000100. Arrow batches carry the type's scale already (quantize changes nothing).
    """
    exponent = Decimal(1).scaleb(-scale)

    def convert(value: Decimal) -> str:
        return _decimal_text(value.quantize(exponent, context=_WIDE))

    return convert


def _decimal_from_bytes(scale: int) -> Convert:
    def convert(raw: bytes) -> str:
        unscaled = int.from_bytes(raw, "big", signed=True)
        digits = tuple(int(d) for d in str(abs(unscaled)))
        return _decimal_text(Decimal((1 if unscaled < 0 else 0, digits, -scale)))

    return convert


def _b64(value: bytes | bytearray) -> str:
    return base64.b64encode(bytes(value)).decode("ascii")


def _ident(value: Any) -> Any:
    return value


def _nullsafe(convert: Convert) -> Convert:
    def run(value: Any) -> Any:
        return None if value is None else convert(value)

    return run


def doc_converter(avro: AvroType, names: Names, *, spark: bool, namespace: str | None = None) -> Convert:
    """A function from one value of ``avro`` (raw Avro, or as Spark collects it) to document form."""
    avro = names.resolve(avro, namespace)
    if isinstance(avro, list):
        return _union(avro, names, spark=spark, namespace=namespace)
    if isinstance(avro, str):
        avro = {"type": avro}
    kind, logical = avro["type"], avro.get("logicalType")
    if isinstance(kind, (dict, list)) or kind not in (*_PRIMITIVES, "record", "array", "map", "enum", "fixed"):
        return doc_converter(kind, names, spark=spark, namespace=namespace)  # nested or a named reference
    if logical == "decimal" and kind in ("bytes", "fixed"):
        scale = int(avro.get("scale", 0))
        return _nullsafe(_decimal_at(scale)) if spark else _nullsafe(_decimal_from_bytes(scale))
    if logical == "date" and kind == "int":
        return _nullsafe(_date)
    if logical == "time-micros" and kind == "long":
        return _nullsafe(_time)
    if logical == "timestamp-micros" and kind == "long":
        return _nullsafe(lambda v: _timestamp(v, "Z"))
    if logical == "local-timestamp-micros" and kind == "long":
        return _nullsafe(lambda v: _timestamp(v, ""))
    if kind in ("float", "double"):
        return _nullsafe(_float)
    if kind in ("bytes", "fixed"):
        return _nullsafe(_b64)
    if kind == "record":
        ns = avro.get("namespace", namespace)
        fields = [
            (f["name"], column_name(f), doc_converter(f["type"], names, spark=spark, namespace=ns))
            for f in avro["fields"]
        ]

        def record(value: Any) -> Any:
            if value is None:
                return None
            get = value.__getitem__
            return {col: conv(get(name)) for name, col, conv in fields}

        return record
    if kind == "array":
        item = doc_converter(avro["items"], names, spark=spark, namespace=namespace)
        return _nullsafe(lambda v: [item(x) for x in v])
    if kind == "map":
        val = doc_converter(avro["values"], names, spark=spark, namespace=namespace)
        # Spark's Rows give a map as a dict, Arrow as a list of (key, value) pairs.
        return _nullsafe(lambda v: {k: val(x) for k, x in (v if isinstance(v, list) else v.items())})
    return _ident


def _union(branches: list[AvroType], names: Names, *, spark: bool, namespace: str | None) -> Convert:
    real = [b for b in branches if b != "null"]
    if len(real) == 1:
        return doc_converter(real[0], names, spark=spark, namespace=namespace)
    convs = [doc_converter(b, names, spark=spark, namespace=namespace) for b in real]
    if spark:
        # Spark shows a union of several types as struct<member0, member1, …>: one member is set.
        def from_members(value: Any) -> Any:
            if value is None:
                return None
            for i, conv in enumerate(convs):
                member = value[f"member{i}"]
                if member is not None:
                    return conv(member)
            return None

        return from_members
    kinds = [_python_kind(names.resolve(b, namespace)) for b in real]

    def from_raw(value: Any) -> Any:
        if value is None:
            return None
        for kind, conv in zip(kinds, convs, strict=True):
            if isinstance(value, kind):
                return conv(value)
        raise TypeError(f"value of type {type(value).__name__} matches no branch of union {real}")

    return from_raw


def _python_kind(avro: AvroType) -> type | tuple[type, ...]:
    kind = avro if isinstance(avro, str) else avro["type"]
    kinds: dict[str, type | tuple[type, ...]] = {
        "boolean": bool,
        "int": int,
        "long": int,
        "float": float,
        "double": float,
        "bytes": (bytes, bytearray),
        "fixed": (bytes, bytearray),
        "string": str,
        "enum": str,
        "record": dict,
        "map": dict,
        "array": list,
    }
    return kinds.get(kind, object)


def spark_projection(
    avro: AvroType, column: Column, names: Names, namespace: str | None = None, *, maps_as_entries: bool = False
) -> Column:
    """``column`` with every date and timestamp inside replaced by its day / µs count (see the module doc); with
    ``maps_as_entries``, every map inside also replaced by its entries sorted by key (Spark compares no maps)."""
    from pyspark.sql import functions as F

    avro = names.resolve(avro, namespace)
    if not _projected_inside(avro, names, namespace, set(), maps_as_entries):
        return column

    def inner(inner_avro: AvroType, inner_column: Column, ns: str | None = namespace) -> Column:
        return spark_projection(inner_avro, inner_column, names, ns, maps_as_entries=maps_as_entries)

    if isinstance(avro, list):
        real = [b for b in avro if b != "null"]
        if len(real) == 1:
            return inner(real[0], column)
        members = [inner(b, column.getField(f"member{i}")).alias(f"member{i}") for i, b in enumerate(real)]
        return F.when(column.isNull(), F.lit(None)).otherwise(F.struct(*members))
    if isinstance(avro, str):
        return column
    kind, logical = avro["type"], avro.get("logicalType")
    if isinstance(kind, (dict, list)):
        return inner(kind, column)
    if logical == "date":
        return F.unix_date(column)
    if logical == "timestamp-micros":
        return F.unix_micros(column)
    if logical == "local-timestamp-micros":
        # timestamp_ntz -> timestamp reads the wall clock in the session zone, which the sinks set to UTC.
        return F.unix_micros(column.cast("timestamp"))
    if kind == "record":
        ns = avro.get("namespace", namespace)
        fields = [inner(f["type"], column.getField(f["name"]), ns).alias(f["name"]) for f in avro["fields"]]
        return F.when(column.isNull(), F.lit(None)).otherwise(F.struct(*fields))
    if kind == "array":
        return F.transform(column, lambda x: inner(avro["items"], x))
    if kind == "map":
        values = F.transform_values(column, lambda _k, v: inner(avro["values"], v))
        return F.array_sort(F.map_entries(values)) if maps_as_entries else values
    return column


def _projected_inside(avro: AvroType, names: Names, namespace: str | None, seen: set[str], maps: bool) -> bool:
    """Whether :func:`spark_projection` changes anything inside ``avro`` (a map counts when ``maps``)."""
    avro = names.resolve(avro, namespace)
    if isinstance(avro, list):
        return any(_projected_inside(b, names, namespace, seen, maps) for b in avro)
    if isinstance(avro, str):
        return False
    kind = avro["type"]
    if isinstance(kind, (dict, list)):
        return _projected_inside(kind, names, namespace, seen, maps)
    if avro.get("logicalType") in ("date", "timestamp-micros", "local-timestamp-micros"):
        return True
    if kind == "record":
        ns = avro.get("namespace", namespace)
        full = f"{ns}.{avro['name']}"
        if full in seen:
            return False
        seen.add(full)
        return any(_projected_inside(f["type"], names, ns, seen, maps) for f in avro["fields"])
    if kind == "array":
        return _projected_inside(avro["items"], names, namespace, seen, maps)
    if kind == "map":
        return maps or _projected_inside(avro["values"], names, namespace, seen, maps)
    return False


def search_mapping(avro: AvroType, names: Names, namespace: str | None = None) -> dict[str, Any]:
    """The OpenSearch field mapping for a column of this Avro type (its document form, see above)."""
    avro = names.resolve(avro, namespace)
    if isinstance(avro, list):
        real = [b for b in avro if b != "null"]
        if len(real) == 1:
            return search_mapping(real[0], names, namespace)
        first = names.resolve(real[0], namespace)
        if isinstance(first, dict) and first.get("logicalType") == "decimal":
            return {"type": "double", "ignore_malformed": True}  # NaN is the string branch
        return {"type": "object", "enabled": False}
    if isinstance(avro, str):
        avro = {"type": avro}
    kind, logical = avro["type"], avro.get("logicalType")
    if isinstance(kind, (dict, list)):
        return search_mapping(kind, names, namespace)
    if logical == "decimal":
        return {"type": "double", "ignore_malformed": True}
    if logical == "date":
        return {"type": "date", "format": "strict_date", "ignore_malformed": True}
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return {"type": "date_nanos", "format": "strict_date_optional_time_nanos", "ignore_malformed": True}
    if logical in ("uuid", "time-micros"):
        # A time of day is "HH:MM:SS.ffffff" (24:00:00 included): OpenSearch has no type for it, and the fixed
        # width makes a keyword's order the time's order.
        return {"type": "keyword"}
    simple: dict[str, dict[str, Any]] = {
        "boolean": {"type": "boolean"},
        # An int is mapped as a long: a field's mapping cannot change, and int → bigint is a routine ALTER.
        "int": {"type": "long"},
        "long": {"type": "long"},
        "float": {"type": "float", "ignore_malformed": True},
        "double": {"type": "double", "ignore_malformed": True},
        "bytes": {"type": "binary"},
        "string": {"type": "text", "fields": {"raw": {"type": "keyword", "ignore_above": 8191}}},
    }
    if kind in simple:
        return simple[kind]
    # Records, arrays and maps are kept in _source as they are, not indexed: their inner shape (e.g. a
    # PostgreSQL array's dims and lower bounds) is rarely what one searches by.
    return {"type": "object", "enabled": False}
