"""The ``cache`` sink: one Redis hash per row, written only when it moves forward.

Key scheme (docs/sinks.md):

    <namespace>:current                                  the served generation N
    <namespace>:g<N>:<schema>.<table>:<key>              hash {row, commit_lsn, lsn, op, ts_ms, applied_ms}

``<key>`` is the JSON array of the key's values (``[42]``, ``["eu",7]``), ``row`` the row in document form
(JSON), ``commit_lsn``/``lsn`` 16 hex digits so that string order is position order. A Lua script compares
positions and writes atomically: a replayed or late event never overwrites a newer one.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import SecretStr

from sinks._api import BaseSink, Change, Rejected, SinkContext, TableInfo, TableRef
from sinks._clients import shared
from sinks.errors import SinkTransientError

# Many entries per call (a round trip and a command per row would cost more than the work itself).
# KEYS: entries; ARGV: ttl, then per entry 7 values: kind ('u' upsert / 'd' delete / 'D' unconditional delete),
# commit_lsn, lsn (16 hex digits: string order is position order), row json, op, ts_ms, applied_ms.
_APPLY = """
local ttl = tonumber(ARGV[1])
local applied = 0
for i, key in ipairs(KEYS) do
  local b = 1 + (i - 1) * 7
  local kind, c, l = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local older = false
  if kind ~= 'D' then
    local cur = redis.call('HMGET', key, 'commit_lsn', 'lsn')
    older = cur[1] and (c < cur[1] or (c == cur[1] and l < cur[2]))
  end
  if not older then
    applied = applied + 1
    if kind == 'u' then
      redis.call('HSET', key, 'row', ARGV[b + 4], 'commit_lsn', c, 'lsn', l, 'op', ARGV[b + 5], 'ts_ms', ARGV[b + 6],
                 'applied_ms', ARGV[b + 7])
      if ttl > 0 then redis.call('EXPIRE', key, ttl) end
    else
      redis.call('DEL', key)
    end
  end
end
return applied
"""
_APPLY_SHA = hashlib.sha1(_APPLY.encode(), usedforsecurity=False).hexdigest()  # the name EVALSHA calls it by
_PIPELINE = 1000
_MAX_PARTS = 4  # verify's readers of one table
_PER_CALL = 200  # entries per script call


def _hex(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016X}"


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class CacheSink(BaseSink):
    """Generations, read-back and set-up on the driver; rows are written by :class:`CacheWriter` on the executors."""

    name = "cache"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        cfg = context.settings.sinks.cache
        self.namespace = cfg.namespace or context.settings.kafka.topic_prefix
        self.ttl = cfg.ttl_s or 0
        self.url = cfg.url
        self.client = redis.Redis.from_url(cfg.url.get_secret_value(), socket_timeout=30)

    def close(self) -> None:
        self.client.close()

    def prepare(self, tables: Sequence[TableInfo]) -> None:
        return None  # keys appear as rows are written

    def partition_writer(self) -> CacheWriter:
        return CacheWriter(self.url, self.namespace, self.ttl)

    # --- generations -----------------------------------------------------------------------

    def current_generation(self) -> int | None:
        value = _call(self.client.get, f"{self.namespace}:current")
        return int(value) if value is not None else None

    def prepare_generation(self, generation: int) -> None:
        # Keys appear as rows are written; leftovers of an earlier, failed rebuild to this number go first.
        self.drop_generation(generation)

    def drop_generation(self, generation: int) -> None:
        self._drop(f"{_glob_escape(self.namespace)}:g{generation}:*")

    def swap(self, generation: int) -> None:
        old = self.current_generation()
        _call(self.client.set, f"{self.namespace}:current", str(generation))
        if old is not None and old != generation:
            time.sleep(self.context.settings.sinks.swap_grace_s)  # readers that read the old number finish first
            self.drop_generation(old)

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
        return entry_prefix(self.namespace, table, generation)

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        return CachePart(self.url, self.entry_prefix(table.name, generation), 0, 1)()

    def read_parts(self, table: TableRef, generation: int, parts: int) -> list[CachePart]:
        # Each part walks the whole key space (SCAN cannot be split) and reads the rows of its share of the keys:
        # walking is cheap next to reading rows, but more than a few walkers would only load Redis.
        n = max(1, min(parts, _MAX_PARTS))
        return [CachePart(self.url, self.entry_prefix(table.name, generation), i, n) for i in range(n)]


@dataclass(frozen=True)
class CachePart:
    """The rows of one share of a table's keys (by a hash of the key), read in an executor task (verify)."""

    url: SecretStr
    prefix: str
    part: int
    parts: int

    def __call__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        client = redis.Redis.from_url(self.url.get_secret_value(), socket_timeout=30)
        try:
            mine: list[bytes] = []
            for key in client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
                if self.parts == 1 or zlib.crc32(key) % self.parts == self.part:
                    mine.append(key)
                if len(mine) >= _PIPELINE:
                    yield from self._rows(client, mine)
                    mine = []
            yield from self._rows(client, mine)
        finally:
            client.close()

    def _rows(self, client: redis.Redis, keys: list[bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "row")
        for key, row in zip(keys, pipe.execute(), strict=True):
            if row is not None:  # deleted since the walk saw it
                yield key.decode()[len(self.prefix) :], json.loads(row)


def entry_prefix(namespace: str, table: str, generation: int) -> str:
    return f"{namespace}:g{generation}:{table}:"


@dataclass(frozen=True)
class CacheWriter:
    """Writes one partition of a table's changes (in an executor task, or on the driver): Lua-guarded
    pipelines, with the process's client for the URL."""

    url: SecretStr
    namespace: str
    ttl: int

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        url = self.url.get_secret_value()
        client = shared(("redis", url), lambda: redis.Redis.from_url(url, socket_timeout=30))  # sinks._clients
        prefix = entry_prefix(self.namespace, table.name, table.generation)
        pending: list[Change] = []
        for change in changes:
            if change.op == "t":
                assert change.position is not None  # a truncate always has its position
                self._truncate(client, prefix, change.position)
                continue
            pending.append(change)
            if len(pending) >= _PIPELINE:
                self._apply(client, prefix, pending)
                pending = []
        if pending:
            self._apply(client, prefix, pending)
        return ()

    def _apply(self, client: redis.Redis, prefix: str, changes: list[Change]) -> None:
        partial = [c for c in changes if c.unchanged and c.row is not None]
        stored: dict[str, dict[str, Any]] = {}
        if partial:  # unchanged TOAST values: keep what the cache holds (the script does not parse JSON)
            pipe = client.pipeline(transaction=False)
            for c in partial:
                pipe.hget(prefix + c.doc_id, "row")
            rows = _call(pipe.execute)
            stored = {c.doc_id: json.loads(r) for c, r in zip(partial, rows, strict=True) if r is not None}
        now_ms = str(int(time.time() * 1000))
        keys: list[str] = []
        args: list[Any] = []
        for c in changes:
            doc_id = c.doc_id
            keys.append(prefix + doc_id)
            pos = c.position
            commit, lsn = ("", "") if pos is None else (_hex(pos[0]), _hex(pos[1]))
            if c.row is None:
                args += ["D" if pos is None else "d", commit, lsn, "", "", "", ""]
            else:
                row = c.row
                old = stored.get(doc_id)
                if c.unchanged and old is not None:
                    row = {**row, **{col: old.get(col) for col in c.unchanged}}
                row_json = json.dumps(row, separators=(",", ":"), ensure_ascii=False)
                args += ["u", commit, lsn, row_json, c.op, c.ts_ms or 0, now_ms]
        self._run(client, keys, args)

    def _truncate(self, client: redis.Redis, prefix: str, before: tuple[int, int]) -> None:
        keys = list(_call(lambda: list(client.scan_iter(match=_glob_escape(prefix) + "*", count=1000))))
        self._run(client, keys, ["d", _hex(before[0]), _hex(before[1]), "", "", "", ""] * len(keys))

    def _run(self, client: redis.Redis, keys: list[str], args: list[Any]) -> None:
        """The apply script over ``keys`` (7 ``args`` each), ``_PER_CALL`` entries per call, in one pipeline of
        EVALSHA. redis-py's Script objects ask SCRIPT EXISTS before each pipeline: a round trip more per write,
        which for the lane's small writes was most of their time. A server that lacks the script (new,
        restarted, SCRIPT FLUSH) refuses every call with NOSCRIPT: it is loaded and the pipeline runs again,
        which the script's position check makes harmless where a call was applied meanwhile."""

        def execute() -> Any:
            pipe = client.pipeline(transaction=False)
            for start in range(0, len(keys), _PER_CALL):
                part = keys[start : start + _PER_CALL]
                pipe.evalsha(_APPLY_SHA, len(part), *part, self.ttl, *args[start * 7 : (start + len(part)) * 7])
            return pipe.execute()

        if not keys:
            return
        try:
            _call(execute)
        except redis.exceptions.NoScriptError:
            _call(client.script_load, _APPLY)
            _call(execute)


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        # Transient like any store fault: credentials are often fixed on the server (an ACL user
        # re-enabled, a rotated password restored) without restarting the sinks. Never the URL: it holds them.
        raise SinkTransientError(
            f"Redis refused the credentials of sinks.cache.url ({exc}); check the user and password in the URL "
            "against the server's ACL (ACL GETUSER …)"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise SinkTransientError(f"Redis unreachable: {exc}") from exc
