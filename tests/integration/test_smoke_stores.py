"""The derived stores' servers: OpenSearch indexes and finds a document; Redis sets and gets."""

from __future__ import annotations

import redis
from opensearchpy import OpenSearch


def test_opensearch_indexes_and_finds_a_document(opensearch_url: str, unique: str) -> None:
    client = OpenSearch(hosts=[opensearch_url], timeout=30)
    index = f"smoke-{unique}"
    client.indices.create(index=index, body={"settings": {"number_of_shards": 1, "number_of_replicas": 0}})
    try:
        # External versioning is how sinks keep writes from going backwards: an older version is refused.
        client.index(index=index, id="1", body={"note": "derived views"}, version=20, version_type="external")
        client.indices.refresh(index=index)
        hits = client.search(index=index, body={"query": {"match": {"note": "views"}}})["hits"]["hits"]
        assert [(h["_id"], h["_source"]["note"], h.get("_version")) for h in hits] == [("1", "derived views", None)]
        assert client.get(index=index, id="1")["_version"] == 20
    finally:
        client.indices.delete(index=index)


def test_redis_sets_and_gets(redis_url: str, unique: str) -> None:
    client = redis.Redis.from_url(redis_url)
    key = f"smoke:{unique}"
    assert client.set(key, b"value", ex=60)
    assert client.get(key) == b"value"
    assert 0 < client.ttl(key) <= 60
    client.delete(key)
