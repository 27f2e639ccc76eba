"""``cdc verify``'s source side (cdc._expected): every row once, in key order, read in keyset chunks of one
snapshot — with keys whose text and order are not Python's (composite, text with quotes and spaces, numeric,
timestamps), and with writes between chunks that the snapshot must not see."""

from __future__ import annotations

from pathlib import Path

import psycopg

from cdc import source_tables
from cdc._config import load_settings
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
