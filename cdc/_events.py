"""Turning decoded row changes into Kafka records: Confluent-framed Avro key and envelope.

One :class:`TableCodec` per (table, relation version): built when a Relation message (or a snapshot)
describes the table, holding the converters, the Avro field names and the registered schema ids, so the
per-row path does no lookups.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fastavro

from decoders import TupleData
from schemas import AvroMapping, ColumnShape, envelope_schema, field_names, key_schema

_FRAME = struct.Struct(">bI")
_TEXT, _BINARY, _NULL, _UNCHANGED = ord("t"), ord("b"), ord("n"), ord("u")

Converter = Callable[[bytes], Any]


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    """A column as the stream (Relation message) or the catalogs (snapshot) describe it."""

    name: str
    type_oid: int
    typmod: int


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What every event's ``source`` block says about where it came from."""

    version: str
    name: str  # the logical server name: the topic prefix
    db: str


@dataclass(frozen=True, slots=True)
class Position:
    """Where a change sits in the stream; sinks order changes of one key by (commit_lsn, lsn)."""

    commit_lsn: int
    lsn: int
    commit_time_us: int
    xid: int | None
    snapshot: str = "false"  # "true" for snapshot reads, "last" for the last one of a snapshot


class TableCodec:
    """Encodes one table's changes under one version of its schema."""

    def __init__(
        self,
        *,
        schema: str,
        table: str,
        topic: str,
        namespace: str,
        columns: Sequence[ColumnShape],
        mappings: Sequence[AvroMapping],
        key_columns: Sequence[str],
        source: SourceInfo,
        register: Callable[[str, dict[str, Any]], int],
    ) -> None:
        names = [c.name for c in columns]
        missing = [k for k in key_columns if k not in names]
        if missing:
            raise ValueError(f"key column(s) {missing} are not columns of {schema}.{table}")
        self.schema, self.table, self.topic = schema, table, topic
        self.columns = tuple(columns)
        self.field_names = field_names(columns)
        self.key_indexes = tuple(names.index(k) for k in key_columns)
        self.key_field_names = field_names([columns[i] for i in self.key_indexes])
        self._text: tuple[Converter, ...] = tuple(m.from_text for m in mappings)
        self._binary: tuple[Converter | None, ...] = tuple(m.from_binary for m in mappings)
        self.binary_capable = tuple(b is not None for b in self._binary)
        self.key_schema = key_schema(namespace, [columns[i] for i in self.key_indexes])
        self.value_schema = envelope_schema(namespace, columns)
        self._key_parsed = fastavro.parse_schema(self.key_schema)
        self._value_parsed = fastavro.parse_schema(self.value_schema)
        self.key_id = register(f"{topic}-key", self.key_schema)
        self.value_id = register(f"{topic}-value", self.value_schema)
        self._key_frame = _FRAME.pack(0, self.key_id)
        self._value_frame = _FRAME.pack(0, self.value_id)
        self._source_const = {
            "version": source.version,
            "connector": "postgresql",
            "name": source.name,
            "db": source.db,
            "schema": schema,
            "table": table,
        }
        self.truncate_key = self._encode_key(dict.fromkeys(self.key_field_names))

    # --- values -----------------------------------------------------------------------------

    def row(self, tup: TupleData) -> tuple[dict[str, Any], list[str]]:
        """The row as Avro-ready values by field name, and the fields left out as unchanged TOAST."""
        out: dict[str, Any] = {}
        unchanged: list[str] = []
        text, binary, names = self._text, self._binary, self.field_names
        for i, kind in enumerate(tup.kinds):
            raw = tup.values[i]
            if kind == _TEXT:
                out[names[i]] = text[i](raw)  # type: ignore[arg-type]
            elif kind == _BINARY:
                conv = binary[i]
                if conv is None:
                    raise ValueError(f"column {self.columns[i].name!r} arrived in binary but has no binary reader")
                out[names[i]] = conv(raw)  # type: ignore[arg-type]
            else:
                out[names[i]] = None
                if kind == _UNCHANGED:
                    unchanged.append(names[i])
        return out, unchanged

    def row_from_values(self, values: Sequence[Any]) -> dict[str, Any]:
        """A row whose values are already Avro-ready (snapshot path)."""
        return dict(zip(self.field_names, values, strict=True))

    def key_of(self, row: dict[str, Any]) -> bytes:
        names = self.field_names
        return self._encode_key(
            {kn: row[names[i]] for kn, i in zip(self.key_field_names, self.key_indexes, strict=True)}
        )

    def _encode_key(self, record: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        buf.write(self._key_frame)
        fastavro.schemaless_writer(buf, self._key_parsed, record)
        return buf.getvalue()

    # --- envelopes ----------------------------------------------------------------------------

    def envelope(
        self,
        op: str,
        pos: Position,
        *,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str] | None = None,
        now_us: int,
    ) -> bytes:
        ts_ms = pos.commit_time_us // 1000
        record = {
            "before": before,
            "after": after,
            "source": {
                **self._source_const,
                "ts_ms": ts_ms,
                "ts_us": pos.commit_time_us,
                "snapshot": pos.snapshot,
                "sequence": json.dumps([str(pos.commit_lsn), str(pos.lsn)]),
                "txId": pos.xid,
                "lsn": pos.lsn,
                "xmin": None,
                "commit_lsn": pos.commit_lsn,
            },
            "transaction": None,
            "op": op,
            "ts_ms": now_us // 1000,
            "ts_us": now_us,
            "unchanged_toast": unchanged or [],
        }
        buf = io.BytesIO()
        buf.write(self._value_frame)
        fastavro.schemaless_writer(buf, self._value_parsed, record)
        return buf.getvalue()
