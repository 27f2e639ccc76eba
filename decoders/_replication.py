"""The streaming replication protocol's framing around pgoutput: the CopyBoth messages of a walsender.

Layouts: PostgreSQL's "Streaming Replication Protocol" (XLogData ``w``, Primary keepalive ``k``,
Standby status update ``r``). Times on the wire are microseconds since 2000-01-01; here they are Unix
epoch microseconds, converted in exactly one place each way.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from decoders._messages import PG_EPOCH_OFFSET_US, DecodeError

__all__ = ["XLOG_HEADER", "XLOG_PAYLOAD_AT", "Keepalive", "XLogData", "parse_copy_data", "standby_status"]

_XLOG_HEADER: Final = struct.Struct(">QQq")  # start LSN, server's WAL end, send time
# For a reader's hot loop, which reads the header of an XLogData ('w') itself instead of building an XLogData:
# XLOG_HEADER.unpack_from(message, 1) and the payload at XLOG_PAYLOAD_AT.
XLOG_HEADER: Final = _XLOG_HEADER
XLOG_PAYLOAD_AT: Final = 1 + _XLOG_HEADER.size
_KEEPALIVE: Final = struct.Struct(">QqB")  # server's WAL end, send time, reply requested
_STANDBY_STATUS: Final = struct.Struct(">cQQQqB")  # 'r', write, flush, apply, client time, reply
_XLOG_DATA: Final = ord("w")
_PRIMARY_KEEPALIVE: Final = ord("k")


@dataclass(frozen=True, slots=True)
class XLogData:
    """A chunk of the replication stream: for a logical slot, exactly one pgoutput message.

    ``payload`` is a view into the buffer given to :func:`parse_copy_data` (no copy is made), so it is
    only valid as long as that buffer is.
    """

    start_lsn: int
    end_lsn: int
    send_time_us: int
    payload: memoryview


@dataclass(frozen=True, slots=True)
class Keepalive:
    """The server's heartbeat; answer with :func:`standby_status` at once when ``reply_requested``."""

    end_lsn: int
    send_time_us: int
    reply_requested: bool


def parse_copy_data(buf: bytes | memoryview) -> XLogData | Keepalive:
    """Parse one CopyData message from the walsender; raises :class:`DecodeError` on anything else."""
    view = memoryview(buf)
    if not view:
        raise DecodeError("empty replication message", offset=0, kind=None)
    kind = view[0]
    if kind == _XLOG_DATA:
        if len(view) < 25:
            raise DecodeError(
                f"XLogData truncated: {len(view)} bytes, the header alone is 25", offset=len(view), kind="w"
            )
        start_lsn, end_lsn, send_time = _XLOG_HEADER.unpack_from(view, 1)
        return XLogData(start_lsn, end_lsn, send_time + PG_EPOCH_OFFSET_US, view[25:])
    if kind == _PRIMARY_KEEPALIVE:
        if len(view) != 18:
            raise DecodeError(
                f"primary keepalive message must be 18 bytes, got {len(view)}",
                offset=min(len(view), 18),
                kind="k",
            )
        end_lsn, send_time, reply = _KEEPALIVE.unpack_from(view, 1)
        return Keepalive(end_lsn, send_time + PG_EPOCH_OFFSET_US, reply != 0)
    raise DecodeError(
        f"unknown replication message type {chr(kind)!r} ({kind:#04x}); expected 'w' (XLogData) "
        "or 'k' (primary keepalive)",
        offset=0,
        kind=chr(kind),
    )


def standby_status(
    write_lsn: int, flush_lsn: int, apply_lsn: int, now_us_unix: int, reply_requested: bool = False
) -> bytes:
    """Encode a Standby status update (``r``) to send back with ``put_copy_data``.

    ``flush_lsn`` is what the server may discard WAL up to and what the slot's confirmed position moves
    to, so report only what is durably handled downstream. ``now_us_unix`` is the client's clock in Unix
    epoch microseconds; the wire wants microseconds since 2000-01-01, hence the subtraction.
    """
    try:
        return _STANDBY_STATUS.pack(
            b"r",
            write_lsn,
            flush_lsn,
            apply_lsn,
            now_us_unix - PG_EPOCH_OFFSET_US,
            1 if reply_requested else 0,
        )
    except struct.error as exc:
        raise ValueError(
            f"standby status: LSNs must be unsigned 64-bit integers and the time must fit in a signed one "
            f"(write={write_lsn}, flush={flush_lsn}, apply={apply_lsn}, now_us_unix={now_us_unix})"
        ) from exc
