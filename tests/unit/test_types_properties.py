"""Property tests: random values, written in PostgreSQL's text and binary formats by encoders here,
convert to the same Avro value, which fastavro writes and reads back — and, where Python has an object for
it, encodes to the very bytes fastavro produces from that object.
"""

from __future__ import annotations

import ipaddress
import math
import struct
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import PgType, avro_mapping
from tests.unit.test_types import (
    PG_EPOCH_US,
    array_of,
    avro_bytes,
    avro_check,
    check,
    convert,
    numeric_typmod,
    pg,
    same,
)
from tests.unit.test_types_containers import array_send, hstore_send, range_send, record_send
from tests.unit.test_types_numeric import numeric_send

PG_MIN_US = -211_813_488_000_000_000  # 4714-11-24 00:00:00 BC, in µs from 2000-01-01
PG_END_US = 9_223_371_331_200_000_000  # 294277-01-01 00:00:00, exclusive
AVRO_MAX_PG_US = 2**63 - 2 - PG_EPOCH_US  # the last microsecond an int64 since 1970 holds (but +infinity's)

# PostgreSQL text cannot hold NUL; Avro strings cannot hold lone surrogates.
pg_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)


# --- integers and floats -----------------------------------------------------------------------------


@given(st.integers(-(2**15), 2**15 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1))
def test_integers(i2: int, i4: int, i8: int) -> None:
    for name, fmt, value in (("int2", ">h", i2), ("int4", ">i", i4), ("int8", ">q", i8)):
        check(pg(name), str(value), struct.pack(fmt, value), value)


def _pg_float_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float8(value: float) -> None:
    check(pg("float8"), _pg_float_text(value), struct.pack(">d", value), value)


def _nearest_float4(text: str) -> float:
    """The float4 nearest to a decimal, ties to even, by exact arithmetic: the test's independent oracle."""
    exact = Fraction(text)
    try:
        guess = struct.unpack(">I", struct.pack(">f", float(text)))[0]
    except OverflowError:
        return math.inf  # beyond float4: never what PostgreSQL prints
    neighbours = (struct.unpack(">f", struct.pack(">I", bits))[0] for bits in (guess - 1, guess, guess + 1))
    candidates = [c for c in neighbours if c - c == 0]  # finite ones: the max float4's upper neighbour is inf

    def distance_then_odd(candidate: float) -> tuple[Fraction, int]:
        return abs(Fraction(candidate) - exact), struct.unpack(">I", struct.pack(">f", candidate))[0] & 1

    nearest: float = min(candidates, key=distance_then_odd)
    return nearest


def _shortest_float4_text(value: float) -> str:
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if _nearest_float4(text) == value:
            return text
    raise AssertionError(value)


@given(st.floats(min_value=0, exclude_min=True, width=32, allow_infinity=False))
def test_float4_shortest_text_gives_the_float4(value: float) -> None:
    check(pg("float4"), _shortest_float4_text(value), struct.pack(">f", value), value)


@given(st.integers(1, 2**31 - 3), st.sampled_from([-1, 1]), st.integers(1, 10**6))
def test_float4_decimals_next_to_a_midpoint_round_exactly(bits: int, side: int, nudge: int) -> None:
    # The decimal is a hair off the midpoint of two float4s: rounding through a double lands on the
    # midpoint itself and can then go the wrong way. The converter must not.
    low, high = (struct.unpack(">f", struct.pack(">I", b))[0] for b in (bits, bits + 1))
    if not math.isfinite(high):
        return
    midpoint = (Fraction(low) + Fraction(high)) / 2
    exact = midpoint + side * Fraction(1, 10**45) * nudge * abs(midpoint)
    text = _fraction_text(exact)
    value = avro_mapping(pg("float4")).from_text(text.encode())
    assert value == _nearest_float4(text)


def _fraction_text(value: Fraction, digits: int = 70) -> str:
    whole = value.numerator * 10**digits // value.denominator
    text = str(whole).rjust(digits + 1, "0")
    return f"{text[:-digits]}.{text[-digits:]}"


# --- numeric -----------------------------------------------------------------------------------------


def _pg_numeric_text(value: Decimal) -> str:
    text = format(value, "f")
    return text.lstrip("-") if value == 0 else text  # PostgreSQL has no negative zero


def _moderate(value: Decimal) -> bool:
    exponent = value.as_tuple().exponent
    return isinstance(exponent, int) and -60 < exponent < 60 and len(value.as_tuple().digits) < 80


finite_decimals: st.SearchStrategy[Decimal] = st.decimals(allow_nan=False, allow_infinity=False).filter(_moderate)


@given(finite_decimals)
def test_unconstrained_numeric(value: Decimal) -> None:
    text = _pg_numeric_text(value)
    check(pg("numeric"), text, numeric_send(text), text)


@given(st.integers(1, 38).flatmap(lambda p: st.tuples(st.just(p), st.integers(0, p))), st.data())
def test_constrained_numeric_matches_fastavro(precision_scale: tuple[int, int], data: st.DataObject) -> None:
    precision, scale = precision_scale
    unscaled = data.draw(st.integers(-(10**precision) + 1, 10**precision - 1))
    value = Decimal(unscaled).scaleb(-scale)
    text = format(value, "f") if value != 0 else format(abs(value), "f")
    # check(): our unscaled bytes equal fastavro's from the Decimal, and fastavro reads the Decimal back.
    check(pg("numeric"), text, numeric_send(text), value, typmod=numeric_typmod(precision, scale))


# --- dates and timestamps over PostgreSQL's whole range -----------------------------------------------


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day count from 1970-01-01, year 0 being 1 BC: the inverse of the code's
    days_from_civil, by a different algorithm (H. Hinnant's civil_from_days)."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def _pg_date(days: int) -> str:
    year, month, day = _civil_from_days(days)
    return f"{year:04d}-{month:02d}-{day:02d}" if year > 0 else f"{1 - year:04d}-{month:02d}-{day:02d} BC"


def _pg_timestamp(micros: int, offset_seconds: int | None) -> str:
    local = micros + (offset_seconds or 0) * 1_000_000
    days, rest = divmod(local, 86_400_000_000)
    seconds, fraction = divmod(rest, 1_000_000)
    year, month, day = _civil_from_days(days)
    text = f"{abs(year) if year > 0 else 1 - year:04d}-{month:02d}-{day:02d} "
    text += f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    if fraction:
        text += f".{fraction:06d}".rstrip("0")
    if offset_seconds is not None:
        sign, off = ("+" if offset_seconds >= 0 else "-"), abs(offset_seconds)
        text += f"{sign}{off // 3600:02d}"
        if off % 3600:
            text += f":{off // 60 % 60:02d}"
            if off % 60:
                text += f":{off % 60:02d}"
    return text + (" BC" if year <= 0 else "")


@given(st.integers(-2451545, 2145031948))
def test_dates_over_postgresqls_range(pg_days: int) -> None:
    days = pg_days + 10957
    check(pg("date"), _pg_date(days), struct.pack(">i", pg_days), days)


offsets = st.one_of(st.none(), st.integers(-15 * 3600 - 59 * 60, 15 * 3600 + 59 * 60))


@given(st.integers(PG_MIN_US, AVRO_MAX_PG_US), offsets)
def test_timestamps_over_postgresqls_range(pg_us: int, offset: int | None) -> None:
    micros = pg_us + PG_EPOCH_US
    name = "timestamp" if offset is None else "timestamptz"
    check(pg(name), _pg_timestamp(micros, offset), struct.pack(">q", pg_us), micros)


@given(st.datetimes(timezones=st.just(UTC)), st.integers(-15 * 3600, 15 * 3600))
def test_timestamptz_equals_fastavro_from_datetime(moment: datetime, offset: int) -> None:
    micros = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    local = moment.astimezone(timezone(timedelta(seconds=offset)))
    if not 1 <= local.year <= 9999:
        return
    check(pg("timestamptz"), _pg_timestamp(micros, offset), struct.pack(">q", micros - PG_EPOCH_US), moment)


@given(st.datetimes())
def test_timestamp_equals_fastavro_from_naive_datetime(moment: datetime) -> None:
    micros = (moment - datetime(1970, 1, 1)) // timedelta(microseconds=1)
    check(pg("timestamp"), _pg_timestamp(micros, None), struct.pack(">q", micros - PG_EPOCH_US), moment)


@given(st.times())
def test_time_equals_fastavro_from_time(moment: Any) -> None:
    micros = ((moment.hour * 60 + moment.minute) * 60 + moment.second) * 1_000_000 + moment.microsecond
    text = moment.isoformat()
    check(pg("time"), text, struct.pack(">q", micros), moment)


# --- interval ----------------------------------------------------------------------------------------


def _pg_interval(months: int, days: int, micros: int) -> str:
    """EncodeInterval with IntervalStyle=postgres."""
    parts: list[str] = []
    is_before = False
    year, month = int(months / 12), months - int(months / 12) * 12  # C truncation towards zero
    for value, unit in ((year, "year"), (month, "mon"), (days, "day")):
        if value:
            plus = "+" if is_before and value > 0 else ""
            parts.append(f"{plus}{value} {unit}{'s' if value != 1 else ''}")
            is_before = value < 0
    if not parts or micros:
        sign = "-" if micros < 0 else ("+" if is_before else "")
        seconds, fraction = divmod(abs(micros), 1_000_000)
        text = f"{sign}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        parts.append(text + (f".{fraction:06d}".rstrip("0") if fraction else ""))
    return " ".join(parts)


@given(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1))
def test_interval(months: int, days: int, micros: int) -> None:
    check(
        pg("interval"),
        _pg_interval(months, days, micros),
        struct.pack(">qii", micros, days, months),
        {"months": months, "days": days, "micros": micros},
    )


# --- text formats of containers ----------------------------------------------------------------------


def _array_out_element(value: str | None, delimiter: str = ",") -> str:
    if value is None:
        return "NULL"
    special = set('"\\{}' + delimiter + " \t\n\r\v\f")
    if value == "" or value.upper() == "NULL" or any(c in special for c in value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _array_out(flat: list[str | None], dims: list[int], lower_bounds: list[int]) -> str:
    if not dims:
        return "{}"

    def nest(level: int, start: int) -> str:
        if level == len(dims) - 1:
            items = [_array_out_element(e) for e in flat[start : start + dims[level]]]
        else:
            stride = 1
            for d in dims[level + 1 :]:
                stride *= d
            items = [nest(level + 1, start + i * stride) for i in range(dims[level])]
        return "{" + ",".join(items) + "}"

    decoration = ""
    if any(lb != 1 for lb in lower_bounds):
        decoration = "".join(f"[{lb}:{lb + d - 1}]" for lb, d in zip(lower_bounds, dims, strict=True)) + "="
    return decoration + nest(0, 0)


@st.composite
def arrays(draw: st.DrawFn) -> tuple[list[str | None], list[int], list[int]]:
    dims = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    count = 1
    for d in dims:
        count *= d
    flat = draw(st.lists(st.one_of(st.none(), pg_text), min_size=count, max_size=count)) if dims else []
    lower_bounds = draw(st.lists(st.integers(-5, 5), min_size=len(dims), max_size=len(dims)))
    return flat, dims, lower_bounds


@given(arrays())
def test_text_arrays_any_shape(array: tuple[list[str | None], list[int], list[int]]) -> None:
    flat, dims, lower_bounds = array
    binary = array_send([None if e is None else e.encode() for e in flat], dims, lower_bounds, oid=25)
    expected = {"elements": flat, "dims": dims, "lower_bounds": lower_bounds}
    check(array_of(pg("text")), _array_out(flat, dims, lower_bounds), binary, expected)


def _record_out_field(value: str | None) -> str:
    if value is None:
        return ""
    if value == "" or any(c in '"\\(),' or c.isspace() for c in value):
        return '"' + value.replace('"', '""').replace("\\", "\\\\") + '"'
    return value


@given(st.lists(st.one_of(st.none(), pg_text), min_size=1, max_size=5))
def test_composites_of_text(values: list[str | None]) -> None:
    comp = PgType(1, "c", "public", "composite", fields=tuple((f"f{i}", pg("text"), -1) for i in range(len(values))))
    text = "(" + ",".join(_record_out_field(v) for v in values) + ")"
    binary = record_send([(25, None if v is None else v.encode()) for v in values])
    check(comp, text, binary, {f"f{i}": v for i, v in enumerate(values)})


def _range_bound_out(value: str | None) -> str:
    if value is None:
        return ""
    if value == "" or any(c in '"\\()[],' or c.isspace() for c in value):
        return '"' + value.replace('"', '""').replace("\\", "\\\\") + '"'
    return value


@given(st.one_of(st.none(), pg_text), st.one_of(st.none(), pg_text), st.booleans(), st.booleans())
def test_text_ranges(lower: str | None, upper: str | None, lower_inc: bool, upper_inc: bool) -> None:
    textrange = PgType(1, "textrange", "public", "range", element=pg("text"))
    lower_inc, upper_inc = lower_inc and lower is not None, upper_inc and upper is not None
    text = f"{'[' if lower_inc else '('}{_range_bound_out(lower)},{_range_bound_out(upper)}{']' if upper_inc else ')'}"
    binary = range_send(
        None if lower is None else lower.encode(), None if upper is None else upper.encode(), lower_inc, upper_inc
    )
    expected = {
        "lower": lower,
        "upper": upper,
        "lower_inclusive": lower_inc,
        "upper_inclusive": upper_inc,
        "empty": False,
    }
    check(textrange, text, binary, expected)


@given(st.dictionaries(pg_text, st.one_of(st.none(), pg_text), max_size=5))
def test_hstore(pairs: dict[str, str | None]) -> None:
    def quote(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    text = ", ".join(f"{quote(k)}=>{'NULL' if v is None else quote(v)}" for k, v in pairs.items())
    check(PgType(1, "hstore", "public"), text, hstore_send(pairs), pairs)


# --- inet --------------------------------------------------------------------------------------------


@given(st.lists(st.sampled_from([0, 0, 0, 1, 0xFFFF, 0xABCD]), min_size=8, max_size=8), st.integers(0, 128))
@settings(max_examples=300)
def test_ipv6_text_matches_rfc5952_where_postgresql_agrees(words: list[int], bits: int) -> None:
    address = b"".join(w.to_bytes(2, "big") for w in words)
    binary = bytes([3, bits, 0, 16]) + address
    mapping = avro_mapping(pg("inet"))
    assert mapping.from_binary is not None
    text = mapping.from_binary(binary)
    embedded_ipv4 = words[:5] == [0] * 5 and words[5] in (0, 0xFFFF) and "." in text
    if not embedded_ipv4:  # Python prints IPv4-mapped addresses in hex; PostgreSQL in dotted quad
        expected = str(ipaddress.IPv6Address(address)) + ("" if bits == 128 else f"/{bits}")
        assert text == expected
    assert same(convert(mapping, text, binary), text)
    avro_check(mapping, text)
    assert avro_bytes(mapping.schema, text)
