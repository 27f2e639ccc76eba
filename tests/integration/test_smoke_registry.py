"""Schema registry: register an Avro schema, round-trip a record in Confluent wire format."""

from __future__ import annotations

import io
import json
import struct

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

SCHEMA = {
    "type": "record",
    "name": "Row",
    "namespace": "pgcdc.smoke",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}


def test_register_and_round_trip_confluent_wire_format(registry_url: str, unique: str) -> None:
    # A timeout, and the TOPIC subject strategy: confluent-kafka 2.14+ otherwise asks for "associations" on
    # every (de)serialisation, which Apicurio answers 404 and after which the client once hung (docs/events.md).
    client = SchemaRegistryClient({"url": registry_url, "timeout": 30})
    strategy = {"subject.name.strategy.type": "TOPIC"}
    topic = f"smoke.registry.{unique}"
    subject = f"{topic}-value"
    schema_str = json.dumps(SCHEMA)
    schema_id = client.register_schema(subject, Schema(schema_str, "AVRO"))
    # Asked by name: listing every subject is paged by the registry (Apicurio returns the first page only),
    # and a long-lived local registry holds thousands of subjects from earlier test runs.
    assert client.get_versions(subject)
    latest = client.get_latest_version(subject)
    assert latest.schema_id == schema_id

    ctx = SerializationContext(topic, MessageField.VALUE)
    serializer = AvroSerializer(
        client, schema_str, conf={"auto.register.schemas": False, "use.latest.version": True, **strategy}
    )
    record = {"id": 7, "note": "ünïcode"}
    framed = serializer(record, ctx)
    assert framed is not None

    # Confluent wire format: magic byte 0, 4-byte big-endian schema id, then the plain Avro body.
    assert framed[0] == 0
    assert struct.unpack(">I", framed[1:5])[0] == schema_id
    body = fastavro.schemaless_reader(io.BytesIO(framed[5:]), fastavro.parse_schema(SCHEMA), None)
    assert body == record

    # A consumer with nothing of ours but the registry's address reads it back.
    reader = SchemaRegistryClient({"url": registry_url, "timeout": 30})
    assert AvroDeserializer(reader, conf=strategy)(framed, ctx) == record
    client.delete_subject(subject, permanent=False)
