"""Masked columns: captured, never exposed. A column's values become a keyed hash or null before they are
encoded, in every path that encodes rows (the stream, snapshots, backfills) and in what `cdc verify` expects.

``hash``: the hex HMAC-SHA256, under the operator's key, of the value's Avro encoding under the column's own
mapping. The same value gives the same hash whichever wire format it arrived in (text or binary, stream or
snapshot), and across tables, so masked columns still join; without the key a value cannot be tested against
it. The field's type becomes ``string``.
``null``: the value is dropped; the field keeps its type and is always null.
A NULL stays NULL, and an unchanged TOAST value stays unchanged (the store keeps the hash it has).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from schemas._types import AvroMapping
from schemas._writer import compile_writer

Mask = Literal["hash", "null"]
MASKS: tuple[Mask, ...] = ("hash", "null")


def masked(mapping: AvroMapping, how: Mask, key: bytes | None) -> AvroMapping:
    """``mapping`` with its values masked ``how``; ``key`` is the HMAC key (needed for ``hash``)."""
    if how == "null":
        return replace(
            mapping,
            from_text=_nothing,
            from_binary=_nothing if mapping.from_binary is not None else None,
            fixed=None,
            wire=None,
        )
    if not key:
        raise ValueError("a hash mask needs a key")
    write = compile_writer(mapping.schema)

    def digest(convert: Callable[[bytes], Any]) -> Callable[[bytes], str]:
        def run(raw: bytes) -> str:
            out = bytearray()
            write(convert(raw), out)
            return hmac.new(key, bytes(out), hashlib.sha256).hexdigest()

        return run

    binary = mapping.from_binary
    return AvroMapping(
        schema="string",
        from_text=digest(mapping.from_text),
        from_binary=digest(binary) if binary is not None else None,
    )


def _nothing(_: bytes) -> None:
    return None


__all__ = ["MASKS", "Mask", "masked"]
