"""ChangeWriter.fast_change takes only what the table's encoder takes, leaving anything else untouched;
ChangeWriter.change then hands it to the Python encoder, which takes it or says what is wrong."""

from __future__ import annotations

import json
import struct

import pytest
from pgcdc_dev.codecs import change_writer, make_codec

from cdc._encoder import Encoded
from cdc._window import ChunkWindow
from cdc.encoding import ChangeWriter
from cdc.errors import StreamError
from decoders import Column, Relation
from schemas import PgType

TXN = (0x2_0000_0000, 1_700_000_000_000_000, 7, False)


class _KeepingProducer:
    def __init__(self) -> None:
        self.out: list[tuple[str, bytes, bytes | None]] = []

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        self.out.append((topic, key, value))


@pytest.fixture
def capture() -> tuple[ChangeWriter, _KeepingProducer]:
    producer = _KeepingProducer()
    changes = change_writer(producer, in_batch=True)
    # The codec is made, as on a table's first change, for the relation the stream described.
    changes._relations[16384] = Relation(None, 16384, "public", "t", "d", (Column(1, "id", 20, -1),))
    changes._codecs[16384] = make_codec([("id", PgType(20, "int8"), -1)], topic="p.public.t", key=["id"])
    return changes, producer


def _insert(relid: int, value: int) -> bytes:
    return b"I" + struct.pack(">I", relid) + b"N" + struct.pack(">H", 1) + b"b" + struct.pack(">Iq", 8, value)


def test_an_insert_is_produced(capture: tuple[ChangeWriter, _KeepingProducer]) -> None:
    cap, producer = capture
    cap.begin(*TXN[:3], 0)
    assert cap.fast_change(b"header" + _insert(16384, 5), 100, start=6)
    assert [(topic, key[5:]) for topic, key, _ in producer.out] == [("p.public.t", b"\x02\x0a")]


@pytest.mark.parametrize(
    "message",
    [
        b"I",  # cut before the relation id
        b"I\x00\x00",
        _insert(16384, 5)[:-3],  # cut inside the value
        _insert(99, 5),  # a relation without a codec yet
        _insert(16384, 5) + b"x",  # trailing bytes
    ],
)
def test_what_it_cannot_take_is_left_to_the_general_path(
    capture: tuple[ChangeWriter, _KeepingProducer], message: bytes
) -> None:
    cap, producer = capture
    cap.begin(*TXN[:3], 0)
    assert not cap.fast_change(message, 100)
    assert producer.out == []


class _Refusing:
    """A row encoder that refuses every row, as the C one refuses a rare form the Python one takes."""

    def encode(self, data: bytes, pos: int, copy_modes: bytes | None = None) -> Encoded:
        raise ValueError("not this one")

    def encode_copy_packed(self, data: bytes, copy_modes: bytes) -> tuple[bytes, int]:
        raise ValueError("not this one")


def test_what_the_encoder_refuses_the_python_encoder_takes(capture: tuple[ChangeWriter, _KeepingProducer]) -> None:
    cap, producer = capture
    cap.begin(*TXN[:3], 0)
    cap.change(_insert(16384, 5), 100)
    expected = list(producer.out)
    producer.out.clear()
    cap._codecs[16384].encoder = _Refusing()
    assert not cap.fast_change(_insert(16384, 5), 100)
    cap.change(_insert(16384, 5), 100)
    assert producer.out == expected
    assert [key[5:] for _, key, _ in expected] == [b"\x02\x0a"]


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">H", 1) + b"n", r"without key column\(s\) \['id'\]"),
        (_insert(16384, 5)[:-3], "column 'id': truncated"),
        (_insert(16384, 5) + b"x", "1 bytes after the change's rows"),
        (_insert(99, 5), "relation 99 before its Relation message"),
    ],
)
def test_what_no_encoder_takes_stops_with_what_is_wrong(
    capture: tuple[ChangeWriter, _KeepingProducer], message: bytes, says: str
) -> None:
    cap, producer = capture
    cap.begin(*TXN[:3], 0)
    with pytest.raises(StreamError, match=says):
        cap.change(message, 0x16B3748)
    assert producer.out == []


# An insert whose int8 key arrives as 3 bytes: no encoder takes it (its dead letter prints it as hex here; the
# capture asks PostgreSQL to print it).
_SHORT_KEY = b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">HcI", 1, b"b", 3) + b"abc"


def test_the_stop_names_the_table_the_key_and_the_way_out(capture: tuple[ChangeWriter, _KeepingProducer]) -> None:
    cap, _ = capture
    cap.begin(*TXN[:3], 0)
    with pytest.raises(StreamError) as stopped:
        cap.change(_SHORT_KEY, 0x16B3748)
    said = str(stopped.value)
    assert "cannot capture the change at LSN 0/16B3748" in said
    assert "column 'id'" in said
    assert "table public.t" in said
    assert 'capture.on_unencodable = "dead-letter"' in said
    assert "p.capture-dead-letter" in said


@pytest.mark.parametrize(
    ("message", "column", "key"),
    [
        (b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">H", 1) + b"n", "id", {"id": None}),
        (_SHORT_KEY, "id", {"id": "\\x616263"}),
    ],
    ids=["no key", "unreadable key value"],
)
def test_with_dead_letters_the_change_goes_to_the_dead_letter_topic_and_the_stream_goes_on(
    message: bytes, column: str, key: dict[str, str | None]
) -> None:
    producer = _KeepingProducer()
    cap = change_writer(producer, in_batch=True, on_unencodable="dead-letter")
    cap._relations[16384] = Relation(None, 16384, "public", "t", "d", (Column(1, "id", 20, -1),))
    cap._codecs[16384] = make_codec([("id", PgType(20, "int8"), -1)], topic="p.public.t", key=["id"])
    cap.begin(*TXN[:3], 0)
    cap.change(message, 0x16B3748)
    cap.change(_insert(16384, 6), 0x16B3750)  # the next change is captured as usual
    assert [topic for topic, _, _ in producer.out] == ["p.capture-dead-letter", "p.public.t"]
    _, dead_key, dead_value = producer.out[0]
    assert dead_value is not None
    letter = json.loads(dead_value)
    assert json.loads(dead_key) == {"table": "public.t", "key": key}
    assert letter["table"] == "public.t"
    assert letter["op"] == "c"
    assert letter["lsn"] == "0/16B3748"
    assert letter["commit_lsn"] == "2/0"
    assert letter["column"] == column
    assert letter["key"] == key
    assert letter["row"] == key  # the table's one column is its key
    assert letter["error"]


def test_a_watched_table_reports_each_change_with_its_xid_to_every_open_window(
    capture: tuple[ChangeWriter, _KeepingProducer],
) -> None:
    """A backfill chunk's window hears of every change of its table (the new and the old key, with the
    transaction's xid and commit LSN), from the fast path and the general one alike, until it is unwatched."""
    cap, producer = capture
    first, second = ChunkWindow(), ChunkWindow()
    cap.watch("p.public.t", first)
    cap.watch("p.public.t", second)
    cap.begin(TXN[0], TXN[1], 4242, 0)
    assert cap.fast_change(_insert(16384, 5), 100)
    cap.change(_insert(16384, 6), 101)
    cap.unwatch("p.public.t", first)
    cap.change(_insert(16384, 7), 102)
    keys = [key for _, key, _ in producer.out]
    assert first.changes == [(4242, TXN[0], keys[0]), (4242, TXN[0], keys[1])]
    assert second.changes == [(4242, TXN[0], k) for k in keys]
    cap.unwatch("p.public.t", second)
    cap.change(_insert(16384, 8), 103)
    assert len(second.changes) == 3
