#!/usr/bin/env python3
"""The capture's per-row CPU cost without I/O: pgoutput frames → decode → Avro key and envelope, stage by stage.

    ./dev python -m bench.hotpath_micro [--rows 200000] [--repeat 5]

Synthesises binary-mode XLogData frames for the benchmark table of bench/insert_heavy.py (bigint key, text,
numeric(12,2), jsonb, timestamptz) and runs them through the same functions the capture's loop calls, with a
producer that only keeps the bytes. Prints µs per row for each stage (best of ``--repeat``): a deterministic
figure to optimise against, where the end-to-end benchmarks share 2 cores with PostgreSQL and Kafka.
"""

from __future__ import annotations

import argparse
import gc
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pgcdc_dev.codecs import change_writer, make_codec

from cdc.encoding import ChangeWriter, Position, SourceInfo, Stamp, TableCodec
from decoders import (
    XLOG_HEADER,
    XLOG_PAYLOAD_AT,
    Insert,
    Keepalive,
    Message,
    PgOutputDecoder,
    XLogData,
    parse_copy_data,
)
from schemas import PgType

_PG_EPOCH_US = 946_684_800_000_000
COLUMNS = [
    ("id", PgType(20, "int8"), -1),
    ("kind", PgType(25, "text"), -1),
    ("amount", PgType(1700, "numeric"), (12 << 16 | 2) + 4),
    ("payload", PgType(3802, "jsonb"), -1),
    ("at", PgType(1184, "timestamptz"), -1),
    ("pad", PgType(25, "text"), -1),
]


def _numeric_binary(cents: int) -> bytes:
    """PostgreSQL's numeric send format for cents/100 with dscale 2 (base-10000 digits)."""
    if cents == 0:
        return struct.pack(">hhHH", 0, 0, 0, 2)
    sign = 0x4000 if cents < 0 else 0
    n = abs(cents)
    whole, frac = divmod(n, 100)
    digits: list[int] = []
    while whole:
        whole, d = divmod(whole, 10000)
        digits.insert(0, d)
    weight = len(digits) - 1
    digits.append(frac * 100)
    while digits and digits[-1] == 0:
        digits.pop()
    if not digits:
        return struct.pack(">hhHH", 0, 0, 0, 2)
    return struct.pack(f">hhHH{len(digits)}h", len(digits), weight, sign, 2, *digits)


def _column(value: bytes | None) -> bytes:
    return b"n" if value is None else b"b" + struct.pack(">I", len(value)) + value


def frames(rows: int, *, relid: int = 16384) -> list[bytes]:
    """CopyData messages ('w' + XLogData header + an Insert) like the walsender sends for the benchmark."""
    out = []
    now_pg = 785_000_000_000_000
    for g in range(1, rows + 1):
        values = [
            struct.pack(">q", g),
            f"kind-{g % 10}".encode(),
            _numeric_binary(g),
            b"\x01" + json.dumps({"n": g, "tag": "x"}, separators=(", ", ": ")).encode(),
            struct.pack(">q", now_pg),
            None,
        ]
        body = b"I" + struct.pack(">I", relid) + b"N" + struct.pack(">H", len(values))
        body += b"".join(_column(v) for v in values)
        lsn = 0x1_0000_0000 + g * 120
        out.append(b"w" + struct.pack(">QQq", lsn, lsn + 120, now_pg) + body)
    return out


def codec() -> TableCodec:
    return make_codec(COLUMNS, topic="bench.public.events", source=SourceInfo("1.0.0", "bench", "bench"))


class _KeepingProducer:
    """The capture's producer, minus Kafka: keeps (topic, key, value)."""

    def __init__(self, out: list[tuple[str, bytes | None, bytes | None]]) -> None:
        self.out = out

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        self.out.append((topic, key, value))


def _capture_stub(c: TableCodec, out: list[tuple[str, bytes | None, bytes | None]]) -> ChangeWriter:
    """The capture's ChangeWriter, having read the benchmark table's Relation, with a Kafka transaction open."""
    changes = change_writer(_KeepingProducer(out), in_batch=True)
    changes._codecs[16384] = c
    return changes


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


_Kept = list[tuple[str, bytes | None, bytes | None]]


@dataclass(frozen=True)
class _Workload:
    """What the stages run on: the frames, the codec, the decoder, the list the producer keeps into, the
    transaction's position and stamp time; and each stage's input, made once: the frames parsed, their
    payloads, their decoded messages, and the rows of their Inserts."""

    raw: list[bytes]
    c: TableCodec
    decoder: PgOutputDecoder
    out: _Kept
    pos0: Position
    now_us: int
    # Unused by the stages, but alive while they are timed: a collection during a timed run costs by the heap.
    xlog: list[XLogData | Keepalive]
    payloads: list[bytes]
    msgs: list[Message]
    rows: list[dict[str, Any]]


def _workload(count: int) -> _Workload:
    raw = frames(count)
    c = codec()
    decoder = PgOutputDecoder(2, streaming=True)
    out: _Kept = []
    pos0 = Position(0x2_0000_0000, 0, 1_700_000_000_000_000, 1234)
    now_us = time.time_ns() // 1000

    xlog = [parse_copy_data(r) for r in raw]
    payloads = [bytes(x.payload) for x in xlog]  # type: ignore[union-attr]
    msgs = [decoder.decode(p) for p in payloads]
    rows = [c.row(m.new)[0] for m in msgs if isinstance(m, Insert)]
    return _Workload(raw, c, decoder, out, pos0, now_us, xlog, payloads, msgs, rows)


def _stages(w: _Workload) -> dict[str, Callable[[], None]]:
    """Each stage alone over every frame, from the previous stage's output: parse, decode, row, key, envelope."""
    # Bound once: the measured loops read closure cells, not attributes of ``w`` (a lookup per row would be
    # counted in the µs per row).
    raw, c, decoder, pos0, now_us = w.raw, w.c, w.decoder, w.pos0, w.now_us
    payloads, msgs, rows = w.payloads, w.msgs, w.rows

    def stage_parse() -> None:
        for r in raw:
            parse_copy_data(r)

    def stage_decode() -> None:
        for p in payloads:
            decoder.decode(p)

    def stage_row() -> None:
        for m in msgs:
            c.row(m.new)  # type: ignore[union-attr]

    def stage_key() -> None:
        for r in rows:
            c.key_of(r)

    def stage_envelope() -> None:
        for i, r in enumerate(rows):
            c.envelope("c", Stamp(Position(pos0.commit_lsn, i, pos0.commit_time_us, pos0.xid), now_us), None, r, [])

    return {
        "parse": stage_parse,
        "decode": stage_decode,
        "row": stage_row,
        "key": stage_key,
        "envelope": stage_envelope,
    }


def _paths(w: _Workload) -> dict[str, Callable[[], None]]:
    """Every frame from bytes to the producer: stage by stage ("all"), the codec's fast path ("fast"), and the
    capture's ChangeWriter as its read loop calls it ("capture"). Each clears ``w.out`` first."""
    raw, c, decoder, out, pos0, now_us = w.raw, w.c, w.decoder, w.out, w.pos0, w.now_us
    produce = out.append

    def all_stages() -> None:
        out.clear()
        for r in raw:
            frame = parse_copy_data(r)
            msg = decoder.decode(frame.payload)  # type: ignore[union-attr]
            after, unchanged = c.row(msg.new)  # type: ignore[union-attr]
            produce(
                (
                    c.topic,
                    c.key_of(after),
                    c.envelope(
                        "c",
                        Stamp(Position(pos0.commit_lsn, frame.start_lsn, pos0.commit_time_us, pos0.xid), now_us),  # type: ignore[union-attr]
                        None,
                        after,
                        unchanged,
                    ),
                )
            )

    def fast_path() -> None:
        out.clear()
        envelope = c.envelope_bytes
        stamp = Stamp(pos0, now_us)  # one per transaction, as ChangeWriter makes it; each change passes its LSN
        for r in raw:
            frame = parse_copy_data(r)
            data = bytes(frame.payload)  # type: ignore[union-attr]
            after, key, unchanged, _ = c.encoder.encode(data, 6)
            produce((c.topic, key, envelope("c", stamp, None, after, unchanged, frame.start_lsn)))  # type: ignore[union-attr]

    return {"all": all_stages, "fast": fast_path, "capture": _capture_path(w)}


def _capture_path(w: _Workload) -> Callable[[], None]:
    """ChangeWriter.fast_change over every frame, in a Kafka transaction begun once, producing into ``w.out``."""
    out = w.out
    capture = _capture_stub(w.c, out)
    frames_only = [bytes(r) for r in w.raw]
    capture.begin(w.pos0.commit_lsn, w.pos0.commit_time_us, w.pos0.xid, w.now_us)

    def capture_path() -> None:
        """ChangeWriter.fast_change as the read loop calls it (header read in place), producing into ``out``."""
        out.clear()
        fast_change, unpack = capture.fast_change, XLOG_HEADER.unpack_from
        for data in frames_only:
            lsn, _end, _ = unpack(data, 1)
            if not fast_change(data, lsn, XLOG_PAYLOAD_AT):
                raise AssertionError("the fast path refused a benchmark frame")

    return capture_path


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    w = _workload(args.rows)
    runs = {**_stages(w), **_paths(w)}
    runs["fast"]()
    fast = list(w.out)
    runs["all"]()
    assert fast == w.out, "the fast path must write the same bytes"
    per_row = {}
    for name, fn in runs.items():
        per_row[name] = round(_best(fn, args.repeat) / args.rows * 1e6, 2)
    print(json.dumps({"rows": args.rows, "us_per_row": per_row}))
    return per_row


if __name__ == "__main__":
    main()
