"""A logical replication connection over psycopg's libpq layer (psycopg has no high-level API for it)."""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from psycopg import pq
from psycopg.pq.abc import PGconn

from cdc._encoder import native_module
from cdc._libs import libpq_addresses
from cdc._source import translate_pg_error
from cdc.errors import SourceCheckError, TransientError
from decoders import format_lsn, parse_lsn, standby_status

log = logging.getLogger(__name__)


def _change_reader() -> Any | None:
    """cdc._native.ChangeReader on the libpq psycopg runs, or None (changes are read one message at a time)."""
    _native = native_module()
    if _native is None:
        return None
    try:
        return _native.ChangeReader(libpq_addresses(("PQgetCopyData", "PQfreemem", "PQconsumeInput")))
    except (OSError, AttributeError) as exc:
        log.info("a streamed transaction's changes are read one message at a time: %s", exc)
        return None


@dataclass(frozen=True, slots=True)
class CreatedSlot:
    consistent_lsn: int
    snapshot_name: str | None


class ReplicationConnection:
    """One walsender session: create a slot, start streaming, read CopyData, send standby status."""

    def __init__(self, conninfo: str, *, where: str) -> None:
        self._where = where
        self._conn: PGconn = pq.PGconn.connect(conninfo.encode())
        if self._conn.status != pq.ConnStatus.OK:
            message = self._error()
            self._conn.finish()
            raise translate_pg_error(psycopg.OperationalError(message), where)
        self._closed = False
        self._changes = _change_reader()

    def _error(self) -> str:
        return self._conn.get_error_message().strip()

    def create_slot(self, slot: str, *, export_snapshot: bool, failover: bool = False) -> CreatedSlot:
        """CREATE_REPLICATION_SLOT; with export_snapshot, the snapshot stays valid until the next command;
        ``failover`` (17+; ignored before) makes it a slot standbys synchronize."""
        version = self._conn.server_version
        if version >= 150000:
            options = ["SNAPSHOT 'export'" if export_snapshot else "SNAPSHOT 'nothing'"]
            if failover and version >= 170000:
                options.append("FAILOVER true")
            option = f"({', '.join(options)})"
        else:  # the older spelling, still accepted by 15+, but the option list is the documented one there
            option = "EXPORT_SNAPSHOT" if export_snapshot else "NOEXPORT_SNAPSHOT"
        # Slot names are validated to [a-z0-9_] in the configuration; quoting is still applied.
        res = self._conn.exec_(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput {option}'.encode())
        if res.status != pq.ExecStatus.TUPLES_OK:
            raise SourceCheckError(f"cannot create replication slot {slot!r}: {self._error()}", check="create-slot")
        consistent = res.get_value(0, 1)
        snapshot = res.get_value(0, 2)
        assert consistent is not None
        return CreatedSlot(parse_lsn(consistent.decode()), snapshot.decode() if snapshot else None)

    def set_failover(self, slot: str, failover: bool) -> None:
        """ALTER_REPLICATION_SLOT … (FAILOVER …) (17+): whether standbys synchronize the slot."""
        res = self._conn.exec_(f'ALTER_REPLICATION_SLOT "{slot}" (FAILOVER {str(failover).lower()})'.encode())
        if res.status != pq.ExecStatus.COMMAND_OK:
            raise SourceCheckError(
                f"cannot set failover = {str(failover).lower()} on replication slot {slot!r}: {self._error()}; "
                "set source.failover to what the slot has, or alter it by hand",
                check="slot-failover",
            )

    def start(self, slot: str, start_lsn: int, options: dict[str, str]) -> None:
        opts = ", ".join(f"{k} '{v.replace(chr(39), chr(39) * 2)}'" for k, v in options.items())
        self._conn.send_query(f'START_REPLICATION SLOT "{slot}" LOGICAL {format_lsn(start_lsn)} ({opts})'.encode())
        res = self._conn.get_result()
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            message = self._error()
            if "is active for PID" in message:
                # Usually an older instance we have just fenced: it stops at its next commit. Retried.
                raise TransientError(f"replication slot {slot!r} is still in use by another process: {message}")
            raise TransientError(f"START_REPLICATION failed on {self._where}: {message}")
        self._conn.nonblocking = 1

    def read(self, timeout: float) -> memoryview | None:
        """The next CopyData payload, or None when nothing arrived within ``timeout`` seconds."""
        nbytes, data = self._conn.get_copy_data(1)
        if nbytes > 0:  # the common case while behind: a message already buffered
            return data
        return self._wait(timeout, nbytes)

    def _wait(self, timeout: float, nbytes: int) -> memoryview | None:
        """read() when nothing was buffered (nbytes 0) or the stream ended (-1, -2)."""
        conn = self._conn
        deadline = time.monotonic() + timeout
        polled = False
        while True:
            if nbytes == 0 and not polled:
                # Nothing buffered: take what the socket already holds before calling it "nothing arrived"
                # (with timeout 0 the capture commits its batch on None).
                polled = True
                conn.consume_input()
                nbytes, data = conn.get_copy_data(1)
                continue
            if nbytes > 0:
                return data
            if nbytes < 0:
                self._ended(nbytes)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([conn.socket], [], [], remaining)
            if readable:
                conn.consume_input()
            nbytes, data = conn.get_copy_data(1)

    def _ended(self, nbytes: int) -> NoReturn:
        """PQgetCopyData's -1 (the stream ended) or -2 (it failed), as the error to retry on."""
        if nbytes == -1:
            res = self._conn.get_result()
            detail = res.error_message.decode(errors="replace") if res is not None else self._error()
            raise TransientError(f"replication stream from {self._where} ended: {detail.strip()}")
        raise TransientError(f"replication stream from {self._where} failed: {self._error()}")

    @property
    def reads_changes_in_bulk(self) -> bool:
        """Whether :meth:`read_changes` can be called (the C build's ChangeReader)."""
        return self._changes is not None

    def read_changes(self, limit: int) -> tuple[bytes, int, int, bytes | None]:
        """The row changes (XLogData holding an Insert, Update or Delete) already received, without waiting, up to
        about ``limit`` bytes: (them framed as (start LSN, length) then the pgoutput message, one after another;
        how many; the largest end LSN among them, 0 without any; the first message that is not one, or None),
        see cdc._native.ChangeReader.read."""
        assert self._changes is not None
        pgconn = self._conn.pgconn_ptr  # type: ignore[attr-defined]  # public, not in the Protocol
        framed, count, end, held, nbytes = self._changes.read(pgconn, limit)
        if nbytes < 0:
            self._ended(nbytes)
        return framed, count, end, held

    def read_live_changes(
        self, producer: Any, targets: dict[int, Any], commit_lsn: int, limit: int
    ) -> tuple[int, int, bytes | None]:
        """The Inserts and Updates of a live transaction already received, produced from C (``producer``: the
        cdc._native.DirectProducer, ``targets``: relation id -> its ReplayTarget for this transaction) up to
        the first message it does not take: (how many; the largest end LSN among them; that message or None),
        see cdc._native.ChangeReader.live_changes."""
        assert self._changes is not None
        pgconn = self._conn.pgconn_ptr  # type: ignore[attr-defined]  # public, not in the Protocol
        count, end, held, nbytes = self._changes.live_changes(pgconn, producer, targets, commit_lsn, limit)
        if nbytes < 0:
            self._ended(nbytes)
        return count, end, held

    def send_status(self, write: int, flush: int, apply: int, *, reply: bool = False) -> None:
        msg = standby_status(write, flush, apply, time.time_ns() // 1000, reply)
        while (sent := self._conn.put_copy_data(msg)) == 0:  # non-blocking and the buffer is full: wait
            select.select([], [self._conn.socket], [], 1.0)
        if sent != 1:
            raise TransientError(f"cannot send standby status to {self._where}: {self._error()}")
        while self._conn.flush() == 1:  # non-blocking: 1 means "more to send"
            select.select([], [self._conn.socket], [], 1.0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn.finish()
