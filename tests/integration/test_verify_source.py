"""``cdc verify``'s source side (cdc._expected): every row once, in key order, read in keyset chunks of one
snapshot — with keys whose text and order are not Python's (composite, text with quotes and spaces, numeric,
timestamps), and with writes between chunks that the snapshot must not see."""

from __future__ import annotations

import pickle
from pathlib import Path

import psycopg
import pytest

from cdc import source_tables
from cdc._expected import UnencodableRow
from cdc.config import load_settings
from tests.integration._capture_helpers import CdcConfig, scratch_database


def test_rows_come_once_in_key_order_in_chunks_of_one_snapshot(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    with scratch_database(pg_dsn, f"vsrc_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute('CREATE TABLE "Odd Keys" (t text, n numeric, at timestamptz, v int, PRIMARY KEY (t, n, at))')
            conn.execute(
                """INSERT INTO "Odd Keys" SELECT (ARRAY['a b', 'a''b', 'A', '', 'é', 'z"z'])[1 + g % 6],
                   (g % 7) * 1.25, '2026-01-01'::timestamptz + (g % 3) * interval '1 hour 0.5 second', g
                   FROM generate_series(1, 120) g ON CONFLICT DO NOTHING"""
            )
            order = [t for (t,) in conn.execute('SELECT t FROM "Odd Keys" ORDER BY t, n, at').fetchall()]
        config = CdcConfig(
            dsn, kafka_bootstrap, registry_url, f"v{unique}", ['public."Odd Keys"'], f"s_{unique}", f"p_{unique}"
        ).write(tmp_path / "cdc.toml")
        (table,) = source_tables(load_settings(config))
        rows = table.rows(chunk_rows=7)
        first = [next(rows) for _ in range(5)]  # the snapshot is taken: later writes are not seen
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO \"Odd Keys\" VALUES ('zzz', 1, now(), -1)")
            conn.execute('DELETE FROM "Odd Keys" WHERE v = (SELECT max(v) FROM "Odd Keys" WHERE v > 0)')
        got = first + list(rows)
        assert len({(r["t"], r["n"], r["at"]) for r in got}) == len(got), "every row once"
        assert [r["t"] for r in got] == order, "in PostgreSQL's key order, as of the snapshot"


def test_a_row_avro_cannot_hold_is_handed_on_with_its_key_not_raised(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """A timestamp in year 294276 has no event (capture.on_unencodable): the source side hands such a row to
    verify with its key as PostgreSQL prints it, and its key's values when the key itself can be encoded."""
    late = "294276-12-31 23:59:59"
    with scratch_database(pg_dsn, f"vlate_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, ts timestamp)")
            conn.execute("CREATE TABLE k (ts timestamp PRIMARY KEY)")
            conn.execute(f"INSERT INTO t VALUES (1, '2024-01-01'), (2, '{late}'), (3, NULL)")
            conn.execute(f"INSERT INTO k VALUES ('2024-01-01'), ('{late}')")
        config = CdcConfig(
            dsn, kafka_bootstrap, registry_url, f"v{unique}", ["public.t", "public.k"], f"s_{unique}", f"p_{unique}"
        ).write(tmp_path / "cdc.toml")
        tables = {t.qualified: t for t in source_tables(load_settings(config))}
        for name, keys, bad_key, key_values in [
            ("public.t", [1, 3], {"id": "2"}, {"id": 2}),
            ("public.k", [1_704_067_200_000_000], {"ts": late}, None),
        ]:
            found: list[UnencodableRow] = []
            rows = list(tables[name].rows(chunk_rows=1, unencodable=found.append))
            assert [next(iter(r.values())) for r in rows] == keys
            (bad,) = found
            assert bad.key_text == bad_key
            assert bad.key == key_values
            assert "timestamp-micros" in bad.error
            with pytest.raises(ValueError, match="timestamp-micros"):
                list(tables[name].rows())


def test_key_ranges_of_one_exported_snapshot_read_every_row_once_in_parallel_tasks(
    pg_dsn: str, kafka_bootstrap: str, registry_url: str, unique: str, tmp_path: Path
) -> None:
    """What verify's tasks do: the driver exports a snapshot and splits the table at sampled keys; each range,
    read in its own session that imports the snapshot (here, from a pickled copy of the table, as a task gets
    it), yields its rows once, and together they are the table as of the export, whatever was written since."""
    with scratch_database(pg_dsn, f"vrng_{unique}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE r (region text, id int, v int, PRIMARY KEY (region, id))")
            conn.execute(
                "INSERT INTO r SELECT (ARRAY['eu', 'us', 'a''b', 'z z'])[1 + g % 4], g, g"
                " FROM generate_series(1, 5000) g"
            )
            conn.execute("ANALYZE r")
            expected = [tuple(row) for row in conn.execute("SELECT region, id FROM r ORDER BY region, id").fetchall()]
        config = CdcConfig(
            dsn, kafka_bootstrap, registry_url, f"v{unique}", ["public.r"], f"s_{unique}", f"p_{unique}"
        ).write(tmp_path / "cdc.toml")
        (table,) = source_tables(load_settings(config))
        with table.snapshot() as (conn, exported):
            ranges = table.ranges(conn, 4, min_rows=1000)
            with psycopg.connect(dsn, autocommit=True) as writer:  # after the export: no range may see these
                writer.execute("INSERT INTO r VALUES ('eu', 0, 0), ('zzz', 1, 1)")
                writer.execute("DELETE FROM r WHERE id = 2500")
            task = pickle.loads(pickle.dumps(table))  # noqa: S301 - our own bytes
            parts = [
                [(r["region"], r["id"]) for r in task.rows(chunk_rows=300, snapshot=exported, within=k)] for k in ranges
            ]
        assert len(ranges) == 4, ranges
        assert all(500 < len(part) < 2000 for part in parts), [len(p) for p in parts]  # split at sampled keys
        assert [key for part in parts for key in part] == expected, "every row once, in order, as of the export"
