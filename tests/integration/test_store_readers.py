"""The search index and the cache read with their plain clients hold every value as docs/sinks.md documents it.

The type zoo (test_types_zoo) is captured and written by the search and cache sinks; then opensearch-py reads
every document through the table's alias and redis-py every row hash through ``<namespace>:current``, as a
user's application would, without pgcdc's code. Each value must be the documented document form
(docs/sinks.md, "The stores"): checked by hand for the types the document form spells out (numbers, NaN and
infinities, exact numerics, text, base64 bytea, ISO dates and timestamps, PostgreSQL's ±infinity, dates and
timestamps ISO 8601 cannot print as numbers), and for every other column against the sinks' documented
converter applied to PostgreSQL's own value.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from opensearchpy import OpenSearch, helpers
from psycopg import sql

from tests.integration._capture_helpers import wait_for
from tests.integration._sinks_helpers import SPARK_WORKER, InProcessSinks, Stack, assert_verified, cdc_here
from tests.integration.test_capture_zoo import SourceColumn, insert_rows, source_columns
from tests.integration.test_capture_zoo import zoo_table as zoo_table  # noqa: PLC0414 - the fixture, for pytest
from tests.integration.test_types_zoo import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, TEXT, ZOO, Zoo
from tests.integration.test_types_zoo import zoo as zoo  # noqa: PLC0414 - the fixture, re-exported for pytest
from tests.integration.test_warehouse_readers import check_every_column
from tests.unit.test_types import same

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.timeout(1200), SPARK_WORKER]

_SKIP = object()  # a ZOO case whose document form this file does not spell out by hand


def _documented(column_type: str, expected: Any, text: bytes | None) -> Any:
    """ZOO's expectation for a case in docs/sinks.md's document form, for the types it spells out."""
    if expected is TEXT:
        return text.decode() if text is not None and column_type in ("text", "numeric") else _SKIP
    if column_type in ("date", "timestamp", "timestamptz") and isinstance(expected, int):
        infinities = (INT32_MAX, INT32_MIN) if column_type == "date" else (INT64_MAX, INT64_MIN)
        return {infinities[0]: "infinity", infinities[1]: "-infinity"}.get(expected, expected)
    if isinstance(expected, datetime):
        if expected.tzinfo is not None:
            return expected.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"
        return expected.isoformat(timespec="microseconds")
    if isinstance(expected, date):
        return expected.isoformat()
    if isinstance(expected, float):
        if math.isnan(expected):
            return "NaN"
        return {math.inf: "Infinity", -math.inf: "-Infinity"}.get(expected, expected)
    if isinstance(expected, Decimal):
        return str(expected)
    if isinstance(expected, bytes):
        return base64.b64encode(expected).decode()
    if isinstance(expected, bool | str):
        return expected
    return _SKIP


_BY_HAND = frozenset(
    ("boolean", "real", "double precision", "numeric", "numeric(12,2)", "text", "bytea", "date", "timestamp")
) | {"timestamptz"}


def _search_rows(url: str, alias: str) -> dict[int, dict[str, Any]]:
    client = OpenSearch(url, timeout=120)
    return {json.loads(hit["_id"])[0]: hit["_source"] for hit in helpers.scan(client, index=alias)}


def _cache_rows(url: str, namespace: str, table: str) -> dict[int, dict[str, Any]]:
    r = redis.Redis.from_url(url)
    current = int(r.get(f"{namespace}:current") or 0)
    out = {}
    for key in r.scan_iter(match=f"{namespace}:g{current}:{table}:*", count=1000):
        ident = key.decode().rsplit(":", 1)[1]
        row = r.hget(key, "row")
        assert row is not None, key
        out[json.loads(ident)[0]] = json.loads(row)
    return out


READERS: dict[str, Callable[[Stack, str, str], dict[int, dict[str, Any]]]] = {
    "opensearch-py": lambda stack, prefix, table: _search_rows(stack.opensearch, f"{prefix}-{table}".lower()),
    "redis-py": lambda stack, prefix, table: _cache_rows(stack.redis, prefix, table),
}


def test_plain_clients_read_every_zoo_value_in_the_documented_form_and_verify_finds_no_drift(
    *, zoo: Zoo, zoo_table: tuple[str, int], pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, tmp_path: Path
) -> None:
    table, rows = zoo_table
    insert_rows(zoo, table, 1, rows)
    name = f"{zoo.schema}.{table}"
    prefix = f"r{unique}"
    with _search_and_cache(name, rows, pg_dsn=pg_dsn, stack=stack, spark=spark, unique=unique, workdir=tmp_path):
        stored = {reader: read(stack, prefix, name) for reader, read in READERS.items()}
        # Every value compared with PostgreSQL's, as an operator checks.
        result = cdc_here("verify", "search", "cache", "--config", str(tmp_path / "cdc.toml"))
        assert_verified(result, ("search", "cache"))
    columns = source_columns(zoo, table)
    for reader, got in stored.items():
        assert sorted(got) == sorted(columns[0].texts), reader  # every row, once
        _check_by_hand(got, columns, reader)
        check_every_column(got, columns, reader, spark_values=False)


@contextlib.contextmanager
def _search_and_cache(
    table: str, rows: int, *, pg_dsn: str, stack: Stack, spark: SparkSession, unique: str, workdir: Path
) -> Iterator[None]:
    """`cdc run` and `cdc sinks run search cache` until both stores hold ``rows`` rows of ``table``."""
    prefix = f"r{unique}"
    cfg = stack.config(pg_dsn, [table], prefix=prefix, unique=unique, workdir=workdir)
    capture = cfg.start(workdir)
    sinks = InProcessSinks(spark, workdir / "cdc.toml", workdir / "sinks.log", ["search", "cache"])
    try:
        capture.wait_streaming(180)
        sinks.start()
        for reader, read in READERS.items():
            wait_for(lambda r=read: _count(r, stack, prefix, table) == rows, 600, f"{rows} rows via {reader}", sinks)
        yield
    finally:
        if sinks.alive():
            sinks.stop()
        capture.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (f"s_{unique}",))
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(f"p_{unique}")))


def _count(read: Callable[[Stack, str, str], dict[int, Any]], stack: Stack, prefix: str, table: str) -> int:
    try:
        return len(read(stack, prefix, table))
    except Exception:  # the index or alias does not exist yet
        return 0


def _check_by_hand(got: dict[int, dict[str, Any]], columns: list[SourceColumn], where: str) -> None:
    """The _BY_HAND columns against ZOO's expectations: row j + 1 holds each type's j-th case."""
    mismatches = []
    for i, (column, (column_type, cases)) in enumerate(zip(columns, ZOO, strict=True)):
        if column_type not in _BY_HAND:
            continue
        for j, (expression, expected) in enumerate(cases):
            want = _documented(column_type, expected, column.texts[j + 1])
            if want is _SKIP:
                continue
            value = got[j + 1].get(f"c{i}")
            if not same(value, want):
                mismatches.append(f"{column_type} {expression}: got {value!r}, expected {want!r}")
    assert not mismatches, f"{where}: {len(mismatches)} mismatches:\n" + "\n".join(mismatches)
