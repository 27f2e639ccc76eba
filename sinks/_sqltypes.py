"""The ``sql`` sink's type mapping, written once: an Avro field's column type in SQL, and its values both ways
(document form to what the database stores, and back to document form for ``cdc verify``).

=====================================  ===========================  ======================  ==========================
Avro (PostgreSQL)                      PostgreSQL target            SQLite target           MariaDB target
=====================================  ===========================  ======================  ==========================
boolean                                boolean                      BOOLEAN (0/1)           BOOLEAN (0/1)
int (smallint, integer)                integer                      INTEGER                 INTEGER
long (bigint, oid, …)                  bigint                       BIGINT                  BIGINT
float (real), double (double prec.)    real, double precision       REAL                    DOUBLE (finite only)
decimal, with "NaN" (numeric(p,s))     numeric(p,s)                 TEXT, exact ("12.50")   DECIMAL(p,s) (finite;
                                                                                            p <= 65, s <= 30), else
                                                                                            LONGTEXT, exact
string (text, varchar, uuid, json)     text                         TEXT                    LONGTEXT
bytes, fixed (bytea)                   bytea                        BLOB                    LONGBLOB
date                                   date                         DATE (document form)    DATE (years 1000-9999)
timestamp-micros (timestamptz)         timestamp with time zone     DATETIME (doc. form)    DATETIME(6), UTC (1000-)
local-timestamp-micros (timestamp)     timestamp without time zone  DATETIME (doc. form)    DATETIME(6) (1000-9999)
time-micros (time)                     time                         TIME (document form)    TIME(6)
record, array, map, other unions       json                         JSON (text)             JSON (LONGTEXT, checked)
=====================================  ===========================  ======================  ==========================

Every value PostgreSQL can hold is kept, the edges too: on a PostgreSQL target dates and times cross as
PostgreSQL's own text (``infinity``, BC dates, years past 9999, ``24:00:00``; sessions in UTC with ISO dates),
never through Python's ``date``, which has none of them; SQLite, which has no date types, keeps the document
form itself (``2024-02-29T23:59:59.123456Z``, which its date functions read), and a float's NaN or infinity as
its document form's text (SQLite would store a NaN as NULL). MariaDB's types are narrower: a value outside them
(a float's NaN or infinity, a numeric's NaN, a date or timestamp that is infinite, BC or before year 1000) is
refused with the reason, and its change goes to the dead-letter topic, never stored as something else.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from sinks._delta_widen import widens
from sinks._values import Names

Convert = Callable[[Any], Any]
DIALECTS = (
    "postgresql",
    "sqlite",
    "mariadb",
)  # tested; any other SQLAlchemy dialect is refused (sinks._sql.check_dialect)


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


_SPARK_DDL = {"int": "int", "long": "bigint", "float": "float", "double": "double"}
_SPARK_DDL.update(local_timestamp="timestamp_ntz", timestamp="timestamp")


def widens_kind(old: ColumnKind, new: ColumnKind) -> bool:
    """Whether a column of kind ``old`` moved to ``new`` holds every value it held: the warehouse's rule
    (sinks._delta_widen), on the Spark types of the same Avro types."""
    return widens(_spark_ddl(old), _spark_ddl(new))


def _spark_ddl(kind: ColumnKind) -> str:
    if kind.kind == "decimal":
        return f"decimal({kind.precision},{kind.scale})"
    return _SPARK_DDL.get(kind.kind, kind.kind)


def sql_type(kind: ColumnKind, dialect: str) -> sa.types.TypeEngine[Any]:
    """The column type of ``kind`` in ``dialect``."""
    k = kind.kind
    if dialect == "mariadb":
        return _mariadb_type(kind)
    if k == "decimal":
        return sa.Numeric(kind.precision, kind.scale, asdecimal=True) if dialect == "postgresql" else sa.Text()
    if dialect == "sqlite" and k in _SQLITE_DECLARED:
        return _Declared(_SQLITE_DECLARED[k])  # no conversion: the document form is stored as it is
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
    if dialect == "mariadb":
        return _mariadb_in(kind)
    if dialect == "sqlite" and k in _SQLITE_DECLARED:
        return _ident
    if k in ("float", "double"):
        return _nullsafe(float)  # "NaN", "Infinity", "-Infinity" in document form
    if k == "decimal":
        return _nullsafe(Decimal) if dialect == "postgresql" else _nullsafe(str)
    if k == "bytes":
        return _nullsafe(base64.b64decode)
    if k == "date":
        return _nullsafe(_pg_date_in)
    if k in ("timestamp", "local_timestamp"):
        return _nullsafe(lambda v: _pg_timestamp_in(v, tz=k == "timestamp"))
    if k == "time":
        return _nullsafe(str)
    return _ident


def to_doc(kind: ColumnKind, dialect: str = "postgresql") -> Convert:
    """A stored value, as the database driver returns it, to document form (sinks._values). Dates and times
    come as document form already: PostgreSQL's by the loaders :func:`register_pg_loaders` installs, SQLite's
    as stored; MariaDB's as Python's date, datetime and timedelta."""
    k = kind.kind
    if dialect == "mariadb" and k in _MARIADB_OUT:
        return _nullsafe(_MARIADB_OUT[k])
    if k in ("float", "double"):
        return _nullsafe(_float_out)
    if k == "decimal":
        return _nullsafe(_decimal_out)
    if k == "bytes":
        return _nullsafe(lambda v: base64.b64encode(bytes(v)).decode("ascii"))
    if k == "boolean":
        return _nullsafe(bool)
    return _ident


def _float_out(value: Any) -> Any:
    if isinstance(value, str):  # SQLite keeps NaN and the infinities as their document form's text
        return value
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _decimal_out(value: Any) -> str:
    return format(value, "f") if isinstance(value, Decimal) and value.is_finite() else str(value)


_SQLITE_DECLARED = {"float": "REAL", "double": "REAL", "date": "DATE", "timestamp": "DATETIME",
                    "local_timestamp": "DATETIME", "time": "TIME"}  # fmt: skip


class _Declared(sa.types.UserDefinedType[Any]):
    """A column declared with a type name and no conversion either way (SQLite's flexible typing)."""

    cache_ok = True

    def __init__(self, name: str) -> None:
        self.name = name

    def get_col_spec(self, **_kw: Any) -> str:
        return self.name


# --- MariaDB (docs: the module's) ----------------------------------------------------------------------------

_MARIADB_MAX_PRECISION, _MARIADB_MAX_SCALE = 65, 30  # DECIMAL's limits (MySQL's scale limit; MariaDB's is 38)


def _mariadb_decimal(kind: ColumnKind) -> bool:
    """Whether a decimal column is a DECIMAL in MariaDB (else LONGTEXT, exact)."""
    return (kind.precision or 0) <= _MARIADB_MAX_PRECISION and (kind.scale or 0) <= _MARIADB_MAX_SCALE


def _mariadb_type(kind: ColumnKind) -> sa.types.TypeEngine[Any]:
    from sqlalchemy.dialects import mysql

    k = kind.kind
    if k == "decimal":
        return sa.Numeric(kind.precision, kind.scale, asdecimal=True) if _mariadb_decimal(kind) else mysql.LONGTEXT()
    types: dict[str, sa.types.TypeEngine[Any]] = {
        "boolean": sa.Boolean(),
        "int": sa.Integer(),
        "long": sa.BigInteger(),
        # A real's value is exact in a DOUBLE, and reads back as the same Python float (a FLOAT would not);
        # asdecimal=False: SQLAlchemy's default makes a Decimal of 10 places of it.
        "float": mysql.DOUBLE(asdecimal=False),
        "double": mysql.DOUBLE(asdecimal=False),
        "text": mysql.LONGTEXT(),
        "bytes": mysql.LONGBLOB(),
        "date": sa.Date(),
        "timestamp": mysql.DATETIME(fsp=6),
        "local_timestamp": mysql.DATETIME(fsp=6),
        # Declared, not SQLAlchemy's TIME: that one makes a datetime.time of the value, which has no 24:00:00.
        "time": _Declared("TIME(6)"),
        "json": sa.JSON(none_as_null=True),
    }
    return types[k]


def _mariadb_in(kind: ColumnKind) -> Convert:
    k = kind.kind
    if k in ("float", "double"):
        return _nullsafe(_finite_float)
    if k == "decimal":
        return _nullsafe(_finite_decimal) if _mariadb_decimal(kind) else _nullsafe(str)
    if k == "bytes":
        return _nullsafe(base64.b64decode)
    if k == "date":
        return _nullsafe(_mariadb_date_in)
    if k in ("timestamp", "local_timestamp"):
        return _nullsafe(_mariadb_datetime_in)
    if k == "time":
        return _nullsafe(str)
    return _ident


def _finite_float(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise UnstorableError(f"{value!r}: MariaDB's DOUBLE holds no NaN or infinity")
    return number


def _finite_decimal(value: Any) -> Decimal:
    number = Decimal(value)
    if not number.is_finite():
        raise UnstorableError(f"{value!r}: MariaDB's DECIMAL holds no NaN or infinity")
    return number


_ISO_DATE = re.compile(r"^(\d{4})-\d\d-\d\d$")
_ISO_DATETIME = re.compile(r"^(\d{4}-\d\d-\d\d)T(\d\d:\d\d:\d\d(?:\.\d+)?)Z?$")


def _mariadb_date_in(value: Any) -> str:
    m = _ISO_DATE.match(value) if isinstance(value, str) else None
    if m is None or int(m.group(1)) < 1000:
        raise UnstorableError(f"{value!r}: MariaDB's DATE holds years 1000 to 9999 only")
    return str(value)


def _mariadb_datetime_in(value: Any) -> str:
    m = _ISO_DATETIME.match(value) if isinstance(value, str) else None
    if m is None or int(m.group(1)[:4]) < 1000:
        raise UnstorableError(f"{value!r}: MariaDB's DATETIME holds years 1000 to 9999 only")
    return f"{m.group(1)} {m.group(2)}"


def _mariadb_time_out(value: Any) -> str:
    micros = value.days * _DAY_US + value.seconds * 1_000_000 + value.microseconds  # PyMySQL's timedelta
    return _time_text(micros)


_MARIADB_OUT: dict[str, Convert] = {
    "date": lambda v: v.isoformat(),
    "timestamp": lambda v: v.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    "local_timestamp": lambda v: v.strftime("%Y-%m-%dT%H:%M:%S.%f"),
    "time": _mariadb_time_out,
}


# --- PostgreSQL's dates and times as its own text (docs: the module's) --------------------------------------

_DAY_US = 86_400_000_000
_PG_DATE = re.compile(r"^(\d+)-(\d\d)-(\d\d)(?: (\d\d:\d\d:\d\d)(?:\.(\d+))?)?(\+00)?( BC)?$")


def civil(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day number since 1970-01-01, proleptic Gregorian; year 0 is 1 BC."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, doy - (153 * mp + 2) // 5 + 1


def day_number(year: int, month: int, day: int) -> int:
    """The inverse of :func:`civil`."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month - 3 if month > 2 else month + 9) + 2) // 5 + day - 1
    return era * 146_097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719_468


def _pg_date_text(days: int) -> str:
    year, month, day = civil(days)
    if year <= 0:
        return f"{1 - year:04d}-{month:02d}-{day:02d} BC"
    return f"{year:04d}-{month:02d}-{day:02d}"


def _time_text(micros: int) -> str:
    seconds, us = divmod(micros, 1_000_000)
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}.{us:06d}"


def _pg_date_in(value: Any) -> str:
    """A date's document form (ISO text, ``infinity``, or days since 1970) as PostgreSQL reads it."""
    return _pg_date_text(value) if isinstance(value, int) else str(value)


def _pg_timestamp_in(value: Any, *, tz: bool) -> str:
    """A timestamp's document form (ISO text, ``infinity``, or µs since 1970) as PostgreSQL reads it."""
    if not isinstance(value, int):
        return str(value)
    days, rest = divmod(value, _DAY_US)
    date = _pg_date_text(days)
    era = " BC" if date.endswith(" BC") else ""
    return f"{date.removesuffix(' BC')} {_time_text(rest)}{'+00' if tz else ''}{era}"


def _pg_out(text: str, *, kind: str) -> Any:
    """PostgreSQL's text of a date or timestamp (ISO, UTC) to document form."""
    if text in ("infinity", "-infinity"):
        return text
    m = _PG_DATE.match(text)
    if m is None:
        raise ValueError(f"unexpected {kind} text from PostgreSQL: {text!r}")
    year, month, day, clock, fraction, _utc, bc = m.groups()
    y = 1 - int(year) if bc else int(year)
    days = day_number(y, int(month), int(day))
    if kind == "date":
        return f"{y:04d}-{month}-{day}" if 1 <= y <= 9999 else days
    micros = 0
    if clock:
        h, mi, se = (int(x) for x in clock.split(":"))
        micros = (h * 3600 + mi * 60 + se) * 1_000_000 + int((fraction or "").ljust(6, "0"))
    if not 1 <= y <= 9999:
        return days * _DAY_US + micros
    return f"{y:04d}-{month}-{day}T{_time_text(micros)}{'Z' if kind == 'timestamptz' else ''}"


def _pg_time_out(text: str) -> str:
    clock, _, fraction = text.partition(".")
    return f"{clock}.{fraction.ljust(6, '0')}"


def register_pg_loaders(connection: Any) -> None:
    """Have a psycopg connection return dates, timestamps and times in document form (from PostgreSQL's text,
    which holds infinity, BC and years past 9999), in a UTC session with ISO dates."""
    from psycopg.adapt import Loader

    def loader(convert: Callable[[str], Any]) -> type[Loader]:
        class DocForm(Loader):
            def load(self, data: Any) -> Any:
                return convert(bytes(data).decode("ascii"))

        return DocForm

    adapters = connection.adapters
    adapters.register_loader("date", loader(lambda t: _pg_out(t, kind="date")))
    adapters.register_loader("timestamptz", loader(lambda t: _pg_out(t, kind="timestamptz")))
    adapters.register_loader("timestamp", loader(lambda t: _pg_out(t, kind="timestamp")))
    adapters.register_loader("time", loader(_pg_time_out))
    with connection.cursor() as cursor:
        cursor.execute("SET TimeZone TO 'UTC'; SET DateStyle TO 'ISO, YMD'")
    connection.commit()  # a SET in a transaction the pool later rolls back would be undone


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
