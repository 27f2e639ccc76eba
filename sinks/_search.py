"""The ``search`` sink: one OpenSearch index per table, served through an alias, versioned by commit LSN.

Index ``<alias>-g<N>``, alias ``<prefix>-<schema>.<table>`` in lower case (plus ``~`` and a hash when the table
name has upper-case letters, :func:`index_alias`). Document id: the key as a JSON array (``[42]``). Documents
hold the row in document form, fields named by :func:`field_name`, plus ``__cdc`` {commit_lsn, lsn, op, ts_ms}.
Every write uses external versioning with the commit LSN as version (``external_gte``: the events of one
transaction share it and arrive in order), so a replayed or late event never overwrites a newer one.
The served generation is kept in the ``<prefix>-cdc-sinks`` index; rebuild swaps all aliases in one request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson
from opensearchpy import OpenSearch, helpers
from opensearchpy.exceptions import ConnectionError as OSConnectionError
from opensearchpy.exceptions import (
    ConnectionTimeout,
    NotFoundError,
    RequestError,
    SerializationError,
    TransportError,
)
from opensearchpy.serializer import JSONSerializer

from sinks._api import BaseSink, Change, Rejected, SinkContext, TableInfo, TableRef
from sinks._clients import shared
from sinks._config import SearchConfig
from sinks._values import Names, column_name, search_mapping
from sinks.errors import SinkTransientError

_META = "__cdc"
_MAX_ID_BYTES = 512
log = logging.getLogger(__name__)
_BULK = 2000  # changes per bulk call
_BULK_BYTES = 16 << 20  # a bulk body's size at most (OpenSearch refuses requests over http.max_content_length, 100 MB)
# A bulk action: its metadata line ({"index": {...}} or {"delete": {...}}) and, for an index, the document.
_Action = tuple[dict[str, Any], dict[str, Any] | None]
_ESCAPE = re.compile(r"[%.]")


def index_alias(prefix: str, table: str) -> str:
    """The alias of ``table`` (``<schema>.<table>`` as in the topic name): ``<prefix>-<table>``, lower case.

    OpenSearch index names are lower case only, so tables whose names differ only in case (``public.Notes``,
    ``public.notes``: distinct topics) would share one index and overwrite each other's documents. A name with
    upper-case letters therefore also gets ``~`` and 8 hex digits of its SHA-256 (``~`` never occurs in a
    topic name, so this cannot be another table's alias).
    """
    alias = f"{prefix}-{table}".lower()
    if table != table.lower():
        alias += "~" + hashlib.sha256(table.encode()).hexdigest()[:8]
    return alias


def field_name(column: str) -> str:
    """The document field of a PostgreSQL column: the name itself, unless OpenSearch would misread it.

    OpenSearch reads a dot in a field name as an object path (columns ``a`` and ``a.b`` then conflict, and
    ``.x.`` is refused), refuses metadata names (``_id``) and blank names, and ``__cdc`` is ours. So ``%`` and
    ``.`` are percent-encoded everywhere, a leading ``_`` too, and a blank name entirely; :func:`column_of`
    decodes (``%`` is always encoded, so ``unquote`` is the exact inverse). Ordinary names are unchanged.
    """
    field = _ESCAPE.sub(lambda m: f"%{ord(m.group()):02X}", column)
    if field.startswith("_"):
        field = "%5F" + field[1:]
    if not field.strip():
        field = "".join(f"%{b:02X}" for b in field.encode())
    return field


def column_of(field: str) -> str:
    """The PostgreSQL column of a document field (the inverse of :func:`field_name`)."""
    return unquote(field, errors="strict")


def _encoded(row: Mapping[str, Any]) -> dict[str, Any]:
    return {field_name(col): value for col, value in row.items()}


class _Serializer(JSONSerializer):
    """The client's JSON: requests as opensearch-py writes them, responses read with orjson (a bulk response
    lists every action's result: the stdlib's parser took a tenth of search's lane at 2,000 changes/s)."""

    def loads(self, s: Any) -> Any:
        try:
            return orjson.loads(s)
        except orjson.JSONDecodeError as exc:
            raise SerializationError(s, exc) from exc


def _client(cfg: SearchConfig) -> OpenSearch:
    auth = (cfg.username, cfg.password.get_secret_value()) if cfg.username and cfg.password else None
    return OpenSearch(
        cfg.url,
        http_auth=auth,
        verify_certs=cfg.verify_certs,
        timeout=60,
        max_retries=3,
        retry_on_timeout=True,
        serializer=_Serializer(),
    )


def _client_key(cfg: SearchConfig) -> tuple[Any, ...]:
    """What a client is made from: two writers with these equal share one (sinks._clients)."""
    password = cfg.password.get_secret_value() if cfg.password else None
    return ("opensearch", cfg.url, cfg.username, password, cfg.verify_certs)


class SearchSink(BaseSink):
    """Generations, read-back and index set-up on the driver; documents are written by :class:`SearchWriter`
    on the executors."""

    name = "search"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        cfg = context.settings.sinks.search
        self.client = _client(cfg)
        self.cfg = cfg
        self.prefix = (cfg.index_prefix or context.settings.kafka.topic_prefix).lower()
        self.state_index = f"{self.prefix}-cdc-sinks"
        self._mapped: dict[str, str] = {}  # index -> the row schema (json) its mapping was last put for

    def close(self) -> None:
        self.client.close()

    def alias(self, table: str) -> str:
        return index_alias(self.prefix, table)

    def index(self, table: str, generation: int) -> str:
        return f"{self.alias(table)}-g{generation}"

    # --- generations -----------------------------------------------------------------------

    def current_generation(self) -> int | None:
        try:
            doc = _call(self.client.get, index=self.state_index, id="search")
        except NotFoundError:
            return None
        return int(doc["_source"]["generation"])

    def prepare_generation(self, generation: int) -> None:
        # Indices are created with their table's first batch; leftovers of a failed rebuild go first.
        self.drop_generation(generation)
        self._mapped.clear()

    def drop_generation(self, generation: int) -> None:
        _call(self.client.indices.delete, index=f"{self.prefix}-*-g{generation}", ignore_unavailable=True)

    def swap(self, generation: int) -> None:
        old = self.current_generation()
        self._serve(generation)
        _call(self.client.index, index=self.state_index, id="search", body={"generation": generation}, refresh=True)
        self._point_aliases(generation)
        if old is not None and old != generation:
            # Searches that resolved an alias just before the swap are still running on the old indices;
            # deleting them at once would fail those searches ("all shards failed").
            time.sleep(self.context.settings.sinks.swap_grace_s)
            self.drop_generation(old)

    def _serve(self, generation: int) -> None:
        """Give a generation's indices the settings of served ones (a rebuild built them without refreshes or
        replicas), make every document searchable, and wait for the replicas before readers are pointed there."""
        pattern = f"{self.prefix}-*-g{generation}"
        current = _call(self.client.indices.get_settings, index=pattern, name="index.refresh_interval")
        built = [i for i, info in current.items() if _refresh_interval(info) == "-1"]
        if not built:  # served already (a restart completing an earlier swap): settings an operator set stay
            return
        served = {"index": {"refresh_interval": None, "number_of_replicas": self.cfg.replicas}}  # None: the default
        _call(self.client.indices.put_settings, index=",".join(built), body=served)
        _call(self.client.indices.refresh, index=pattern)
        status = "green" if self.cfg.replicas else "yellow"
        # OpenSearch waits up to its default 30 s (the client's `timeout` is the HTTP one, not this wait's).
        health = _call(self.client.cluster.health, index=pattern, wait_for_status=status, request_timeout=60)
        if health.get("timed_out"):
            log.warning("search: %s did not reach %s health in 30 s; serving it anyway", pattern, status)

    def _point_aliases(self, generation: int) -> None:
        """Point every table's alias at ``generation`` only, in one atomic request."""
        suffix = f"-g{generation}"
        indices = _call(self.client.indices.get, index=f"{self.prefix}-*{suffix}", ignore_unavailable=True)
        holders = _call(self.client.indices.get_alias, index=f"{self.prefix}-*", ignore_unavailable=True)
        actions: list[dict[str, Any]] = []
        for index in indices:
            alias = index[: -len(suffix)]
            for other, info in holders.items():
                if other != index and alias in info.get("aliases", {}):
                    actions.append({"remove": {"index": other, "alias": alias}})
            actions.append({"add": {"index": index, "alias": alias}})
        if actions:
            _call(self.client.indices.update_aliases, body={"actions": actions})

    def read_table(self, table: TableRef, generation: int) -> Iterator[tuple[str, dict[str, Any]]]:
        parts = self.read_parts(table, generation, 1)
        return parts[0]() if parts else iter(())

    def read_parts(self, table: TableRef, generation: int, parts: int) -> list[SearchPart]:
        index = self.index(table.name, generation)
        if not self.client.indices.exists(index=index):
            return []
        self.client.indices.refresh(index=index)  # the last writes are searchable
        return [SearchPart(self.cfg, index, i, max(1, parts)) for i in range(max(1, parts))]

    # --- writes ----------------------------------------------------------------------------

    def _ensure_index(self, table: TableInfo) -> str:
        generation = table.generation
        index = self.index(table.name, generation)
        signature = json.dumps(table.row_schema, sort_keys=True)
        if self._mapped.get(index) == signature:
            return index
        names = Names()
        properties = {field_name(column_name(f)): search_mapping(f["type"], names) for f in table.row_schema["fields"]}
        properties[_META] = {
            "properties": {
                "commit_lsn": {"type": "long"},
                "lsn": {"type": "long"},
                "op": {"type": "keyword"},
                "ts_ms": {"type": "date", "format": "epoch_millis"},
                "applied_ms": {"type": "date", "format": "epoch_millis"},
            }
        }
        # dynamic false: a column added later is mapped by put_mapping below, never guessed from a value.
        mappings = {"dynamic": False, "properties": properties}
        if not _call(self.client.indices.exists, index=index):
            served = self.current_generation()
            settings: dict[str, Any] = {"number_of_shards": self.cfg.shards, "number_of_replicas": self.cfg.replicas}
            if served is not None and generation != served:
                settings.update(_BUILDING)  # a rebuild's index: nobody reads it until the swap restores these
            try:
                self.client.indices.create(index=index, body={"settings": settings, "mappings": mappings})
            except TransportError as exc:
                if "resource_already_exists_exception" not in str(exc):
                    raise
            if generation == served:
                _call(
                    self.client.indices.update_aliases,
                    body={"actions": [{"add": {"index": index, "alias": self.alias(table.name)}}]},
                )
        else:
            self._map_new_fields(index, table.name, properties)
        self._mapped[index] = signature
        return index

    def _map_new_fields(self, index: str, table: str, properties: dict[str, Any]) -> None:
        """Maps the fields the index lacks (columns added at the source). An existing field's mapping cannot
        change: a column widened past it (an ``integer`` field of an index made before ints were mapped as
        ``long``) is said, with the way out."""
        found: dict[str, Any] = _call(self.client.indices.get_mapping, index=index)
        mapped: dict[str, Any] = next(iter(found.values()), {})
        current: dict[str, Any] = mapped.get("mappings", {}).get("properties", {})
        new = {name: m for name, m in properties.items() if name not in current}
        if new:
            _call(self.client.indices.put_mapping, index=index, body={"properties": new})
        narrower = sorted(n for n, m in properties.items() if n in current and current[n].get("type") != m.get("type"))
        if narrower:
            log.warning(
                "sink search: index %s maps %s of %s otherwise than the table's columns are now (a type changed at "
                "the source): documents whose values the old mapping refuses go to the dead-letter topic; `cdc "
                "sinks rebuild search` builds the index anew with today's mapping",
                index,
                ", ".join(narrower),
                table,
            )

    def prepare(self, tables: Sequence[TableInfo]) -> None:
        for table in tables:
            self._ensure_index(table)

    def partition_writer(self) -> SearchWriter:
        return SearchWriter(self.cfg, self.prefix)


@dataclass(frozen=True)
class SearchPart:
    """One slice of an index (a sliced scroll: each document in exactly one), read in an executor task."""

    cfg: SearchConfig
    index: str
    part: int
    parts: int

    def __call__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        query: dict[str, Any] = {"query": {"match_all": {}}}
        if self.parts > 1:
            query["slice"] = {"id": self.part, "max": self.parts}
        client = _client(self.cfg)
        try:
            for hit in helpers.scan(client, index=self.index, query=query, size=2000):
                source = dict(hit["_source"])
                source.pop(_META, None)
                yield hit["_id"], {column_of(field): value for field, value in source.items()}
        finally:
            client.close()


@dataclass(frozen=True)
class SearchWriter:
    """Writes one partition of a table's changes (in an executor task, or on the driver): bulk requests, with
    the process's client for the settings."""

    cfg: SearchConfig
    prefix: str

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        index = f"{index_alias(self.prefix, table.name)}-g{table.generation}"
        client = shared(_client_key(self.cfg), lambda: _client(self.cfg))  # sinks._clients
        rejected: list[Rejected] = []
        pending: list[Change] = []
        for change in changes:
            if change.op == "t":
                assert change.position is not None  # a truncate always has its position
                self._truncate(client, index, change.position)
                continue
            pending.append(change)
            if len(pending) >= _BULK:
                rejected += self._apply(client, index, table.topic, pending)
                pending = []
        if pending:
            rejected += self._apply(client, index, table.topic, pending)
        return rejected

    def _apply(self, client: OpenSearch, index: str, topic: str, changes: list[Change]) -> list[Rejected]:
        partial = [c for c in changes if c.unchanged and c.row is not None]
        stored: dict[str, dict[str, Any]] = {}
        if partial:  # unchanged TOAST values: keep what the index holds
            found = _call(client.mget, index=index, body={"ids": [c.doc_id for c in partial]})
            stored = {d["_id"]: d["_source"] for d in found["docs"] if d.get("found")}
        actions: list[_Action] = []
        rejected: list[Rejected] = []
        now = int(time.time() * 1000)  # when the change was applied: freshness = applied_ms - ts_ms
        for c in changes:
            if len(c.doc_id.encode()) > _MAX_ID_BYTES:  # OpenSearch refuses the whole bulk request for one such id
                rejected.append(
                    Rejected(topic, c.partition, c.offset, f"OpenSearch: document id over {_MAX_ID_BYTES} bytes")
                )
            else:
                actions.append(_action(index, c, stored.get(c.doc_id), now))
        by_id = {c.doc_id: c for c in changes}
        for item in _bulk(client, actions):
            ((op, result),) = item.items()
            status = int(result.get("status", 0))
            if status in (404, 409):  # already gone / a newer version is stored: nothing to do
                continue
            if status == 429 or status >= 500:
                raise SinkTransientError(f"OpenSearch refused a bulk {op} with {status}; retrying the batch")
            change = by_id[result["_id"]]
            rejected.append(Rejected(topic, change.partition, change.offset, f"OpenSearch {op}: {result.get('error')}"))
        return rejected

    def _truncate(self, client: OpenSearch, index: str, before: tuple[int, int]) -> None:
        commit, lsn = before
        older = {
            "bool": {
                "should": [
                    {"range": {f"{_META}.commit_lsn": {"lt": commit}}},
                    {
                        "bool": {
                            "filter": [
                                {"term": {f"{_META}.commit_lsn": commit}},
                                {"range": {f"{_META}.lsn": {"lt": lsn}}},
                            ]
                        }
                    },
                ]
            }
        }
        # delete_by_query sees only what a refresh has made searchable: documents of the batches just before
        # (within the refresh interval, or any while a rebuild builds without refreshes) must be seen too.
        _call(client.indices.refresh, index=index)
        _call(
            client.delete_by_query,
            index=index,
            body={"query": older},
            refresh=True,
            conflicts="proceed",
        )


# A rebuild writes an index no one reads yet: no periodic refresh (each makes a segment) and no replicas to
# copy every write to; the swap restores both (OpenSearch's advice for bulk loads).
_BUILDING = {"refresh_interval": "-1", "number_of_replicas": 0}


def _refresh_interval(info: dict[str, Any]) -> Any:
    """An index's own refresh_interval from get_settings (absent when the index has the default)."""
    return info.get("settings", {}).get("index", {}).get("refresh_interval")


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (OSConnectionError, ConnectionTimeout) as exc:
        raise SinkTransientError(f"OpenSearch unreachable: {exc}") from exc


def _action(index: str, c: Change, old: dict[str, Any] | None, now_ms: int) -> _Action:
    """The bulk action of one change: a delete, or the document (``old``: what the index holds, for the
    unchanged TOAST values), versioned by its commit LSN so an older change never replaces a newer one."""
    head: dict[str, Any] = {"_index": index, "_id": c.doc_id}
    if c.commit_lsn is not None:
        head.update(version=c.commit_lsn, version_type="external_gte")
    if c.row is None:
        return {"delete": head}, None
    row = _encoded(c.row)
    if c.unchanged and old is not None:
        row = {**row, **{field_name(col): old.get(field_name(col)) for col in c.unchanged}}
    meta = {"commit_lsn": c.commit_lsn, "lsn": c.lsn, "op": c.op, "ts_ms": c.ts_ms, "applied_ms": now_ms}
    return {"index": head}, {**row, _META: meta}


def _bulk(client: OpenSearch, actions: list[_Action]) -> list[dict[str, Any]]:
    """The bulk request's per-action errors, as ``{op: item}``. A request refused as a whole (validation) is
    applied one action at a time to find the culprits.

    The body is serialized with orjson, in requests of at most _BULK_BYTES: the client's own helper serializes
    action by action with the stdlib's json, a sixth of a live lane's time at 2,000 changes/s."""
    errors: list[dict[str, Any]] = []
    for body, part in _bodies(actions):
        try:
            errors += _failed(_call(client.bulk, body=body))
        except RequestError as exc:
            log.warning("OpenSearch refused a bulk request (%s); applying its actions one by one", exc.error)
            for action in part:
                try:
                    errors += _failed(_call(client.bulk, body=_lines([action])))
                except RequestError as one:
                    ((op, head),) = action[0].items()
                    errors.append({op: {"_id": head["_id"], "status": 400, "error": str(one.info or one)}})
    return errors


def _bodies(actions: list[_Action]) -> Iterator[tuple[bytes, list[_Action]]]:
    """Bulk bodies of at most _BULK_BYTES (one action over it goes alone), each with its actions."""
    part: list[_Action] = []
    lines: list[bytes] = []
    size = 0
    for action in actions:
        encoded = _lines([action])
        if part and size + len(encoded) > _BULK_BYTES:
            yield b"".join(lines), part
            part, lines, size = [], [], 0
        part.append(action)
        lines.append(encoded)
        size += len(encoded)
    if part:
        yield b"".join(lines), part


def _lines(actions: list[_Action]) -> bytes:
    out = []
    for head, source in actions:
        out.append(orjson.dumps(head))
        if source is not None:
            out.append(orjson.dumps(source))
    out.append(b"")
    return b"\n".join(out)


def _failed(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not response.get("errors"):
        return []
    return [
        item for item in response["items"] for result in item.values() if not 200 <= result.get("status", 500) < 300
    ]
