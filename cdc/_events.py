"""Turning decoded row changes into Kafka records: Confluent-framed Avro key and envelope.

One :class:`TableCodec` per (table, relation version): built when a Relation message (or a snapshot)
describes the table, holding the converters, the Avro field names and the registered schema ids, so the
per-row path does no lookups.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cdc._deadletter import TableColumns
from cdc._encoder import (
    REPLICA_IDENTITY_HINT,
    EncoderSpec,
    KeyMissingError,
    PythonRowEncoder,
    RowEncoder,
    make_encoder,
    native_module,
)
from decoders import TupleData
from schemas import (
    AvroMapping,
    ColumnShape,
    avro_mapping,
    avro_namespace,
    compile_field_writers,
    compile_writer,
    envelope_schema,
    field_names,
    key_schema,
    masked,
    write_long,
    write_string,
)

if TYPE_CHECKING:
    from cdc._config import Settings
    from schemas import PgType

_FRAME = struct.Struct(">bI")
_TEXT, _BINARY, _UNCHANGED = ord("t"), ord("b"), ord("u")

Converter = Callable[[bytes], Any]


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    """A column as the stream (Relation message) or the catalogs (snapshot) describe it."""

    name: str
    type_oid: int
    typmod: int
    attnum: int | None = None  # its number in pg_attribute (what a rename keeps), when known


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


@dataclass(frozen=True, slots=True)
class Stamp:
    """What an event says around its rows: where its change sits (``pos``), when the capture wrote it
    (``now_us``: the event's ts_ms/ts_us, one per source transaction) and, with transaction metadata on, its place
    in its transaction (id, total_order, data_collection_order)."""

    pos: Position
    now_us: int
    transaction: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class TableShape:
    """One version of a table as its events describe it: its names, topic, columns, their Avro mappings, key."""

    schema: str
    table: str
    topic: str
    namespace: str  # the Avro namespace of its schemas
    columns: Sequence[ColumnShape]
    mappings: Sequence[AvroMapping]
    key_columns: Sequence[str]
    relid: int | None = None  # the table's oid, when known (see schemas.ColumnHistory)
    registered_key: Mapping[str, Any] | None = None  # the key subject's latest schema (see schemas.key_schema)


class TableCodec:
    """Encodes one table's changes under one version of its schema."""

    def __init__(
        self, shape: TableShape, *, source: SourceInfo, register: Callable[[str, dict[str, Any]], int]
    ) -> None:
        schema, table, topic, namespace = shape.schema, shape.table, shape.topic, shape.namespace
        columns, mappings = shape.columns, shape.mappings
        names = [c.name for c in columns]
        missing = [k for k in shape.key_columns if k not in names]
        if missing:
            raise ValueError(f"key column(s) {missing} are not columns of {schema}.{table}")
        self.schema, self.table, self.topic = schema, table, topic
        self.columns = tuple(columns)
        self.field_names = field_names(columns)
        self.key_indexes = tuple(names.index(k) for k in shape.key_columns)
        # A key column keeps its Value field name in Key (sanitised names are made unique over all columns).
        self.key_field_names = tuple(self.field_names[i] for i in self.key_indexes)
        self._text: tuple[Converter, ...] = tuple(m.from_text for m in mappings)
        self._binary: tuple[Converter | None, ...] = tuple(m.from_binary for m in mappings)
        self.binary_capable = tuple(b is not None for b in self._binary)
        self.key_schema = key_schema(
            namespace,
            [columns[i] for i in self.key_indexes],
            self.key_field_names,
            registered=shape.registered_key,
        )
        self.value_schema = envelope_schema(namespace, columns, shape.relid)
        self.key_id = register(f"{topic}-key", self.key_schema)
        self.value_id = register(f"{topic}-value", self.value_schema)
        self._key_frame = _FRAME.pack(0, self.key_id)
        self._value_frame = _FRAME.pack(0, self.value_id)
        # Rows from the wire are encoded by the table's RowEncoder (cdc._encoder); these dict writers serve the
        # events made of decoded values (truncates, the re-snapshot's deletes, the tests' oracle).
        self._write_key = compile_writer(self.key_schema)
        value_record = self.value_schema["fields"][0]["type"][1]
        self._write_row = compile_writer(value_record)
        self.encoder, self.python_encoder = self._encoders(mappings, compile_field_writers(value_record))
        self._native = native_module()  # the C envelope, when there is a C build
        self._source_head = _strings(source.version, "postgresql", source.name)
        self._source_db = _strings(source.db)
        self._source_table = _strings(schema, table)
        self._source_info = source
        self._txn_key: tuple[Any, ...] | None = None  # what _txn_parts were made for
        self._txn_parts = (b"", b"", b"", b"")
        self.truncate_key = self._encode_key(dict.fromkeys(self.key_field_names))
        self.described = TableColumns(
            f"{schema}.{table}", tuple(names), tuple(c.pgtype.oid for c in columns), self.key_indexes
        )

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

    def binary_value(self, index: int, raw: bytes) -> Any:
        """Column ``index``'s value from its binary (send format) bytes, as the events carry it."""
        convert = self._binary[index]
        if convert is None:
            raise ValueError(f"column {self.columns[index].name!r} has no binary reader")
        return convert(raw)

    def key_of(self, row: dict[str, Any]) -> bytes:
        names = self.field_names
        record = {kn: row[names[i]] for kn, i in zip(self.key_field_names, self.key_indexes, strict=True)}
        if None in record.values():
            # An all-null key means "truncate"; a row's key must never look like one (or be partial).
            raise self.missing_key(row)
        return self._encode_key(record)

    def _encode_key(self, record: dict[str, Any]) -> bytes:
        out = bytearray(self._key_frame)
        self._write_key(record, out)
        return bytes(out)

    def _encoders(
        self, mappings: Sequence[AvroMapping], writers: Sequence[Callable[[Any, bytearray], None]]
    ) -> tuple[RowEncoder, PythonRowEncoder]:
        """The table's row encoder (the C one when built) and the Python one, which takes what the C one
        refuses and names what is wrong with a row neither takes."""
        spec = EncoderSpec(
            table=f"{self.schema}.{self.table}",
            columns=tuple(c.name for c in self.columns),
            field_names=self.field_names,
            mappings=tuple(mappings),
            field_writers=tuple(writers),
            key_indexes=self.key_indexes,
            key_frame=self._key_frame,
        )
        encoder = make_encoder(spec)
        return encoder, encoder if isinstance(encoder, PythonRowEncoder) else PythonRowEncoder(spec)

    def missing_key(self, row: dict[str, Any]) -> KeyMissingError:
        names = self.field_names
        missing = [self.columns[i].name for i in self.key_indexes if row[names[i]] is None]
        return KeyMissingError(f"{self.schema}.{self.table}", missing, REPLICA_IDENTITY_HINT)

    # --- envelopes ----------------------------------------------------------------------------

    def envelope(
        self,
        op: str,
        stamp: Stamp,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str] | None = None,
    ) -> bytes:
        """The Confluent-framed envelope of decoded rows; the same bytes fastavro writes for
        :meth:`envelope_record`."""
        encode = self.encode_row
        return self.envelope_bytes(
            op, stamp, None if before is None else encode(before), None if after is None else encode(after), unchanged
        )

    def encode_row(self, row: dict[str, Any]) -> bytes:
        """A row (as :meth:`row` gives it) as the Value record's Avro bytes."""
        out = bytearray()
        self._write_row(row, out)
        return bytes(out)

    def envelope_bytes(  # noqa: PLR0917 - the hot path: positional, no per-change object
        self,
        op: str,
        stamp: Stamp,
        before: bytes | None,
        after: bytes | None,
        unchanged: list[str] | None = None,
        lsn: int | None = None,
    ) -> bytes:
        """:meth:`envelope` with the rows already encoded (Value records, as the row encoder gives them).

        ``lsn``: the change's own LSN, when ``stamp.pos`` is its transaction's (one per transaction).
        """
        pos, transaction = stamp.pos, stamp.transaction
        if lsn is None:
            lsn = pos.lsn
        # Everything after the rows but the change's own LSN is the same for a whole transaction.
        key = (pos.commit_lsn, pos.commit_time_us, pos.xid, pos.snapshot, op, stamp.now_us)
        if key != self._txn_key:
            self._txn_key = key
            self._txn_parts = self._transaction_parts(op, pos, stamp.now_us)
        head, middle, tail, ops = self._txn_parts
        if self._native is not None:
            return self._native.envelope(  # type: ignore[no-any-return]
                self._value_frame, before, after, head, pos.commit_lsn, lsn, middle, tail, transaction, ops, unchanged
            )
        out = bytearray(self._value_frame)
        for row in (before, after):  # ["null", Value]
            if row is None:
                out.append(0)
            else:
                out.append(2)
                out += row
        out += head
        write_string(f'["{pos.commit_lsn}","{lsn}"]', out)
        out += middle
        write_long(lsn, out)
        out += tail
        if transaction is None:
            out.append(0)
        else:
            out.append(2)
            write_string(transaction[0], out)
            write_long(transaction[1], out)
            write_long(transaction[2], out)
        out += ops
        if unchanged:
            write_long(len(unchanged), out)
            for name in unchanged:
                write_string(name, out)
        out.append(0)
        return bytes(out)

    def use_python(self) -> None:
        """Encode with the Python implementations only, the C build aside: what the tests compare the C ones
        with (CDC_PURE_PYTHON does the same for a whole process)."""
        self.encoder, self._native = self.python_encoder, None

    @property
    def native_plan(self) -> Any:
        """The C build of this codec's row encoder (cdc._native.TuplePlan), None without it."""
        return None if isinstance(self.encoder, PythonRowEncoder) else self.encoder

    def event_parts(self, pos: Position, now_us: int) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
        """The constant parts of this table's "c", "u" and "d" events at ``pos`` (its transaction's) without a
        transaction block, as :meth:`envelope_bytes` writes them: ``frame``, the before and after rows, ``head``,
        the sequence string of the commit LSN and the change's LSN, ``middle``, the change's LSN as a long, then
        ``tail_c``, ``tail_u`` or ``tail_d`` (up to the unchanged columns) — cdc._native.DirectProducer._change
        writes them so."""
        head, middle, tail, ops_c = self._transaction_parts("c", pos, now_us)
        ops_u = self._transaction_parts("u", pos, now_us)[3]
        ops_d = self._transaction_parts("d", pos, now_us)[3]
        no_transaction = tail + b"\x00"
        return self._value_frame, head, middle, no_transaction + ops_c, no_transaction + ops_u, no_transaction + ops_d

    def read_event_frame(self, pos: Position, now_us: int) -> tuple[bytes, bytes]:
        """The bytes around the Value record of a snapshot read ("r": no before, the row as after): the event
        is ``prefix + record + suffix``, as :meth:`envelope_bytes` writes it, for every row read at ``pos``."""
        empty = self.envelope_bytes("r", Stamp(pos, now_us), None, b"")
        cut = len(self._value_frame) + 2  # the frame, before's null branch, after's Value branch (2: index 1)
        return empty[:cut], empty[cut:]

    def _transaction_parts(self, op: str, pos: Position, now_us: int) -> tuple[bytes, bytes, bytes, bytes]:
        head = bytearray(self._source_head)
        write_long(pos.commit_time_us // 1000, head)
        head.append(0)  # snapshot: ["string", "null"] branch 0
        write_string(pos.snapshot, head)
        head += self._source_db
        head.append(2)  # sequence: ["null", "string"], the string follows
        middle = bytearray([2])
        write_long(pos.commit_time_us, middle)
        middle += self._source_table
        if pos.xid is None:
            middle.append(0)
        else:
            middle.append(2)
            write_long(pos.xid, middle)
        middle.append(2)  # lsn: ["null", "long"], the long follows
        tail = bytearray([0, 2])  # xmin null; commit_lsn present
        write_long(pos.commit_lsn, tail)
        ops = bytearray()  # after the transaction block
        write_string(op, ops)
        ops.append(2)
        write_long(now_us // 1000, ops)
        ops.append(2)
        write_long(now_us, ops)
        return bytes(head), bytes(middle), bytes(tail), bytes(ops)

    def envelope_record(
        self,
        op: str,
        stamp: Stamp,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str] | None = None,
    ) -> dict[str, Any]:
        """The envelope as a plain record (what a consumer decodes; tests encode it with fastavro)."""
        src, pos, transaction, now_us = self._source_info, stamp.pos, stamp.transaction, stamp.now_us
        return {
            "before": before,
            "after": after,
            "source": {
                "version": src.version,
                "connector": "postgresql",
                "name": src.name,
                "db": src.db,
                "schema": self.schema,
                "table": self.table,
                "ts_ms": pos.commit_time_us // 1000,
                "ts_us": pos.commit_time_us,
                "snapshot": pos.snapshot,
                "sequence": f'["{pos.commit_lsn}","{pos.lsn}"]',
                "txId": pos.xid,
                "lsn": pos.lsn,
                "xmin": None,
                "commit_lsn": pos.commit_lsn,
            },
            "transaction": None
            if transaction is None
            else {"id": transaction[0], "total_order": transaction[1], "data_collection_order": transaction[2]},
            "op": op,
            "ts_ms": now_us // 1000,
            "ts_us": now_us,
            "unchanged_toast": unchanged or [],
        }


def _strings(*values: str) -> bytes:
    out = bytearray()
    for v in values:
        write_string(v, out)
    return bytes(out)


class TypeSource(Protocol):
    """Where a column's type oid becomes its description: the catalogs (cdc._catalog.TypeResolver), or types
    resolved earlier and carried along (cdc._expected reads a table's rows in tasks with no catalog access)."""

    def resolve(self, oid: int) -> PgType: ...


def table_shape(
    settings: Settings,
    types: TypeSource,
    schema: str,
    table: str,
    *,
    columns: Sequence[ColumnSpec],
    key: Sequence[str],
) -> TableShape:
    """One version of a table as its events describe it: the one place column types become Avro mappings (the
    capture's stream and snapshot, and `cdc verify`'s reading of the source, all go through it)."""
    shapes, mappings = [], []
    masks = settings.masks_of(schema, table)
    key_bytes = settings.source.mask_key_bytes() if "hash" in masks.values() else None
    for col in columns:
        pgtype = types.resolve(col.type_oid)
        mapping = avro_mapping(pgtype, col.typmod)
        if col.name in masks:
            mapping = masked(mapping, masks[col.name], key_bytes)
        mappings.append(mapping)
        shapes.append(ColumnShape(col.name, pgtype, col.typmod, mapping.schema, attnum=col.attnum))
    return TableShape(
        schema=schema,
        table=table,
        topic=settings.topic_for(schema, table),
        namespace=avro_namespace(settings.kafka.topic_prefix, schema, table),
        columns=shapes,
        mappings=mappings,
        key_columns=key,
    )
