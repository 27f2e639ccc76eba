"""PostgreSQL: a logical slot streams a committed change over the replication protocol (psycopg.pq)."""

from __future__ import annotations

import os
import select
import struct
import time

import psycopg
import pytest
from psycopg import pq, sql
from psycopg.conninfo import make_conninfo
from psycopg.pq.abc import PGconn

pytestmark = pytest.mark.pg_matrix

# Standby status updates count microseconds from 2000-01-01; the Unix epoch is 946684800 s earlier.
_PG_EPOCH_OFFSET_US = 946_684_800 * 1_000_000


def _read_cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode(), end + 1


def _next_copy_data(conn: PGconn, deadline: float) -> bytes:
    while True:
        nbytes, data = conn.get_copy_data(1)  # 1 = async: 0 bytes means "nothing buffered yet"
        if nbytes > 0:
            return bytes(data)
        if nbytes == -1:
            raise AssertionError(f"replication stream ended: {conn.get_error_message()!r}")
        remaining = deadline - time.monotonic()
        assert remaining > 0, "no replication message before the deadline"
        select.select([conn.socket], [], [], remaining)
        conn.consume_input()


def test_logical_slot_streams_a_committed_insert(pg_dsn: str, unique: str) -> None:
    table, slot, pub = f"smoke_{unique}", f"smoke_slot_{unique}", f"smoke_pub_{unique}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, note text)").format(sql.Identifier(table)))
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(pub), sql.Identifier(table)))

    repl = pq.PGconn.connect(make_conninfo(pg_dsn, replication="database").encode())
    try:
        assert repl.status == pq.ConnStatus.OK, repl.get_error_message()
        res = repl.exec_(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput'.encode())
        assert res.status == pq.ExecStatus.TUPLES_OK, res.error_message
        assert res.get_value(0, 0) == slot.encode()

        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(sql.Identifier(table)), (42, "héllo"))

        options = f"proto_version '1', publication_names '\"{pub}\"'"
        repl.send_query(f'START_REPLICATION SLOT "{slot}" LOGICAL 0/0 ({options})'.encode())
        started = repl.get_result()
        assert started is not None, repl.get_error_message()
        assert started.status == pq.ExecStatus.COPY_BOTH, repl.get_error_message()

        relation_name = None
        inserted: list[str | None] = []
        deadline = time.monotonic() + 30
        while not inserted:
            msg = _next_copy_data(repl, deadline)
            if msg[:1] == b"k":  # keepalive
                continue
            assert msg[:1] == b"w", msg[:1]
            wal_end = struct.unpack_from(">Q", msg, 9)[0]
            payload = msg[25:]
            kind = payload[:1]
            if kind == b"R":  # Relation: relid, namespace, name, replident, columns…
                _ns, pos = _read_cstring(payload, 5)
                relation_name, _ = _read_cstring(payload, pos)
            elif kind == b"I":  # Insert: relid, 'N', tuple(ncols, per column kind + length + text)
                assert payload[5:6] == b"N"
                (ncols,) = struct.unpack_from(">h", payload, 6)
                pos = 8
                for _ in range(ncols):
                    col_kind = payload[pos : pos + 1]
                    pos += 1
                    if col_kind == b"n":
                        inserted.append(None)
                        continue
                    assert col_kind == b"t", col_kind
                    (length,) = struct.unpack_from(">i", payload, pos)
                    inserted.append(payload[pos + 4 : pos + 4 + length].decode())
                    pos += 4 + length

        assert relation_name == table
        assert inserted == ["42", "héllo"]

        # Acknowledge what we received: a standby status update ('r').
        now_us = int(time.time() * 1_000_000) - _PG_EPOCH_OFFSET_US
        assert repl.put_copy_data(b"r" + struct.pack(">QQQqB", wal_end, wal_end, wal_end, now_us, 0)) == 1
        repl.flush()
    finally:
        repl.finish()

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() != (
            False,
        ):
            assert time.monotonic() < deadline, "walsender did not release the slot"
            time.sleep(0.1)
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(pub)))
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


def test_the_server_is_the_version_the_run_asked_for(pg_dsn: str, pg_server: str) -> None:
    """A [pg18] test (or CDC_TEST_PG=18) must reach a PostgreSQL 18, not fall back to the default server
    unnoticed."""
    if os.environ.get("CDC_TEST_PG_DSN"):
        pytest.skip("the server is the one CDC_TEST_PG_DSN names, whatever its version")
    with psycopg.connect(pg_dsn) as conn:
        major = conn.info.server_version // 10000
    assert major == int(pg_server), f"the test asks for PostgreSQL {pg_server} but the server is {major}"
