"""The search index's writer on a real OpenSearch: versions, deletes, refusals, read back with the plain client."""

from __future__ import annotations

import pytest
from opensearchpy import OpenSearch

from sinks import Change, TableInfo
from sinks._search import SearchWriter, index_alias
from sinks.config import SearchConfig

pytestmark = pytest.mark.integration

_SCHEMA = {"type": "record", "name": "Row", "fields": [{"name": "id", "type": "int"}, {"name": "v", "type": "string"}]}
_KEY = {"type": "record", "name": "Key", "fields": [{"name": "id", "type": "int"}]}


def _change(key: int, row: dict[str, object] | None, commit_lsn: int, offset: int) -> Change:
    return Change({"id": key}, row, "d" if row is None else "u", commit_lsn, commit_lsn, 0, (), 0, offset)


def test_the_writer_keeps_versions_deletes_and_names_the_documents_opensearch_refuses(
    opensearch_url: str, unique: str
) -> None:
    """One bulk body: a newer change replaces a document, an older one is ignored (409), a delete removes one,
    and a document the index's mapping refuses comes back as that change's rejection (for the dead letter),
    the others applied. A batch that spans several bodies applies all of them."""
    prefix = f"sw{unique}"
    table = TableInfo("t", "public.t", _KEY, _SCHEMA, generation=1, batch_id=0)
    index = f"{index_alias(prefix, 'public.t')}-g1"
    client = OpenSearch(opensearch_url)
    client.indices.create(
        index=index, body={"mappings": {"properties": {"id": {"type": "long"}, "v": {"type": "long"}}}}
    )
    writer = SearchWriter(SearchConfig(url=opensearch_url), prefix)

    def stored() -> dict[str, object]:
        client.indices.refresh(index=index)
        hits = client.search(index=index, body={"query": {"match_all": {}}, "size": 100})["hits"]["hits"]
        return {h["_id"]: h["_source"]["v"] for h in hits}

    try:
        assert not list(writer.write(table, iter([_change(k, {"id": k, "v": str(k)}, 10, k) for k in (1, 2, 3)])))
        assert stored() == {"[1]": "1", "[2]": "2", "[3]": "3"}
        rejected = list(
            writer.write(
                table,
                iter(
                    [
                        _change(1, {"id": 1, "v": "11"}, 20, 4),  # newer: replaces
                        _change(2, {"id": 2, "v": "0"}, 5, 5),  # older than the stored: ignored
                        _change(3, None, 20, 6),  # delete
                        _change(4, {"id": 4, "v": "not a number"}, 20, 7),  # the mapping refuses it
                        _change(5, {"id": 5, "v": "5"}, 20, 8),
                    ]
                ),
            )
        )
        assert [(r.topic, r.offset) for r in rejected] == [("t", 7)]
        assert "OpenSearch index" in rejected[0].error
        assert "not a number" in rejected[0].error
        assert stored() == {"[1]": "11", "[2]": "2", "[5]": "5"}
        pad = "x" * 8000  # 3,000 documents of 8 kB: more than one bulk body
        many = [_change(k, {"id": k, "v": str(k), "pad": pad}, 30, k) for k in range(10, 3010)]
        assert not list(writer.write(table, iter(many)))
        client.indices.refresh(index=index)
        assert client.count(index=index)["count"] == 3 + 3000
        last = client.get(index=index, id="[3009]")["_source"]
        assert (last["v"], last["pad"], last["__cdc"]["commit_lsn"]) == ("3009", pad, 30)
    finally:
        client.indices.delete(index=index, ignore_unavailable=True)
