"""The ``cache`` sink: one Redis hash per row, written only when it moves forward.

Key scheme (docs/sinks.md):

    <namespace>:current                                  the served generation N
    <namespace>:g<N>:<schema>.<table>:<key>              hash {row, commit_lsn, lsn, op, ts_ms}

``<key>`` is the JSON array of the key's values (``[42]``, ``["eu",7]``), ``row`` the row in document form
(JSON), ``commit_lsn``/``lsn`` 16 hex digits so that string order is position order. A Lua script compares
positions and writes atomically: a replayed or late event never overwrites a newer one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import redis

from sinks._api import BaseSink, Batch, Change, SinkContext, TableRef
from sinks.errors import SinkTransientError

# KEYS[1] entry; ARGV commit_lsn, lsn (hex16), row json, op, ts_ms, ttl seconds (0 = none)
_UPSERT = """
local cur = redis.call('HMGET', KEYS[1], 'commit_lsn', 'lsn')
if cur[1] and (ARGV[1] < cur[1] or (ARGV[1] == cur[1] and ARGV[2] < cur[2])) then return 0 end
redis.call('HSET', KEYS[1], 'row', ARGV[3], 'commit_lsn', ARGV[1], 'lsn', ARGV[2], 'op', ARGV[4], 'ts_ms', ARGV[5])
if tonumber(ARGV[6]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[6]) end
return 1
"""
# KEYS[1] entry; ARGV commit_lsn, lsn ('' = unconditional): delete unless the stored row is newer
_DELETE = """
if ARGV[1] ~= '' then
  local cur = redis.call('HMGET', KEYS[1], 'commit_lsn', 'lsn')
  if cur[1] and (ARGV[1] < cur[1] or (ARGV[1] == cur[1] and ARGV[2] < cur[2])) then return 0 end
end
return redis.call('DEL', KEYS[1])
"""
_PIPELINE = 1000


def _hex(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016X}"


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class CacheSink(BaseSink):
    name = "cache"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        cfg = context.settings.sinks.cache
        self.namespace = cfg.namespace or context.settings.kafka.topic_prefix
        self.ttl = cfg.ttl_s or 0
        self.client = redis.Redis.from_url(cfg.url.get_secret_value(), socket_timeout=30)
        self._upsert = self.client.register_script(_UPSERT)
        self._delete = self.client.register_script(_DELETE)

    def close(self) -> None:
        self.client.close()

    # --- generations -----------------------------------------------------------------------

    def current_generation(self) -> int | None:
        value = self._call(self.client.get, f"{self.namespace}:current")
        return int(value) if value is not None else None

    def prepare_generation(self, generation: int) -> None:
        # Keys appear as rows are written; leftovers of an earlier, failed rebuild to this number go first.
        self._drop(f"{_glob_escape(self.namespace)}:g{generation}:*")

    def swap(self, generation: int) -> None:
        old = self.current_generation()
        self._call(self.client.set, f"{self.namespace}:current", str(generation))
        if old is not None and old != generation:
            self._drop(f"{_glob_escape(self.namespace)}:g{old}:*")

    def _drop(self, pattern: str) -> None:
        batch: list[Any] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= _PIPELINE:
                self.client.unlink(*batch)
                batch.clear()
        if batch:
            self.client.unlink(*batch)

    def entry_prefix(self, table: str, generation: int) -> str:
        return f"{self.namespace}:g{generation}:{table}:"

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        prefix = self.entry_prefix(table.name, generation)
        keys = list(self.client.scan_iter(match=_glob_escape(prefix) + "*", count=1000))
        for start in range(0, len(keys), _PIPELINE):
            chunk = keys[start : start + _PIPELINE]
            pipe = self.client.pipeline(transaction=False)
            for key in chunk:
                pipe.hget(key, "row")
            for key, row in zip(chunk, pipe.execute(), strict=True):
                if row is not None:
                    yield key.decode()[len(prefix) :], json.loads(row)

    # --- writes ----------------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            prefix = self.entry_prefix(table.name, batch.generation)
            if table.truncate is not None:
                self._truncate(prefix, table.truncate)
            pending: list[Change] = []
            for change in table.changes():
                pending.append(change)
                if len(pending) >= _PIPELINE:
                    self._apply(prefix, pending)
                    pending = []
            if pending:
                self._apply(prefix, pending)

    def _apply(self, prefix: str, changes: list[Change]) -> None:
        partial = [c for c in changes if c.unchanged and c.row is not None]
        stored: dict[str, dict[str, Any]] = {}
        if partial:  # unchanged TOAST values: keep what the cache holds (the script does not parse JSON)
            pipe = self.client.pipeline(transaction=False)
            for c in partial:
                pipe.hget(prefix + c.doc_id, "row")
            rows = self._call(pipe.execute)
            stored = {c.doc_id: json.loads(r) for c, r in zip(partial, rows, strict=True) if r is not None}
        pipe = self.client.pipeline(transaction=False)
        for c in changes:
            key = prefix + c.doc_id
            if c.row is None:
                pos = c.position
                self._delete(keys=[key], args=["", ""] if pos is None else [_hex(pos[0]), _hex(pos[1])], client=pipe)
                continue
            row = c.row
            old = stored.get(c.doc_id)
            if c.unchanged and old is not None:
                row = {**row, **{col: old.get(col) for col in c.unchanged}}
            assert c.commit_lsn is not None
            assert c.lsn is not None
            self._upsert(
                keys=[key],
                args=[
                    _hex(c.commit_lsn),
                    _hex(c.lsn),
                    json.dumps(row, separators=(",", ":"), ensure_ascii=False),
                    c.op,
                    c.ts_ms or 0,
                    self.ttl,
                ],
                client=pipe,
            )
        self._call(pipe.execute)

    def _truncate(self, prefix: str, before: tuple[int, int]) -> None:
        keys = list(self.client.scan_iter(match=_glob_escape(prefix) + "*", count=1000))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            self._delete(keys=[key], args=[_hex(before[0]), _hex(before[1])], client=pipe)
        self._call(pipe.execute)

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise SinkTransientError(f"Redis unreachable: {exc}") from exc
