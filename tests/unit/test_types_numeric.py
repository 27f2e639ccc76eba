"""numeric: decimal(p,s) with a NaN branch when the scale is fixed, exact text otherwise."""

from __future__ import annotations

import struct
from decimal import Decimal

import pytest

from schemas import FormatError, avro_mapping
from tests.unit.test_types import avro_check, check, numeric_typmod, pg

NUMERIC = pg("numeric")
_SPECIAL = {"NaN": 0xC000, "Infinity": 0xD000, "-Infinity": 0xF000}


def numeric_send(value: str, *, strip: bool = True) -> bytes:
    """numeric_send for a decimal literal: base-10000 digits, weight, sign, display scale.

    ``strip=False`` keeps trailing zero digit groups, which PostgreSQL strips but a reader must not need.
    """
    if value in _SPECIAL:
        return struct.pack(">hhHh", 0, 0, _SPECIAL[value], 0)
    number = Decimal(value)
    sign, digits, exp = number.as_tuple()
    assert isinstance(exp, int)
    dscale = max(-exp, 0)
    unscaled = int("".join(map(str, digits)) or "0") * 10 ** (exp + dscale)
    frac_digits = -(-dscale // 4) * 4
    aligned = unscaled * 10 ** (frac_digits - dscale)
    groups: list[int] = []
    while aligned:
        aligned, group = divmod(aligned, 10000)
        groups.insert(0, group)
    weight = len(groups) - frac_digits // 4 - 1 if groups else 0
    while strip and groups and groups[-1] == 0:
        groups.pop()
    negative = 0x4000 if sign and unscaled else 0
    return struct.pack(f">hhHh{len(groups)}H", len(groups), weight, negative, dscale, *groups)


def test_numeric_send_matches_postgresql() -> None:
    # Bytes taken from PostgreSQL 15: numeric_send('1.50'), numeric_send('-0.00').
    assert numeric_send("1.50") == bytes.fromhex("000200000000000200011388")
    assert numeric_send("-0.00") == bytes.fromhex("0000000000000002")


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "0.00",
        "1.50",
        "-1.50",
        "NaN",
        "Infinity",
        "-Infinity",
        "1" + "0" * 100,
        "0." + "0" * 20 + "1",
        "-0.00012",
        "123456789012345678901234567890.123456789",
        "10000",
        "0.0001",
        "9999.9999",
    ],
)
def test_unconstrained_numeric_is_its_exact_text(text: str) -> None:
    assert avro_mapping(NUMERIC).schema == "string"
    check(NUMERIC, text, numeric_send(text), text)
    check(NUMERIC, text, numeric_send(text, strip=False), text)


@pytest.mark.parametrize(
    ("precision", "scale", "texts"),
    [
        (12, 2, ["0.00", "1.50", "-1.50", "9999999999.99", "-9999999999.99", "-0.01", "0.01"]),
        (38, 0, ["9" * 38, "-" + "9" * 38, "0"]),
        (38, 38, ["0." + "9" * 38, "-0." + "0" * 37 + "1"]),
        (5, 5, ["0.00001"]),
        (1, 0, ["-9", "9"]),
    ],
)
def test_constrained_numeric_is_an_avro_decimal(precision: int, scale: int, texts: list[str]) -> None:
    typmod = numeric_typmod(precision, scale)
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    assert avro_mapping(NUMERIC, typmod).schema == [decimal, "string"]
    for text in texts:
        # check() also asserts our bytes are exactly fastavro's for the Decimal, and that it reads it back.
        check(NUMERIC, text, numeric_send(text), Decimal(text), typmod=typmod)
        check(NUMERIC, text, numeric_send(text, strip=False), Decimal(text), typmod=typmod)


def test_constrained_numeric_nan_takes_the_string_branch() -> None:
    typmod = numeric_typmod(5, 2)
    mapping = avro_mapping(NUMERIC, typmod)
    check(NUMERIC, "NaN", numeric_send("NaN"), "NaN", typmod=typmod)
    assert mapping.from_binary is not None
    with pytest.raises(FormatError, match="Infinity"):
        mapping.from_binary(numeric_send("Infinity"))


@pytest.mark.parametrize(
    ("precision", "scale", "avro", "text", "expected"),
    [
        (3, -2, (5, 0), "12300", Decimal(12300)),  # negative scale: multiples of 100
        (2, 5, (5, 5), "0.00012", Decimal("0.00012")),  # scale above precision: tiny numbers
        (1000, 3, None, "1.500", "1.500"),  # wider than Spark's 38 digits: exact text
        (39, 2, None, "-1.50", "-1.50"),
        (37, -2, None, "100", "100"),  # 37 digits and two zeros: 39
    ],
)
def test_numeric_typmods_avro_cannot_take_directly(
    precision: int, scale: int, avro: tuple[int, int] | None, text: str, expected: object
) -> None:
    typmod = numeric_typmod(precision, scale)
    schema = avro_mapping(NUMERIC, typmod).schema
    if avro is None:
        assert schema == "string"
    else:
        assert isinstance(schema, list)
        assert schema[0] == {"type": "bytes", "logicalType": "decimal", "precision": avro[0], "scale": avro[1]}
    check(NUMERIC, text, numeric_send(text), expected, typmod=typmod)


def test_decimal_bytes_are_sized_as_fastavro_sizes_them() -> None:
    # -128 fits one byte (0x80) in Java's minimal encoding; fastavro writes two (0xff80). Ours equal fastavro's.
    mapping = avro_mapping(NUMERIC, numeric_typmod(5, 0))
    assert mapping.from_text(b"-128") == b"\xff\x80"
    assert mapping.from_text(b"127") == b"\x7f"
    assert mapping.from_text(b"128") == b"\x00\x80"
    assert mapping.from_text(b"0") == b"\x00"
    avro_check(mapping, mapping.from_text(b"-128"), Decimal(-128))


def test_domain_over_constrained_numeric_uses_the_domain_typmod() -> None:
    domain = pg("price", namespace="shop", kind="domain", base=NUMERIC, base_typmod=numeric_typmod(10, 2))
    schema = avro_mapping(domain).schema
    assert isinstance(schema, list)
    assert (schema[0]["precision"], schema[0]["scale"]) == (10, 2)
    check(domain, "1.50", numeric_send("1.50"), Decimal("1.50"))
