"""What the capture scenarios share: a scratch database, slots made at one point, the two timed readers.

Every capture scenario (bench/insert_heavy.py, update_heavy.py, pgbench_tpcb.py, big_transaction.py) does:

1. ``with scratch() as s:`` — a fresh database on the local PostgreSQL (dropped afterwards with every slot in
   it, and the Kafka topics and registry subjects of its topic prefix);
2. creates its tables and the publication, then ``s.create_slots(...)`` — pgoutput slots created one after the
   other with no write of ours in between, so they all start at the same point of the same WAL;
3. writes the workload and notes the end LSN (``s.end_lsn()``, with a fence after it for `cdc run`'s slot);
4. times ``s.recvlogical(...)`` — pg_recvlogical (pgoutput with `cdc run`'s options, to /dev/null) reading its
   slot to the end LSN: the reference, what logical decoding itself delivers here — and ``s.time_cdc(...)`` —
   ``cdc run`` with the default configuration (snapshot off) until its slot's confirmed_flush_lsn, which only
   moves after the Kafka transaction holding the events committed, reaches the end LSN.

Each reader yields a ``Usage``: seconds, CPU seconds (utime + stime) and peak RSS (VmHWM) of the process, and of
the walsender backend serving its slot (sampled from /proc while it runs; a backend's RSS counts the shared
buffers it touched, so read its CPU rather than its memory). The /proc readers are bench/_debezium.py's.
A ``Usage`` also holds the CPU each part of the machine spent meanwhile (pgcdc_dev/bench/cpu.py: PostgreSQL, the broker,
the reader by thread, idle): :func:`cpu_notes` puts both readers' in a result's notes, per row. :func:`timed_write`
and :func:`time_readers` are steps 3 and 4 as those scenarios take them.

The scenarios that run `cdc run` themselves, with a configuration of their own (capture_latency.py, snapshot.py,
backfill.py), share the end of this module: a database of their own (:func:`own_database`), the configuration and
launch of `cdc run`, pgbench's paced single-row updates and the read_committed consumer that times them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient
from pgcdc_dev import CHECKOUT as ROOT
from pgcdc_dev import discovery
from pgcdc_dev.bench import cpu as _cpu
from pgcdc_dev.bench.report import Measure, Result
from pgcdc_dev.bench.warm_broker import delete_topics
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench import _debezium as dbz
from cdc.service import HEARTBEAT_PREFIX

cpu_seconds = dbz.cpu_seconds
peak_rss_mb = dbz.peak_rss_mb


# --- small helpers ----------------------------------------------------------------------------


def fmt_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def dsn_for(admin: str, db: str) -> str:
    params = conninfo_to_dict(admin)
    params["dbname"] = db
    return make_conninfo("", **params)


def libpq_env(dsn: str) -> dict[str, str]:
    """The environment that points libpq tools (pgbench, psql) at dsn without putting it on a command line."""
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD", "dbname": "PGDATABASE"}
    env = dict(os.environ)
    for key, value in conninfo_to_dict(dsn).items():
        if key in names and value is not None:
            env[names[key]] = str(value)
    return env


def load_avg() -> float:
    """The 1-minute load average: a shared machine's figures are read next to it."""
    return round(os.getloadavg()[0], 2)


@dataclass
class Usage:
    """What one reader cost: wall time, and CPU and peak memory of it and of the walsender serving it."""

    seconds: float
    cpu_s: float
    peak_rss_mb: float
    walsender_cpu_s: float | None = None
    walsender_peak_rss_mb: float | None = None
    # `cdc run` only: seconds from its launch until it streamed (its slot active): imports, connections, Kafka
    # init_transactions — what a long-running capture pays once.
    startup_s: float | None = None
    # CPU seconds per part of the machine while it streamed (pgcdc_dev/bench/cpu.py); for `cdc run`, also up to its
    # first "replaying streamed transaction" line, when it has one: the rest is the replay.
    cpu_split: dict[str, float] | None = None
    cpu_split_before_replay: dict[str, float] | None = None
    replay_started_s: float | None = None  # seconds into streaming when that line appeared

    @property
    def streaming_seconds(self) -> float:
        """Wall time without the start-up: from when the reader streamed."""
        return self.seconds - (self.startup_s or 0.0)

    def as_json(self) -> dict[str, Any]:
        def rounded(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: rounded(x) for k, x in v.items()}
            return round(v, 3) if isinstance(v, float) else v

        return {k: rounded(v) for k, v in asdict(self).items()}


class _SlotWatch:
    """Samples the walsender backend serving a slot (pg_replication_slots.active_pid) every interval."""

    def __init__(self, dsn: str, slot: str, interval: float = 0.2) -> None:
        self.dsn, self.slot, self.interval = dsn, slot, interval
        self.cpu: dict[int, float] = {}  # last CPU seconds seen per walsender pid (a reconnect gets a new one)
        self.rss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{slot}", daemon=True)

    def __enter__(self) -> _SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)).fetchone()
        if row is None or row[0] is None:
            return
        pid = int(row[0])
        cpu = cpu_seconds(pid)
        if cpu:
            self.cpu[pid] = cpu
        self.rss = max(self.rss, peak_rss_mb(pid))

    def _loop(self) -> None:
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                self.sample(conn)
                self._stop.wait(self.interval)

    @property
    def cpu_s(self) -> float | None:
        return sum(self.cpu.values()) if self.cpu else None

    @property
    def rss_mb(self) -> float | None:
        return self.rss or None


# --- the scratch database ---------------------------------------------------------------------


@dataclass
class Endpoints:
    admin: str  # a superuser DSN of the local PostgreSQL
    kafka: str
    registry: str


def endpoints() -> Endpoints:
    return Endpoints(
        admin=discovery.find("postgres").value,
        kafka=discovery.find("kafka").value,
        registry=discovery.find("registry").value,
    )


def cluster_endpoints() -> Endpoints:
    """The same PostgreSQL, with the three-broker cluster and its registry (pgcdc_dev.services kafka-cluster)."""
    return Endpoints(
        admin=discovery.find("postgres").value,
        kafka=str(discovery.deploy_record("kafka-cluster")["bootstrap"]),
        registry=str(discovery.deploy_record("registry-cluster")["url"]),
    )


def drop_topics(ep: Endpoints, prefix: str) -> None:
    """The run's topics on ``ep``'s brokers (best effort)."""
    with contextlib.suppress(Exception):
        _drop_kafka(ep, prefix)


def server_major() -> int:
    """The major version of the server the benchmarks run on."""
    with psycopg.connect(endpoints().admin) as conn:
        return conn.info.server_version // 10000


@dataclass
class Scratch:
    ep: Endpoints
    db: str
    dsn: str
    bindir: Path
    work: Path  # logs and configs of this run (kept when a run fails)
    server_version: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def topic_prefix(self) -> str:
        return self.db

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def current_lsn(self, conn: psycopg.Connection[Any] | None = None) -> int:
        with contextlib.ExitStack() as stack:
            c = conn or stack.enter_context(self.connect())
            row = c.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint").fetchone()
        assert row is not None
        return int(row[0])

    def end_lsn(self, conn: psycopg.Connection[Any] | None = None, *, fence_for: Sequence[str] = ()) -> int:
        """The LSN after the workload just written (pg_current_wal_lsn()), then a fence after it for each slot
        in ``fence_for``: a heartbeat as `cdc run` writes its own (a non-transactional logical message, prefix
        pgcdc.heartbeat, content the slot's name; no event), which it confirms as soon as it reads it.

        `cdc run` confirms a position in its slot only with what it has read and committed, not with the
        walsender's keepalives, so WAL written after the workload's last commit and before the end LSN is read
        (another process's: a checkpoint's, the bgwriter's, autovacuum's) was confirmed only at the capture's
        next own heartbeat, 10 s after it started streaming: the ~10 s "stalls" of 1 in 20-35 update-heavy runs
        (the stalled run of 2026-11-24 09:20 reached the end LSN 10.06 s after it began to stream, 60 ms after
        its first heartbeat)."""
        with contextlib.ExitStack() as stack:
            c = conn or stack.enter_context(self.connect())
            end = self.current_lsn(c)
        if fence_for:
            with self.connect() as fence, fence.transaction():
                # In a transaction with an xid, so that its commit flushes the WAL up to the fences: alone, a
                # non-transactional message's WAL waits for the WAL writer (up to 3 x wal_writer_delay), and
                # logical decoding sends only flushed WAL (PostgreSQL 17 adds a flush argument instead).
                fence.execute("SELECT pg_current_xact_id()")
                for slot in fence_for:
                    fence.execute("SELECT pg_logical_emit_message(false, %s, %s)", (HEARTBEAT_PREFIX, slot))
        return end

    def create_publication(self, name: str, tables: Sequence[str]) -> None:
        """CREATE PUBLICATION name FOR TABLE tables ("schema.table")."""
        idents = [sql.Identifier(*t.split(".", 1)) for t in tables]
        with self.connect() as conn:
            conn.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(name), sql.SQL(", ").join(idents))
            )

    def create_slots(self, names: Sequence[str]) -> int:
        """pgoutput slots, one after the other on one connection with nothing written in between; returns
        the LSN after the last: every slot decodes exactly the transactions committed from then on."""
        with self.connect() as conn:
            for name in names:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
            return self.current_lsn(conn)

    def processes(self) -> dict[str, int | None]:
        """PostgreSQL's postmaster and the Kafka broker, when they run on this machine: for pgcdc_dev/bench/cpu.py."""
        with self.connect() as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        return {
            "PostgreSQL": _cpu.postmaster_pid(row[0]) if row else None,
            "Kafka broker": _cpu.java_pid("kafka.Kafka"),
        }

    def server_tls(self) -> bool:
        """Whether this connection to the server is encrypted (TLS: sslmode prefer finds ssl = on)."""
        with self.connect() as conn:
            row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        return bool(row and row[0])

    def without_tls(self) -> Scratch:
        """The same scratch database reached with sslmode=disable: for both readers, a variant of a run."""
        return replace(self, dsn=make_conninfo(self.dsn, sslmode="disable"))

    def slot_lag_bytes(self, slot: str) -> int | None:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (slot,),
            ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    # --- the reference ------------------------------------------------------------------------

    def recvlogical(
        self, slot: str, publication: str, end_lsn: int, *, streaming: bool = True, timeout: float = 3600.0
    ) -> Usage:
        """pg_recvlogical from slot's start to end_lsn, to /dev/null, timed.

        It asks pgoutput for what `cdc run` asks (proto 2, binary, streaming of large in-progress transactions,
        logical messages), so the walsender does the same work for both; ``streaming=False`` leaves large
        transactions to be spilled by the server and sent at their commit instead.
        """
        cmd = self._recvlogical_command(slot, publication, end_lsn, streaming=streaming)
        split = _cpu.CpuSplit(self.processes())
        with _SlotWatch(self.dsn, slot, interval=0.1) as watch:
            split.start()
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            exited = _reap(proc, t0 + timeout)
            if exited is None:
                raise TimeoutError(f"pg_recvlogical did not reach {fmt_lsn(end_lsn)} in {timeout:.0f} s")
            seconds = time.monotonic() - t0
            parts = split.now()
        status, usage = exited
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_recvlogical exited with {proc.returncode}")
        cpu = usage.ru_utime + usage.ru_stime
        parts["pg_recvlogical"] = cpu  # its CPU was in the rest: a part of its own
        parts["rest"] = max(0.0, parts["rest"] - cpu)
        return Usage(
            seconds=seconds,
            cpu_s=cpu,
            peak_rss_mb=usage.ru_maxrss / 1024,
            walsender_cpu_s=watch.cpu_s,
            walsender_peak_rss_mb=watch.rss_mb,
            cpu_split=parts,
        )

    def _recvlogical_command(self, slot: str, publication: str, end_lsn: int, *, streaming: bool) -> list[str]:
        """pg_recvlogical's command line: pgoutput with `cdc run`'s options, from slot's start to end_lsn, to
        /dev/null (streaming asked for only where the server has it, 14+)."""
        return [
            str(self.bindir / "pg_recvlogical"),
            "-d",
            self.dsn,
            "--slot",
            slot,
            "--start",
            "-o",
            "proto_version=2",
            "-o",
            f"publication_names={publication}",
            "-o",
            "binary=true",
            "-o",
            "messages=true",
            *(["-o", "streaming=on"] if streaming and self.server_version >= 140000 else []),
            "--endpos",
            fmt_lsn(end_lsn),
            "--no-loop",
            "-f",
            "/dev/null",
        ]

    # --- ours ---------------------------------------------------------------------------------

    def cdc(self, slot: str, publication: str, tables: Sequence[str], name: str = "cdc") -> CdcRun:
        """A `cdc run` on slot (not yet started: use it as a context manager)."""
        return CdcRun(self, slot=slot, publication=publication, tables=tables, name=name)

    def time_cdc(self, slot: str, publication: str, tables: Sequence[str], end_lsn: int, name: str = "cdc") -> Usage:
        """`cdc run` from slot's start until its confirmed_flush_lsn reaches end_lsn, timed from the launch."""
        with self.cdc(slot, publication, tables, name) as run:
            startup = run.wait_streaming()
            split = _cpu.CpuSplit(self.processes(), {"capture": run.proc.pid if run.proc else None})
            split.start()
            usage = run.wait_for(end_lsn, split=split)
            usage.startup_s = startup
            return usage


def cpu_notes(count: int, unit: str, ours: Usage, ref: Usage, *, label: str = "") -> list[str]:
    """Each reader's CPU per part of the machine, in CPU-µs per ``unit`` (pgcdc_dev/bench/cpu.py), and for `cdc run`
    with a replayed streamed transaction, the phases before and after the replay began. ``label`` follows
    the readers' names (a variant of the run)."""
    notes = []
    if ref.cpu_split:
        notes.append(f"pg_recvlogical run{label}: " + _cpu.CpuSplit.per_unit_note(ref.cpu_split, count, unit))
    if ours.cpu_split:
        notes.append(f"cdc run{label}: " + _cpu.CpuSplit.per_unit_note(ours.cpu_split, count, unit))
        before = ours.cpu_split_before_replay
        if before and ours.replay_started_s is not None:
            after = {k: max(0.0, v - before.get(k, 0.0)) for k, v in ours.cpu_split.items()}
            replay_s = ours.streaming_seconds - ours.replay_started_s
            notes.append(
                f"cdc run{label}, {ours.replay_started_s:.2f} s until the replay began (reading into the spill): "
                + _cpu.CpuSplit.per_unit_note(before, count, unit)
            )
            notes.append(
                f"cdc run{label}, the replay and commit ({replay_s:.2f} s): "
                + _cpu.CpuSplit.per_unit_note(after, count, unit)
            )
    return notes


def rate_measures(name: str, unit: str, count: int, ours: Usage, ref: Usage, *, note: str) -> list[Measure]:
    """``name`` of `cdc run` against pg_recvlogical on the same WAL: once streaming (the target's measure: a
    capture runs for months, and Debezium is timed the same way), and from the launch of the process."""
    reference = round(count / ref.seconds)
    return [
        Measure(
            name,
            unit,
            round(count / ours.streaming_seconds),
            reference=reference,
            reference_name="pg_recvlogical",
            target_ratio=0.8,
            note=f"{note}; ours until the slot's confirmed_flush_lsn reaches the end LSN (Kafka transactions "
            f"committed), from when `cdc run` streams ({ours.startup_s or 0:.2f} s of process start-up excluded, as "
            "for Debezium); pg_recvlogical from its launch",
        ),
        Measure(
            f"{name} from launch",
            unit,
            round(count / ours.seconds),
            reference=reference,
            reference_name="pg_recvlogical",
            note="the same, ours from the launch of `cdc run` (imports, connections, Kafka init_transactions)",
        ),
    ]


W = TypeVar("W")


def timed_write(
    s: Scratch,
    result: Result,
    start_lsn: int,
    write: Callable[[psycopg.Connection[Any]], W],
    fence_for: Sequence[str],
) -> tuple[int, W]:
    """Runs the workload ``write`` on one connection and takes the end LSN after it, with a fence for each slot
    in ``fence_for`` (:meth:`Scratch.end_lsn`); the end LSN and what ``write`` returned. The write's seconds and
    the WAL it made since ``start_lsn`` go into ``result.params`` as ``write_s`` and ``wal_mb``."""
    t0 = time.monotonic()
    with s.connect() as conn:
        written = write(conn)
        end_lsn = s.end_lsn(conn, fence_for=fence_for)
    result.params["write_s"] = round(time.monotonic() - t0, 2)
    result.params["wal_mb"] = round((end_lsn - start_lsn) / 2**20, 1)
    return end_lsn, written


@dataclass(frozen=True)
class Readers:
    """The two readers of a run's WAL, one after the other: pg_recvlogical on ``ref_slot`` (asking for
    streaming as `cdc run` does unless ``streaming`` is off) and `cdc run` on ``cdc_slot``, both of
    ``publication``. ``variant`` names a second pair on the same WAL (" without TLS"): it follows the readers'
    names in the notes and, in snake case, their series' names."""

    ref_slot: str
    cdc_slot: str
    publication: str
    tables: tuple[str, ...]
    streaming: bool = True
    variant: str = ""


def time_readers(
    s: Scratch, readers: Readers, end_lsn: int, result: Result, *, count: int, unit: str
) -> tuple[Usage, Usage]:
    """Times pg_recvlogical, then `cdc run`, each to ``end_lsn``: (ours, the reference). Both go into
    ``result.series`` and their CPU per part, per ``unit`` of the ``count`` written, into its notes."""
    ref = s.recvlogical(readers.ref_slot, readers.publication, end_lsn, streaming=readers.streaming)
    ours = s.time_cdc(readers.cdc_slot, readers.publication, list(readers.tables), end_lsn)
    suffix = "_" + readers.variant.strip().lower().replace(" ", "_") if readers.variant else ""
    result.series[f"pg_recvlogical{suffix}"] = ref.as_json()
    result.series[f"cdc{suffix}"] = ours.as_json()
    result.notes += cpu_notes(count, unit, ours, ref, label=readers.variant)
    return ours, ref


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class CdcRun:
    """`cdc run` as a child process with the default configuration: only where to read and write is set."""

    def __init__(self, scratch: Scratch, *, slot: str, publication: str, tables: Sequence[str], name: str) -> None:
        self.s = scratch
        self.slot = slot
        self.config = scratch.work / f"{name}.toml"
        self.log = scratch.work / f"{name}.log"
        self.config.write_text(
            "[source]\n"
            f"dsn = {_toml_str(scratch.dsn)}\n"
            f"tables = [{', '.join(_toml_str(t) for t in tables)}]\n"
            f"slot = {_toml_str(slot)}\n"
            f"publication = {_toml_str(publication)}\n"
            "[kafka]\n"
            f"bootstrap_servers = {_toml_str(scratch.ep.kafka)}\n"
            f"topic_prefix = {_toml_str(scratch.topic_prefix)}\n"
            "[registry]\n"
            f"url = {_toml_str(scratch.ep.registry)}\n"
            "[capture]\n"
            'snapshot = "never"\n'
            "[metrics]\n"
            "port = 0\n"  # any free port: parallel runs must not collide on 9464
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self._watch = _SlotWatch(scratch.dsn, slot)

    def __enter__(self) -> CdcRun:
        # No CDC_* variable may change the defaults under test (the settings read the environment too).
        env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pgcdc", "run", "--config", str(self.config)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._watch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.__exit__()
        stop_process(self.proc)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def confirmed_lsn(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = %s",
            (self.slot,),
        ).fetchone()
        return 0 if row is None or row[0] is None else int(row[0])

    def usage(self, seconds: float, conn: psycopg.Connection[Any] | None = None) -> Usage:
        """Our process's CPU and peak RSS so far (read while it runs), and its walsender's."""
        assert self.proc is not None
        if conn is not None:
            self._watch.sample(conn)
        return Usage(
            seconds=seconds,
            cpu_s=cpu_seconds(self.proc.pid),
            peak_rss_mb=peak_rss_mb(self.proc.pid),
            walsender_cpu_s=self._watch.cpu_s,
            walsender_peak_rss_mb=self._watch.rss_mb,
        )

    def wait_streaming(self, timeout: float = 120.0) -> float:
        """Block until a walsender serves our slot (the capture streams); seconds since the launch."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with self.s.connect() as conn:
            while True:
                row = conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
                ).fetchone()
                if row is not None and row[0]:
                    return time.monotonic() - self.started
                if self.proc.poll() is not None:
                    raise RuntimeError(f"cdc run exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cdc run did not start streaming in {timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.02)

    def wait_for(
        self,
        end_lsn: int,
        *,
        since: float | None = None,
        timeout: float = 3600.0,
        split: _cpu.CpuSplit | None = None,
    ) -> Usage:
        """Block until the slot's confirmed_flush_lsn >= end_lsn; seconds from `since` (default: the launch).
        With ``split`` (started), the Usage carries the CPU per part until then, and until the first streamed
        transaction's replay began when the log says so."""
        assert self.proc is not None
        start = self.started if since is None else since
        streamed_at = time.monotonic()
        deadline = streamed_at + timeout
        before_replay: dict[str, float] | None = None
        replay_at: float | None = None
        with self.s.connect() as conn:
            while True:
                if (
                    split is not None
                    and before_replay is None
                    and "replaying streamed transaction" in self.log.read_text(errors="replace")
                ):
                    before_replay, replay_at = split.now(), time.monotonic() - streamed_at
                if self.confirmed_lsn(conn) >= end_lsn:
                    usage = self.usage(time.monotonic() - start, conn)
                    if split is not None:
                        usage.cpu_split = split.now()
                        usage.cpu_split_before_replay, usage.replay_started_s = before_replay, replay_at
                    return usage
                if self.proc.poll() is not None:
                    raise RuntimeError(f"cdc run exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cdc run did not reach {fmt_lsn(end_lsn)} in {timeout:.0f} s")
                time.sleep(0.05)


def _reap(proc: subprocess.Popen[bytes], deadline: float) -> tuple[int, resource.struct_rusage] | None:
    """Wait for ``proc`` to exit: its wait status and its own resource usage; None (and the child killed) once
    ``deadline`` (time.monotonic()) passes first."""
    # wait4 gives the exited child's own rusage: CPU and max RSS (kB on Linux) without racing its exit.
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.monotonic() > deadline:
            proc.kill()
            return None
        time.sleep(0.02)


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM a child still running, SIGKILL it if it has not exited a minute later."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --- set-up and tear-down ---------------------------------------------------------------------


def drop_slots(admin: str, db: str) -> None:
    """Drop the scratch database's replication slots, ending their readers if they linger."""
    with psycopg.connect(admin, autocommit=True) as conn:
        for attempt in range(50):
            rows = conn.execute(
                "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s", (db,)
            ).fetchall()
            if not rows:
                return
            for slot, pid in rows:
                if pid is None:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                elif attempt >= 10:  # only the backends of this scratch database's own slots
                    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)


def _drop_kafka(ep: Endpoints, prefix: str) -> None:
    """The topics of prefix (``<prefix>.…``) and their registry subjects."""
    admin = AdminClient({"bootstrap.servers": ep.kafka})
    topics = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix + ".")]
    if topics:
        delete_topics(ep.kafka, topics)
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"{ep.registry}/subjects", timeout=10) as resp:  # noqa: S310 - local registry
            subjects = [s for s in json.loads(resp.read()) if isinstance(s, str) and s.startswith(prefix + ".")]
        for subject in subjects:
            url = f"{ep.registry}/subjects/{urllib.parse.quote(subject, safe='')}"
            for suffix in ("", "?permanent=true"):
                req = urllib.request.Request(url + suffix, method="DELETE")  # noqa: S310
                with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=10):  # noqa: S310
                    pass


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Scratch]:
    """A fresh database ``<prefix>_<time>``; dropped afterwards with its slots, topics and subjects (the run's
    configs and logs are kept in its ``work`` directory, printed at the end)."""
    ep = endpoints()
    db = re.sub(r"[^a-z0-9_]", "_", f"{prefix}_{int(time.time() * 1000)}".lower())
    with psycopg.connect(ep.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
        row = conn.execute("SELECT setting FROM pg_config() WHERE name = 'BINDIR'").fetchone()
        assert row is not None
        bindir = Path(row[0])
        version = conn.info.server_version
    work = Path(tempfile.mkdtemp(prefix=f"pgcdc-{prefix}-"))
    s = Scratch(ep=ep, db=db, dsn=dsn_for(ep.admin, db), bindir=bindir, work=work, server_version=version)
    ok = False
    try:
        yield s
        ok = True
    finally:
        drop_slots(ep.admin, db)
        with psycopg.connect(ep.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
        with contextlib.suppress(Exception):  # best effort: a broker hiccup must not hide the run's own error
            _drop_kafka(ep, s.topic_prefix)
        # Kept either way (configs and logs: small): a run that is only slow, an outlier of a --repeat, is
        # read from its `cdc run` log afterwards.
        print(f"logs {'of the run' if ok else 'of the failed run'} kept in {work}", file=sys.stderr)


# --- scenarios that run `cdc run` on a database of their own (latency, snapshot, backfill) ----

# pgbench's script of the latency loads: one single-row UPDATE per transaction, the row picked at random.
PACED_UPDATE = """\\set id random(1, {rows})
UPDATE {table} SET v = v + 1, at = now() WHERE id = :id;
"""


@dataclass(frozen=True)
class OwnDatabase:
    """A database of a scenario's own on the local PostgreSQL, named ``prefix``; the scenario's slot,
    publication and topics are named after it. ``work`` holds the run's configs and logs."""

    ep: Endpoints
    prefix: str
    work: Path
    dsn: str


def own_database(stem: str, scenario: str) -> OwnDatabase:
    """Creates the database ``<stem>_<epoch seconds>`` and the work directory ``pgcdc-bench-<scenario>-…``."""
    ep = endpoints()
    prefix = f"{stem}_{int(time.time())}"
    work = Path(tempfile.mkdtemp(prefix=f"pgcdc-bench-{scenario}-"))
    with psycopg.connect(ep.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(prefix)))
    return OwnDatabase(ep=ep, prefix=prefix, work=work, dsn=dsn_for(ep.admin, prefix))


def drop_own_database(db: OwnDatabase, topics: Sequence[str], prefixes: Sequence[str]) -> None:
    """Drops the database with its slots, then (best effort) ``topics`` with their registry subjects and the
    offsets topic of each of ``prefixes``."""
    drop_slots(db.ep.admin, db.prefix)
    with psycopg.connect(db.ep.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db.prefix)))
    with contextlib.suppress(Exception):
        delete_topics(db.ep.kafka, [*topics, *(f"{prefix}.offsets" for prefix in prefixes)])
        dbz.delete_subjects(db.ep.registry, topics)


def drop_slot_when_free(conn: psycopg.Connection[Any], slot: str) -> None:
    """Drops ``slot`` (if it exists) once its reader has let go of it: 50 tries, 0.2 s apart."""
    for _ in range(50):
        try:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (slot,),
            )
            break
        except psycopg.errors.ObjectInUse:
            time.sleep(0.2)


def snapshot_config(path: Path, db: OwnDatabase, table: str) -> Path:
    """`cdc run`'s configuration at ``path`` for ``public.<table>`` of ``db``, with the initial snapshot."""
    path.write_text(
        f'[source]\ndsn = "{db.dsn}"\ntables = ["public.{table}"]\nslot = "{db.prefix}"\npublication = "{db.prefix}"\n'
        f'[kafka]\nbootstrap_servers = "{db.ep.kafka}"\ntopic_prefix = "{db.prefix}"\n'
        f'[registry]\nurl = "{db.ep.registry}"\n[metrics]\nport = 0\n[capture]\nsnapshot = "initial"\n'
    )
    return path


def launch_cdc(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`cdc run` with ``config``, logging at level info (the scenarios read its log lines) into ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pgcdc", "--log-level", "info", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@dataclass(frozen=True)
class PacedLoad:
    """pgbench running :data:`PACED_UPDATE` on ``table`` (ids 1..``rows``) at ``rate`` transactions/s in all
    (``-R``: a schedule, not a closed loop) over ``clients`` connections for ``seconds`` (``-T``). With
    ``report``, its output is kept to be read (``communicate``); without, it goes to /dev/null."""

    table: str
    rows: int
    rate: float
    clients: int
    seconds: int
    report: bool = False


def paced_script(dsn: str, work: Path, load: PacedLoad) -> tuple[Path, Path]:
    """pgbench (from the server's BINDIR) and its script, written into ``work``."""
    with psycopg.connect(dsn) as conn:
        bindir = conn.execute("SELECT setting FROM pg_config() WHERE name = 'BINDIR'").fetchone()
        quoted = sql.Identifier(load.table).as_string(conn)
    assert bindir is not None
    script = work / "update.sql"
    script.write_text(PACED_UPDATE.format(rows=load.rows, table=quoted))
    return Path(bindir[0]) / "pgbench", script


def start_paced(dsn: str, files: tuple[Path, Path], load: PacedLoad) -> subprocess.Popen[bytes]:
    """Starts ``load`` on ``dsn`` with pgbench and its script (``files``, from :func:`paced_script`)."""
    pgbench, script = files
    return subprocess.Popen(
        [
            str(pgbench),
            "-n",
            "-f",
            str(script),
            "-R",
            str(load.rate),
            "-T",
            str(load.seconds),
            "-c",
            str(load.clients),
            "-j",
            str(load.clients),
            "-M",
            "prepared",
            dsn,
        ],
        stdout=subprocess.PIPE if load.report else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if load.report else subprocess.DEVNULL,
    )


def latency_consumer(kafka: str, group: str) -> Consumer:
    """The latency scenarios' consumer: read_committed (what a reader gets), and a fetch is answered as soon as
    it has a byte (within 10 ms otherwise), so the wait for a fetch adds little to a latency."""
    return Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 10,
            "fetch.min.bytes": 1,
        }
    )
