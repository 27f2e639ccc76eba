"""Avro schemas for change events: relation metadata to key and envelope schemas.

Knows nothing of the network; registering schemas is the capture service's job. Topic naming and the
security settings the capture and the sinks share live in the common layer (``pgcdc_common``).

Column types: :func:`avro_mapping` maps a PostgreSQL type (:class:`PgType`) and type modifier to an Avro
schema and to converters from both wire formats to Avro-ready values (docs/types.md has the table).
"""

from schemas._conv import AvroSchema, FormatError, UnsupportedTypeError, ValueOutOfRangeError, nullable
from schemas._envelope import (
    ColumnHistory,
    ColumnShape,
    avro_name,
    avro_namespace,
    envelope_schema,
    field_names,
    key_schema,
    message_key_schema,
    message_value_schema,
    source_schema,
    transaction_key_schema,
    transaction_value_schema,
)
from schemas._masks import MASKS, Mask, masked
from schemas._names import dedupe_named_types
from schemas._pgtype import PgType, TypeKind
from schemas._types import TEXT_OUTPUT_SETTINGS, AvroMapping, avro_mapping
from schemas._writer import UnsupportedSchemaError, compile_field_writers, compile_writer, write_long, write_string

__all__ = [
    "MASKS",
    "TEXT_OUTPUT_SETTINGS",
    "AvroMapping",
    "AvroSchema",
    "ColumnHistory",
    "ColumnShape",
    "FormatError",
    "Mask",
    "PgType",
    "TypeKind",
    "UnsupportedSchemaError",
    "UnsupportedTypeError",
    "ValueOutOfRangeError",
    "avro_mapping",
    "avro_name",
    "avro_namespace",
    "compile_field_writers",
    "compile_writer",
    "dedupe_named_types",
    "envelope_schema",
    "field_names",
    "key_schema",
    "masked",
    "message_key_schema",
    "message_value_schema",
    "nullable",
    "source_schema",
    "transaction_key_schema",
    "transaction_value_schema",
    "write_long",
    "write_string",
]
