"""The binary COPY parser the snapshot reads rows with."""

from __future__ import annotations

import struct

import pytest

from cdc._snapshot import parse_binary_copy
from cdc.errors import StreamError

HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)


def _row(*fields: bytes | None) -> bytes:
    out = struct.pack(">h", len(fields))
    for f in fields:
        out += struct.pack(">i", -1) if f is None else struct.pack(">i", len(f)) + f
    return out


def test_rows_nulls_and_empty_values() -> None:
    data = HEADER + _row(b"\x00\x00\x00\x01", b"abc", None) + _row(b"", None, b"z") + struct.pack(">h", -1)
    assert parse_binary_copy(data) == [[b"\x00\x00\x00\x01", b"abc", None], [b"", None, b"z"]]


def test_header_extension_is_skipped() -> None:
    header = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 3) + b"ext"
    assert parse_binary_copy(header + _row(b"x") + struct.pack(">h", -1)) == [[b"x"]]


def test_no_rows() -> None:
    assert parse_binary_copy(HEADER + struct.pack(">h", -1)) == []


def test_not_binary_copy() -> None:
    with pytest.raises(StreamError, match="signature"):
        parse_binary_copy(b"1\tabc\n")
