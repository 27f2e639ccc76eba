"""The row encoder: one contract, two implementations.

A row arrives as bytes, either a pgoutput TupleData (the stream) or a row of ``COPY … (FORMAT binary)`` output
(the snapshot), and leaves as the Avro bytes of the table's Value record plus the Confluent-framed key cut from
it (Key's fields are Value's key fields with the same types, so their encodings are the same bytes). The
capture encodes every row through :class:`RowEncoder`:

- ``cdc._native.TuplePlan`` (C) runs when the extension is built and ``CDC_PURE_PYTHON`` is not set;
- :class:`PythonRowEncoder` runs otherwise, and always when the C one refuses a row: it is the reference (the
  tests hold both to the same bytes) and it names what is wrong with a row it cannot encode (the column, a
  missing key), so a refusal becomes an actionable error instead of a second, slower way of encoding.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from schemas import AvroMapping, write_long

try:  # the C build (cdc/_native.pyx); optional: without it the Python encoder runs
    from cdc import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on how the package was built
    _native = None

Converter = Callable[[bytes], Any]
FieldWriter = Callable[[Any, bytearray], None]

COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_TEXT, _BINARY, _NULL, _UNCHANGED = ord("t"), ord("b"), ord("n"), ord("u")
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
PACKED_HEAD = struct.Struct(">II")  # a packed row's record and key lengths
# How the Python encoder writes a binary column: through its converter and field writer, or straight from the
# frame.
_GENERIC, _ZIGZAG, _UTF8 = 0, 1, 2
_INT_READERS = {code: struct.Struct(">" + code).unpack for code in ("h", "i", "q", "I")}

# encode()'s result: the Value record, the framed key (None when a key column is null or unchanged), the
# unchanged TOAST fields, and the position after the row.
Encoded = tuple[bytes, bytes | None, list[str], int]


# why a change's key columns must all have a value (a snapshot row's: see encode_copy_packed)
REPLICA_IDENTITY_HINT = "the table's REPLICA IDENTITY must include the key (REPLICA IDENTITY DEFAULT or FULL)"


class KeyMissingError(ValueError):
    """A row did not carry its key columns (the capture turns this into a StreamError)."""

    def __init__(self, table: str, missing: list[str], why: str) -> None:
        super().__init__(f"a row of {table} arrived without key column(s) {missing}: {why}")
        self.missing = missing


class ColumnError(ValueError):
    """A column's value could not be read or encoded (the message names the column; ``column`` holds it)."""

    def __init__(self, column: str, why: str) -> None:
        super().__init__(f"column {column!r}: {why}")
        self.column = column


class RowEncoder(Protocol):
    """What the capture encodes rows with (cdc._native.TuplePlan or :class:`PythonRowEncoder`).

    Both raise on anything malformed or unconvertible (struct.error, IndexError, ValueError…) before any side
    effect, and both give the same bytes for every row they take.
    """

    def encode(self, data: bytes, pos: int, copy_modes: bytes | None = None) -> Encoded:
        """The row at ``pos`` of ``data``: a pgoutput TupleData, or with ``copy_modes`` a row of binary COPY
        (Int16 field count, then per field an Int32 length, -1 for NULL, and the value in the format
        ``copy_modes[i]`` says, ord "b" or "t"; fields after the table's columns are left unread)."""
        ...

    def encode_copy_packed(self, data: bytes, copy_modes: bytes) -> tuple[bytes, int]:
        """A whole binary COPY output's rows packed into one bytes object: per row its record's and key's
        lengths (:data:`PACKED_HEAD`), the record, the key. Returns that and the number of rows; a NULL key
        raises."""
        ...


@dataclass(frozen=True)
class EncoderSpec:
    """What a table's encoder is made from (TableCodec builds it from the table's columns)."""

    table: str  # schema.table, for errors
    columns: tuple[str, ...]  # column names, for errors
    field_names: tuple[str, ...]  # their Avro field names (unchanged TOAST fields are reported by these)
    mappings: tuple[AvroMapping, ...]
    field_writers: tuple[FieldWriter, ...]  # schemas.compile_field_writers of the Value record
    key_indexes: tuple[int, ...]
    key_frame: bytes  # the Confluent frame of the key schema's id


def native_enabled() -> bool:
    """Whether codecs use the C encoder: it is built, and CDC_PURE_PYTHON is not set (a switch to rule it out
    when chasing a suspected encoding difference; the bytes must be the same either way)."""
    return _native is not None and os.environ.get("CDC_PURE_PYTHON", "") in ("", "0")


def native_module() -> Any | None:
    """The C build (cdc._native) when it is there and CDC_PURE_PYTHON does not turn it off, else None."""
    return _native if native_enabled() else None


def make_encoder(spec: EncoderSpec) -> RowEncoder:
    """The C encoder when :func:`native_enabled`, else the Python one."""
    if not native_enabled():
        return PythonRowEncoder(spec)
    return _native.TuplePlan(  # type: ignore[no-any-return]
        [_native_wire(m) for m in spec.mappings],
        tuple(m.from_text for m in spec.mappings),
        tuple(m.from_binary for m in spec.mappings),
        spec.field_writers,
        spec.field_names,
        spec.key_indexes,
        spec.key_frame,
    )


def _native_wire(mapping: AvroMapping) -> tuple[int, int]:
    """(how, scale) for the C encoder: which of its fast cases this mapping's send format takes, if any."""
    name, _, scale = (mapping.wire or mapping.fixed or "").partition(":")
    return _native.WIRES.get(name, 0), int(scale or 0)


def packed_rows(packed: bytes, records: bool = True) -> tuple[list[bytes], list[bytes] | None]:
    """:meth:`RowEncoder.encode_copy_packed`'s rows as (their keys, their records), each a list in order; the
    records are None when not asked for."""
    native = native_module()
    if native is not None:
        return native.packed_rows(packed, records)  # type: ignore[no-any-return]
    keys: list[bytes] = []
    recs: list[bytes] | None = [] if records else None
    at, size = 0, len(packed)
    while at < size:
        reclen, keylen = PACKED_HEAD.unpack_from(packed, at)
        at += PACKED_HEAD.size + reclen + keylen
        if at > size:
            raise ValueError("packed rows cut short")
        keys.append(packed[at - keylen : at])
        if recs is not None:
            recs.append(packed[at - keylen - reclen : at - keylen])
    return keys, recs


def copy_body_start(data: bytes) -> int:
    """Where the first row of a ``COPY … (FORMAT binary)`` output starts (after its signature and header)."""
    if data[:11] != COPY_SIGNATURE:
        raise ValueError("COPY output does not start with the binary COPY signature")
    (ext_len,) = _I32(data, 15)
    return 19 + int(ext_len)


@dataclass(frozen=True)
class CopyRowRefused:
    """A binary COPY row the Python encoder set aside: its fields (None for NULL) and why."""

    fields: list[bytes | None]
    error: ValueError


def copy_row_fields(data: bytes, pos: int) -> tuple[list[bytes | None], int | None]:
    """The fields of the binary COPY row at ``pos`` (None for NULL) and the position after it; None for the
    position when the row is cut short."""
    (nfields,) = _I16(data, pos)
    pos += 2
    fields: list[bytes | None] = []
    for _ in range(nfields):
        if pos + 4 > len(data):
            return fields, None
        (length,) = _I32(data, pos)
        pos += 4
        if length < 0:
            fields.append(None)
            continue
        if pos + length > len(data):
            return fields, None
        fields.append(data[pos : pos + length])
        pos += length
    return fields, pos


class PythonRowEncoder:
    """:class:`RowEncoder` in Python: the reference encoder, and the one that says what is wrong with a row."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self._ncols = len(spec.columns)
        self._text: tuple[Converter, ...] = tuple(m.from_text for m in spec.mappings)
        self._binary: tuple[Converter | None, ...] = tuple(m.from_binary for m in spec.mappings)
        self._fast = tuple(_fast_kind(m) for m in spec.mappings)
        self._ints = tuple(_INT_READERS.get(m.fixed or "") for m in spec.mappings)

    def encode(self, data: bytes, pos: int, copy_modes: bytes | None = None) -> Encoded:
        out, marks, unchanged, pos = self._record(data, pos, copy_modes)
        return bytes(out), self._key(out, marks), unchanged, pos

    def encode_keyed(
        self, data: bytes, pos: int, copy_modes: bytes | None = None
    ) -> tuple[bytes, bytes, list[str], int]:
        """:meth:`encode`, raising :class:`KeyMissingError` (naming the columns) when a key column is null or
        unchanged instead of giving no key."""
        out, marks, unchanged, pos = self._record(data, pos, copy_modes)
        return bytes(out), self._required_key(out, marks, REPLICA_IDENTITY_HINT), unchanged, pos

    def encode_copy_packed(self, data: bytes, copy_modes: bytes) -> tuple[bytes, int]:
        packed, rows, _ = self.encode_copy_rows(data, copy_modes, set_aside=False)
        return packed, rows

    def encode_copy_rows(
        self, data: bytes, copy_modes: bytes, *, set_aside: bool = True
    ) -> tuple[bytes, int, list[CopyRowRefused]]:
        """:meth:`encode_copy_packed`, a row whose values cannot be encoded set aside (its fields as COPY sent
        them, and why) instead of failing the chunk. Output that is malformed or cut short still raises."""
        pos = copy_body_start(data)
        out = bytearray()
        rows = 0
        refused: list[CopyRowRefused] = []
        while True:
            if pos + 2 > len(data):
                raise ValueError("the COPY output ends before its end marker (malformed or cut short)")
            if _I16(data, pos)[0] == -1:
                return bytes(out), rows, refused
            start = pos
            try:
                record, key, pos = self._copy_row(data, pos, copy_modes)
            except ValueError as exc:
                fields, end = copy_row_fields(data, start)  # raises if the row is cut short: not a value's fault
                if not set_aside or end is None:
                    raise
                refused.append(CopyRowRefused(fields, exc))
                pos = end
                continue
            out += PACKED_HEAD.pack(len(record), len(key))
            out += record
            out += key
            rows += 1

    def _copy_row(self, data: bytes, pos: int, copy_modes: bytes) -> tuple[bytes, bytes, int]:
        """One binary COPY row's record and key, and the position after it (its fields after the table's
        columns, the resume key, skipped)."""
        (nfields,) = _I16(data, pos)
        record, marks, _, pos = self._record(data, pos, copy_modes)
        key = self._required_key(record, marks, "key columns must be NOT NULL (choose others with source.key_columns)")
        for _ in range(nfields - self._ncols):
            (length,) = _I32(data, pos)
            pos += 4 + max(length, 0)
        return bytes(record), key, pos

    def _key(self, out: bytearray, marks: list[int]) -> bytes | None:
        key = bytearray(self.spec.key_frame)
        for k in self.spec.key_indexes:
            if out[marks[k]] == 0:  # the null branch: the key column is missing
                return None
            key += out[marks[k] : marks[k + 1]]
        return bytes(key)

    def _required_key(self, out: bytearray, marks: list[int], why: str) -> bytes:
        """The record's key; KeyMissingError naming the key columns it holds no value of, and ``why`` they must."""
        key = self._key(out, marks)
        if key is None:
            missing = [self.spec.columns[k] for k in self.spec.key_indexes if out[marks[k]] == 0]
            raise KeyMissingError(self.spec.table, missing, why)
        return key

    def _record(self, data: bytes, pos: int, copy_modes: bytes | None) -> tuple[bytearray, list[int], list[str], int]:
        """The Value record, where each column's bytes start in it (and where they end), the unchanged TOAST
        fields, and the position after the row."""
        ncols = self._ncols
        if copy_modes is None:
            if _U16(data, pos)[0] != ncols:
                raise ValueError(f"column count {_U16(data, pos)[0]} differs from the relation's {ncols}")
        elif _I16(data, pos)[0] < ncols:
            raise ValueError("the COPY row has fewer fields than the table has columns")
        pos += 2
        out = bytearray()
        marks: list[int] = []
        unchanged: list[str] = []
        i = 0
        try:
            for i in range(ncols):
                marks.append(len(out))
                if copy_modes is None:
                    pos = self._tuple_column(i, data, pos, out, unchanged)
                else:
                    pos = self._copy_column(i, data, pos, copy_modes[i], out)
        except Exception as exc:  # whatever a converter raises: say which column
            raise ColumnError(self.spec.columns[i], str(exc) or type(exc).__name__) from exc
        marks.append(len(out))
        return out, marks, unchanged, pos

    def _tuple_column(self, i: int, data: bytes, pos: int, out: bytearray, unchanged: list[str]) -> int:
        """Column ``i`` of a pgoutput TupleData at ``pos``: its kind byte, then for 'b' and 't' a length and the
        value. Returns the position after it."""
        kind = data[pos]
        if kind in (_BINARY, _TEXT):
            length: int = _U32(data, pos + 1)[0]
            self._value(i, kind, _cut(data, pos + 5, length), out)
            return pos + 5 + length
        if kind == _NULL:
            out.append(0)
        elif kind == _UNCHANGED:
            out.append(0)
            unchanged.append(self.spec.field_names[i])
        else:
            raise ValueError(f"unknown value kind {kind:#04x}")
        return pos + 1

    def _copy_column(self, i: int, data: bytes, pos: int, mode: int, out: bytearray) -> int:
        """Column ``i`` of a binary COPY row at ``pos``: a length (-1: NULL), then the value in ``mode``."""
        length: int = _I32(data, pos)[0]
        if length < 0:
            out.append(0)
            return pos + 4
        self._value(i, mode, _cut(data, pos + 4, length), out)
        return pos + 4 + length

    def _value(self, i: int, kind: int, raw: bytes, out: bytearray) -> None:
        """Writes column ``i``'s value ``raw`` (text or binary: ``kind``) into the record's ["null", type]
        union."""
        if kind == _TEXT:
            self.spec.field_writers[i](self._text[i](raw), out)
            return
        how = self._fast[i]
        if how == _ZIGZAG:
            n = self._ints[i](raw)[0]  # type: ignore[misc]
            out.append(2)
            if 0 <= n < 64:
                out.append(n << 1)
            else:
                write_long(n, out)
        elif how == _UTF8:
            if not raw.isascii():
                raw.decode()  # PostgreSQL sends the database's encoding: Avro strings must be UTF-8
            out.append(2)
            write_long(len(raw), out)
            out += raw
        else:
            convert = self._binary[i]
            if convert is None:
                raise ValueError("a binary value, but the column has no binary reader")
            self.spec.field_writers[i](convert(raw), out)


def _cut(data: bytes, start: int, length: int) -> bytes:
    """The ``length`` bytes at ``start``; a value cut short raises."""
    raw = data[start : start + length]
    if len(raw) != length:
        raise ValueError("truncated column")
    return raw


def _fast_kind(mapping: AvroMapping) -> int:
    """How the Python encoder writes a binary value of this mapping (see _GENERIC, _ZIGZAG, _UTF8)."""
    if mapping.fixed in _INT_READERS and mapping.schema in ("int", "long"):
        return _ZIGZAG  # an Avro int/long that is the send format's integer as is
    if mapping.wire == "text":
        return _UTF8  # text, varchar, …: the send format is the string's bytes
    return _GENERIC


__all__ = [
    "COPY_SIGNATURE",
    "PACKED_HEAD",
    "REPLICA_IDENTITY_HINT",
    "ColumnError",
    "CopyRowRefused",
    "EncoderSpec",
    "KeyMissingError",
    "PythonRowEncoder",
    "RowEncoder",
    "copy_body_start",
    "copy_row_fields",
    "make_encoder",
    "native_enabled",
    "native_module",
    "packed_rows",
]
