"""The sql sink's type mapping: the calendar arithmetic behind PostgreSQL's dates past Python's, and which
column each Avro type gets."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from sinks._sqltypes import ColumnKind, _pg_date_text, _pg_out, civil, column_kind, day_number
from sinks._values import Names

EPOCH = dt.date(1970, 1, 1).toordinal()


@given(st.integers(min_value=dt.date.min.toordinal() - EPOCH, max_value=dt.date.max.toordinal() - EPOCH))
def test_the_calendar_agrees_with_pythons_where_both_reach(days: int) -> None:
    date = dt.date.fromordinal(days + EPOCH)
    assert civil(days) == (date.year, date.month, date.day)
    assert day_number(date.year, date.month, date.day) == days


@given(st.integers(min_value=-100_000_000, max_value=100_000_000))
def test_postgresqls_text_of_any_date_reads_back_as_its_day(days: int) -> None:
    back = _pg_out(_pg_date_text(days), kind="date")
    assert back == days or back == dt.date.fromordinal(days + EPOCH).isoformat()


def test_postgresqls_text_becomes_document_form() -> None:
    assert _pg_out("2024-02-29 23:59:59.5+00", kind="timestamptz") == "2024-02-29T23:59:59.500000Z"
    assert _pg_out("2024-02-29 23:59:59", kind="timestamp") == "2024-02-29T23:59:59.000000"
    assert _pg_out("0044-03-15 BC", kind="date") == day_number(-43, 3, 15)
    assert _pg_out("-infinity", kind="timestamptz") == "-infinity"
    assert _pg_date_text(day_number(-43, 3, 15)) == "0044-03-15 BC"


def test_each_avro_type_gets_its_column_kind() -> None:
    names = Names()
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}
    assert column_kind(["null", decimal, "string"], names) == ColumnKind("decimal", 10, 2)
    assert column_kind(["null", {"type": "int", "logicalType": "date"}], names) == ColumnKind("date")
    assert column_kind(["null", "string", "long"], names) == ColumnKind("json")
    assert column_kind({"type": "array", "items": "string"}, names) == ColumnKind("json")
    assert column_kind({"type": "enum", "name": "E", "symbols": ["a"]}, names) == ColumnKind("text")
    assert column_kind({"type": "string", "logicalType": "uuid"}, names) == ColumnKind("text")
