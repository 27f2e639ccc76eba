"""The binary COPY parser the snapshot reads rows with, and the chunk encoding around it."""

from __future__ import annotations

import struct

import pytest
from pgcdc_dev.codecs import make_codec

from cdc._chunks import encode_chunk, packed_keys, parse_binary_copy
from cdc._encoder import ColumnError
from cdc.errors import StreamError
from schemas import PgType

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


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (HEADER + _row(b"abc")[:-1], "ends inside a row"),
        (HEADER + _row(b"abc"), "ends before its end marker"),
    ],
)
def test_cut_short_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(StreamError, match=says):
        parse_binary_copy(data)


def test_not_binary_copy() -> None:
    with pytest.raises(StreamError, match="signature"):
        parse_binary_copy(b"1\tabc\n")


@pytest.mark.parametrize("python", [False, True], ids=["table's encoder", "python"])
def test_a_chunk_is_counted_by_its_encoder_and_a_cut_one_is_refused(python: bool) -> None:
    """Block ranges take a chunk's row count from the encoder (no second walk over the chunk); a chunk cut
    short fails with the row's table and what is wrong, whichever encoder runs."""
    codec = make_codec([("id", PgType(23, "int4"), -1), ("name", PgType(25, "text"), -1)], topic="p.public.t")
    if python:
        codec.use_python()
    rows = [_row(struct.pack(">i", i), f"n{i}".encode()) for i in range(5)]
    data = HEADER + b"".join(rows) + struct.pack(">h", -1)
    count, packed, refused = encode_chunk(codec, "public.t", data, b"bb")
    assert count == 5
    assert refused == []
    assert len(packed_keys(packed)) == 5
    with pytest.raises(StreamError, match=r"cannot snapshot a row of public\.t: column 'id': truncated"):
        encode_chunk(codec, "public.t", data[:-9], b"bb")
    with pytest.raises(StreamError, match=r"cannot snapshot a row of public.t: .*cut short"):
        encode_chunk(codec, "public.t", data[:-2], b"bb")


@pytest.mark.parametrize("python", [False, True], ids=["table's encoder", "python"])
def test_a_row_no_encoder_takes_is_set_aside_with_its_fields_and_why(python: bool) -> None:
    """A row whose value cannot be encoded (here a text value that is not UTF-8) does not fail its chunk: it is
    set aside with its fields as COPY sent them and the column at fault (capture.on_unencodable decides), and the
    rows around it are encoded as usual."""
    codec = make_codec([("id", PgType(23, "int4"), -1), ("name", PgType(25, "text"), -1)], topic="p.public.t")
    if python:
        codec.use_python()
    rows = [_row(struct.pack(">i", i), b"\xff\xfe" if i == 2 else f"n{i}".encode()) for i in range(5)]
    data = HEADER + b"".join(rows) + struct.pack(">h", -1)
    count, packed, refused = encode_chunk(codec, "public.t", data, b"bb")
    assert count == 4
    assert [packed_key[-1] for packed_key in packed_keys(packed)] == [0, 2, 6, 8]  # zigzag ids 0, 1, 3, 4
    assert len(refused) == 1
    assert refused[0].fields == [struct.pack(">i", 2), b"\xff\xfe"]
    assert isinstance(refused[0].error, ColumnError)
    assert refused[0].error.column == "name"
