"""Dates, times, timestamps and intervals.

PostgreSQL counts from 2000-01-01, Avro from 1970-01-01: binary values only need the epoch shifted.
±infinity are PostgreSQL's own sentinels, the extreme int32 (date) and int64 (timestamps), kept as they are.
Text is PostgreSQL's output with ``DateStyle=ISO`` and ``IntervalStyle=postgres``; years 1..9999 AD take a
fast path through the C-level ``fromisoformat``, other years (BC, five and more digits) exact integer
arithmetic on the proleptic Gregorian calendar PostgreSQL uses.
"""

from __future__ import annotations

import re
import struct
from datetime import UTC, date, datetime, timedelta
from typing import Any

from schemas._conv import (
    I32,
    I64,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    FormatError,
    ValueOutOfRangeError,
    conv,
)
from schemas._names import avro_fullname

UNIX_EPOCH_DAYS = 10_957  # days from 1970-01-01 to PostgreSQL's epoch 2000-01-01
UNIX_EPOCH_MICROS = UNIX_EPOCH_DAYS * 86_400_000_000
_ORDINAL_1970 = date(1970, 1, 1).toordinal()
_EPOCH_AWARE = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_NAIVE = datetime(1970, 1, 1)  # local-timestamp-micros counts from a naive (wall-clock) epoch
# A finite PostgreSQL timestamp below this (its epoch) still fits an int64 once shifted to 1970; above it,
# only +infinity (INT64_MAX) is representable.
_PG_FINITE_HIGH = INT64_MAX - UNIX_EPOCH_MICROS


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days from 1970-01-01 to a proleptic Gregorian date, year 0 being 1 BC (H. Hinnant's algorithm)."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


# --- date --------------------------------------------------------------------------------------------

_DATE = re.compile(r"(\d+)-(\d\d)-(\d\d)( BC)?")


def _date_slow(text: str) -> int:
    if text == "infinity":
        return INT32_MAX
    if text == "-infinity":
        return INT32_MIN
    match = _DATE.fullmatch(text)
    if match is None:
        raise FormatError(f"not an ISO date: {text!r} (is DateStyle ISO?)")
    year = int(match[1])
    return days_from_civil(1 - year if match[4] else year, int(match[2]), int(match[3]))


def _date_str(text: str, _fromiso: Any = date.fromisoformat) -> int:
    if len(text) == 10:  # YYYY-MM-DD: a year 1..9999 AD
        try:
            return _fromiso(text).toordinal() - _ORDINAL_1970  # type: ignore[no-any-return]
        except ValueError:
            pass  # not ISO: the slow path says why
    return _date_slow(text)


def _date_text(data: bytes, _fromiso: Any = date.fromisoformat) -> int:
    text = data.decode()  # the same as _date_str, without a second call on the hot path
    if len(text) == 10:
        try:
            return _fromiso(text).toordinal() - _ORDINAL_1970  # type: ignore[no-any-return]
        except ValueError:
            pass
    return _date_slow(text)


def _date_bin(data: bytes, _unpack: Any = I32.unpack) -> int:
    value: int = _unpack(data)[0]
    if value in (INT32_MAX, INT32_MIN):  # ±infinity
        return value
    return value + UNIX_EPOCH_DAYS


DATE = conv({"type": "int", "logicalType": "date"}, _date_str, _date_bin, from_text=_date_text, wire="date")


# --- timestamp, timestamptz --------------------------------------------------------------------------

_TIMESTAMP = re.compile(
    r"(\d+)-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?)?( BC)?"
)


def _timestamp_slow(text: str) -> int:
    """Microseconds since 1970 (UTC when an offset is present) of any timestamp PostgreSQL prints."""
    if text == "infinity":
        return INT64_MAX
    if text == "-infinity":
        return INT64_MIN
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        raise FormatError(f"not an ISO timestamp: {text!r} (is DateStyle ISO?)")
    year = int(match[1])
    days = days_from_civil(1 - year if match[12] else year, int(match[2]), int(match[3]))
    seconds = days * 86_400 + int(match[4]) * 3600 + int(match[5]) * 60 + int(match[6])
    if match[8]:
        offset = int(match[9]) * 3600 + int(match[10] or 0) * 60 + int(match[11] or 0)
        seconds -= offset if match[8] == "+" else -offset
    micros = seconds * 1_000_000 + (int(match[7].ljust(6, "0")) if match[7] else 0)
    if not INT64_MIN < micros < INT64_MAX:
        raise ValueOutOfRangeError(
            f"timestamp {text!r} is beyond what Avro's timestamp-micros (int64 µs since 1970) can hold"
        )
    return micros


def _make_timestamp_str(epoch: datetime) -> Any:
    def from_str(text: str, _fromiso: Any = datetime.fromisoformat, _epoch: datetime = epoch) -> int:
        # Fast path: a four-digit year AD, which fromisoformat parses in C (offsets with seconds too).
        if text[4:5] == "-" and text[-1] != "C":
            try:
                delta: timedelta = _fromiso(text) - _epoch
            except (ValueError, TypeError):
                return _timestamp_slow(text)  # not ISO, or an offset where none belongs: it says why
            return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return _timestamp_slow(text)

    def from_text(data: bytes, _fromiso: Any = datetime.fromisoformat, _epoch: datetime = epoch) -> int:
        text = data.decode()  # the same as from_str, without a second call on the hot path
        if text[4:5] == "-" and text[-1] != "C":
            try:
                delta: timedelta = _fromiso(text) - _epoch
            except (ValueError, TypeError):
                return _timestamp_slow(text)
            return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return _timestamp_slow(text)

    return from_str, from_text


def _timestamp_bin(data: bytes, _unpack: Any = I64.unpack) -> int:
    value: int = _unpack(data)[0]
    if INT64_MIN < value < _PG_FINITE_HIGH:
        return value + UNIX_EPOCH_MICROS
    if value in (INT64_MAX, INT64_MIN):  # ±infinity
        return value
    raise ValueOutOfRangeError(f"timestamp {value} µs after 2000-01-01 is beyond what Avro's timestamp-micros can hold")


_tstz_str, _tstz_text = _make_timestamp_str(_EPOCH_AWARE)
_ts_str, _ts_text = _make_timestamp_str(_EPOCH_NAIVE)
TIMESTAMPTZ = conv(
    {"type": "long", "logicalType": "timestamp-micros"}, _tstz_str, _timestamp_bin, from_text=_tstz_text, wire="ts"
)
TIMESTAMP = conv(
    {"type": "long", "logicalType": "local-timestamp-micros"}, _ts_str, _timestamp_bin, from_text=_ts_text, wire="ts"
)


# --- time, timetz ------------------------------------------------------------------------------------


def _time_text(text: Any) -> int:
    """Microseconds after midnight of 'HH:MM:SS[.ffffff]' (str or bytes); 24:00:00 is valid."""
    micros = (int(text[0:2]) * 3600 + int(text[3:5]) * 60 + int(text[6:8])) * 1_000_000
    if len(text) > 8:
        micros += int(text[9:15].ljust(6, b"0" if isinstance(text, bytes) else "0"))
    return micros


def _int8_bin(data: bytes, _unpack: Any = I64.unpack) -> int:
    return _unpack(data)[0]  # type: ignore[no-any-return]


TIME_MICROS: dict[str, Any] = {"type": "long", "logicalType": "time-micros"}
TIME = conv(TIME_MICROS, _time_text, _int8_bin, from_text=_time_text)

_TIMETZ = struct.Struct(">qi")


def _timetz_str(text: str) -> dict[str, int]:
    sign_at = max(text.rfind("+"), text.rfind("-"))
    if sign_at < 8:
        raise FormatError(f"not a time with time zone: {text!r}")
    parts = text[sign_at + 1 :].split(":")
    offset = int(parts[0]) * 3600 + (int(parts[1]) * 60 if len(parts) > 1 else 0)
    offset += int(parts[2]) if len(parts) > 2 else 0
    return {
        "time": _time_text(text[:sign_at]),
        "offset_seconds": offset if text[sign_at] == "+" else -offset,
    }


def _timetz_bin(data: bytes) -> dict[str, int]:
    micros, zone = _TIMETZ.unpack(data)
    # PostgreSQL stores the zone in seconds WEST of UTC; ISO 8601 (and java.time) count east.
    return {"time": micros, "offset_seconds": -zone}


TIMETZ = conv(
    {
        "type": "record",
        "name": avro_fullname("pg_catalog", "timetz"),
        "fields": [
            {"name": "time", "type": TIME_MICROS},
            {"name": "offset_seconds", "type": "int"},
        ],
    },
    _timetz_str,
    _timetz_bin,
)


# --- interval ----------------------------------------------------------------------------------------

_INTERVAL = struct.Struct(">qii")
_MONTHS_PER_UNIT = {"year": 12, "years": 12, "mon": 1, "mons": 1}


def _interval_time(part: str) -> int:
    negative = part[0] == "-"
    hours, minutes, seconds = part.lstrip("+-").split(":")
    whole, _, frac = seconds.partition(".")
    micros = (int(hours) * 3600 + int(minutes) * 60 + int(whole)) * 1_000_000
    micros += int(frac.ljust(6, "0")) if frac else 0
    return -micros if negative else micros


def _interval_str(text: str) -> dict[str, int]:
    """An interval printed with IntervalStyle=postgres: '1 year 2 mons -3 days +04:05:06.789'."""
    months = days = micros = 0
    parts = text.split(" ")
    i, count = 0, len(parts)
    try:
        while i < count:
            part = parts[i]
            if ":" in part:
                micros = _interval_time(part)
                i += 1
                continue
            value, unit = int(part), parts[i + 1]
            i += 2
            if unit in ("day", "days"):
                days = value
            else:
                months += value * _MONTHS_PER_UNIT[unit]
    except (ValueError, IndexError, KeyError) as exc:
        raise FormatError(f"not an interval in IntervalStyle postgres: {text!r}") from exc
    return {"months": months, "days": days, "micros": micros}


def _interval_bin(data: bytes) -> dict[str, int]:
    micros, days, months = _INTERVAL.unpack(data)
    return {"months": months, "days": days, "micros": micros}


INTERVAL = conv(
    {
        "type": "record",
        "name": avro_fullname("pg_catalog", "interval"),
        "fields": [
            {"name": "months", "type": "int"},
            {"name": "days", "type": "int"},
            {"name": "micros", "type": "long"},
        ],
    },
    _interval_str,
    _interval_bin,
)
