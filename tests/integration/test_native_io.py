"""The snapshot's C loops against the real services: CopyReader (a COPY read through psycopg's libpq) gives what
psycopg's Copy gives and fails as psycopg would; DirectProducer (a chunk produced on confluent_kafka's librdkafka
handle) writes the same records, to the same partitions, in the same transaction, as Producer.produce(); a
streamed or live transaction's Inserts, Updates and Deletes produced from C (DirectProducer.replay_changes,
ChangeReader.live_changes) are the events the fast path writes.
"""

from __future__ import annotations

import functools
import os
import queue
import struct
import tempfile
import threading
from typing import Any

import psycopg
import pytest
from pgcdc_dev.codecs import change_writer, make_codec
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc._catalog import load_table
from cdc._chunks import LibpqCopies, RangeJob, ReadRange, copy_reader, parse_binary_copy
from cdc._encoder import PACKED_HEAD
from cdc._replication import ReplicationConnection
from cdc._snapshot import Snapshotter, TableRewrittenError
from cdc._spill import Spill
from cdc.encoding import ChangeWriter, SourceInfo
from cdc.kafka import Topics, TransactionalProducer
from decoders import StreamCommit
from schemas import PgType
from tests.integration._capture_helpers import committed_records, scratch_database

pytestmark = pytest.mark.integration

PURE_PYTHON = os.environ.get("CDC_PURE_PYTHON", "") not in ("", "0")


@pytest.fixture
def reader() -> Any:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: the snapshot reads through psycopg's Copy")
    found = copy_reader()
    assert found is not None, "cdc._native is built but CopyReader was not set up (see the capture's log line)"
    return found


def test_libpq_copies_give_what_psycopg_copy_gives(reader: Any, pg_dsn: str, unique: str) -> None:
    with scratch_database(pg_dsn, f"copy_{unique}") as dsn, psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, body text, n numeric)")
        conn.execute("INSERT INTO t SELECT g, repeat('x', g % 300), g / 7.0 FROM generate_series(1, 20000) g")
        query = sql.SQL("COPY (SELECT * FROM t ORDER BY id) TO STDOUT (FORMAT binary)")
        expected = bytearray()
        with conn.cursor() as cur, cur.copy(query) as copy:
            for block in copy:
                expected += block
        nonblocking = conn.pgconn.nonblocking
        copies = LibpqCopies(reader, conn)
        copies.send(query)
        data = copies.receive()
        assert data == bytes(expected)
        assert len(data) > 1_000_000  # several of libpq's reads, and a buffer grown more than once
        # psycopg's connection is as it was: same mode, idle in the same transaction, usable.
        assert conn.pgconn.nonblocking == nonblocking
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (20000,)
        # A COPY sent ahead and then abandoned (the snapshot failed meanwhile) leaves the connection usable too.
        copies.send(query)
        copies.abandon()
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (20000,)


def test_a_copy_streamed_in_parts_gives_the_rows_of_the_whole(reader: Any, pg_dsn: str, unique: str) -> None:
    """Block ranges stream one COPY in parts of at most N rows: each part parses alone (the header repeated, a
    trailer added) and together they are the whole COPY's rows, in order. A stream stopped early (the snapshot
    was cancelled) leaves the connection usable, without reading the table to its end first."""
    with scratch_database(pg_dsn, f"copyparts_{unique}") as dsn, psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, body text)")
        conn.execute("INSERT INTO t SELECT g, repeat('y', g % 700) FROM generate_series(1, 25000) g")
        conn.commit()
        copies = LibpqCopies(reader, conn)
        # Parts that end with the rows, one before them, none at all; one row per part (the trailer is a message
        # of its own and must not make a part of its own: a bare header is no COPY output).
        for rows, per_part in [(25000, 1000), (24999, 1000), (3, 1), (1, 1), (0, 1), (0, 1000)]:
            first_rows = sql.SQL("COPY (SELECT * FROM t WHERE id <= {}) TO STDOUT (FORMAT binary)").format(rows)
            copies.send(first_rows)
            whole = parse_binary_copy(copies.receive())
            assert len(whole) == rows
            copies.send(first_rows)
            parts: list[list[list[bytes | None]]] = []
            done = False
            while not done:
                data, done = copies.receive_part(per_part)
                parts.append(parse_binary_copy(data))
            assert [len(p) for p in parts] == [per_part] * (rows // per_part) + [rows % per_part], (rows, per_part)
            assert [row for part in parts for row in part] == whole
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (25000,)
        # Stopped after one part of a COPY that would take a while: cancelled, not read to its end.
        big = sql.SQL("COPY (SELECT g, repeat('z', 500) FROM generate_series(1, 50000000) g) TO STDOUT (FORMAT binary)")
        copies.send(big)
        assert len(parse_binary_copy(copies.receive_part(100)[0])) == 100
        copies.abandon_stream()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR  # the cancel's error
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (25000,)


def test_a_table_rewritten_between_its_block_ranges_is_not_read_on(reader: Any, pg_dsn: str, unique: str) -> None:
    """VACUUM FULL keeps every row a snapshot sees but moves them to other blocks: a block range read after it
    would miss the rows that moved into a range read before. The table's file tells, and the read stops with a
    transient error (the restart reads the table in key order)."""
    with scratch_database(pg_dsn, f"rewrite_{unique}") as dsn, psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE t (id int PRIMARY KEY, body text)")
        setup.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 1000) g")
        table = load_table(setup, "public", "t")
        assert table is not None
        filenode = "SELECT pg_relation_filenode('t'::regclass)"
        before = setup.execute(filenode).fetchone()
        setup.execute("VACUUM FULL t")
        after = setup.execute(filenode).fetchone()
        assert before is not None
        assert after is not None
        assert before != after
        chunks: queue.Queue[Any] = queue.Queue()
        # Ranges made before the rewrite stop; ranges made after it read every row.
        for made_with, rewritten in [(before[0], True), (after[0], False)]:
            with psycopg.connect(dsn) as conn:
                work = ReadRange(table, 1, None, None, [0, None], made_with)
                codec = make_codec(
                    [("id", PgType(23, "int4"), -1), ("body", PgType(25, "text"), -1)], topic="p.public.t"
                )
                job = RangeJob(work, codec, most_rows=400)
                assert job.kinds == b"bb"
                stream = functools.partial(
                    Snapshotter._stream_blocks, conn, job, LibpqCopies(reader, conn), chunks, threading.Event()
                )
                if rewritten:
                    with pytest.raises(TableRewrittenError, match="rewritten"):
                        stream()
                    assert chunks.empty()  # nothing read
                else:
                    stream()
                    assert sum(chunks.get_nowait().rows for _ in range(chunks.qsize())) == 1000


def test_libpq_copies_fail_as_psycopg_would(reader: Any, pg_dsn: str, unique: str) -> None:
    with scratch_database(pg_dsn, f"copyerr_{unique}") as dsn, psycopg.connect(dsn) as conn:
        copies = LibpqCopies(reader, conn)
        copies.send(sql.SQL("COPY (SELECT * FROM missing) TO STDOUT (FORMAT binary)"))
        with pytest.raises(psycopg.errors.UndefinedTable, match='relation "missing" does not exist'):
            copies.receive()
        # A failure during the COPY (not before it): division by zero on the second row.
        conn.rollback()
        conn.execute("SELECT 1")  # in a transaction again, as the snapshot's reader always is
        copies.send(sql.SQL("COPY (SELECT 1 / (2 - g) FROM generate_series(1, 3) g) TO STDOUT (FORMAT binary)"))
        with pytest.raises(psycopg.errors.DivisionByZero):
            copies.receive()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        assert conn.execute("SELECT 1").fetchone() == (1,)


def _slot(dsn: str, name: str) -> str:
    """Slots are server-wide: each test's are named after its scratch database."""
    return f"{name}_{conninfo_to_dict(dsn)['dbname']}"


def _published(dsn: str, *ddl: str, slots: tuple[str, ...]) -> None:
    """Table t made by ``ddl``, in publication "pub", and a pgoutput slot per name in ``slots``, all at one point:
    copies of the first, so each decodes the same WAL from the same start. Slots made one after the other would
    start apart, and a transaction of another database between them (another test's) can make the server stream
    a large transaction in different chunks to each."""
    first, *others = (_slot(dsn, name) for name in slots)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in ddl:
            conn.execute(statement)
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (first,))
        for slot in others:
            conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (first, slot))


def _ensure_topics(kafka: str, *topics: str) -> None:
    admin = Topics({"bootstrap.servers": kafka}, partitions=3, replication_factor=1)
    for topic in topics:
        admin.ensure(topic)


def test_direct_producer_writes_what_produce_writes(kafka_bootstrap: str, unique: str) -> None:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: snapshot events go through produce()")
    conf = {"bootstrap.servers": kafka_bootstrap}
    direct, plain = f"direct{unique}", f"plain{unique}"
    _ensure_topics(kafka_bootstrap, direct, plain)
    keys = [f"key-{i}".encode() for i in range(30000)]
    records = [bytes([i % 256]) * (i % 700) for i in range(30000)]
    packed = b"".join(PACKED_HEAD.pack(len(r), len(k)) + r + k for k, r in zip(keys, records, strict=True))
    producer = TransactionalProducer(conf, f"native-io-{unique}")
    try:
        assert producer._direct is not None, "cdc._native is built but DirectProducer was not set up"
        producer.begin()
        producer.produce_packed(direct, packed, len(keys), b"<prefix>", b"<suffix>")
        fallback, producer._direct = producer._direct, None  # one produce() per event
        producer.produce_packed(plain, packed, len(keys), b"<prefix>", b"<suffix>")
        producer._direct = fallback
        producer.commit()
        # An aborted transaction's events from C are not seen either.
        producer.begin()
        producer.produce_packed(direct, PACKED_HEAD.pack(1, 7) + b"x" + b"aborted", 1, b"", b"")
        producer.abort()
    finally:
        producer.close()
    written = committed_records(kafka_bootstrap, direct, 3)
    assert written == committed_records(kafka_bootstrap, plain, 3)
    assert len(written) == 30000
    assert {p for p, _, _ in written} == {0, 1, 2}  # the partitioner ran per key
    assert sorted((k, v) for _, k, v in written) == sorted(
        (k, b"<prefix>" + r + b"<suffix>") for k, r in zip(keys, records, strict=True)
    )


UNCHANGED = b"unchanged TOASTed value"  # written as pgoutput's 'u' marker


def _streamed(kind: bytes, xid: int, relid: int, *tuples: tuple[bytes, list[bytes | None]]) -> bytes:
    """A pgoutput change as streamed (its subtransaction's xid after the type byte): tuples of (marker, values)."""
    out = kind + struct.pack(">II", xid, relid)
    for marker, values in tuples:
        out += marker + struct.pack(">H", len(values))
        for value in values:
            if value is UNCHANGED:
                out += b"u"
            else:
                out += b"n" if value is None else b"b" + struct.pack(">I", len(value)) + value
    return out


def _row(i: int) -> list[bytes | None]:
    name = None if i % 7 == 0 else ("é" * (i % 5) + "x" * (i % 300)).encode()
    return [struct.pack(">q", i), name, struct.pack(">i", -i)]


def _replay_into(
    kafka: str, topics: list[str], spill: Spill, tid: str, *, from_c: bool, queue: int | None = None
) -> tuple[list[int], dict[str, int]]:
    """ChangeWriter.replay of ``spill`` into ``topics`` (two tables) in one Kafka transaction, the producer's local
    queue ``queue`` messages at most; the offsets at which the C loop stopped, for each call of it, and how many
    create, update and delete events it made and deletes' tombstones it left owed ("owed")."""
    conf: dict[str, Any] = {"bootstrap.servers": kafka}
    if queue is not None:
        conf["queue.buffering.max.messages"] = queue
    producer = TransactionalProducer(conf, tid)
    cap = change_writer(producer)
    columns = [("id", PgType(20, "int8"), -1), ("name", PgType(25, "text"), -1), ("qty", PgType(23, "int4"), -1)]
    for relid, topic in zip((16384, 16385), topics, strict=True):
        # One source name for both runs: the events differ only in their topic.
        cap._codecs[relid] = make_codec(columns, topic=topic, key=["id"], source=SourceInfo("1.0", "src", "db"))
    stops: list[int] = []
    made, owed = _count_made(cap), _count_owed(producer)
    replay = producer.replay_changes

    def stopping(block: bytes, at: int, targets: dict[int, Any], aborted: set[int], commit_lsn: int) -> int:
        stops.append(replay(block, at, targets, aborted, commit_lsn))
        return stops[-1]

    producer.replay_changes = stopping  # type: ignore[method-assign]
    if not from_c:
        producer._direct = None
    commit = StreamCommit(
        xid=700, flags=0, commit_lsn=0x5_0000_0000, end_lsn=0x5_0000_1000, commit_time_us=1_700_000_000_000_000
    )
    try:
        cap._writer.begin()
        cap.replay(spill, commit, 2, 1_700_000_000_123_456)
        producer.commit()
    finally:
        producer.close()
    return stops, {**made, "owed": owed["n"]}


def test_replayed_changes_from_c_are_what_the_fast_path_writes(kafka_bootstrap: str, unique: str) -> None:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: a streamed transaction is replayed by the fast path only")
    direct, plain = [f"d{unique}.public.a", f"d{unique}.public.b"], [f"p{unique}.public.a", f"p{unique}.public.b"]
    _ensure_topics(kafka_bootstrap, *direct, *plain)
    with tempfile.TemporaryFile() as file:
        spill = Spill(file, block=4096)  # many blocks: runs cut at their ends too
        lsn = 0x4_0000_0000
        messages = []
        for i in range(3000):
            messages.append(_streamed(b"I", 700, 16384, (b"N", _row(i))))
            if i % 500 == 250:  # another table, an update, a delete, a rolled-back subtransaction's insert
                messages.append(_streamed(b"I", 700, 16385, (b"N", _row(i))))
                messages.append(_streamed(b"U", 700, 16384, (b"N", _row(i - 1))))
                messages.append(_streamed(b"U", 700, 16384, (b"N", [*_row(i - 3)[:1], UNCHANGED, _row(i - 3)[2]])))
                messages.append(_streamed(b"U", 700, 16384, (b"O", _row(i - 4)), (b"N", _row(i - 4))))
                key_change = (b"K", [struct.pack(">q", i - 5), None, None]), (b"N", _row(200_000 + i))
                messages.append(_streamed(b"U", 700, 16384, *key_change))
                messages.append(_streamed(b"D", 700, 16384, (b"K", [struct.pack(">q", i - 2), None, None])))
                messages.append(_streamed(b"I", 701, 16384, (b"N", _row(100_000 + i))))
        for message in messages:
            lsn += 100
            spill.add(lsn, message)
        spill.aborted_subxids.add(701)
        stops, made = _replay_into(kafka_bootstrap, direct, spill, f"replay-c-{unique}", from_c=True)
        nothing = {"c": 0, "u": 0, "d": 0, "owed": 0}
        assert _replay_into(kafka_bootstrap, plain, spill, f"replay-py-{unique}", from_c=False) == ([], nothing)
    # The updates that are one event each (no key change), and the deletes, were produced from C.
    assert made["u"] == 6 * 3
    assert made["d"] == 6
    # The C loop ran, and handed back every message it does not take (a key change, aborted, the other table
    # before its first change went through the fast path).
    assert len(stops) > 20
    for topic_c, topic_py in zip(direct, plain, strict=True):
        written = committed_records(kafka_bootstrap, topic_c, 3, in_order=True)
        assert written == committed_records(kafka_bootstrap, topic_py, 3, in_order=True)
        assert written
    a = committed_records(kafka_bootstrap, direct[0], 3, in_order=True)
    # 3000 inserts, 6 x 3 updates, 6 deletes and 6 key changes (delete, tombstone, create); no rolled-back insert
    assert len(a) == 3000 + 6 * 3 + 6 * 2 + 6 * 3


def test_a_deletes_refused_tombstone_is_written_once_after_it_when_replayed(kafka_bootstrap: str, unique: str) -> None:
    """A one-message local queue: C produces a delete's event and librdkafka refuses its tombstone (the queue is
    full until the event is delivered). The tombstone is produced next, once, and the delete is not handed to
    the general path (which would write its event twice)."""
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: a streamed transaction is replayed by the fast path only")
    direct, plain = [f"od{unique}.public.a", f"od{unique}.public.b"], [f"op{unique}.public.a", f"op{unique}.public.b"]
    _ensure_topics(kafka_bootstrap, *direct, *plain)
    with tempfile.TemporaryFile() as file:
        spill = Spill(file, block=1 << 20)
        lsn = 0x4_0000_0000
        for i in range(40):
            for message in (
                _streamed(b"I", 700, 16384, (b"N", _row(i))),
                _streamed(b"D", 700, 16384, (b"K", [struct.pack(">q", i - 1), None, None])),
            ):
                lsn += 100
                spill.add(lsn, message)
        _, made = _replay_into(kafka_bootstrap, direct, spill, f"owed-c-{unique}", from_c=True, queue=1)
        _replay_into(kafka_bootstrap, plain, spill, f"owed-py-{unique}", from_c=False)
    assert made["d"] == 40
    assert made["owed"] > 0, "no tombstone was refused after its event: the owed path was not exercised"
    written = committed_records(kafka_bootstrap, direct[0], 3, in_order=True)
    assert written == committed_records(kafka_bootstrap, plain[0], 3, in_order=True)
    assert len(written) == 40 + 40 * 2  # each delete: its event and one tombstone


def test_a_deletes_refused_tombstone_is_written_once_after_it_when_live(
    kafka_bootstrap: str, pg_dsn: str, unique: str
) -> None:
    """The same for a live transaction (ChangeReader.live_changes): one transaction of inserts, then deletes,
    through a three-message local queue drained whenever it is full. The general path takes a delete C was
    refused room for and leaves two messages queued; C then produces the next delete's event into the last
    place and is refused its tombstone."""
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: live changes go through the fast path only")
    direct, plain = f"old{unique}.public.t", f"olp{unique}.public.t"
    _ensure_topics(kafka_bootstrap, direct, plain)
    with scratch_database(pg_dsn, f"ow_{unique}") as dsn:
        _published(dsn, "CREATE TABLE t (id int PRIMARY KEY, body text, qty int)", slots=("c", "py"))
        with psycopg.connect(dsn) as conn:
            conn.execute("INSERT INTO t SELECT g, 'b' || g, g FROM generate_series(1, 60) g")
            conn.execute("DELETE FROM t WHERE id % 2 = 0")
            conn.commit()
        made = _capture_live(
            kafka_bootstrap,
            dsn,
            "c",
            direct,
            f"olive-c-{unique}",
            from_c=True,
            queue=3,
            commits=1,
            drain_when_full=True,
        )
        _capture_live(kafka_bootstrap, dsn, "py", plain, f"olive-py-{unique}", from_c=False, commits=1)
    written = committed_records(kafka_bootstrap, direct, 3, in_order=True)
    assert written == committed_records(kafka_bootstrap, plain, 3, in_order=True)
    assert len(written) == 60 + 30 * 2
    assert made["d"] > 0, "no delete was produced from C"
    assert made["owed"] > 0, "no tombstone was refused after its event: the owed path was not exercised"


def _read_stream(dsn: str, slot: str, *, bulk: bool) -> tuple[list[tuple[str, bytes]], int]:
    """The replication stream of ``slot`` from its start until a Stream Commit: XLogData as ("w", LSN + the
    pgoutput message), keepalives as ("k", b""); with ``bulk``, every change after the first of a run taken by
    read_changes, as the capture takes them; and how many read_changes took."""
    params = conninfo_to_dict(dsn)
    params["replication"] = "database"
    params["options"] = "-c logical_decoding_work_mem=64kB"
    repl = ReplicationConnection(make_conninfo("", **params), where="test")
    out: list[tuple[str, bytes]] = []
    taken = 0
    try:
        assert repl.reads_changes_in_bulk, "cdc._native is built but ChangeReader was not set up"
        repl.start(_slot(dsn, slot), 0, {"proto_version": "2", "publication_names": '"pub"', "streaming": "on"})
        held: bytes | None = None
        while True:
            raw = held if held is not None else repl.read(10.0)
            held = None
            assert raw is not None, "the stream went quiet before the Stream Commit"
            if raw[0] == ord("k"):
                out.append(("k", b""))
                continue
            lsn, payload = bytes(raw[1:9]), bytes(raw[25:])
            out.append(("w", lsn + payload))
            if payload[:1] == b"c":  # Stream Commit
                return out, taken
            if bulk and payload[:1] in (b"I", b"U", b"D"):
                framed, count, end, held = repl.read_changes(1 << 20)
                taken += count
                at = 0
                for _ in range(count):
                    length = struct.unpack_from(">I", framed, at + 8)[0]
                    out.append(("w", framed[at : at + 8] + framed[at + 12 : at + 12 + length]))
                    at += 12 + length
                assert at == len(framed)
                assert end >= int.from_bytes(lsn) or count == 0
    finally:
        repl.close()


def test_read_changes_takes_what_read_takes_one_at_a_time(pg_dsn: str, unique: str) -> None:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: changes are read one message at a time")
    with scratch_database(pg_dsn, f"rc_{unique}") as dsn:
        _published(dsn, "CREATE TABLE t (id int PRIMARY KEY, body text)", slots=("one", "bulk"))
        with psycopg.connect(dsn) as conn:  # streamed: far past 64 kB, with updates and deletes inside
            conn.execute("INSERT INTO t SELECT g, repeat('x', g % 500) FROM generate_series(1, 20000) g")
            conn.execute("UPDATE t SET body = 'y' WHERE id % 3 = 0")
            conn.execute("DELETE FROM t WHERE id % 5 = 0")
            conn.commit()
        one, _ = _read_stream(dsn, "one", bulk=False)
        bulk, taken = _read_stream(dsn, "bulk", bulk=True)
    # The changes, each with its WAL position, in order. Only they are compared: the server streams the
    # transaction in chunks (Stream Start, a Relation, changes, Stream Stop) whose boundaries can differ between
    # two slots read at different times even from one start, when other databases' WAL interleaves (other
    # tests run beside this one), so the messages around the changes may differ in number and place.
    changes_one, changes_bulk = _changes(one), _changes(bulk)
    assert len(changes_one) == 20000 + 6666 + 4000
    assert changes_bulk == changes_one
    assert taken > len(changes_one) // 2  # most changes came in runs
    # What bulk hands back between runs (the message after a run) is kept: every chunk it saw is whole.
    kinds = [m[1][8:9] for m in bulk if m[0] == "w"]
    assert kinds.count(b"S") == kinds.count(b"E") >= 2, kinds.count(b"S")


def _changes(stream: list[tuple[str, bytes]]) -> list[bytes]:
    """The Insert, Update and Delete messages of a stream read by :func:`_read_stream`, with their positions."""
    return [m for kind, m in stream if kind == "w" and m[8:9] in (b"I", b"U", b"D")]


def _count_made(cap: ChangeWriter) -> dict[str, int]:
    """How many create, update and delete events C makes through ``cap`` from now on (a live count)."""
    made = {"c": 0, "u": 0, "d": 0}
    counted = cap._writer.count_from_c

    def counting(targets: dict[int, Any]) -> None:
        for target in targets.values():
            made["c"] += target.inserts
            made["u"] += target.updates
            made["d"] += target.deletes
        counted(targets)

    cap._writer.count_from_c = counting  # type: ignore[method-assign]
    return made


def _count_owed(producer: TransactionalProducer) -> dict[str, int]:
    """How many tombstones of deletes produced from C librdkafka refused, left for ``producer`` to produce."""
    owed = {"n": 0}
    pay = producer._pay_owed

    def paying(targets: dict[int, Any]) -> None:
        owed["n"] += sum(target.owed is not None for target in targets.values())
        pay(targets)

    producer._pay_owed = paying  # type: ignore[method-assign]
    return owed


def _capture_live(
    kafka: str,
    dsn: str,
    slot: str,
    topic: str,
    tid: str,
    *,
    from_c: bool,
    queue: int | None = None,
    commits: int = 3,
    drain_when_full: bool = False,
) -> dict[str, int]:
    """The first ``commits`` live transactions of ``slot`` (table t: id int, body text, qty int) through
    ChangeWriter.fast_change and, with ``from_c``, ChangeWriter.more_changes, as the capture's loop calls them, into
    ``topic``. Returns how many create, update and delete events C made, how often the producer's local queue
    (``queue`` messages at most) was full, and how many deletes' tombstones C left owed. ``drain_when_full``:
    a wait for room waits until the queue is empty, which makes where C finds it full predictable."""
    conf: dict[str, Any] = {"bootstrap.servers": kafka}
    if queue is not None:
        conf["queue.buffering.max.messages"] = queue
    producer = TransactionalProducer(conf, tid)
    cap = change_writer(producer)
    full = 0
    queue_full = producer._queue_full

    def counting_full() -> None:
        nonlocal full
        full += 1
        if drain_when_full:
            assert producer._producer.flush(30.0) == 0, "the local queue did not drain"
        else:
            queue_full()

    producer._queue_full = counting_full  # type: ignore[method-assign]
    owed = _count_owed(producer)
    params = conninfo_to_dict(dsn)
    params["replication"] = "database"
    repl = ReplicationConnection(make_conninfo("", **params), where="test")
    columns = [("id", PgType(23, "int4"), -1), ("body", PgType(25, "text"), -1), ("qty", PgType(23, "int4"), -1)]
    committed = 0
    made = _count_made(cap)
    try:
        repl.start(_slot(dsn, slot), 0, {"proto_version": "1", "publication_names": '"pub"', "binary": "true"})
        cap._writer.begin()
        held: bytes | None = None
        while committed < commits:
            raw = held if held is not None else repl.read(10.0)
            held = None
            assert raw is not None, f"the stream went quiet before commit {committed + 1}"
            data = bytes(raw)
            if data[0] != ord("w"):
                continue
            kind = data[25:26]
            if kind == b"R":
                relid = struct.unpack_from(">I", data, 26)[0]
                cap._codecs[relid] = make_codec(columns, topic=topic, key=["id"], source=SourceInfo("1.0", "s", "db"))
            elif kind == b"B":
                final_lsn, commit_time, xid = struct.unpack_from(">QqI", data, 26)
                cap.begin(final_lsn, commit_time, xid, 1_700_000_000_000_000)
            elif kind == b"C":
                committed += 1
            elif kind in (b"I", b"U", b"D"):
                lsn = struct.unpack_from(">Q", data, 1)[0]
                assert cap.fast_change(data, lsn, start=25)
                if from_c:
                    held, _ = cap.more_changes(repl, data)
        producer.commit()
    finally:
        repl.close()
        producer.close()
    return {**made, "full": full, "owed": owed["n"]}


def test_live_changes_from_c_are_what_the_fast_path_writes(kafka_bootstrap: str, pg_dsn: str, unique: str) -> None:
    if PURE_PYTHON:
        pytest.skip("CDC_PURE_PYTHON is set: live changes go through the fast path only")
    direct, plain, small = f"ld{unique}.public.t", f"lp{unique}.public.t", f"lq{unique}.public.t"
    _ensure_topics(kafka_bootstrap, direct, plain, small)
    with scratch_database(pg_dsn, f"li_{unique}") as dsn:
        _published(
            dsn,
            "CREATE TABLE t (id int PRIMARY KEY, body text, qty int)",
            "ALTER TABLE t ALTER body SET STORAGE EXTERNAL",  # long values out of line, uncompressed
            slots=("c", "py", "cq"),
        )
        with psycopg.connect(dsn) as conn:
            conn.execute("INSERT INTO t VALUES (-1, 'one row', 0)")  # a one-row transaction: no target for it
            conn.commit()
            # Inserts, then updates (a TOASTed value left unchanged: 'u'; a key change: three events) and deletes,
            # with NULLs and long non-ASCII values
            conn.execute(
                "INSERT INTO t SELECT g, CASE WHEN g % 9 = 0 THEN NULL WHEN g % 350 = 0 THEN repeat('é', 3000)"
                " ELSE repeat('é', g % 300) END, g FROM generate_series(1, 5000) g"
            )
            conn.execute("UPDATE t SET body = 'u' WHERE id % 1000 = 0")
            conn.execute("UPDATE t SET qty = qty + 1 WHERE id % 350 = 0")
            conn.execute("UPDATE t SET id = -id WHERE id = 4999")
            conn.execute("INSERT INTO t SELECT g, 'x', g FROM generate_series(5001, 6000) g")
            conn.execute("DELETE FROM t WHERE id % 1500 = 0")
            conn.commit()
            conn.execute("INSERT INTO t SELECT g, 'y', g FROM generate_series(6001, 9000) g")
            conn.commit()
        made = _capture_live(kafka_bootstrap, dsn, "c", direct, f"live-c-{unique}", from_c=True)
        by_python = _capture_live(kafka_bootstrap, dsn, "py", plain, f"live-py-{unique}", from_c=False)
        assert (by_python["c"], by_python["u"], by_python["d"]) == (0, 0, 0)
        # A local queue of 300 messages: C's rd_kafka_produce is refused (queue full) again and again, hands the
        # change back, and the general path waits for room and produces it; nothing is lost or written twice.
        small_queue = _capture_live(kafka_bootstrap, dsn, "cq", small, f"live-cq-{unique}", from_c=True, queue=300)
    written = committed_records(kafka_bootstrap, direct, 3, in_order=True)
    assert written == committed_records(kafka_bootstrap, plain, 3, in_order=True)
    assert written == committed_records(kafka_bootstrap, small, 3, in_order=True)
    assert small_queue["full"] > 0, "the 300-message queue never filled: the hand-back was not exercised"
    assert small_queue["c"] > 1000, "C made (almost) no events with a small queue"
    assert len(written) == 1 + 5000 + 5 + 14 + 3 + 1000 + 4 * 2 + 3000
    unchanged = [v for _, _, v in written if v and v.endswith(b"\x02\x08body\x00")]  # ["body"] and the end
    assert len(unchanged) == 13  # the updates that left a long body alone (not 3150: NULL) carry it as unchanged
    # Most Inserts, Updates and Deletes were produced from C. Not all: whenever librdkafka's queue is full (a busy
    # machine's broker acknowledges slowly) C hands the change back to the general path, as tested above.
    assert made["c"] > len(written) // 2
    assert made["u"] > 10
    assert made["d"] >= 3  # the first of the 4 deletes may end a run of the general path
