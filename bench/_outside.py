"""Freshness as a reader outside pgcdc sees it: each store's plain client polling for rows committed at known times.

The sinks stamp each row with when they applied it (``applied_ms``), which measures the sink, not what a
reader of the store gets. Here a thread per store polls with that store's ordinary client for the ids of
rows whose commit time the load recorded, and takes the first time it found each one:

* Redis: ``EXISTS`` on the rows' keys (redis-py, pipelined);
* OpenSearch: ``mget`` of their document ids (real-time GET: no refresh needed, as a reader fetching by id);
* Delta: the table's newest version read by delta-rs (a reader that is not Spark), its ids compared.

Freshness of a row = first seen - commit, so each figure includes the poll's own period (20 ms for Redis and
OpenSearch, 500 ms for Delta, stated with the result).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow.compute as pc
import redis
from deltalake import DeltaTable
from opensearchpy import OpenSearch

POLL_S = {"search": 0.02, "cache": 0.02, "warehouse": 0.5}


@dataclass
class _Probe:
    """One store's poller: which ids it still waits for and when it saw each."""

    name: str
    find: Callable[[list[int]], Iterable[int]]  # the ids of those given that the store holds now
    period_s: float
    pending: dict[int, float] = field(default_factory=dict)  # id -> commit time (epoch s)
    seen: dict[int, float] = field(default_factory=dict)  # id -> seen - commit (s)


class OutsideWatch:
    """Polls every store for rows as they are committed; ``commit(id)`` right after each commit returns."""

    def __init__(self, probes: list[_Probe]) -> None:
        self._probes = probes
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._poll, args=(p,), daemon=True) for p in probes]

    @classmethod
    def for_stores(
        cls, *, redis_url: str, redis_prefix: str, opensearch: str, index: str, delta_path: str | None
    ) -> OutsideWatch:
        """``redis_prefix``: the cache's key prefix up to the key (``<ns>:g<N>:<schema>.<table>:``); ``index``:
        the search alias; ``delta_path``: the warehouse table's served path (None: not watched)."""
        r = redis.Redis.from_url(redis_url)
        os_client = OpenSearch(opensearch, timeout=30)

        def in_cache(ids: list[int]) -> Iterable[int]:
            pipe = r.pipeline(transaction=False)
            for i in ids:
                pipe.exists(f"{redis_prefix}[{i}]")
            return [i for i, found in zip(ids, pipe.execute(), strict=True) if found]

        def in_search(ids: list[int]) -> Iterable[int]:
            docs = os_client.mget(index=index, body={"ids": [f"[{i}]" for i in ids]}, _source=False)["docs"]
            return [i for i, d in zip(ids, docs, strict=True) if d.get("found")]

        probes = [
            _Probe("cache", in_cache, POLL_S["cache"]),
            _Probe("search", in_search, POLL_S["search"]),
        ]
        if delta_path is not None:
            probes.append(_Probe("warehouse", _delta_finder(delta_path), POLL_S["warehouse"]))
        return cls(probes)

    def start(self) -> OutsideWatch:
        for t in self._threads:
            t.start()
        return self

    def commit(self, ids: Iterable[int], at: float | None = None) -> None:
        at = time.time() if at is None else at
        with self._lock:
            for p in self._probes:
                for i in ids:
                    p.pending[i] = at

    def wait(self, timeout_s: float) -> None:
        """Until every committed id has been seen in every store, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.pending for p in self._probes):
            time.sleep(0.1)

    def stop(self) -> dict[str, list[float]]:
        """Stops polling; per store, the sorted freshness (s) of every id seen."""
        self._halt.set()
        for t in self._threads:
            t.join(10)
        return {p.name: sorted(p.seen.values()) for p in self._probes}

    def missing(self) -> dict[str, int]:
        return {p.name: len(p.pending) for p in self._probes}

    def _poll(self, probe: _Probe) -> None:
        while not self._halt.wait(probe.period_s):
            with self._lock:
                ids = list(probe.pending)[:2000]
            if not ids:
                continue
            with contextlib.suppress(Exception):  # a store not ready yet (the index not created): poll again
                found = probe.find(ids)
                now = time.time()
                with self._lock:
                    for i in found:
                        at = probe.pending.pop(i, None)
                        if at is not None:
                            probe.seen[i] = now - at


def _delta_finder(path: str) -> Callable[[list[int]], Iterable[int]]:
    """delta-rs: which of ``ids`` the table's newest version holds (files outside their range are skipped by
    their statistics, so a poll reads the few files a recent commit wrote, not the table)."""

    def find(ids: list[int]) -> Iterable[int]:
        dataset = DeltaTable(path).to_pyarrow_dataset()
        wanted = (pc.field("id") >= min(ids)) & (pc.field("id") <= max(ids)) & pc.field("id").isin(ids)
        found: list[int] = dataset.to_table(columns=["id"], filter=wanted).column("id").to_pylist()
        return found

    return find
