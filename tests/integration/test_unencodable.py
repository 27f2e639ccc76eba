"""A legal PostgreSQL value Avro cannot hold (a timestamp in year 294276) under capture.on_unencodable, in the
stream and in the snapshot, in a value column and in a key column: "stop" stops naming it, acknowledges
nothing past it and the same command stops again; "dead-letter" writes it to <prefix>.capture-dead-letter with
PostgreSQL's text form of the row, and everything around it is captured."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import (
    CdcConfig,
    CdcProcess,
    capture_role,
    committed_records,
    drop_role,
    read_topic,
    scratch_database,
    wait_for,
)

pytestmark = pytest.mark.pg_matrix  # `./dev test` runs it on PostgreSQL 18 too

SECRET = "unencodable-Secret-42"
LATE = "294276-12-31 23:59:59"  # PostgreSQL's last timestamp: after 294247 AD, beyond an Avro timestamp
STOPPED = 7  # StreamError


def _rows(dsn: str, rows: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(rows)


def _dead_letters(kafka: str, prefix: str) -> list[dict[str, object]]:
    return [json.loads(v) for _, _, v in committed_records(kafka, f"{prefix}.capture-dead-letter", 1) if v]


def _keys(kafka: str, registry: str, topic: str) -> set[object]:
    return {next(iter(e.key.values())) for e in read_topic(kafka, registry, topic) if e.key and e.value}


@pytest.mark.parametrize("where", ["snapshot", "stream"])
def test_a_value_avro_cannot_hold_stops_or_goes_to_the_dead_letter_topic(
    where: str, *, pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    prefix, role, slot = f"late{unique}", f"late_{unique}", f"s_{unique}"
    try:
        with scratch_database(pg_dsn, f"late_{unique}") as admin, capture_role(admin, role, SECRET) as dsn:
            # t: the value column holds the late timestamp; k: the key column does.
            _rows(dsn, "CREATE TABLE t (id int PRIMARY KEY, ts timestamp); CREATE TABLE k (ts timestamp PRIMARY KEY)")
            # In one transaction, between rows that are captured as usual (in the stream, the C path takes a
            # transaction's run of changes and hands back the one it refuses).
            bad = (
                "INSERT INTO t SELECT g, '2024-01-05' FROM generate_series(10, 20) g;"
                f"INSERT INTO t VALUES (2, '{LATE}'); INSERT INTO k VALUES ('{LATE}');"
                "INSERT INTO t SELECT g, '2024-01-06' FROM generate_series(30, 40) g"
            )
            good = "INSERT INTO t VALUES (1, '2024-01-01'), (3, '2024-01-03'); INSERT INTO k VALUES ('2024-01-01')"
            _rows(dsn, good + ";" + (bad if where == "snapshot" else ""))
            cfg = CdcConfig(dsn, kafka_bootstrap, registry_url, prefix, ["public.t", "public.k"], slot, f"p_{unique}")
            first = cfg.start(tmp_path)
            try:
                if where == "stream":
                    first.wait_streaming(180)
                    _rows(dsn, bad)
                assert first.proc is not None
                code = first.proc.wait(180)
            finally:
                if first.alive():
                    first.kill()
            output = first.log.read_text(errors="replace")
            assert code == STOPPED, output
            said = "cannot snapshot a row of public." if where == "snapshot" else "cannot capture the change at LSN"
            assert said in output, output
            assert "beyond what Avro's timestamp-micros can hold" in output, output
            assert "column 'ts'" in output, output
            assert 'capture.on_unencodable = "dead-letter"' in output, output
            assert f"{prefix}.capture-dead-letter" in output, output
            assert "table public.t, key (id=2)" in output or f"table public.k, key (ts={LATE})" in output, output
            assert SECRET not in output, "a password reached the output"

            # The way out the message gives: the same command with the policy changed.
            cfg.extra += '\non_unencodable = "dead-letter"\n'
            again = CdcProcess(cfg.write(tmp_path / "cdc.toml"), tmp_path / "cdc-again.log")
            again.start()
            try:
                again.wait_streaming(180)
                _rows(dsn, "INSERT INTO t VALUES (4, '2024-01-04'); INSERT INTO k VALUES ('2024-01-04')")
                wait_for(
                    lambda: (
                        4 in _keys(kafka_bootstrap, registry_url, f"{prefix}.public.t")
                        and len(_keys(kafka_bootstrap, registry_url, f"{prefix}.public.k")) == 2
                    ),
                    120,
                    "the changes after the dead-lettered ones",
                    again,
                )
                letters = _dead_letters(kafka_bootstrap, prefix)
            finally:
                again.stop()
            assert _keys(kafka_bootstrap, registry_url, f"{prefix}.public.t") == {
                1,
                3,
                4,
                *range(10, 21),
                *range(30, 41),
            }
            assert len(_keys(kafka_bootstrap, registry_url, f"{prefix}.public.k")) == 2
            by_table = {str(letter["table"]): letter for letter in letters}
            assert sorted(by_table) == ["public.k", "public.t"], letters
            op = "r" if where == "snapshot" else "c"
            assert by_table["public.t"]["key"] == {"id": "2"}
            assert by_table["public.t"]["row"] == {"id": "2", "ts": LATE}
            assert by_table["public.k"]["key"] == {"ts": LATE}
            for letter in by_table.values():
                assert letter["op"] == op
                assert letter["column"] == "ts"
                assert "timestamp-micros" in str(letter["error"])
                assert str(letter["lsn"]).count("/") == 1
            rerun = again.log.read_text(errors="replace")
            assert "written to " + f"{prefix}.capture-dead-letter" in rerun, rerun
            assert "Traceback" not in rerun, rerun
            assert SECRET not in rerun, "a password reached the output"
    finally:
        drop_role(pg_dsn, role)
