"""numeric: Avro decimal when the column fixes the scale, else PostgreSQL's exact text.

numeric(p,s) becomes ``["bytes" decimal(P,S), "string"]``: the decimal branch holds every number (the
two's-complement big-endian unscaled integer, sized as fastavro sizes it, so our bytes equal fastavro's),
the string branch holds ``NaN`` — the one special value a constrained numeric accepts (it rejects
±Infinity). Unconstrained numeric has no fixed scale, which Avro's decimal needs, so it is its text
output, exact to the last digit and to the display scale ("1.50" stays "1.50"), NaN and ±Infinity
included. So is a numeric(p,s) whose Avro precision would exceed 38: Spark cannot read wider decimals.
"""

from __future__ import annotations

import struct
from typing import Any

from schemas._conv import Conv, FormatError, conv

# Spark's DecimalType holds at most 38 digits; wider decimals would be unreadable in the sinks.
MAX_DECIMAL_PRECISION = 38

_HEAD = struct.Struct(">hhHh")  # ndigits, weight, sign, dscale; then ndigits base-10000 digits
_POS, _NEG, _NAN, _PINF, _NINF = 0x0000, 0x4000, 0xC000, 0xD000, 0xF000
_SPECIAL = {_NAN: "NaN", _PINF: "Infinity", _NINF: "-Infinity"}
_DIGIT_READERS = tuple(struct.Struct(f">{n}H") for n in range(64))
_POW10 = tuple(10**e for e in range(400))


def numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) from a numeric typmod, or None when unconstrained.

    PostgreSQL 15 stores the scale in 11 signed bits: it may be negative or exceed the precision.
    """
    if typmod < 4:  # VARHDRSZ: -1 means no typmod
        return None
    packed = typmod - 4
    return (packed >> 16) & 0xFFFF, ((packed & 0x7FF) ^ 1024) - 1024


def avro_decimal(precision: int, scale: int) -> tuple[int, int]:
    """The Avro (precision, scale) that holds every value of numeric(precision, scale) exactly.

    Avro needs 0 <= scale <= precision: a negative scale becomes 0 with the precision grown by as many
    digits (numeric(3,-2) holds 99900: decimal(5,0)); a scale above the precision becomes the precision
    (numeric(2,5) holds 0.00099: decimal(5,5)).
    """
    avro_scale = max(scale, 0)
    return max(precision - scale, 0) + avro_scale, avro_scale


def _digits(data: bytes, ndigits: int) -> tuple[int, ...]:
    return struct.unpack_from(f">{ndigits}H", data, 8)


def _acc_and_exp(data: bytes) -> tuple[int, int, int, int]:
    """(digits as one integer, its decimal exponent, sign, dscale) of a finite numeric's send format."""
    ndigits, weight, sign, dscale = _HEAD.unpack_from(data)
    digits = (
        _DIGIT_READERS[ndigits].unpack_from(data, 8) if ndigits < 64 else struct.unpack_from(f">{ndigits}H", data, 8)
    )
    acc = 0
    for digit in digits:
        acc = acc * 10000 + digit
    return acc, 4 * (weight - ndigits + 1), sign, dscale


def numeric_bin_text(data: bytes) -> str:
    """numeric's send format as numeric_out prints it: all integer digits, exactly dscale decimals."""
    sign = _HEAD.unpack_from(data)[2]
    if sign in _SPECIAL:
        return _SPECIAL[sign]
    acc, exp, sign, dscale = _acc_and_exp(data)
    digits = str(acc) if acc else ""
    if exp >= 0:
        int_part, frac = (digits + "0" * exp) if digits else "0", ""
    elif len(digits) > -exp:
        int_part, frac = digits[:exp], digits[exp:]
    else:
        int_part, frac = "0", digits.rjust(-exp, "0")
    if dscale > 0:
        frac = frac[:dscale].ljust(dscale, "0")
        text = f"{int_part}.{frac}"
    else:
        text = int_part
    return "-" + text if sign == _NEG else text


def _make_decimal(scale: int) -> tuple[Any, Any, Any]:
    """Converters from numeric's text and send formats to the unscaled bytes at ``scale`` (or "NaN")."""
    scale_up = _POW10[: scale + 1]
    # The unscaled integer's bytes are sized as fastavro sizes them, magnitude plus a sign bit:
    # (bit_length + 8) // 8. Java's minimal encoding can be a byte shorter for negative powers of two;
    # both decode to the same value, and matching fastavro keeps our bytes identical to its bytes.

    def from_text(data: bytes) -> Any:
        dot = data.find(b".")
        if dot < 0:
            if data == b"NaN":
                return "NaN"
            unscaled = int(data) * scale_up[scale]
        else:
            decimals = len(data) - dot - 1
            unscaled = int(data.replace(b".", b""))
            if decimals != scale:
                if decimals > scale:
                    raise FormatError(f"numeric {data!r} has more than {scale} decimals")
                unscaled *= scale_up[scale - decimals]
        return unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)

    def from_str(text: str) -> Any:
        return from_text(text.encode())

    def from_binary(data: bytes, _head: Any = _HEAD.unpack_from, _readers: Any = _DIGIT_READERS) -> Any:
        ndigits, weight, sign, _dscale = _head(data)
        if sign not in (_POS, _NEG):
            if sign == _NAN:
                return "NaN"
            raise FormatError(f"numeric({scale}) cannot hold {_SPECIAL.get(sign, hex(sign))}")
        acc = 0
        digits = _readers[ndigits].unpack_from(data, 8) if ndigits < 64 else _digits(data, ndigits)
        for digit in digits:
            acc = acc * 10000 + digit
        exp = 4 * (weight - ndigits + 1) + scale
        if exp >= 0:
            unscaled = acc * (_POW10[exp] if exp < 400 else 10**exp)
        else:
            unscaled = acc // (_POW10[-exp] if exp > -400 else 10**-exp)
        if sign == _NEG:
            unscaled = -unscaled
        return unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)

    return from_str, from_text, from_binary


NUMERIC_TEXT = conv("string", str, numeric_bin_text, from_text=bytes.decode)


def numeric(typmod: int) -> Conv:
    """The mapping of numeric with this typmod (see the module docstring)."""
    constraint = numeric_typmod(typmod)
    if constraint is None:
        return NUMERIC_TEXT
    precision, scale = avro_decimal(*constraint)
    if precision > MAX_DECIMAL_PRECISION:
        return NUMERIC_TEXT
    from_str, from_text, from_binary = _make_decimal(scale)
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    return conv([decimal, "string"], from_str, from_binary, from_text=from_text, wire=f"decimal:{scale}")
