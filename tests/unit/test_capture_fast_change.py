"""ChangeWriter.fast_change takes only what it can encode; anything else is left, untouched, to the general path."""

from __future__ import annotations

import struct

import pytest
from pgcdc_dev.codecs import change_writer, make_codec

from cdc._changes import ChangeWriter
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
