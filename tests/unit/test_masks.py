"""Masks: a keyed hash that does not depend on the wire format, or null; NULL and unchanged stay so."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest

from schemas import PgType, avro_mapping, masked

KEY = b"k3y"
INT4 = PgType(23, "int4")
TEXT = PgType(25, "text")
NUMERIC = PgType(1700, "numeric")


def test_a_hashed_value_is_the_hmac_of_its_avro_encoding_whatever_its_wire_format() -> None:
    mapping = masked(avro_mapping(INT4, -1), "hash", KEY)
    assert mapping.schema == "string"
    assert mapping.fixed is None  # the C encoder's fast path would write the raw value
    from_text, from_binary = (
        mapping.from_text(b"42"),
        mapping.from_binary and mapping.from_binary(struct.pack(">i", 42)),
    )
    assert from_text == from_binary == hmac.new(KEY, bytes([84]), hashlib.sha256).hexdigest()  # zigzag(42) = 84
    assert mapping.from_text(b"43") != from_text
    assert masked(avro_mapping(INT4, -1), "hash", b"other").from_text(b"42") != from_text


def test_equal_values_hash_alike_in_any_column_of_the_same_mapping() -> None:
    a, b = masked(avro_mapping(TEXT, -1), "hash", KEY), masked(avro_mapping(TEXT, -1), "hash", KEY)
    assert a.from_text(b"ann@example.com") == b.from_text(b"ann@example.com")
    assert "ann" not in a.from_text(b"ann@example.com")


def test_a_null_mask_keeps_the_type_and_drops_the_value() -> None:
    plain = avro_mapping(NUMERIC, -1)
    mapping = masked(plain, "null", None)
    assert mapping.schema == plain.schema
    assert mapping.from_text(b"1.5") is None
    assert (mapping.from_binary is None) == (plain.from_binary is None)


def test_a_hash_mask_without_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="key"):
        masked(avro_mapping(TEXT, -1), "hash", None)
