"""Shared by the tests where consumers that are not ours (Flink, Kafka Connect, Java clients) read the topics."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.integration._capture_helpers import CdcConfig, CdcProcess

PROGRAMS = Path(__file__).parent / "consumers"  # Java programs, run by `java File.java` (no build step)


def java() -> str:
    """The `java` of JAVA_HOME, else of PATH; fails (a required tool) when there is none."""
    home = os.environ.get("JAVA_HOME")
    path = shutil.which("java", path=os.path.join(home, "bin")) if home else shutil.which("java")
    if path is None:
        pytest.fail("java is not installed: apt-get install -y openjdk-17-jdk-headless (./dev bootstrap does)")
    return path


def start_capture(*, source: str, kafka: str, registry: str, unique: str, table: str, workdir: Path) -> CdcProcess:
    """`cdc run` on ``table`` with the topic prefix ``t<unique>``, once it streams."""
    cfg = CdcConfig(
        dsn=source,
        kafka=kafka,
        registry=registry,
        prefix=f"t{unique}",
        tables=[table],
        slot=f"s_{unique}",
        publication=f"p_{unique}",
    )
    proc = cfg.start(workdir)
    proc.wait_streaming()
    return proc


@dataclass(frozen=True)
class Orders:
    """A scratch database's ``orders`` table, captured with the topic prefix ``t<unique>``."""

    source: str
    kafka: str
    registry: str
    unique: str

    @property
    def topic(self) -> str:
        return f"t{self.unique}.public.orders"

    def start_capture(self, workdir: Path) -> CdcProcess:
        return start_capture(
            source=self.source,
            kafka=self.kafka,
            registry=self.registry,
            unique=self.unique,
            table="public.orders",
            workdir=workdir,
        )

    def create(self, *, replica_identity_full: bool, amount: bool = False) -> None:
        """300 orders; with ``amount``, a numeric(10,2) column too."""
        with psycopg.connect(self.source, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE orders (id int PRIMARY KEY, customer text NOT NULL, qty int, price numeric, "
                "paid boolean, placed timestamptz" + (", amount numeric(10,2))" if amount else ")")
            )
            if replica_identity_full:
                conn.execute("ALTER TABLE orders REPLICA IDENTITY FULL")
            conn.execute(
                "INSERT INTO orders SELECT g, 'customer ' || g, g % 7, (g * 1.25)::numeric, g % 2 = 0, "
                "'2026-01-02 03:04:05.123456+00'::timestamptz + g * interval '1 minute 0.5 s' "
                "FROM generate_series(1, 300) g"
            )
            if amount:
                conn.execute("UPDATE orders SET amount = id * 0.5")

    def change(self) -> None:
        """Updates, deletes, a key change (a delete and an insert), NULLs, and a column added while running."""
        with psycopg.connect(self.source, autocommit=True) as conn:
            conn.execute("UPDATE orders SET qty = qty + 100, paid = NOT paid WHERE id % 5 = 0")
            conn.execute("DELETE FROM orders WHERE id % 11 = 0")
            conn.execute("UPDATE orders SET id = id + 1000 WHERE id IN (3, 4)")
            conn.execute("UPDATE orders SET price = NULL, placed = NULL WHERE id = 7")
            conn.execute("ALTER TABLE orders ADD COLUMN region text")
            conn.execute(
                "INSERT INTO orders (id, customer, qty, price, paid, placed, region) "
                "VALUES (2000, 'late', 1, 9.99, true, now(), 'eu')"
            )
            conn.execute("UPDATE orders SET region = 'us' WHERE id % 3 = 0")

    def truncate_and_change(self) -> None:
        """A truncate, then new rows, an update and a delete after it."""
        with psycopg.connect(self.source, autocommit=True) as conn:
            conn.execute("TRUNCATE orders")
            conn.execute(
                "INSERT INTO orders (id, customer, qty, paid) "
                "SELECT g, 'new ' || g, g, true FROM generate_series(1, 20) g"
            )
            conn.execute("UPDATE orders SET qty = 0 WHERE id = 5")
            conn.execute("DELETE FROM orders WHERE id = 6")
