"""Turning decoded row changes into Kafka records: Confluent-framed Avro key and envelope.

One :class:`TableCodec` per (table, relation version): built when a Relation message (or a snapshot)
describes the table, holding the converters, the Avro field names and the registered schema ids, so the
per-row path does no lookups.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    write_long,
    write_string,
)

if TYPE_CHECKING:
    from cdc._catalog import TypeResolver
    from cdc._config import Settings

try:  # the C build of encode_tuple (cdc/_native.pyx); optional: without it the Python one runs
    from cdc import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on how the package was built
    _native = None

_FRAME = struct.Struct(">bI")
_TEXT, _BINARY, _NULL, _UNCHANGED = ord("t"), ord("b"), ord("n"), ord("u")
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
# How encode_tuple writes a binary column: through its converter and field writer, or straight from the frame.
_GENERIC, _ZIGZAG, _UTF8 = 0, 1, 2
_INT_READERS = {code: struct.Struct(">" + code).unpack for code in ("h", "i", "q", "I")}

Converter = Callable[[bytes], Any]


class KeyMissingError(ValueError):
    """A change did not carry its key columns (the capture turns this into a StreamError)."""


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
        # A key column keeps its Value field name in Key (sanitised names are made unique over all columns).
        self.key_field_names = tuple(self.field_names[i] for i in self.key_indexes)
        self._text: tuple[Converter, ...] = tuple(m.from_text for m in mappings)
        self._binary: tuple[Converter | None, ...] = tuple(m.from_binary for m in mappings)
        self.binary_capable = tuple(b is not None for b in self._binary)
        self.key_schema = key_schema(namespace, [columns[i] for i in self.key_indexes], self.key_field_names)
        self.value_schema = envelope_schema(namespace, columns)
        self.key_id = register(f"{topic}-key", self.key_schema)
        self.value_id = register(f"{topic}-value", self.value_schema)
        self._key_frame = _FRAME.pack(0, self.key_id)
        self._value_frame = _FRAME.pack(0, self.value_id)
        # The hot path writes Avro itself (schemas.compile_writer); fastavro would resolve the whole envelope
        # schema for every event, which costs more than everything else per row together.
        self._write_key = compile_writer(self.key_schema)
        value_record = self.value_schema["fields"][0]["type"][1]
        self._write_row = compile_writer(value_record)  # the Value record
        # encode_tuple's plan: per column how to write a binary value, its reader, its field writer.
        self._field_writers = tuple(compile_field_writers(value_record))
        self._fast_kinds = tuple(_fast_kind(m) for m in mappings)
        self._int_readers = tuple(_INT_READERS.get(m.fixed or "") for m in mappings)
        self._plan: Any = None
        if native_enabled():
            self._plan = _native.TuplePlan(
                [_native_wire(m) for m in mappings],
                self._text,
                self._binary,
                self._field_writers,
                self.field_names,
                self.key_indexes,
                self._key_frame,
            )
        self._source_head = _strings(source.version, "postgresql", source.name)
        self._source_db = _strings(source.db)
        self._source_table = _strings(schema, table)
        self._source_info = source
        self._txn_key: tuple[Any, ...] | None = None
        self._txn_parts = (b"", b"", b"", b"")
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

    def encode_tuple(
        self, data: bytes, pos: int, *, copy_modes: bytes | None = None
    ) -> tuple[bytes, bytes | None, list[str], int]:
        """A pgoutput TupleData at ``pos`` of ``data`` straight to Avro (see :meth:`encode_tuple_python`): by
        the C build of this codec when there is one, else by the Python one."""
        if self._plan is not None:
            return self._plan.encode(data, pos, copy_modes)  # type: ignore[no-any-return]
        return self.encode_tuple_python(data, pos, copy_modes=copy_modes)

    def encode_copy(self, data: bytes, copy_modes: bytes) -> tuple[list[bytes], list[bytes]] | None:
        """cdc._snapshot.encode_copy_rows of a chunk by the C build (one call per chunk); None without it."""
        if self._plan is None:
            return None
        packed, _ = self._plan.encode_copy_packed(data, copy_modes)
        return _native.packed_rows(packed)  # type: ignore[no-any-return]

    def encode_copy_packed(self, data: bytes, copy_modes: bytes) -> tuple[bytes, int] | None:
        """:meth:`encode_copy` packed into one bytes object (TuplePlan.encode_copy_packed: per row its record's and
        key's lengths, the record, the key) and the number of rows; None without the C build. What the snapshot
        hands to a producer that produces from C."""
        if self._plan is None:
            return None
        return self._plan.encode_copy_packed(data, copy_modes)  # type: ignore[no-any-return]

    def encode_tuple_python(
        self, data: bytes, pos: int, *, copy_modes: bytes | None = None
    ) -> tuple[bytes, bytes | None, list[str], int]:
        """A pgoutput TupleData at ``pos`` of ``data`` straight to Avro: the capture's fast path.

        Returns the Value record's bytes (what ``write_row(row(tup)[0])`` writes), the framed key (what
        ``key_of`` returns; None when a key column is null or unchanged), the unchanged TOAST fields, and
        the position after the tuple. The key is cut from the record: Key's fields are Value's key fields with
        the same types, so their encodings are the same bytes. Raises on anything malformed or unconvertible
        (struct.error, IndexError, ValueError…) before any side effect: the caller then decodes the frame the
        slow way, which fails with the full diagnosis or succeeds.

        ``copy_modes``: read a row of binary COPY instead (the snapshot): Int16 field count, then per field
        an Int32 length (-1: NULL) and the value, in the format ``copy_modes[i]`` says (ord "b" or "t"). The
        row may have more fields than the table has columns; the position returned is after the columns'.
        """
        if copy_modes is None:
            (ncols,) = _U16(data, pos)
            if ncols != len(self.columns):
                raise ValueError("column count differs from the relation's")
        else:
            ncols = len(self.columns)
            if _I16(data, pos)[0] < ncols:
                raise ValueError("the COPY row has fewer fields than the table columns")
        pos += 2
        out = bytearray()
        marks: list[int] = []
        unchanged: list[str] = []
        fast, ints, writers = self._fast_kinds, self._int_readers, self._field_writers
        for i in range(ncols):
            marks.append(len(out))
            if copy_modes is None:
                kind = data[pos]
                if kind in (_BINARY, _TEXT):
                    (length,) = _U32(data, pos + 1)
                    start = pos + 5
                else:
                    start = length = 0
                    pos += 1
            else:
                (length,) = _I32(data, pos)
                start = pos + 4
                if length < 0:
                    kind, length = _NULL, 0
                    pos = start
                else:
                    kind = copy_modes[i]
            if kind == _BINARY:
                pos = start + length
                raw = data[start:pos]
                if len(raw) != length:
                    raise ValueError("truncated column")
                how = fast[i]
                if how == _ZIGZAG:
                    n = ints[i](raw)[0]  # type: ignore[misc]
                    out.append(2)
                    if 0 <= n < 64:
                        out.append(n << 1)
                    else:
                        write_long(n, out)
                elif how == _UTF8:
                    if not raw.isascii():
                        raw.decode()  # PostgreSQL sends the database's encoding: Avro strings must be UTF-8
                    out.append(2)
                    write_long(length, out)
                    out += raw
                else:
                    conv = self._binary[i]
                    if conv is None:
                        raise ValueError("binary value without a binary reader")
                    writers[i](conv(raw), out)
            elif kind == _NULL:
                out.append(0)
            elif kind == _UNCHANGED:
                out.append(0)
                unchanged.append(self.field_names[i])
            elif kind == _TEXT:
                pos = start + length
                raw = data[start:pos]
                if len(raw) != length:
                    raise ValueError("truncated column")
                writers[i](self._text[i](raw), out)
            else:
                raise ValueError(f"unknown value kind {kind:#04x}")
        marks.append(len(out))
        key = bytearray(self._key_frame)
        for k in self.key_indexes:
            if out[marks[k]] == 0:  # null branch: the key column is missing
                return bytes(out), None, unchanged, pos
            key += out[marks[k] : marks[k + 1]]
        return bytes(out), bytes(key), unchanged, pos

    def missing_key(self, row: dict[str, Any]) -> KeyMissingError:
        names = self.field_names
        missing = [self.columns[i].name for i in self.key_indexes if row[names[i]] is None]
        return KeyMissingError(
            f"a change of {self.schema}.{self.table} arrived without key column(s) {missing}; the table's "
            "REPLICA IDENTITY must include the key (REPLICA IDENTITY DEFAULT or FULL)"
        )

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
        transaction: tuple[str, int, int] | None = None,
    ) -> bytes:
        """The Confluent-framed envelope; the same bytes fastavro writes for :meth:`envelope_record`.

        ``transaction``: (id, total_order, data_collection_order) when transaction metadata is on.
        """
        return self.envelope_bytes(
            op,
            pos,
            before=None if before is None else self.encode_row(before),
            after=None if after is None else self.encode_row(after),
            unchanged=unchanged,
            now_us=now_us,
            transaction=transaction,
        )

    def encode_row(self, row: dict[str, Any]) -> bytes:
        """A row (as :meth:`row` gives it) as the Value record's Avro bytes."""
        out = bytearray()
        self._write_row(row, out)
        return bytes(out)

    def envelope_bytes(
        self,
        op: str,
        pos: Position,
        *,
        before: bytes | None,
        after: bytes | None,
        unchanged: list[str] | None = None,
        now_us: int,
        transaction: tuple[str, int, int] | None = None,
        lsn: int | None = None,
    ) -> bytes:
        """:meth:`envelope` with the rows already encoded (Value records, as :meth:`encode_tuple` gives them).

        ``lsn``: the change's own LSN, when ``pos`` is its transaction's (the fast path makes one per transaction).
        """
        if lsn is None:
            lsn = pos.lsn
        # Everything after the rows but the change's own LSN is the same for a whole transaction.
        key = (pos.commit_lsn, pos.commit_time_us, pos.xid, pos.snapshot, op, now_us)
        if key != self._txn_key:
            self._txn_key = key
            self._txn_parts = self._transaction_parts(op, pos, now_us)
        head, middle, tail, ops = self._txn_parts
        if self._plan is not None:
            return _native.envelope(  # type: ignore[no-any-return]
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

    @property
    def native_plan(self) -> Any:
        """The C build of this codec's tuple encoder (cdc._native.TuplePlan), None without it."""
        return self._plan

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
        empty = self.envelope_bytes("r", pos, before=None, after=b"", now_us=now_us)
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
        pos: Position,
        *,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unchanged: list[str] | None = None,
        now_us: int,
        transaction: tuple[str, int, int] | None = None,
    ) -> dict[str, Any]:
        """The envelope as a plain record (what a consumer decodes; tests encode it with fastavro)."""
        src = self._source_info
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


def _fast_kind(mapping: AvroMapping) -> int:
    """How encode_tuple_python writes a binary value of this mapping (see _GENERIC, _ZIGZAG, _UTF8)."""
    if mapping.fixed in _INT_READERS and mapping.schema in ("int", "long"):
        return _ZIGZAG  # an Avro int/long that is the send format's integer as is
    if mapping.wire == "text":
        return _UTF8  # text, varchar, …: the send format is the string's bytes
    return _GENERIC


def _native_wire(mapping: AvroMapping) -> tuple[int, int]:
    """(how, scale) for the C encoder: which of its fast cases this mapping's send format takes, if any."""
    name, _, scale = (mapping.wire or mapping.fixed or "").partition(":")
    return _native.WIRES.get(name, 0), int(scale or 0)


def native_module() -> Any | None:
    """The C build (cdc._native) when it is there and CDC_PURE_PYTHON does not turn it off, else None."""
    return _native if native_enabled() else None


def native_enabled() -> bool:
    """Whether codecs use the C encoder: it is built, and CDC_PURE_PYTHON is not set (a switch to rule it out
    when chasing a suspected encoding difference; the bytes must be the same either way)."""
    return _native is not None and os.environ.get("CDC_PURE_PYTHON", "") in ("", "0")


def _strings(*values: str) -> bytes:
    out = bytearray()
    for v in values:
        write_string(v, out)
    return bytes(out)


def build_codec(
    settings: Settings,
    types: TypeResolver,
    schema: str,
    table: str,
    columns: Sequence[ColumnSpec],
    *,
    key_columns: Sequence[str],
    source: SourceInfo,
    register: Callable[[str, dict[str, Any]], int],
) -> TableCodec:
    """The codec of one version of a table: the one place column types become Avro mappings and schemas
    (the capture's stream and snapshot, and `cdc verify`'s reading of the source, all go through it)."""
    shapes, mappings = [], []
    for col in columns:
        pgtype = types.resolve(col.type_oid)
        mapping = avro_mapping(pgtype, col.typmod)
        mappings.append(mapping)
        shapes.append(ColumnShape(col.name, pgtype, col.typmod, mapping.schema))
    return TableCodec(
        schema=schema,
        table=table,
        topic=settings.topic_for(schema, table),
        namespace=avro_namespace(settings.kafka.topic_prefix, schema, table),
        columns=shapes,
        mappings=mappings,
        key_columns=key_columns,
        source=source,
        register=register,
    )
