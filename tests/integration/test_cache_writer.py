"""The cache's writer on a real Redis: its apply script survives the server losing it, and keeps positions."""

from __future__ import annotations

import json

import pytest
import redis
from pydantic import SecretStr

from sinks import Change, TableInfo
from sinks._cache import CacheWriter, entry_prefix

pytestmark = pytest.mark.integration

_SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "id", "type": "int"}, {"name": "v", "type": "string"}]}
_KEY = {"type": "record", "name": "Key", "fields": [{"name": "id", "type": "int"}]}


def _upsert(key: int, value: str, commit_lsn: int) -> Change:
    return Change({"id": key}, {"id": key, "v": value}, "u", commit_lsn, commit_lsn, 0, (), 0, commit_lsn)


def test_the_writer_reloads_its_script_after_a_flush_and_never_goes_back(redis_url: str, unique: str) -> None:
    """The writer calls its script by digest (EVALSHA), with no SCRIPT EXISTS before each write: a server that
    lost it (restarted, SCRIPT FLUSH) refuses the calls, the writer loads it and writes again; a change older
    than the stored one is still refused."""
    client = redis.Redis.from_url(redis_url)
    namespace = f"cw{unique}"
    table = TableInfo("t", "public.t", _KEY, _SCHEMA, generation=1, batch_id=0)
    writer = CacheWriter(SecretStr(redis_url), namespace, ttl=0)
    prefix = entry_prefix(namespace, "public.t", 1)

    def stored() -> dict[str, str]:
        rows = {k.decode(): client.hget(k, "row") for k in client.scan_iter(match=prefix + "*")}
        return {k[len(prefix) :]: json.loads(v)["v"] for k, v in rows.items() if v is not None}

    try:
        writer.write(table, iter([_upsert(1, "one", 10), _upsert(2, "two", 10)]))
        assert stored() == {"[1]": "one", "[2]": "two"}
        client.script_flush()
        writer.write(table, iter([_upsert(1, "newer", 20), _upsert(2, "older", 5), _upsert(3, "three", 20)]))
        assert stored() == {"[1]": "newer", "[2]": "two", "[3]": "three"}
    finally:
        for key in client.scan_iter(match=f"{namespace}:*"):
            client.delete(key)
