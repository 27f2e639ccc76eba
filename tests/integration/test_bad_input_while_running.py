"""The bad-input catalogue's entries met while running (docs/bad-input.md, "While running").

Unlike the one-shot refusals of test_bad_input.py, these happen to a pipeline that already streams: each test
sets the fault up for real, checks the exit code and that the message says what, where and how to fix it
(never a password, never a traceback), then fixes it as an operator would, runs again, and checks that
nothing was lost or doubled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    capture_role,
    drop_role,
    read_topic,
    scratch_database,
    wait_for,
)
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, cdc_here

pytestmark = pytest.mark.integration

SECRET = "While-Running-Secret-5e1c"  # the capture role's password: must never appear in any output


def _set_max_message_bytes(kafka: str, topic: str, limit: int) -> None:
    """What the operator runs: kafka-configs --alter --entity-type topics … --add-config max.message.bytes=…"""
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[ConfigEntry("max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET)],
    )
    admin = AdminClient({"bootstrap.servers": kafka})  # kept referenced: a collected client cancels its futures
    admin.incremental_alter_configs([resource])[resource].result(30)


def _confirmed_lsn(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert row is not None, f"slot {slot} is gone"
    return int(row[0])


def _assert_says_too_large(output: str, topic: str, limit: int) -> None:
    """The size error says which topic, the limits in force, that nothing is lost, and the command that fixes it."""
    for fragment in (
        f"an event for topic '{topic}' is ",
        f"the topic's max.message.bytes is {limit:,}",
        "the producer's message.max.bytes",
        "no change is lost",
        f"kafka-configs --alter --entity-type topics --entity-name {topic} --add-config max.message.bytes=N",
    ):
        assert fragment in output, f"{fragment!r} missing from:\n{output}"


# (the event's body in bytes, the topic's max.message.bytes while it fails, extra config): over the topic's
# limit only (the broker refuses it at commit), and over the producer's own 1,000,000 (librdkafka refuses it).
SIZES = {
    "over-the-topic-limit": (100_000, 20_000, ""),
    "over-the-producer-limit": (1_200_000, 20_000, '[kafka.producer]\n"message.max.bytes" = 3000000\n'),
}


@pytest.mark.parametrize("case", list(SIZES))
def test_message_too_large(
    case: str, *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    body_bytes, limit, fixed_config = SIZES[case]
    prefix, role, slot = f"big{unique}", f"big_{unique}", f"s_{unique}"
    try:
        with scratch_database(pg_dsn, f"big_{unique}") as admin, capture_role(admin, role, SECRET) as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE t (id int PRIMARY KEY, body text)")
                conn.execute("INSERT INTO t VALUES (1, 'before')")
            # No heartbeats: the slot's confirmed position then moves only with the table's transactions.
            cfg = CdcConfig(
                dsn, kafka_bootstrap, registry_url, prefix, ["public.t"], slot, f"p_{unique}", heartbeat_interval_s=3600
            )
            capture = cfg.start(tmp_path)
            topic = f"{prefix}.public.t"
            try:
                capture.wait_streaming(180)
                _set_max_message_bytes(kafka_bootstrap, topic, limit)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint").fetchone()
                    assert row is not None
                    before = int(row[0])  # the WAL position before the large row's transaction
                    # Random hex does not compress much (lz4): the batch stays over the limit.
                    conn.execute(
                        "INSERT INTO t SELECT 2, string_agg(md5(random()::text), '') FROM generate_series(1, %s)",
                        (body_bytes // 32,),
                    )
                    conn.execute("INSERT INTO t VALUES (3, 'after')")
                assert capture.proc is not None
                code = capture.proc.wait(180)
            finally:
                if capture.alive():
                    capture.kill()
            output = capture.log.read_text(errors="replace")
            assert code == 6, output
            _assert_says_too_large(output, topic, limit)
            if case == "over-the-producer-limit":
                assert "the producer's message.max.bytes 1,000,000" in output, output
                assert '"message.max.bytes" = N' in output, output
            assert SECRET not in output, "a password reached the output"
            assert "Traceback" not in output, output
            # Nothing acknowledged past the failed transaction: PostgreSQL still holds it for the next run.
            assert _confirmed_lsn(admin, slot) <= before
            assert [e.key for e in read_topic(kafka_bootstrap, registry_url, topic)] == [{"id": 1}]

            # The operator's fix, as the message says; the same command again.
            _set_max_message_bytes(kafka_bootstrap, topic, 2_000_000)
            cfg.extra += fixed_config
            again = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc-again.log")
            again.start()
            try:
                wait_for(
                    lambda: {3} <= {e.key["id"] for e in read_topic(kafka_bootstrap, registry_url, topic) if e.key},
                    180,
                    "the held-back events after the fix",
                    again,
                )
                events = read_topic(kafka_bootstrap, registry_url, topic)
                assert _confirmed_lsn(admin, slot) > before
            finally:
                again.stop()
            # Exactly once each: the snapshot's row, the large one whole, and the one after it.
            assert Counter((e.key or {})["id"] for e in events if e.value is not None) == {1: 1, 2: 1, 3: 1}
            (large,) = [e.value for e in events if e.key == {"id": 2} and e.value is not None]
            assert len(large["after"]["body"]) == body_bytes // 32 * 32
            rerun = again.log.read_text(errors="replace")
            assert SECRET not in rerun, "a password reached the output"
            assert "Traceback" not in rerun, rerun
    finally:
        drop_role(pg_dsn, role)


def test_snapshot_row_too_large(
    *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """A row the snapshot reads that is over its topic's limit: the snapshot's events are produced from C with
    no delivery callback (cdc/_native.pyx, DirectProducer), so the refusal is told from the events' sizes; the
    same actionable error as when streaming, nothing committed, and after the fix every row exactly once."""
    prefix, slot = f"bigs{unique}", f"s_{unique}"
    topic = f"{prefix}.public.t"
    with scratch_database(pg_dsn, f"bigs_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, body text)")
            conn.execute("INSERT INTO t SELECT g, 'row ' || g FROM generate_series(1, 5000) g")
            conn.execute("INSERT INTO t SELECT 5001, string_agg(md5(random()::text), '') FROM generate_series(1, 3125)")
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        new = NewTopic(topic, num_partitions=1, config={"cleanup.policy": "compact", "max.message.bytes": "20000"})
        admin.create_topics([new])[topic].result(30)
        cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, prefix, ["public.t"], slot, f"p_{unique}")
        capture = cfg.start(tmp_path)
        try:
            assert capture.proc is not None
            code = capture.proc.wait(180)
        finally:
            if capture.alive():
                capture.kill()
        output = capture.log.read_text(errors="replace")
        assert code == 6, output
        _assert_says_too_large(output, topic, 20_000)
        if os.environ.get("CDC_PURE_PYTHON", "") in ("", "0"):  # the case this test is for: no delivery callback
            assert "events produced through librdkafka from C" in output, output
        assert "Traceback" not in output, output
        assert read_topic(kafka_bootstrap, registry_url, topic) == [], "a failed snapshot transaction was committed"

        _set_max_message_bytes(kafka_bootstrap, topic, 2_000_000)
        again = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc-again.log")
        again.start()
        try:
            again.wait_streaming(180)
        finally:
            again.stop()
        events = read_topic(kafka_bootstrap, registry_url, topic)
        assert Counter((e.key or {})["id"] for e in events) == {i: 1 for i in range(1, 5002)}
        assert "Traceback" not in again.log.read_text(errors="replace")


@contextmanager
def _small_disk(where: Path, size: str) -> Iterator[None]:
    """A tmpfs of ``size`` mounted at ``where`` (unmounted afterwards), or skip: mounting needs root.

    A missing capability skips even under CDC_TEST_REQUIRE_SERVICES, as the fault suite does for services it
    cannot restart: only a missing service fails the run.
    """
    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a small tmpfs, and mounting one needs root")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {where} (needs CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)  # busy: detach lazily


def _write_forever(out: Any, chunk: bytes) -> None:
    while True:
        out.write(chunk)


def _fill(where: Path) -> Path:
    """Fill the filesystem under ``where`` to the last byte with one file; returns it (delete it to free)."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as out:
        for chunk in (2**20, 4096, 1):
            with pytest.raises(OSError, match="No space left on device"):
                _write_forever(out, b"\0" * chunk)
    assert shutil.disk_usage(where).free == 0
    return filler


@SPARK_WORKER
@pytest.mark.slow  # Spark starts twice
@pytest.mark.usefixtures("spark")  # verify runs in the test process, on its Spark application
def test_sinks_state_disk_full(*, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path) -> None:
    state = tmp_path / "state"  # the sinks' state_dir in Stack.config: checkpoints and status.json
    with _small_disk(state, "16m"), scratch_database(pg_dsn, f"full_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 200) g")
        cfg = stack.config(dsn, ["public.items"], prefix=f"full{unique}", unique=unique, workdir=tmp_path)
        config = cfg.write(tmp_path / "cdc.toml")
        capture = cfg.start(tmp_path)
        sinks = SinksProcess(config, tmp_path / "sinks.log", ["cache"])
        again = SinksProcess(config, tmp_path / "sinks-again.log", ["cache"])
        try:
            capture.wait_streaming(180)
            sinks.start()
            wait_for(lambda: sinks.batches() >= 1, 300, "the cache sink's first batch", sinks)
            filler = _fill(state)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = qty + 1000 WHERE id <= 50")
                conn.execute("DELETE FROM items WHERE id > 190")
            assert sinks.proc is not None
            code = sinks.proc.wait(300)
            output = sinks.log.read_text(errors="replace")
            assert code == 11, output[-5000:]
            for fragment in (
                f"sink cache cannot write its checkpoint under {state.resolve() / 'cache'}",
                "the disk is full (No space left on device",
                "Nothing is lost",
                "Free space on that disk",
                "sinks.state_dir",
                "cdc sinks run",
            ):
                assert fragment in output, f"{fragment!r} missing from:\n{output[-5000:]}"
            assert "Traceback" not in output, output[-5000:]
            assert "\tat org.apache" not in output, output[-5000:]  # nor the JVM's stack trace

            # The operator frees the space and runs the sinks again; the source moved on meanwhile.
            filler.unlink()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items SELECT g, 'late ' || g, g FROM generate_series(1001, 1100) g")
            again.start()
            verified = cdc_here("verify", "cache", "--config", str(config), "--wait", "300")
            assert verified.returncode == 0, verified.stdout + verified.stderr + again.tail()
            assert again.alive(), again.tail()
            assert again.stop() == 0, again.tail()
        finally:
            for proc in (sinks, again):
                if proc.alive():
                    proc.kill()
            capture.stop()
