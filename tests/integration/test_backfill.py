"""Backfills while streaming (cdc/_backfill.py), on the real services: a table added to a running capture is
backfilled while writes go on to it and to the others; `cdc snapshot` asks for one (with --where), and
--list, --pause, --resume and --cancel operate them.

What must hold for every key of a backfilled table: the topic ends equal to the source; no two events of the key
share a (commit_lsn, lsn); in the topic's order a key's positions never go backwards (a backfill row carries its
chunk's high watermark, and what the stream wrote after the chunk's snapshot is either dropped from the chunk or
after it).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    Event,
    latest_by_key,
    read_topic,
    scratch_database,
    wait_for,
)

pytestmark = pytest.mark.pg_matrix  # `./dev test` runs it on PostgreSQL 18 too


def _write(dsn: str, table: str, ids: int, done: threading.Event, counts: list[float]) -> None:
    """Updates, deletes and re-inserts on ``table`` (ids 1..ids) until ``done``; counts the transactions."""
    rng = random.Random(table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.is_set():
            key = rng.randint(1, ids)
            roll = rng.random()
            if roll < 0.6:
                conn.execute(f"UPDATE {table} SET v = v + 1 WHERE id = %s", (key,))
            elif roll < 0.8:
                conn.execute(f"DELETE FROM {table} WHERE id = %s", (key,))
            else:
                conn.execute(f"INSERT INTO {table} VALUES (%s, 0) ON CONFLICT (id) DO UPDATE SET v = 0", (key,))
            counts.append(time.monotonic())
            time.sleep(0.002)


def _tables(dsn: str, **rows: int) -> None:
    """Tables (id int key, v int) with ids 1..rows, by name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, n in rows.items():
            conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v int NOT NULL)")
            conn.execute(f"INSERT INTO {name} SELECT g, 0 FROM generate_series(1, {n}) g")


def _source(dsn: str, table: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute(f"SELECT id, v FROM {table}").fetchall())


def _topic(kafka: str, registry: str, topic: str) -> dict[int, int]:
    return {k: v["v"] for k, v in latest_by_key(read_topic(kafka, registry, topic), "id").items()}


def _converge(dsn: str, kafka: str, registry: str, topic: str, *, table: str, proc: CdcProcess) -> None:
    expected = _source(dsn, table)
    wait_for(lambda: _topic(kafka, registry, topic) == expected, 120, f"{table} to converge", proc)


def _assert_in_order(events: list[Event]) -> None:
    positions: dict[Any, list[tuple[int, int]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e.partition, e.offset)):
        if e.key is not None and e.value is not None:
            src = e.value["source"]
            positions[e.key["id"]].append((src["commit_lsn"], src["lsn"]))
    for key, seq in positions.items():
        assert len(set(seq)) == len(seq), f"key {key}: two events at one position {seq}"
        assert seq == sorted(seq), f"key {key}: positions go backwards {seq}"


# What a backfill asks of the writers is its locks (plain SELECTs in REPEATABLE READ: ACCESS SHARE, the same on every
# version); PostgreSQL 18's backfills run in this suite's other tests. What a backfill costs the stream is
# bench/backfill.py's to measure.
@pytest.mark.one_version
def test_a_table_added_to_a_running_capture_is_backfilled_while_it_is_written(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    rows = 200_000
    with scratch_database(pg_dsn, f"bf_{unique}") as dsn:
        _tables(dsn, a=1000, b=rows)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION p_{unique} FOR TABLE a")
        cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, f"bf{unique}", ["public.a"], f"s_{unique}", f"p_{unique}")
        done = threading.Event()
        writes: dict[str, list[float]] = {"a": [], "b": []}
        writers = [
            threading.Thread(target=_write, args=(dsn, t, n, done, writes[t])) for t, n in (("a", 1000), ("b", rows))
        ]
        first = cfg.start(tmp_path)
        try:
            first.wait_streaming(180)
            for w in writers:
                w.start()
            # b written while it is not captured: only the backfill can bring those changes
            wait_for(lambda: len(writes["b"]) >= 200, 60, "writes to the table not yet captured", first)
        finally:
            first.stop()
        # The user's steps: the table added to the publication and the configuration, then the same command
        # again, while the applications write on.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"ALTER PUBLICATION p_{unique} ADD TABLE b")
        cfg.tables = ["public.a", "public.b"]
        again = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc-again.log")
        locks = _LockWatch(dsn, "b")
        try:
            locks.start()
            again.start()
            wait_for(lambda: "backfill added." in again.tail(400), 120, "the backfill to start", again)
            during_start = time.monotonic()
            wait_for(lambda: " done: " in again.tail(400), 600, "the backfill", again)
            during_end = time.monotonic()
            locks.stop()
            wait_for(lambda: writes["b"][-1] > during_end, 60, "a write to b after the backfill", again)
            done.set()
            for w in writers:
                w.join(30)
            for table in ("a", "b"):
                _converge(dsn, kafka_bootstrap, registry_url, f"bf{unique}.public.{table}", table=table, proc=again)
        finally:
            done.set()
            locks.stop()
            again.stop()
        log = again.log.read_text()
        assert "public.b is new to the capture: its rows are backfilled while streaming" in log, log
        events = read_topic(kafka_bootstrap, registry_url, f"bf{unique}.public.b")
        reads = [e for e in events if e.value is not None and e.value["op"] == "r"]
        assert reads, "the backfill wrote nothing"
        assert {e.value["source"]["snapshot"] for e in reads if e.value} == {"incremental"}
        assert len(reads) <= rows
        _assert_in_order(events)
        _assert_in_order(read_topic(kafka_bootstrap, registry_url, f"bf{unique}.public.a"))
        # Writers are not held up: the capture's sessions held no lock on b but ACCESS SHARE (which conflicts only
        # with ACCESS EXCLUSIVE: DDL), and the writers wrote b all through the backfill.
        assert locks.modes == {"AccessShareLock"}, f"the capture's locks on b during the backfill: {locks.modes}"
        during = [t for t in writes["b"] if during_start <= t <= during_end]
        print(f"writes to b during the {during_end - during_start:.1f} s backfill: {len(during)}")
        assert during, "no write to b committed while the backfill ran"


class _LockWatch:
    """The lock modes the capture's sessions (application_name pgcdc*) hold on ``table``, sampled from pg_locks
    on a connection of its own until stopped."""

    def __init__(self, dsn: str, table: str) -> None:
        self._dsn, self._table = dsn, table
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.modes: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _watch(self) -> None:
        query = (
            "SELECT DISTINCT l.mode FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.relation = %s::regclass AND a.application_name LIKE 'pgcdc%%' AND a.pid <> pg_backend_pid() "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                self.modes.update(mode for (mode,) in conn.execute(query, (self._table,)).fetchall())
                self._stop.wait(0.005)  # a chunk's transaction holds its lock for milliseconds


def _cdc(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgcdc", "snapshot", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@contextlib.contextmanager
def _writes_elsewhere(pg_dsn: str, unique: str) -> Iterator[None]:
    """One-row transactions in another database, one after another, until the block ends."""
    done = threading.Event()
    with scratch_database(pg_dsn, f"elsewhere_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE w (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())")

        def write() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not done.is_set():
                    conn.execute("INSERT INTO w DEFAULT VALUES")

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            yield
        finally:
            done.set()
            writer.join(30)


def _listed(config: Path, id_: str) -> str:
    out = _cdc(config, "--list").stdout
    return next((line for line in out.splitlines() if line.startswith(f"{id_}\t")), "")


@pytest.mark.one_version  # the CLI and the backfill queue: no server version changes them
def test_cdc_snapshot_where_pause_resume_and_cancel(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    rows = 3000
    with scratch_database(pg_dsn, f"bs_{unique}") as dsn:
        _tables(dsn, t=rows)
        cfg = CdcConfig(
            dsn,
            kafka_bootstrap,
            registry_url,
            f"bs{unique}",
            ["public.t"],
            f"s_{unique}",
            f"p_{unique}",
            extra="backfill_chunk_rows = 100\nbackfill_rows_per_s = 400\nsignal_poll_s = 0.2",
        )
        topic = f"bs{unique}.public.t"
        proc = cfg.start(tmp_path)
        config = tmp_path / "cdc.toml"
        try:
            proc.wait_streaming(180)
            # Mistakes are said at once, before anything is asked.
            wrong = _cdc(config, "public.nosuch")
            assert wrong.returncode == 2, wrong.stderr
            assert "table public.nosuch is not captured" in wrong.stderr
            bad = _cdc(config, "public.t", "--where", "id >> 'x'")
            assert bad.returncode == 2, bad.stderr
            assert "is not a filter of public.t" in bad.stderr
            writes = _cdc(config, "public.t", "--where", "(DELETE FROM t) IS NULL")
            assert writes.returncode == 2, writes.stdout

            asked = _cdc(config, "public.t", "--where", "id % 10 = 0")
            assert asked.returncode == 0, asked.stderr
            first = asked.stdout.split()[1].rstrip(":")
            # Each chunk starts at a stream wake-up (up to 1 s apart when idle): on a busy machine, minutes.
            wait_for(lambda: "\tdone\t" in _listed(config, first), 300, "the --where backfill", proc)
            assert "300 row(s)" in _listed(config, first)

            second = _cdc(config, "public.t").stdout.split()[1].rstrip(":")
            wait_for(lambda: "\trunning\t" in _listed(config, second), 60, "the second backfill to start", proc)
            assert _cdc(config, "--pause", second).returncode == 0
            wait_for(lambda: "\tpaused\t" in _listed(config, second), 60, "the pause", proc)
            paused_at = _listed(config, second)
            time.sleep(3)
            assert _listed(config, second) == paused_at, "a paused backfill went on"
            # Another database writes on meanwhile: its WAL is none of this capture's business, but the server
            # sends a keepalive whenever it waits for more of it, so the stream is never quiet for a second.
            with _writes_elsewhere(pg_dsn, unique):
                assert _cdc(config, "--resume", second).returncode == 0
                wait_for(lambda: "\tdone\t" in _listed(config, second), 60, "the resumed backfill", proc)
            assert f"{rows} row(s)" in _listed(config, second)

            third = _cdc(config, "public.t").stdout.split()[1].rstrip(":")
            wait_for(lambda: "\trunning\t" in _listed(config, third), 60, "the third backfill to start", proc)
            assert _cdc(config, "--cancel", third).returncode == 0
            wait_for(lambda: "\tcancelled\t" in _listed(config, third), 60, "the cancel", proc)
            status = _cli(config, "status", "--json")
            capture = json.loads(status.stdout)["capture"]
            # metrics.port = 0: its health endpoint cannot be found; the slot says it runs, and why no more.
            assert capture["service"].startswith("running (a replication connection, pid "), capture
            assert "metrics.port = 0" in capture["service"]
            listed = {b["id"]: b for b in capture["backfills"]}
            assert listed[first]["status"] == "done", listed
            assert listed[first]["where"] == "id % 10 = 0"
            assert listed[third]["status"] == "cancelled"
        finally:
            proc.stop()
        events = read_topic(kafka_bootstrap, registry_url, topic)
        reads = [e for e in events if e.value is not None and e.value["source"]["snapshot"] == "incremental"]
        by_key: dict[int, int] = defaultdict(int)
        for e in reads:
            assert e.key is not None
            by_key[e.key["id"]] += 1
        # The --where one read the multiples of 10, the second every row: twice each multiple of 10, once the rest.
        assert all(by_key[k] >= (2 if k % 10 == 0 else 1) for k in range(1, rows + 1))
        assert _topic(kafka_bootstrap, registry_url, topic) == _source(dsn, "t")
        _assert_in_order(events)


def _window_open(log: str, id_: str) -> bool:
    """Whether the log ends with a chunk whose window was held open and whose rows were not written yet."""
    held = [int(n) for n in re.findall(rf":{re.escape(id_)}:(\d+):\w+: window held open", log)]
    written = [int(n) for n in re.findall(rf"backfill {re.escape(id_)}: chunk (\d+) written", log)]
    return bool(held) and max(held) > max(written, default=-1)


def _past(config: Path, id_: str, chunks: int) -> bool:
    """More than ``chunks`` committed, or the backfill over (the caller then says it ended too soon)."""
    line = _listed(config, id_)
    return "\tdone\t" in line or _chunks_in(line) > chunks


def _committed_chunks(config: Path, id_: str) -> int:
    return _chunks_in(_listed(config, id_))


def _chunks_in(line: str) -> int:
    # "asked for, not taken yet" until the capture takes the request
    return int(line.split(" row(s) in ")[1].split(maxsplit=1)[0]) if " row(s) in " in line else 0


_KILLS = 3


def test_sigkills_during_a_backfill_lose_and_double_nothing(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """Three SIGKILLs, each at a later chunk than the one before, while the table is written; each chunk's window
    is held open ~1 s after its snapshot (CDC_TEST_CHUNK_HOLD_S), so the kills land inside open windows, whose
    chunks are read again after the restart. The last restart holds no window open, so the rest runs at full
    speed: the kill rounds may take as long as a busy machine needs without the backfill ending under them."""
    rows = 10_000
    with scratch_database(pg_dsn, f"bk_{unique}") as dsn:
        _tables(dsn, b=rows)
        cfg = CdcConfig(
            dsn,
            kafka_bootstrap,
            registry_url,
            f"bk{unique}",
            ["public.b"],
            f"s_{unique}",
            f"p_{unique}",
            # ~400-500 chunks (the writer deletes rows): five held-open kill-and-restart rounds took 117 and all of
            # 143 on busy CI runs (a round is a restart and a few `cdc snapshot --list`, ~40 s there); three
            # take fewer.
            extra='snapshot = "never"\nbackfill_chunk_rows = 20\nsignal_poll_s = 0.2',
        )
        config = cfg.write(tmp_path / "cdc.toml")
        proc = CdcProcess(config, tmp_path / "cdc.log")
        proc.env["CDC_TEST_CHUNK_HOLD_S"] = "1"
        proc.args[1] = "debug"  # each chunk written is logged
        done = threading.Event()
        writer = threading.Thread(target=_write, args=(dsn, "b", rows, done, []))
        proc.start()
        try:
            proc.wait_streaming(180)
            asked = _cdc(config, "public.b")
            assert asked.returncode == 0, asked.stderr
            id_ = asked.stdout.split()[1].rstrip(":")
            writer.start()
            in_window, last = 0, -1
            for kills in range(_KILLS):
                wait_for(partial(_past, config, id_, last + 1), 120, "the backfill to move on", proc)
                ended = "\tdone\t" in _listed(config, id_)
                assert not ended, f"the backfill ended before kill {kills + 1}: too few chunks for this machine"
                time.sleep(random.uniform(0.2, 0.8))
                proc.kill()
                if _window_open(proc.tail(400), id_):
                    in_window += 1  # killed after a chunk's snapshot, before its rows were written
                if kills == _KILLS - 1:
                    del proc.env["CDC_TEST_CHUNK_HOLD_S"]
                proc.start()
                proc.wait_streaming(180)
                last = _committed_chunks(config, id_)
            wait_for(lambda: "\tdone\t" in _listed(config, id_), 300, "the backfill to finish", proc)
            done.set()
            writer.join(30)
            _converge(dsn, kafka_bootstrap, registry_url, f"bk{unique}.public.b", table="b", proc=proc)
        finally:
            done.set()
            proc.stop()
        assert in_window >= 2, f"only {in_window} kill(s) landed in an open window"
        events = read_topic(kafka_bootstrap, registry_url, f"bk{unique}.public.b")
        _assert_in_order(events)
        reads: dict[int, int] = defaultdict(int)
        for e in events:
            if e.key is not None and e.value is not None and e.value["source"]["snapshot"] == "incremental":
                reads[e.key["id"]] += 1
        assert max(reads.values()) == 1, "a chunk's rows were written twice"
        assert "Traceback" not in proc.log.read_text()


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgcdc", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_publication_pgcdc_created_follows_source_tables(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """`cdc attach` adds a table newly in source.tables to the publication pgcdc created (and says it will be
    backfilled), and drops one no longer there; `cdc run` backfills the new one and says the old one's topic
    stays as it is."""
    with scratch_database(pg_dsn, f"bp_{unique}") as dsn:
        _tables(dsn, a=0, c=500)
        cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, f"bp{unique}", ["public.a"], f"s_{unique}", f"p_{unique}")
        proc = cfg.start(tmp_path)
        try:
            proc.wait_streaming(180)
        finally:
            proc.stop()
        cfg.tables = ["public.c"]
        config = cfg.write(tmp_path / "cdc.toml")
        attach = _cli(config, "attach")
        assert attach.returncode == 0, attach.stderr
        assert f'ran: ALTER PUBLICATION "p_{unique}" ADD TABLE "public"."c"' in attach.stdout, attach.stdout
        assert f'ran: ALTER PUBLICATION "p_{unique}" DROP TABLE "public"."a"' in attach.stdout, attach.stdout
        assert "public.c will be backfilled by `cdc run` while it streams" in attach.stdout, attach.stdout
        again = CdcProcess(config, tmp_path / "cdc-again.log")
        again.start()
        try:
            wait_for(lambda: " done: " in again.tail(), 120, "the backfill of c", again)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO a VALUES (1, 1)")  # no longer captured
                conn.execute("UPDATE c SET v = -1 WHERE id = 1")
            _converge(dsn, kafka_bootstrap, registry_url, f"bp{unique}.public.c", table="c", proc=again)
        finally:
            again.stop()
        log = again.log.read_text()
        assert "public.a is no longer captured (not in source.tables or the publication); its topic is left" in log
        assert read_topic(kafka_bootstrap, registry_url, f"bp{unique}.public.a") == []


def _key_line(kind: str, id_: int, at: str) -> str:
    """A line of a `cdc verify` report for table k's key (id, at)."""
    return json.dumps({"kind": kind, "key": json.dumps([id_, at]), "columns": {"id": str(id_), "at": at}})


def test_a_backfill_of_listed_keys_reads_them_and_deletes_those_gone(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """`cdc snapshot TABLE --keys FILE` (what `cdc verify --repair` sends): exactly the listed keys are read
    again, a listed key the table does not have gets a delete and a tombstone, a restart in the middle goes on
    from the keys done (read back from the request's row), and a list with a wrong key is refused at once."""
    with scratch_database(pg_dsn, f"bk_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE k (id int, at timestamptz, v int NOT NULL, PRIMARY KEY (id, at))")
            conn.execute(
                "INSERT INTO k SELECT g, '2024-01-01T00:00:00Z'::timestamptz + g * interval '1.5 s', 0 "
                "FROM generate_series(1, 1000) g"
            )
        cfg = CdcConfig(
            dsn,
            kafka_bootstrap,
            registry_url,
            f"bk{unique}",
            ["public.k"],
            f"s_{unique}",
            f"p_{unique}",
            # ~4 s a chunk: a busy machine's `cdc snapshot --list` polls, the update and the stop all fit before
            # the last of the six chunks (at 60 rows/s, 0.8 s a chunk, the backfill ended first on CI).
            extra="backfill_chunk_rows = 50\nbackfill_rows_per_s = 12\nsignal_poll_s = 0.2",
        )
        topic = f"bk{unique}.public.k"
        config = cfg.write(tmp_path / "cdc.toml")

        def at(i: int) -> str:
            seconds = i * 1.5
            return f"2024-01-01T{int(seconds) // 3600:02d}:{int(seconds) // 60 % 60:02d}:{seconds % 60:09.6f}Z"

        listed = [i for i in range(1, 1001) if i % 4 == 0]  # 250 keys, in 5 chunks
        lines = [_key_line(random.choice(["missing", "different"]), i, at(i)) for i in listed]
        lines += [_key_line("extra", 5000, at(5000)), _key_line("extra", 7000, at(8)), _key_line("missing", 4, at(4))]
        lines.append(json.dumps({"kind": "unencodable", "key": {"id": "9"}, "error": "left out"}))
        keys = tmp_path / "public.k.jsonl"
        keys.write_text("\n".join(lines) + "\n")
        bad = tmp_path / "bad.jsonl"
        bad.write_text(_key_line("missing", 3, "not a time") + "\n")

        proc = cfg.start(tmp_path)
        try:
            proc.wait_streaming(180)
            refused = _cdc(config, "public.k", "--keys", str(bad))
            assert refused.returncode == 2, refused.stdout
            assert "a key to repair is not a value of its column's type" in refused.stderr, refused.stderr
            wrong = tmp_path / "wrong.jsonl"
            wrong.write_text(json.dumps({"kind": "missing", "key": "[1]", "columns": {"id": "1"}}) + "\n")
            refused = _cdc(config, "public.k", "--keys", str(wrong))
            assert refused.returncode == 2, refused.stdout
            assert "key columns (id, at)" in refused.stderr, refused.stderr

            asked = _cdc(config, "public.k", "--keys", str(keys))
            assert asked.returncode == 0, asked.stderr
            assert "backfill of 252 key(s) of public.k" in asked.stdout, asked.stdout
            id_ = asked.stdout.split()[1].rstrip(":")
            wait_for(lambda: _committed_chunks(config, id_) >= 1, 60, "the first chunk", proc)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE k SET v = v + 1 WHERE id % 8 = 0")
        finally:
            proc.stop()
        assert "\trunning\t" in _listed(config, id_), "the restart is not in the middle of the backfill"
        again = CdcProcess(config, tmp_path / "cdc-again.log")
        again.start()
        try:
            wait_for(lambda: "\tdone\t" in _listed(config, id_), 120, "the listed keys' backfill", again)
            assert "250 row(s) in 6 chunk(s), 2 key(s) deleted" in _listed(config, id_), _listed(config, id_)
        finally:
            again.stop()
        events = read_topic(kafka_bootstrap, registry_url, topic)
        incremental = [e for e in events if e.value is not None and e.value["source"]["snapshot"] == "incremental"]
        reads = [e.key["id"] for e in incremental if e.value["op"] == "r"]  # type: ignore[index]
        assert sorted(reads) == listed, "not exactly the listed keys were read again"
        deletes = [e for e in incremental if e.value["op"] == "d"]  # type: ignore[index]
        assert sorted(e.key["id"] for e in deletes) == [5000, 7000]  # type: ignore[index]
        for d in deletes:  # each followed by its tombstone
            after = [e for e in events if e.key == d.key and e.partition == d.partition and e.offset > d.offset]
            assert after, d
            assert after[0].value is None, after
        assert {k: v["v"] for k, v in latest_by_key(events, "id").items()} == _source(dsn, "k")
        _assert_in_order(events)


@pytest.mark.one_version  # the signal topic is Kafka's: no server version changes it
def test_requests_produced_to_the_signal_topic_are_taken_once(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """A backfill asked for through `<prefix>.signals` (a plain Kafka producer): taken once across restarts,
    one produced while the capture is down is taken when it is back, another capture's record (keyed to its
    slot) is passed over, and a record that is not a request is listed as a failed backfill."""
    with scratch_database(pg_dsn, f"bt_{unique}") as dsn:
        _tables(dsn, t=2000)
        slot = f"s_{unique}"
        cfg = CdcConfig(
            dsn,
            kafka_bootstrap,
            registry_url,
            f"bt{unique}",
            ["public.t"],
            slot,
            f"p_{unique}",
            extra="signal_poll_s = 0.2",
        )
        signals, topic = f"bt{unique}.signals", f"bt{unique}.public.t"
        config = cfg.write(tmp_path / "cdc.toml")
        producer = Producer({"bootstrap.servers": kafka_bootstrap})

        def ask(key: str, value: bytes) -> int:
            offsets: list[int] = []
            producer.produce(signals, key=key, value=value, on_delivery=lambda _, m: offsets.append(m.offset() or 0))
            assert producer.flush(30) == 0
            return offsets[0]

        backfill = json.dumps({"kind": "backfill", "data": {"tables": ["public.t"]}}).encode()
        proc = cfg.start(tmp_path)
        try:
            # A new capture takes every request produced after it was created (its slot), even one produced
            # before it first reads the topic: these go in while its snapshot may still run.
            wait_for(lambda: "created replication slot" in proc.log.read_text(errors="replace"), 120, "the slot", proc)
            ask("another-slot", backfill)
            bad = ask(slot, b"not json")
            first = ask(slot, backfill)
            wait_for(lambda: "\tdone\t" in _listed(config, f"kafka-0-{first}"), 120, "the first backfill", proc)
            assert "failed: signal topic record 0/" in _listed(config, f"kafka-0-{bad}"), _listed(
                config, f"kafka-0-{bad}"
            )
        finally:
            proc.stop()
        second = ask(slot, backfill)  # while the capture is down
        again = CdcProcess(config, tmp_path / "cdc-again.log")
        again.start()
        try:
            wait_for(lambda: "\tdone\t" in _listed(config, f"kafka-0-{second}"), 120, "the second backfill", again)
            time.sleep(2)  # time enough to take anything twice
        finally:
            again.stop()
        listed = _cdc(config, "--list").stdout
        assert listed.count("\tdone\t") == 2, listed  # the other slot's was passed over, nothing taken twice
        reads = [
            e
            for e in read_topic(kafka_bootstrap, registry_url, topic)
            if e.value is not None and e.value["source"]["snapshot"] == "incremental"
        ]
        assert len(reads) == 2 * 2000


def _has_topic(kafka: str, topic: str) -> bool:
    return topic in AdminClient({"bootstrap.servers": kafka}).list_topics(timeout=10).topics


def test_a_backfill_after_a_column_rename_reads_the_table_by_its_new_names(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """A column renamed while `cdc run` streams: a backfill asked afterwards (a `cdc verify --repair`, here a
    list of keys) reads the table as it is now, and its rows carry the new name; a whole-table backfill too."""
    with scratch_database(pg_dsn, f"br_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE r (id int PRIMARY KEY, at text, v int)")
            conn.execute("INSERT INTO r SELECT g, 'then ' || g, g FROM generate_series(1, 20) g")
        cfg = CdcConfig(
            dsn, kafka_bootstrap, registry_url, f"br{unique}", ["public.r"], f"s_{unique}", f"p_{unique}",
            extra="signal_poll_s = 0.2",
        )  # fmt: skip
        topic = f"br{unique}.public.r"
        config = cfg.write(tmp_path / "cdc.toml")
        keys = tmp_path / "public.r.jsonl"
        keys.write_text(
            "".join(
                json.dumps({"kind": "different", "key": f"[{i}]", "columns": {"id": str(i)}}) + "\n" for i in (3, 7)
            )
        )
        proc = cfg.start(tmp_path)
        try:
            proc.wait_streaming(180)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("ALTER TABLE r RENAME COLUMN at TO at_time")
            listed = _cdc(config, "public.r", "--keys", str(keys))
            assert listed.returncode == 0, listed.stderr
            first = listed.stdout.split()[1].rstrip(":")
            wait_for(lambda: "\tdone\t" in _listed(config, first), 120, "the backfill of listed keys", proc)
            whole = _cdc(config, "public.r").stdout.split()[1].rstrip(":")
            wait_for(lambda: "\tdone\t" in _listed(config, whole), 120, "the whole-table backfill", proc)
            events = read_topic(kafka_bootstrap, registry_url, topic)
            after = [e.value["after"] for e in events[20:] if e.value is not None]
            assert len(after) == 2 + 20, after
            assert all("at_time" in row and "at" not in row for row in after), after[0]
            assert {row["id"]: row["at_time"] for row in after[:2]} == {3: "then 3", 7: "then 7"}
        finally:
            proc.stop()
