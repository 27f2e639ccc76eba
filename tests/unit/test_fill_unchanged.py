"""Filling an update's unchanged TOAST values from its full old row (REPLICA IDENTITY FULL)."""

from __future__ import annotations

import struct

import pytest

from decoders import PgOutputDecoder, Update, fill_unchanged_from_old


def tuple_data(*columns: tuple[str, bytes | None]) -> bytes:
    out = struct.pack(">H", len(columns))
    for kind, value in columns:
        out += kind.encode()
        if value is not None:
            out += struct.pack(">I", len(value)) + value
    return out


def update(old: bytes, new: bytes, old_kind: str = "O") -> tuple[bytes, int]:
    head = b"U" + struct.pack(">I", 16384)
    return head + old_kind.encode() + old + b"N" + new, len(head)


def test_unchanged_values_are_taken_from_the_old_row_and_the_rest_is_kept() -> None:
    old = tuple_data(("t", b"1"), ("t", b"long old text"), ("b", b"\x00\x01"), ("n", None))
    new = tuple_data(("t", b"1"), ("u", None), ("u", None), ("t", b"new"))
    data, at = update(old, new)
    filled = fill_unchanged_from_old(data, at)
    assert filled is not None
    msg = PgOutputDecoder(1).decode(filled)
    assert isinstance(msg, Update)
    assert msg.new.kinds == b"ttbt"
    assert msg.new.values == (b"1", b"long old text", b"\x00\x01", b"new")
    assert msg.old is not None
    assert msg.old.values == (b"1", b"long old text", b"\x00\x01", None)


def test_nothing_to_fill_gives_none() -> None:
    old = tuple_data(("t", b"1"), ("t", b"x"))
    assert fill_unchanged_from_old(*update(old, tuple_data(("t", b"1"), ("t", b"y")))) is None
    # The old row lacks the value as well (PostgreSQL left it out there too): it stays unchanged.
    old_without = tuple_data(("t", b"1"), ("u", None))
    assert fill_unchanged_from_old(*update(old_without, tuple_data(("t", b"1"), ("u", None)))) is None


def test_only_a_full_old_row_is_taken() -> None:
    key_only = tuple_data(("t", b"1"), ("n", None))
    with pytest.raises(ValueError, match="not a full row"):
        fill_unchanged_from_old(*update(key_only, tuple_data(("t", b"1"), ("u", None)), old_kind="K"))


def test_malformed_rows_are_refused() -> None:
    data, at = update(tuple_data(("t", b"1")), tuple_data(("t", b"1"), ("u", None)))
    with pytest.raises(ValueError, match="column counts"):
        fill_unchanged_from_old(data, at)
    with pytest.raises(ValueError, match="unknown value kind"):
        fill_unchanged_from_old(*update(tuple_data(("x", None)), tuple_data(("u", None))))
