"""Avro schemas for change events: relation metadata to key and envelope schemas.

Knows nothing of the network; registering schemas is the capture service's job.
"""

from schemas._envelope import (
    ColumnShape,
    avro_name,
    avro_namespace,
    envelope_schema,
    field_names,
    key_schema,
    source_schema,
)
from schemas._pgtype import PgType, TypeKind

__all__ = [
    "ColumnShape",
    "PgType",
    "TypeKind",
    "avro_name",
    "avro_namespace",
    "envelope_schema",
    "field_names",
    "key_schema",
    "source_schema",
]
