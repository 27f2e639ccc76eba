"""A write workload that survives faults, and the check that every committed change is in a topic exactly once.

How "exactly once" is checked without trusting the client: every row carries a version ``v`` that each update
increments (REPLICA IDENTITY FULL, so deletes carry it too). Replayed in offset order, each key's events must read
v = 0, 1, 2, … with no gap (a lost event) and no repeat (a duplicate), end with a delete of the last version if the
row is gone, and end at the version the source holds. Statements whose commit the client could not confirm (a
connection cut mid-commit) need no bookkeeping: the source itself says what was committed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import psycopg

TABLE = (
    "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL, name text)",
    "ALTER TABLE items REPLICA IDENTITY FULL",  # deletes carry the version they delete
)


class Workload:
    """Inserts, version-bumping updates and deletes, one row per transaction; survives the faults."""

    def __init__(self, dsn: str, first_id: int) -> None:
        self.dsn, self.next_id = dsn, first_id
        self.done = threading.Event()
        self.statements: Counter[str] = Counter()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rnd = random.Random(3)
        conn: psycopg.Connection[Any] | None = None
        while not self.done.is_set():
            r = rnd.random()
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                if r < 0.55:
                    conn.execute("UPDATE items SET v = v + 1 WHERE id = %s", (rnd.randint(1, self.next_id - 1),))
                    self.statements["update"] += 1
                elif r < 0.85:
                    conn.execute("INSERT INTO items VALUES (%s, 0, 'new')", (self.next_id,))
                    self.next_id += 1
                    self.statements["insert"] += 1
                else:
                    conn.execute("DELETE FROM items WHERE id = %s", (rnd.randint(1, self.next_id - 1),))
                    self.statements["delete"] += 1
                time.sleep(0.003)
            except psycopg.Error:
                self.statements["failed"] += 1  # the server restarting: whether it committed, the source knows
                if 0.55 <= r < 0.85:
                    self.next_id += 1  # the insert may have committed: never reuse its id
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.3)
        if conn is not None:
            conn.close()


def check_exactly_once(events: list[Any], source: dict[int, int]) -> dict[str, int]:
    """Every key's history, replayed in offset order, against the source's final versions."""
    history: dict[int, list[tuple[str, int]]] = {}
    for e in events:
        if e.value is None:
            continue  # tombstones: checked through the deletes before them
        op = e.value["op"]
        row = e.value["before"] if op == "d" else e.value["after"]
        history.setdefault(e.key["id"], []).append((op, int(row["v"])))
    lost = duplicated = 0
    problems = []
    for key, events_ in history.items():
        versions = [v for op, v in events_ if op != "d"]
        if versions != list(range(len(versions))):
            seen = Counter(versions)
            duplicated += sum(n - 1 for n in seen.values() if n > 1)
            lost += len(set(range(max(versions) + 1)) - set(versions)) if versions else 0
            problems.append(f"key {key}: versions {versions[:20]}")
        deletes = [v for op, v in events_ if op == "d"]
        if len(deletes) > 1:
            duplicated += len(deletes) - 1
            problems.append(f"key {key}: {len(deletes)} deletes")
        if key in source:
            if deletes or not versions or versions[-1] != source[key]:
                problems.append(f"key {key}: source v={source[key]}, topic {events_[-3:]}")
                lost += 1
        elif not deletes or (versions and deletes[-1] != versions[-1]):
            problems.append(f"key {key}: deleted in the source, topic {events_[-3:]}")
            lost += 1
    missing = set(source) - set(history)
    lost += len(missing)
    assert not missing, f"{len(missing)} source rows never reached the topic: {sorted(missing)[:10]}"
    assert not problems, f"lost {lost}, duplicated {duplicated}: {problems[:10]}"
    return {
        "keys": len(history),
        "events": sum(len(h) for h in history.values()),
        "lost": lost,
        "duplicated": duplicated,
    }


def source_versions(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT id, v FROM items").fetchall()}
