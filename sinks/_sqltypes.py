"""The ``sql`` sink's type mapping, written once: an Avro field's column type in SQL, and its values both ways
(document form to what the database stores, and back to document form for ``cdc verify``).

=========================================  ============================  ==========================
Avro (PostgreSQL)                          PostgreSQL target             SQLite target
=========================================  ============================  ==========================
boolean                                    boolean                       BOOLEAN (0/1)
int (smallint, integer)                    integer                       INTEGER
long (bigint, oid, …)                      bigint                        BIGINT
float (real) / double (double precision)   real / double precision       REAL
decimal, with "NaN" (numeric(p,s))         numeric(p,s)                  TEXT, exact ("12.50")
string (text, varchar, uuid, json, enums)  text                          TEXT
bytes, fixed (bytea)                       bytea                         BLOB
date                                       date                          DATE (ISO text)
timestamp-micros (timestamptz)             timestamp with time zone      DATETIME (ISO text, UTC)
local-timestamp-micros (timestamp)         timestamp without time zone   DATETIME (ISO text)
time-micros (time)                         time                          TIME (ISO text)
record, array, map, other unions           json                          JSON (text)
=========================================  ============================  ==========================

A value the target type cannot hold is refused with the reason, and goes to the dead-letter topic (the topic
keeps it): PostgreSQL's date and timestamp ``infinity`` and dates outside years 1-9999 (Python's date, which
SQLAlchemy's drivers convert through, has neither), a time of ``24:00:00``, and NaN in a float column of
SQLite (which would store NULL).
"""

from __future__ import annotations

import base64
import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from sinks._values import Names

Convert = Callable[[Any], Any]
DIALECTS = ("postgresql", "sqlite")  # tested; any other SQLAlchemy dialect is refused (sinks._sql.check_dialect)


class UnstorableError(ValueError):
    """A value the target column cannot hold: the change goes to the dead-letter topic with this reason."""


@dataclass(frozen=True)
class ColumnKind:
    """What a column holds, from its Avro type: ``kind`` is one of the rows of the module's table."""

    kind: str
    precision: int | None = None
    scale: int | None = None

    def to_json(self) -> list[Any]:
        return [self.kind, self.precision, self.scale]

    @classmethod
    def from_json(cls, value: list[Any]) -> ColumnKind:
        return cls(value[0], value[1], value[2])


_SIMPLE = {"boolean": "boolean", "int": "int", "long": "long", "float": "float", "double": "double"}
_LOGICAL = {
    ("int", "date"): "date",
    ("long", "timestamp-micros"): "timestamp",
    ("long", "local-timestamp-micros"): "local_timestamp",
    ("long", "time-micros"): "time",
}


def column_kind(avro: Any, names: Names, namespace: str | None = None) -> ColumnKind:
    """The kind of column an Avro field's type needs (``null`` branches aside: every data column is nullable)."""
    avro = names.resolve(avro, namespace)
    if isinstance(avro, list):
        real = [b for b in avro if b != "null"]
        if len(real) == 1:
            return column_kind(real[0], names, namespace)
        kinds = [column_kind(b, names, namespace) for b in real]
        decimal = [k for k in kinds if k.kind == "decimal"]
        if len(decimal) == 1 and all(k.kind in ("decimal", "text") for k in kinds):
            return decimal[0]  # numeric(p,s): the string branch carries NaN and ±Infinity
        return ColumnKind("json")
    if isinstance(avro, str):
        avro = {"type": avro}
    kind, logical = avro["type"], avro.get("logicalType")
    if isinstance(kind, (dict, list)):
        return column_kind(kind, names, namespace)
    if logical == "decimal" and kind in ("bytes", "fixed"):
        return ColumnKind("decimal", int(avro["precision"]), int(avro.get("scale", 0)))
    if (kind, logical) in _LOGICAL:
        return ColumnKind(_LOGICAL[kind, logical])
    if kind in _SIMPLE:
        return ColumnKind(_SIMPLE[kind])
    if kind in ("string", "enum"):
        return ColumnKind("text")
    if kind in ("bytes", "fixed"):
        return ColumnKind("bytes")
    if kind in ("record", "array", "map"):
        return ColumnKind("json")
    return column_kind(names.resolve(kind, namespace), names, namespace)  # a named type's reference


def sql_type(kind: ColumnKind, dialect: str) -> sa.types.TypeEngine[Any]:
    """The column type of ``kind`` in ``dialect``."""
    k = kind.kind
    if k == "decimal":
        return sa.Numeric(kind.precision, kind.scale, asdecimal=True) if dialect == "postgresql" else sa.Text()
    simple: dict[str, sa.types.TypeEngine[Any]] = {
        "boolean": sa.Boolean(),
        "int": sa.Integer(),
        "long": sa.BigInteger(),
        "float": sa.REAL(),
        "double": sa.Double(),
        "text": sa.Text(),
        "bytes": sa.LargeBinary(),
        "date": sa.Date(),
        "timestamp": sa.DateTime(timezone=dialect == "postgresql"),
        "local_timestamp": sa.DateTime(),
        "time": sa.Time(),
        "json": sa.JSON(none_as_null=True),  # a null column value is SQL NULL, not JSON null
    }
    return simple[k]


def to_sql(kind: ColumnKind, dialect: str) -> Convert:
    """Document form to the value the column stores; raises :class:`UnstorableError`."""
    k = kind.kind
    if k in ("float", "double"):
        return _float_in(nan=dialect == "postgresql")
    if k == "decimal":
        return _nullsafe(Decimal) if dialect == "postgresql" else _nullsafe(str)
    if k == "bytes":
        return _nullsafe(base64.b64decode)
    if k == "date":
        return _nullsafe(_date_in)
    if k == "timestamp":
        return _nullsafe(lambda v: _timestamp_in(v, utc=dialect == "postgresql"))
    if k == "local_timestamp":
        return _nullsafe(lambda v: _timestamp_in(v, utc=False))
    if k == "time":
        return _nullsafe(_time_in)
    return _ident


def to_doc(kind: ColumnKind) -> Convert:
    """A stored value, as the database driver returns it, to document form (sinks._values)."""
    k = kind.kind
    if k in ("float", "double"):
        return _nullsafe(_float_out)
    if k == "decimal":
        return _nullsafe(_decimal_out)
    if k == "bytes":
        return _nullsafe(lambda v: base64.b64encode(bytes(v)).decode("ascii"))
    if k == "date":
        return _nullsafe(lambda v: v.isoformat())
    if k == "timestamp":
        return _nullsafe(lambda v: _timestamp_out(v, "Z"))
    if k == "local_timestamp":
        return _nullsafe(lambda v: _timestamp_out(v, ""))
    if k == "time":
        return _nullsafe(lambda v: v.isoformat(timespec="microseconds"))
    if k == "boolean":
        return _nullsafe(bool)
    return _ident


def _float_in(*, nan: bool) -> Convert:
    def convert(value: Any) -> Any:
        if value is None:
            return None
        number = float(value)  # "NaN", "Infinity", "-Infinity" in document form
        if math.isnan(number) and not nan:
            raise UnstorableError("NaN in a float column: SQLite would store NULL")
        return number

    return convert


def _float_out(value: float) -> Any:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _decimal_out(value: Any) -> str:
    return format(value, "f") if isinstance(value, Decimal) and value.is_finite() else str(value)


def _date_in(value: Any) -> dt.date:
    if not isinstance(value, str) or value.endswith("infinity"):
        raise UnstorableError(f"date {value!r} (PostgreSQL's infinity, or outside years 1-9999) has no SQL date here")
    return dt.date.fromisoformat(value)


def _timestamp_in(value: Any, *, utc: bool) -> dt.datetime:
    if not isinstance(value, str) or value.endswith("infinity"):
        raise UnstorableError(f"timestamp {value!r} (infinity, or outside years 1-9999) has no SQL timestamp here")
    if value.endswith("Z"):
        moment = dt.datetime.fromisoformat(value[:-1]).replace(tzinfo=dt.UTC)
        return moment if utc else moment.replace(tzinfo=None)  # SQLite keeps UTC as naive text
    return dt.datetime.fromisoformat(value)


def _timestamp_out(value: dt.datetime, suffix: str) -> str:
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return value.isoformat(timespec="microseconds") + suffix  # strftime's %Y drops year 1's zeros


def _time_in(value: Any) -> dt.time:
    if isinstance(value, str) and value.startswith("24:"):
        raise UnstorableError(f"time {value!r}: a SQL time through Python's drivers ends at 23:59:59.999999")
    return dt.time.fromisoformat(value)


def _ident(value: Any) -> Any:
    return value


def _nullsafe(convert: Convert) -> Convert:
    def run(value: Any) -> Any:
        if value is None:
            return None
        try:
            return convert(value)
        except UnstorableError:
            raise
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise UnstorableError(f"{value!r}: {exc}") from exc

    return run
