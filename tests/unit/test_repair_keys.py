"""Backfills of listed keys (cdc._backfill.KeyList, parse_keys) and the key lists a repair reads
(cdc._repair.report_keys): pure logic, no database."""

from __future__ import annotations

import json

import pytest

from cdc._backfill import KeyList, parse_keys
from cdc._repair import report_keys
from pgcdc_common.errors import ConfigError


def test_keys_are_checked_against_the_key_columns_and_each_kept_once() -> None:
    keys = [{"id": "1", "at": "2026-01-01"}, {"at": "2026-01-01", "id": "1"}, {"id": "2", "at": "x"}]
    assert parse_keys(keys, ["id", "at"], "public.t") == [{"id": "1", "at": "2026-01-01"}, {"id": "2", "at": "x"}]
    for wrong, says in [
        ([{"id": "1"}], "key 1 of the request"),  # a key column missing
        ([{"id": "1", "at": "x", "v": "2"}], "key 1 of the request"),  # one too many
        ([{"id": "1", "at": "x"}, {"id": 2, "at": "x"}], "key 2 of the request"),  # not text
        ([{"id": "1", "at": None}], "key 1 of the request"),  # a key is never null
        ([], "'keys' is not a list"),
        ("1", "'keys' is not a list"),
    ]:
        with pytest.raises(ValueError, match=says) as err:
            parse_keys(wrong, ["id", "at"], "public.t")
        assert "public.t" in str(err.value)


def test_a_key_list_is_read_in_chunks_of_keys_in_the_order_listed() -> None:
    keys = [{"id": str(i)} for i in range(7)]
    chunks = KeyList.__new__(KeyList)  # only its key bookkeeping: the queries need a table
    chunks.keys = keys
    after = None
    seen = []
    while True:
        after, done = chunks.end(after, 3)
        seen.append(after)
        if done:
            break
    assert seen == [["3"], ["6"], ["7"]]


def _line(kind: str, **extra: object) -> str:
    return json.dumps({"kind": kind, "key": "[1]", **extra})


def test_a_verify_report_gives_the_keys_a_repair_re_emits() -> None:
    lines = [
        _line("missing", columns={"id": "1"}),
        "",
        _line("extra", columns={"id": "2"}),
        _line("different", columns={"id": "3"}),
        _line("unencodable", error="year 294276"),  # no event can carry it: left out
    ]
    assert report_keys(lines, "r.jsonl") == ([{"id": "1"}, {"id": "2"}, {"id": "3"}], 0)
    # A key PostgreSQL cannot read back (no columns) is counted, not asked for, and does not stop the others.
    assert report_keys([_line("extra"), _line("missing", columns={"id": "4"})], "r.jsonl") == ([{"id": "4"}], 1)
    with pytest.raises(ConfigError, match=r"line 2 of r.jsonl is not JSON"):
        report_keys([_line("missing", columns={"id": "1"}), "{"], "r.jsonl")
    with pytest.raises(ConfigError, match="not a line of a `cdc verify` report"):
        report_keys([json.dumps({"kind": "other"})], "r.jsonl")
