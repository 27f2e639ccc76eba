"""Decoding PostgreSQL's logical replication stream (``pgoutput``) into typed messages and values.

Knows nothing of Kafka or Avro; the capture service (``cdc``) composes it with ``schemas``. It does not
talk to the server either: it turns bytes received over the replication protocol into messages
(:func:`parse_copy_data`, :class:`PgOutputDecoder`) and encodes the standby status replies
(:func:`standby_status`); whoever owns the connection moves the bytes.
"""

from decoders._messages import (
    UNCHANGED,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    TypeInfo,
    Unchanged,
    Update,
    format_lsn,
    parse_lsn,
)
from decoders._pgoutput import PgOutputDecoder, fill_unchanged_from_old
from decoders._replication import XLOG_HEADER, XLOG_PAYLOAD_AT, Keepalive, XLogData, parse_copy_data, standby_status

__all__ = [
    "UNCHANGED",
    "XLOG_HEADER",
    "XLOG_PAYLOAD_AT",
    "Begin",
    "BeginPrepare",
    "Column",
    "Commit",
    "CommitPrepared",
    "DecodeError",
    "Delete",
    "Insert",
    "Keepalive",
    "LogicalMessage",
    "Message",
    "Origin",
    "PgOutputDecoder",
    "Prepare",
    "Relation",
    "RollbackPrepared",
    "StreamAbort",
    "StreamCommit",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TupleData",
    "TypeInfo",
    "Unchanged",
    "Update",
    "XLogData",
    "fill_unchanged_from_old",
    "format_lsn",
    "parse_copy_data",
    "parse_lsn",
    "standby_status",
]
