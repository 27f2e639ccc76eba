"""A compiled Avro binary writer for Avro-ready values: the capture service's hot path.

fastavro's ``schemaless_writer`` resolves the schema for every record; here a schema is compiled once into
nested closures that append straight to a ``bytearray``. Values must already be Avro-ready (what
``AvroMapping`` converters return: ints for logical dates and times, unscaled bytes for decimals…), so no
logical-type conversion happens here. The output is byte-for-byte what fastavro writes for the same
values; tests compare the two on every type the mappings produce.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

Writer = Callable[[Any, bytearray], None]

_FLOAT = struct.Struct("<f").pack
_DOUBLE = struct.Struct("<d").pack


def write_long(n: int, out: bytearray) -> None:
    """Avro int/long: zig-zag, then base-128 varint."""
    if 0 <= n < 64:  # most lengths, counts and small ids: one byte, no loop
        out.append(n << 1)
        return
    n = (n << 1) ^ (n >> 63)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def write_string(s: str, out: bytearray) -> None:
    data = s.encode()
    write_long(len(data), out)
    out += data


def write_bytes(b: bytes, out: bytearray) -> None:
    write_long(len(b), out)
    out += b


def _write_null(_v: Any, _out: bytearray) -> None:
    return None


def _write_boolean(v: Any, out: bytearray) -> None:
    out.append(1 if v else 0)


def _write_float(v: Any, out: bytearray) -> None:
    out += _FLOAT(v)


def _write_double(v: Any, out: bytearray) -> None:
    out += _DOUBLE(v)


_PRIMITIVES: dict[str, Writer] = {
    "null": _write_null,
    "boolean": _write_boolean,
    "int": write_long,
    "long": write_long,
    "float": _write_float,
    "double": _write_double,
    "bytes": write_bytes,
    "string": write_string,
}

# Which Python types a union branch of each Avro type accepts, in the order fastavro tries them.
_ACCEPTS: dict[str, tuple[type, ...]] = {
    "null": (type(None),),
    "boolean": (bool,),
    "int": (int,),
    "long": (int,),
    "float": (float, int),
    "double": (float, int),
    "bytes": (bytes, bytearray, memoryview),
    "string": (str,),
    "fixed": (bytes, bytearray, memoryview),
    "enum": (str,),
    "array": (list, tuple),
    "map": (dict,),
    "record": (dict,),
}


class UnsupportedSchemaError(ValueError):
    """The schema uses something this writer does not compile (callers fall back to fastavro)."""


def compile_writer(schema: Any) -> Writer:
    """A function ``write(value, out)`` appending the Avro binary encoding of ``value`` to ``out``."""
    return _Compiler().compile(schema, None)


def compile_field_writers(record: dict[str, Any]) -> list[Writer]:
    """One writer per field of ``record``, in order: ``write(field_value, out)`` (the record's own writer calls
    them in turn). Named types defined by an earlier field resolve in later ones, as in the whole record."""
    compiler = _Compiler()
    ns = record.get("namespace")
    if "." in record["name"]:
        ns = record["name"].rsplit(".", 1)[0]
    return [compiler.compile(f["type"], ns) for f in record["fields"]]


class _Compiler:
    def __init__(self) -> None:
        self.named: dict[str, Writer] = {}
        self.kinds: dict[str, str] = {}

    def _fullname(self, name: str, namespace: str | None) -> str:
        return name if "." in name or not namespace else f"{namespace}.{name}"

    def kind(self, schema: Any, namespace: str | None) -> str:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return schema
            return self.kinds[self._fullname(schema, namespace)]
        if isinstance(schema, list):
            return "union"
        t = schema["type"]
        return str(t) if isinstance(t, str) and (t in _ACCEPTS or t == "union") else self.kind(t, namespace)

    def compile(self, schema: Any, namespace: str | None) -> Writer:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return _PRIMITIVES[schema]
            full = self._fullname(schema, namespace)
            if full not in self.named:
                raise UnsupportedSchemaError(f"reference to undefined type {schema!r}")
            # A named type may refer to itself: look it up at call time.
            named = self.named
            return lambda v, out: named[full](v, out)  # noqa: PLW0108 - late binding is the point
        if isinstance(schema, list):
            return self._union(schema, namespace)
        t = schema["type"]
        if t == "record":
            return self._record(schema, namespace)
        if t == "enum":
            full = self._fullname(schema["name"], schema.get("namespace", namespace))
            index = {s: i for i, s in enumerate(schema["symbols"])}
            self.kinds[full] = "enum"

            def write_enum(v: Any, out: bytearray) -> None:
                write_long(index[v], out)

            self.named[full] = write_enum
            return write_enum
        if t == "fixed":
            full = self._fullname(schema["name"], schema.get("namespace", namespace))
            self.kinds[full] = "fixed"

            def write_fixed(v: Any, out: bytearray) -> None:
                out += v

            self.named[full] = write_fixed
            return write_fixed
        if t == "array":
            item = self.compile(schema["items"], namespace)

            def write_array(v: Any, out: bytearray) -> None:
                if v:
                    write_long(len(v), out)
                    for x in v:
                        item(x, out)
                out.append(0)

            return write_array
        if t == "map":
            value = self.compile(schema["values"], namespace)

            def write_map(v: Any, out: bytearray) -> None:
                if v:
                    write_long(len(v), out)
                    for k, x in v.items():
                        write_string(k, out)
                        value(x, out)
                out.append(0)

            return write_map
        if isinstance(t, str) and t in _PRIMITIVES:
            return _PRIMITIVES[t]  # a primitive with a logical type: the value is already Avro-ready
        return self.compile(t, namespace)

    def _record(self, schema: dict[str, Any], namespace: str | None) -> Writer:
        ns = schema.get("namespace", namespace)
        full = self._fullname(schema["name"], ns)
        if "." in schema["name"]:
            ns = schema["name"].rsplit(".", 1)[0]
        self.kinds[full] = "record"
        self.named[full] = _write_null  # placeholder while the fields compile (self-reference)
        fields = [(f["name"], self.compile(f["type"], ns)) for f in schema["fields"]]

        def write_record(v: Any, out: bytearray) -> None:
            for name, write in fields:
                write(v.get(name), out)

        self.named[full] = write_record
        return write_record

    def _union(self, branches: list[Any], namespace: str | None) -> Writer:
        compiled = [self.compile(b, namespace) for b in branches]
        kinds = [self.kind(b, namespace) for b in branches]
        if kinds == ["null", kinds[1]] and len(kinds) == 2 and kinds[1] != "null":
            # The common case: an optional value.
            write_value = compiled[1]

            def write_optional(v: Any, out: bytearray) -> None:
                if v is None:
                    out.append(0)
                else:
                    out.append(2)
                    write_value(v, out)

            return write_optional
        choices: list[tuple[tuple[type, ...], int, Writer]] = [
            (_ACCEPTS[k], i, w) for i, (k, w) in enumerate(zip(kinds, compiled, strict=True))
        ]

        def write_union(v: Any, out: bytearray) -> None:
            for accepts, index, write in choices:
                # bool is an int in Python; never let True pick an int branch (or an int a boolean one).
                if isinstance(v, accepts) and not (isinstance(v, bool) and bool not in accepts):
                    write_long(index, out)
                    write(v, out)
                    return
            raise ValueError(f"no branch of union {branches!r} accepts {type(v).__name__}")

        return write_union
