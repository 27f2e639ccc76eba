"""Containers: arrays, composites, ranges, multiranges and hstore, in both wire formats.

Text formats are parsed as PostgreSQL's output functions write them (array_out, record_out, range_out,
multirange_out, hstore_out), quoting rules included; each element's text then goes to the element type's
``from_str``. Binary formats are the send functions' (array_send, record_send, range_send…), each element
going to the element type's ``from_binary``.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

from schemas._conv import I32, Conv, FormatError, conv, nullable

# --- arrays ------------------------------------------------------------------------------------------

_ARRAY_HEADER = struct.Struct(">iiI")  # ndim, has-nulls flag, element type OID; then (dim, lbound) per dimension
_DIM = struct.Struct(">ii")
_CACHED_FIXED_LENGTHS = 256
_DECORATION = re.compile(r"\[(-?\d+):(-?\d+)\]")
_ESCAPE = re.compile(r"\\(.)", re.S)


def _array_tokens(delimiter: str) -> re.Pattern[str]:
    d = re.escape(delimiter)
    return re.compile(rf'\{{|\}}|{d}|"((?:[^"\\]|\\.)*)"|([^{d}{{}}"]+)', re.S)


def parse_array_text(
    text: str, delimiter: str, tokens: re.Pattern[str]
) -> tuple[list[str | None], list[int], list[int]]:
    """(elements in row-major order, dimension lengths, lower bounds) of array_out's output."""
    start, lower_bounds = 0, None
    if text[:1] == "[":  # "[0:1][2:3]={...}": lower bounds other than 1
        start = text.index("=") + 1
        lower_bounds = [int(lower) for lower, _ in _DECORATION.findall(text, 0, start)]
    if text[start : start + 1] != "{" or text[-1:] != "}":
        raise FormatError(f"not an array: {text[:80]!r}")
    if text[start:] == "{}":
        return [], [], []
    body = text[start + 1 : -1]
    if "{" not in body:  # 1-D
        if '"' not in body:  # the common case: nothing quoted
            elements: list[str | None] = [None if e == "NULL" else e for e in body.split(delimiter)]
        else:
            elements = _parse_flat(body, delimiter)
        dims = [len(elements)]
    else:
        elements, dims = _parse_nested(text, start, tokens)
    return elements, dims, lower_bounds if lower_bounds is not None else [1] * len(dims)


def _flat_pattern(delimiter: str) -> re.Pattern[str]:
    d = re.escape(delimiter)
    return re.compile(rf'"((?:[^"\\]|\\.)*)"(?:{d}|\Z)|([^"{d}]*)(?:{d}|\Z)', re.S)


_FLAT = {d: _flat_pattern(d) for d in ",;"}  # every built-in type's delimiter


def _parse_flat(body: str, delimiter: str) -> list[str | None]:
    """The elements of a 1-D array's body, some quoted (no braces outside quotes)."""
    pattern = _FLAT.get(delimiter) or _flat_pattern(delimiter)
    elements: list[str | None] = []
    pos, end = 0, len(body)
    while pos < end:
        match = pattern.match(body, pos)
        if match is None or match.end() == pos:
            raise FormatError(f"malformed array at {pos}: {body[:80]!r}")
        quoted = match[1]
        if quoted is not None:
            elements.append(_ESCAPE.sub(r"\1", quoted) if "\\" in quoted else quoted)
        else:
            elements.append(None if match[2] == "NULL" else match[2])
        pos = match.end()
    if body.endswith(delimiter):  # a last element that is empty cannot be unquoted: malformed
        raise FormatError(f"malformed array: {body[:80]!r}")
    return elements


def _parse_nested(text: str, start: int, tokens: re.Pattern[str]) -> tuple[list[str | None], list[int]]:
    elements: list[str | None] = []
    dims: list[int] = []
    counts: list[int] = []  # items seen so far in each open brace
    depth, pos = 0, start
    for match in tokens.finditer(text, start):
        if match.start() != pos:
            raise FormatError(f"malformed array at {pos}: {text[:80]!r}")
        pos = match.end()
        delimiter_or_brace = match[0]
        if delimiter_or_brace == "{":
            if depth:
                counts[depth - 1] += 1
            depth += 1
            if len(counts) < depth:
                counts.append(0)
            counts[depth - 1] = 0
        elif delimiter_or_brace == "}":
            if len(dims) < depth:
                dims.extend([-1] * (depth - len(dims)))
            if dims[depth - 1] == -1:
                dims[depth - 1] = counts[depth - 1]
            elif dims[depth - 1] != counts[depth - 1]:
                raise FormatError(f"array is not rectangular: {text[:80]!r}")
            depth -= 1
        elif match[1] is not None:  # quoted element
            counts[depth - 1] += 1
            elements.append(_ESCAPE.sub(r"\1", match[1]))
        elif match[2] is not None:
            counts[depth - 1] += 1
            elements.append(None if match[2] == "NULL" else match[2])
    if pos != len(text) or depth:
        raise FormatError(f"malformed array: {text[:80]!r}")
    return elements, dims


def array(name: str, element: Conv, delimiter: str) -> Conv:
    """An array type as a record: ``elements`` (row-major, nullable), ``dims`` and ``lower_bounds``.

    A PostgreSQL array column holds arrays of any number of dimensions and any lower bounds, and both
    take part in equality; a plain Avro array could only keep the elements. ``{1,2}`` is
    ``{"elements": [1, 2], "dims": [2], "lower_bounds": [1]}``, ``{}`` has no dims at all.
    """
    ints = {"type": "array", "items": "int"}
    schema = {
        "type": "record",
        "name": name,
        "fields": [
            {"name": "elements", "type": {"type": "array", "items": nullable(element.schema)}},
            {"name": "dims", "type": ints},
            {"name": "lower_bounds", "type": ints},
        ],
    }
    tokens = _array_tokens(delimiter)
    element_str = element.from_str

    def from_str(text: str) -> dict[str, Any]:
        raw, dims, lower_bounds = parse_array_text(text, delimiter, tokens)
        return {
            "elements": [None if e is None else element_str(e) for e in raw],
            "dims": dims,
            "lower_bounds": lower_bounds,
        }

    if element.from_binary is None:
        return conv(schema, from_str, None)
    return conv(schema, from_str, _array_from_binary(element.from_binary, element.fixed))


def _array_from_binary(element_bin: Callable[[bytes], Any], fixed: str | None) -> Callable[[bytes], dict[str, Any]]:
    """The reader of an array's binary form (array_send) whose elements ``element_bin`` reads; ``fixed``: the
    struct format of a fixed-width element, read for a whole array without nulls in one unpack."""
    fixed_readers: dict[int, struct.Struct] = {}

    def from_binary(data: bytes, _element: Any = element_bin) -> dict[str, Any]:
        ndim, has_nulls, _oid = _ARRAY_HEADER.unpack_from(data)
        dims, lower_bounds = [], []
        total = 1 if ndim else 0
        pos = 12
        for _ in range(ndim):
            dim, lower = _DIM.unpack_from(data, pos)
            dims.append(dim)
            lower_bounds.append(lower)
            total *= dim
            pos += 8
        if fixed is not None and not has_nulls:
            # Every element is its length (4 bytes, skipped) and a fixed-width value: one unpack reads all.
            reader = fixed_readers.get(total)
            if reader is None:
                reader = struct.Struct(">" + ("4x" + fixed) * total)
                if total <= _CACHED_FIXED_LENGTHS:  # bounded: one reader per array length seen
                    fixed_readers[total] = reader
            return {"elements": list(reader.unpack_from(data, pos)), "dims": dims, "lower_bounds": lower_bounds}
        elements: list[Any] = []
        append = elements.append
        unpack = I32.unpack_from
        for _ in range(total):
            (length,) = unpack(data, pos)
            pos += 4
            if length < 0:
                append(None)
            else:
                append(_element(data[pos : pos + length]))
                pos += length
        return {"elements": elements, "dims": dims, "lower_bounds": lower_bounds}

    return from_binary


# --- composites --------------------------------------------------------------------------------------

# record_out writes a field unquoted, or quoted with '"' and '\' doubled; empty and unquoted is NULL.
_FIELD = re.compile(r'"((?:[^"\\]|\\.|"")*)"|([^,"]*)', re.S)
_FIELD_ESCAPE = re.compile(r'\\(.)|""', re.S)


def _unescape_field(match: re.Match[str]) -> str:
    return match[1] if match[1] is not None else '"'


def split_record_text(text: str, count: int) -> list[str | None]:
    """The fields of record_out's output, NULL as None (``()`` is no field when ``count`` is 0)."""
    if text[:1] != "(" or text[-1:] != ")":
        raise FormatError(f"not a composite value: {text[:80]!r}")
    if count == 0 and text == "()":
        return []
    fields: list[str | None] = []
    pos, end = 1, len(text) - 1
    while True:
        match = _FIELD.match(text, pos, end)
        if match is None:  # pragma: no cover - the pattern matches the empty string
            raise FormatError(f"malformed composite value: {text[:80]!r}")
        if match[1] is not None:
            fields.append(_FIELD_ESCAPE.sub(_unescape_field, match[1]))
        else:
            fields.append(match[2] or None)
        pos = match.end()
        if pos >= end:
            break
        if text[pos] != ",":
            raise FormatError(f"malformed composite value at {pos}: {text[:80]!r}")
        pos += 1
    return fields


def composite(name: str, qualified: str, fields: list[tuple[str, Conv]]) -> Conv:
    """A composite type as an Avro record of nullable fields (an attribute can always be NULL)."""
    schema = {
        "type": "record",
        "name": name,
        "fields": [{"name": field, "type": nullable(c.schema), "default": None} for field, c in fields],
    }
    count = len(fields)
    text_fields = [(field, c.from_str) for field, c in fields]

    def from_str(text: str) -> dict[str, Any]:
        raw = split_record_text(text, count)
        if len(raw) != count:
            raise FormatError(f"{qualified} has {count} attributes, the value {len(raw)} (type altered?)")
        return {f: None if r is None else parse(r) for (f, parse), r in zip(text_fields, raw, strict=True)}

    if any(c.from_binary is None for _, c in fields):
        return conv(schema, from_str, None)
    binary_fields = [(field, c.from_binary) for field, c in fields]
    header = struct.Struct(">Ii")  # attribute type OID, length (-1 for NULL)

    def from_binary(data: bytes) -> dict[str, Any]:
        (got,) = I32.unpack_from(data)
        if got != count:
            raise FormatError(f"{qualified} has {count} attributes, the value {got} (type altered?)")
        out: dict[str, Any] = {}
        pos = 4
        for field, parse in binary_fields:
            length = header.unpack_from(data, pos)[1]
            pos += 8
            if length < 0:
                out[field] = None
            else:
                out[field] = parse(data[pos : pos + length])  # type: ignore[misc]
                pos += length
        return out

    return conv(schema, from_str, from_binary)


# --- ranges and multiranges --------------------------------------------------------------------------

# range_out: '[' or '(', lower, ',', upper, ']' or ')'; a bound is quoted like a record field, an
# infinite bound is empty.
_RANGE = re.compile(r'([\[(])(?:"((?:[^"\\]|\\.|"")*)"|([^,"]*)),(?:"((?:[^"\\]|\\.|"")*)"|([^\])"]*))([\])])', re.S)
_EMPTY_FLAG, _LB_INC, _UB_INC, _LB_INF, _UB_INF = 0x01, 0x02, 0x04, 0x08, 0x10


def _range_schema(name: str, subtype: Conv) -> dict[str, Any]:
    bound = nullable(subtype.schema)
    return {
        "type": "record",
        "name": name,
        "fields": [
            {"name": "lower", "type": bound, "default": None},
            {"name": "upper", "type": bound, "default": None},
            {"name": "lower_inclusive", "type": "boolean"},
            {"name": "upper_inclusive", "type": "boolean"},
            {"name": "empty", "type": "boolean"},
        ],
    }


_EMPTY_RANGE = {"lower": None, "upper": None, "lower_inclusive": False, "upper_inclusive": False, "empty": True}


def _range_parsers(subtype: Conv) -> tuple[Any, Any]:
    """(parse range text at a position → (value, end), parse range send format) for this subtype."""
    sub_str, sub_bin = subtype.from_str, subtype.from_binary

    def bound(quoted: str | None, bare: str) -> Any:
        if quoted is not None:
            return sub_str(_FIELD_ESCAPE.sub(_unescape_field, quoted))
        return sub_str(bare) if bare else None

    def parse_text(text: str, pos: int) -> tuple[dict[str, Any], int]:
        if text.startswith("empty", pos):
            return dict(_EMPTY_RANGE), pos + 5
        match = _RANGE.match(text, pos)
        if match is None:
            raise FormatError(f"not a range: {text[pos : pos + 80]!r}")
        return {
            "lower": bound(match[2], match[3]),
            "upper": bound(match[4], match[5]),
            "lower_inclusive": match[1] == "[",
            "upper_inclusive": match[6] == "]",
            "empty": False,
        }, match.end()

    def parse_binary(data: bytes) -> dict[str, Any]:
        flags = data[0]
        if flags & _EMPTY_FLAG:
            return dict(_EMPTY_RANGE)
        pos, lower, upper = 1, None, None
        if not flags & _LB_INF:
            (length,) = I32.unpack_from(data, pos)
            lower = sub_bin(data[pos + 4 : pos + 4 + length])  # type: ignore[misc]
            pos += 4 + length
        if not flags & _UB_INF:
            (length,) = I32.unpack_from(data, pos)
            upper = sub_bin(data[pos + 4 : pos + 4 + length])  # type: ignore[misc]
        return {
            "lower": lower,
            "upper": upper,
            "lower_inclusive": bool(flags & _LB_INC),
            "upper_inclusive": bool(flags & _UB_INC),
            "empty": False,
        }

    return parse_text, (parse_binary if sub_bin is not None else None)


def range_(name: str, subtype: Conv) -> Conv:
    """A range type as a record: bounds (null when unbounded), their inclusivity, and emptiness."""
    parse_text, parse_binary = _range_parsers(subtype)

    def from_str(text: str) -> dict[str, Any]:
        value, end = parse_text(text, 0)
        if end != len(text):
            raise FormatError(f"not a range: {text[:80]!r}")
        return value  # type: ignore[no-any-return]

    return conv(_range_schema(name, subtype), from_str, parse_binary)


def multirange(range_name: str, subtype: Conv) -> Conv:
    """A multirange as an Avro array of its range records, in PostgreSQL's (sorted, merged) order."""
    parse_text, parse_binary = _range_parsers(subtype)
    schema = {"type": "array", "items": _range_schema(range_name, subtype)}

    def from_str(text: str) -> list[dict[str, Any]]:
        if text[:1] != "{" or text[-1:] != "}":
            raise FormatError(f"not a multirange: {text[:80]!r}")
        out: list[dict[str, Any]] = []
        pos, end = 1, len(text) - 1
        while pos < end:
            value, pos = parse_text(text, pos)
            out.append(value)
            if pos < end:
                if text[pos] != ",":
                    raise FormatError(f"malformed multirange at {pos}: {text[:80]!r}")
                pos += 1
        return out

    if parse_binary is None:
        return conv(schema, from_str, None)

    def from_binary(data: bytes) -> list[dict[str, Any]]:
        (count,) = I32.unpack_from(data)
        out, pos = [], 4
        for _ in range(count):
            (length,) = I32.unpack_from(data, pos)
            out.append(parse_binary(data[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        return out

    return conv(schema, from_str, from_binary)


# --- hstore ------------------------------------------------------------------------------------------

_HSTORE_PAIR = re.compile(r'"((?:[^"\\]|\\.)*)"=>(?:"((?:[^"\\]|\\.)*)"|(NULL))(, |\Z)', re.S)


def _hstore_str(text: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    pos = 0
    while pos < len(text):
        match = _HSTORE_PAIR.match(text, pos)
        if match is None:
            raise FormatError(f"not an hstore at {pos}: {text[:80]!r}")
        value = match[2]
        out[_ESCAPE.sub(r"\1", match[1])] = None if value is None else _ESCAPE.sub(r"\1", value)
        pos = match.end()
    return out


def _hstore_bin(data: bytes) -> dict[str, str | None]:
    (count,) = I32.unpack_from(data)
    out: dict[str, str | None] = {}
    pos = 4
    for _ in range(count):
        (length,) = I32.unpack_from(data, pos)
        key = data[pos + 4 : pos + 4 + length].decode()
        pos += 4 + length
        (length,) = I32.unpack_from(data, pos)
        pos += 4
        if length < 0:
            out[key] = None
        else:
            out[key] = data[pos : pos + length].decode()
            pos += length
    return out


# hstore (an extension): a map of nullable strings, as its keys are strings and its values strings or NULL.
HSTORE = conv({"type": "map", "values": ["null", "string"]}, _hstore_str, _hstore_bin)
