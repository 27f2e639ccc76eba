"""The building block every type module returns: an Avro schema and the converters that fill it.

A :class:`Conv` carries one more converter than the public :class:`~schemas.AvroMapping`: ``from_str``,
the text-format converter for a value that is already a ``str``. Containers (arrays, composites, ranges,
hstore) parse their own text format into ``str`` pieces and hand each piece to the element's
``from_str``; encoding the piece back to bytes only to decode it again would be wasted work.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

AvroSchema: TypeAlias = str | dict[str, Any] | list[Any]
"""An Avro schema as its JSON value: a type name, a complex type (dict) or a union (list)."""

Converter: TypeAlias = Callable[[bytes], Any]
StrConverter: TypeAlias = Callable[[str], Any]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# Precompiled big-endian readers, shared by every type module (PostgreSQL's send format is network order).
I16 = struct.Struct(">h")
I32 = struct.Struct(">i")
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
F32 = struct.Struct(">f")
F64 = struct.Struct(">d")


class UnsupportedTypeError(ValueError):
    """A PostgreSQL type (or type modifier) that has no lossless Avro representation here.

    The message names the type and what to do about it.
    """


class ValueOutOfRangeError(ValueError):
    """A value PostgreSQL holds that the column's Avro type cannot represent exactly.

    The one case among built-in types: a timestamp after 294247-01-10 04:00:54.775806 UTC (the last
    microsecond an Avro ``long`` counts from 1970), which PostgreSQL accepts up to 294276 AD.
    """


class FormatError(ValueError):
    """Bytes that are not a value of the column's type in the expected format (text or binary)."""


@dataclass(frozen=True, slots=True)
class Conv:
    """One PostgreSQL type with one type modifier, mapped: Avro schema and value converters."""

    schema: AvroSchema
    from_str: StrConverter
    from_text: Converter
    from_binary: Converter | None
    # For fixed-width types whose Avro value is the send format read as is (int4, float8…): the struct
    # code that reads it, so that an array of them without NULLs is read by one unpack.
    fixed: str | None = None
    # How the capture's fast path may write the send format without calling ``from_binary`` (see wire_of in
    # cdc/_events.py): "text", "vtext" (a version byte, then text), "ts", "date", "bool", "uuid", "bytes",
    # "decimal:<scale>". It handles only a value's common case; anything else goes through the converter.
    wire: str | None = None


def conv(
    schema: AvroSchema,
    from_str: StrConverter,
    from_binary: Converter | None,
    from_text: Converter | None = None,
    *,
    fixed: str | None = None,
    wire: str | None = None,
) -> Conv:
    """A :class:`Conv`; ``from_text`` defaults to decoding UTF-8 and calling ``from_str``."""
    if from_text is None:

        def from_text(data: bytes, _from_str: StrConverter = from_str) -> Any:
            return _from_str(data.decode())

    return Conv(schema, from_str, from_text, from_binary, fixed, wire)


def nullable(schema: AvroSchema) -> list[Any]:
    """``schema`` as the Avro union that also admits null, with null first (so a field can default to null).

    Avro forbids a union directly inside a union, so a union schema (numeric(p,s) maps to one) is
    flattened instead of nested: ``[decimal, "string"]`` becomes ``["null", decimal, "string"]``.
    """
    if isinstance(schema, list):
        return schema if schema[:1] == ["null"] else ["null", *schema]
    return ["null", schema]
