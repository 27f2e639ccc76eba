"""Scalar types: booleans, integers, floats, strings, bytes, identifiers, bits, network and misc types.

Every converter here is a module-level function or a bound builtin: nothing is looked up per call.
Types whose Avro value is their text output (inet, tsvector, bit strings…) rebuild PostgreSQL's exact text
from the binary send format, so both formats give the same string.
"""

from __future__ import annotations

import binascii
import re
import struct
from fractions import Fraction
from typing import Any

from schemas._conv import F32, F64, I16, I32, I64, U32, FormatError, conv

_U64_WRAP = 2**64
_I64_TOP = 2**63


def _identity(text: str) -> str:
    return text


def _decode(data: bytes) -> str:
    return data.decode()


# --- bool --------------------------------------------------------------------------------------------


BOOL = conv("boolean", "t".__eq__, b"\x01".__eq__, from_text=b"t".__eq__, wire="bool")


# --- integers, OIDs, transaction ids -----------------------------------------------------------------


# Hot converters bind what they call as default arguments: a local lookup instead of a global and an
# attribute lookup on every call (about a third of an int4's conversion time).


def _int2_bin(data: bytes, _unpack: Any = I16.unpack) -> int:
    return _unpack(data)[0]  # type: ignore[no-any-return]


def _int4_bin(data: bytes, _unpack: Any = I32.unpack) -> int:
    return _unpack(data)[0]  # type: ignore[no-any-return]


def _int8_bin(data: bytes, _unpack: Any = I64.unpack) -> int:
    return _unpack(data)[0]  # type: ignore[no-any-return]


def _uint4_bin(data: bytes, _unpack: Any = U32.unpack) -> int:
    return _unpack(data)[0]  # type: ignore[no-any-return]


def _uint8_str(text: str) -> int:
    """An unsigned 64-bit decimal as the signed long with the same bits (how Java and Debezium hold it)."""
    value = int(text)
    return value - _U64_WRAP if value >= _I64_TOP else value


INT2 = conv("int", int, _int2_bin, from_text=int, fixed="h")
INT4 = conv("int", int, _int4_bin, from_text=int, fixed="i")
INT8 = conv("long", int, _int8_bin, from_text=int, fixed="q")
# oid, xid and cid are unsigned 32-bit: they need a long.
UINT4 = conv("long", int, _uint4_bin, from_text=int, fixed="I")
# xid8 is unsigned 64-bit: reading its send format as a signed long gives exactly the two's-complement bits.
XID8 = conv("long", _uint8_str, _int8_bin)


def _lsn_str(text: str) -> int:
    high, _, low = text.partition("/")
    value = (int(high, 16) << 32) | int(low, 16)
    return value - _U64_WRAP if value >= _I64_TOP else value


PG_LSN = conv("long", _lsn_str, _int8_bin)


# --- floats ------------------------------------------------------------------------------------------


def _float4_str(text: str | bytes) -> float:
    """The float4 nearest to a decimal text (float('0.1') is not float4 0.1: round to float4 as well).

    Rounding to double first and then to float4 can err when the double lands exactly halfway between two
    float4s although the decimal does not; that case is settled exactly, off the fast path.
    """
    wide = float(text)
    near: float = F32.unpack(F32.pack(wide))[0]
    if near != wide:
        other = 2 * wide - near  # exact: when ``wide`` is a midpoint, the float4 on its other side
        if F32.unpack(F32.pack(other))[0] == other and other != near and other - wide == wide - near:
            return _float4_tie(text, wide, near, other)
    return near


def _float4_tie(text: str | bytes, wide: float, near: float, other: float) -> float:
    exact = Fraction(text.decode() if isinstance(text, bytes) else text)
    if exact == Fraction(wide):
        return near  # a true tie: struct rounded half to even, as PostgreSQL's strtof does
    return max(near, other) if exact > Fraction(wide) else min(near, other)


def _float4_bin(data: bytes, _unpack: Any = F32.unpack) -> float:
    return _unpack(data)[0]  # type: ignore[no-any-return]


def _float8_bin(data: bytes, _unpack: Any = F64.unpack) -> float:
    return _unpack(data)[0]  # type: ignore[no-any-return]


FLOAT4 = conv("float", _float4_str, _float4_bin, from_text=_float4_str, fixed="f")
FLOAT8 = conv("double", float, _float8_bin, from_text=float, fixed="d")


# --- money -------------------------------------------------------------------------------------------

# Every byte but the ASCII digits: deleting them from money's text leaves its integer count of minor units.
_NOT_DIGITS = bytes(b for b in range(256) if not 0x30 <= b <= 0x39)


def _money_text(data: bytes) -> int:
    # cash_out prints all of the locale's fraction digits, so the digits alone are the stored int64
    # (cents for most locales) whatever lc_monetary says; negatives carry '-' or parentheses.
    value = int(data.translate(None, _NOT_DIGITS))
    return -value if (b"-" in data or b"(" in data) else value


def _money_str(text: str) -> int:
    return _money_text(text.encode())


MONEY = conv("long", _money_str, _int8_bin, from_text=_money_text)


# --- strings -----------------------------------------------------------------------------------------

TEXT = conv("string", _identity, bytes.decode, from_text=bytes.decode, wire="text")

# "char" is one byte; charout prints NUL as '', ASCII as itself and high-bit bytes as \ooo octal.
_CHAR_TEXT = tuple("" if b == 0 else chr(b) if b < 0x80 else f"\\{b:03o}" for b in range(256))


def _char_bin(data: bytes) -> str:
    return _CHAR_TEXT[data[0]] if data else ""


CHAR = conv("string", _identity, _char_bin, from_text=bytes.decode)


def _uuid_bin(data: bytes) -> str:
    h = data.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


UUID = conv({"type": "string", "logicalType": "uuid"}, _identity, _uuid_bin, from_text=bytes.decode, wire="uuid")


def _versioned_text_bin(data: bytes) -> str:
    """jsonb, jsonpath and ltree send a version byte (1) and then their text output."""
    if data[0] != 1:
        raise FormatError(f"unsupported binary format version {data[:1]!r}")
    return data[1:].decode()


JSONB = conv("string", _identity, _versioned_text_bin, from_text=bytes.decode, wire="vtext")
VERSIONED_TEXT = JSONB


# --- bytea -------------------------------------------------------------------------------------------

_ESCAPED_BYTE = re.compile(rb"\\(\\|[0-3][0-7]{2})")


def _unescape_byte(match: re.Match[bytes]) -> bytes:
    token = match.group(1)
    return b"\\" if token == b"\\" else bytes((int(token, 8),))


def _bytea_text(data: bytes) -> bytes:
    if data[:2] == b"\\x":
        return binascii.a2b_hex(data[2:])
    # bytea_output = 'escape': printable ASCII as itself, backslash doubled, other bytes as \ooo.
    return _ESCAPED_BYTE.sub(_unescape_byte, data)


def _bytea_str(text: str) -> bytes:
    return _bytea_text(text.encode())


BYTEA = conv("bytes", _bytea_str, bytes, from_text=_bytea_text, wire="bytes")


# --- bit strings -------------------------------------------------------------------------------------


def _bits_bin(data: bytes) -> str:
    (nbits,) = I32.unpack_from(data)
    if nbits == 0:
        return ""
    body = data[4:]
    return format(int.from_bytes(body, "big"), f"0{len(body) * 8}b")[:nbits]


BITS = conv("string", _identity, _bits_bin, from_text=bytes.decode)


def _bit1_bin(data: bytes) -> bool:
    return bool(data[4] & 0x80)


# bit(1) holds exactly one bit: a boolean, as Debezium maps it.
BIT1 = conv("boolean", "1".__eq__, _bit1_bin, from_text=b"1".__eq__)


# --- network types -----------------------------------------------------------------------------------


def _mac_bin(data: bytes) -> str:
    return data.hex(":")


MACADDR = conv("string", _identity, _mac_bin, from_text=bytes.decode)


def _ipv6_text(addr: bytes) -> str:
    """PostgreSQL's IPv6 presentation (BIND's inet_net_ntop): the longest run of two or more zero
    words becomes '::', IPv4-mapped and IPv4-compatible addresses end in dotted quad.
    """
    words = [(addr[i] << 8) | addr[i + 1] for i in range(0, 16, 2)]
    best_base, best_len, cur_base, cur_len = -1, 0, -1, 0
    for i, word in enumerate(words):
        if word == 0:
            if cur_base == -1:
                cur_base, cur_len = i, 1
            else:
                cur_len += 1
        elif cur_base != -1:
            if best_base == -1 or cur_len > best_len:
                best_base, best_len = cur_base, cur_len
            cur_base = -1
    if cur_base != -1 and (best_base == -1 or cur_len > best_len):
        best_base, best_len = cur_base, cur_len
    if best_base != -1 and best_len < 2:
        best_base = -1
    out: list[str] = []
    for i in range(8):
        if best_base != -1 and best_base <= i < best_base + best_len:
            if i == best_base:
                out.append(":")
            continue
        if i != 0:
            out.append(":")
        if (
            i == 6
            and best_base == 0
            and (best_len == 6 or (best_len == 7 and words[7] != 1) or (best_len == 5 and words[5] == 0xFFFF))
        ):
            out.append(".".join(str(b) for b in addr[12:16]))
            break
        out.append(f"{words[i]:x}")
    if best_base != -1 and best_base + best_len == 8:
        out.append(":")
    return "".join(out)


def _make_inet_bin(is_cidr: bool) -> Any:
    def inet_bin(data: bytes) -> str:
        family, bits, _flag, size = data[0], data[1], data[2], data[3]
        addr = data[4 : 4 + size]
        if family == 2:  # PGSQL_AF_INET
            text, full = ".".join(str(b) for b in addr), 32
        elif family == 3:  # PGSQL_AF_INET6
            text, full = _ipv6_text(addr), 128
        else:
            raise FormatError(f"unknown inet address family {family}")
        # inet omits a full-length mask; cidr always shows it.
        return f"{text}/{bits}" if (bits != full or is_cidr) else text

    return inet_bin


INET = conv("string", _identity, _make_inet_bin(False), from_text=bytes.decode)
CIDR = conv("string", _identity, _make_inet_bin(True), from_text=bytes.decode)


# --- catalog and system types whose value is their text ----------------------------------------------


def _tid_bin(data: bytes) -> str:
    block = U32.unpack_from(data)[0]
    offset = int.from_bytes(data[4:6], "big")
    return f"({block},{offset})"


TID = conv("string", _identity, _tid_bin, from_text=bytes.decode)


_ARRAY_HEADER = struct.Struct(">iiI")


def _vector_bin(data: bytes) -> str:
    """int2vector and oidvector send the 1-D array format; their text is the elements joined by spaces."""
    ndim, _flags, elem_oid = _ARRAY_HEADER.unpack_from(data)
    if ndim == 0:
        return ""
    (count,) = I32.unpack_from(data, 12)
    pos, out = 20, []
    reader = I16 if elem_oid == 21 else U32
    for _ in range(count):
        (length,) = I32.unpack_from(data, pos)
        out.append(str(reader.unpack_from(data, pos + 4)[0]))
        pos += 4 + length
    return " ".join(out)


INT_VECTOR = conv("string", _identity, _vector_bin, from_text=bytes.decode)


def _snapshot_bin(data: bytes) -> str:
    (nxip,) = I32.unpack_from(data)
    xmin, xmax = I64.unpack_from(data, 4)[0], I64.unpack_from(data, 12)[0]
    xips = ",".join(str(I64.unpack_from(data, 20 + 8 * i)[0]) for i in range(nxip))
    return f"{xmin}:{xmax}:{xips}"


SNAPSHOT = conv("string", _identity, _snapshot_bin, from_text=bytes.decode)

# Types whose send format we cannot turn into their text (the reg* types send an OID but print a name that
# depends on the catalog and search_path), and types with no send function at all (aclitem): text only.
TEXT_ONLY = conv("string", _identity, None, from_text=bytes.decode)
