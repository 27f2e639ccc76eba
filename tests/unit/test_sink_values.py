"""Document form from raw Avro values (verify's PostgreSQL side) and from Spark's values (the write path).

Both directions must give the same document for the same value; Spark's side is checked on the JVM in
tests/integration/test_sinks_values.py.
"""

from __future__ import annotations

import datetime as dt
import io
import json
from decimal import Context, Decimal
from typing import Any

import fastavro
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import avro_mapping, nullable
from sinks import key_id
from sinks._values import Names, doc_converter, envelope_row, search_mapping
from sinks.config import SinkSettings, load_sink_settings
from sinks.errors import SinkConfigError
from tests.unit.test_types import numeric_typmod, pg


def raw(schema: Any, value: Any) -> Any:
    return doc_converter(schema, Names(), spark=False)(value)


DATE = {"type": "int", "logicalType": "date"}
TSTZ = {"type": "long", "logicalType": "timestamp-micros"}
TS = {"type": "long", "logicalType": "local-timestamp-micros"}
TIME = {"type": "long", "logicalType": "time-micros"}
DEC = {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}


@pytest.mark.parametrize(
    ("schema", "value", "doc"),
    [
        (DATE, 0, "1970-01-01"),
        (DATE, 2**31 - 1, "infinity"),
        (DATE, -(2**31), "-infinity"),
        (DATE, -719_162, "0001-01-01"),
        (DATE, -719_163, -719_163),  # 1 BC: ISO 8601 as Python prints it cannot, the number stays
        (TSTZ, 1_767_323_045_123_456, "2026-01-02T03:04:05.123456Z"),
        (TSTZ, 2**63 - 1, "infinity"),
        (TSTZ, -(2**63), "-infinity"),
        (TS, 0, "1970-01-01T00:00:00.000000"),
        (TIME, 86_400_000_000, "24:00:00.000000"),
        (TIME, 3_723_000_004, "01:02:03.000004"),
        ("double", float("nan"), "NaN"),
        ("float", float("-inf"), "-Infinity"),
        ("double", -0.0, -0.0),
        ("bytes", b"\x00\xff", "AP8="),
        ("string", "x", "x"),
        (["null", "long"], None, None),
    ],
)
def test_raw_values_in_document_form(schema: Any, value: Any, doc: Any) -> None:
    assert raw(schema, value) == doc


def test_decimals_are_exact_strings_from_both_sides() -> None:
    for text in ("0.00", "-0.01", "12345678.90", "-99999999.99"):
        unscaled = int(Decimal(text).scaleb(2))
        as_bytes = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
        assert raw(DEC, as_bytes) == text
        assert doc_converter(DEC, Names(), spark=True)(Decimal(text)) == text


@given(st.integers(min_value=-(10**38) + 1, max_value=10**38 - 1), st.integers(min_value=0, max_value=38))
def test_a_decimal_collected_from_spark_in_any_notation_reads_as_its_raw_bytes_do(unscaled: int, scale: int) -> None:
    # Collected rows cross from the JVM in Java's engineering notation: decimal(38,10)'s 1E-10 arrives as
    # Decimal('100E-12'). The document form is the number at the type's scale, whatever its exponent on arrival.
    schema = {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": scale}
    as_bytes = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
    value = Decimal(unscaled).scaleb(-scale, context=Context(prec=80))  # the default 28 digits would round
    engineering = Decimal(value.to_eng_string())
    spark = doc_converter(schema, Names(), spark=True)
    assert spark(engineering) == spark(value) == raw(schema, as_bytes)


def test_numeric_38_10_holding_1e_minus_10_reads_as_postgresql_prints_it() -> None:
    schema = {"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": 10}
    assert doc_converter(schema, Names(), spark=True)(Decimal("100E-12")) == "0.0000000001"


def test_numeric_union_from_raw_and_from_spark_members() -> None:
    schema = nullable(avro_mapping_numeric())
    assert raw(schema, "NaN") == "NaN"
    assert raw(schema, (150).to_bytes(2, "big", signed=True)) == "1.50"
    spark = doc_converter(schema, Names(), spark=True)
    assert spark({"member0": Decimal("1.50"), "member1": None}) == "1.50"
    assert spark({"member0": None, "member1": "NaN"}) == "NaN"


def avro_mapping_numeric() -> Any:
    return avro_mapping(pg("numeric"), numeric_typmod(10, 2)).schema


def test_records_use_column_names_and_named_types_resolve() -> None:
    interval = {
        "type": "record",
        "name": "interval",
        "namespace": "pg_catalog",
        "fields": [
            {"name": "months", "type": "int"},
            {"name": "days", "type": "int"},
            {"name": "micros", "type": "long"},
        ],
    }
    row = {
        "type": "record",
        "name": "Value",
        "fields": [
            {"name": "a_b", "type": ["null", interval], "pgcdc.column": "a b"},
            {"name": "later", "type": ["null", "pg_catalog.interval"]},
            {"name": "days", "type": {"type": "array", "items": ["null", DATE]}},
        ],
    }
    value = {"a_b": {"months": 1, "days": 2, "micros": 3}, "later": None, "days": [0, None]}
    assert raw(row, value) == {
        "a b": {"months": 1, "days": 2, "micros": 3},
        "later": None,
        "days": ["1970-01-01", None],
    }


def test_names_resolve_in_the_namespace_of_their_definition() -> None:
    # How a registry prints a row (Java's Schema.toString): names relative to the enclosing namespace.
    # ``pair`` is defined inside ``_pair`` (namespace ``zoo``); ``deep``, defined in the array of ``_deep``,
    # refers to it by its short name, and a later column refers to ``deep`` by its full name from the
    # row's own namespace, where ``pair`` alone would mean ``w.pair``.
    pair = {"type": "record", "name": "pair", "fields": [{"name": "n", "type": ["null", "int"]}]}
    deep = {
        "type": "record",
        "name": "deep",
        "fields": [{"name": "nested", "type": ["null", "pair"]}, {"name": "at", "type": ["null", TSTZ]}],
    }
    envelope = {
        "type": "record",
        "name": "Envelope",
        "namespace": "w",
        "fields": [
            {
                "name": "before",
                "type": [
                    "null",
                    {
                        "type": "record",
                        "name": "Value",
                        "fields": [
                            {"name": "pairs", "type": _in_zoo("_pair", pair)},
                            {"name": "deeps", "type": _in_zoo("_deep", deep)},
                            {"name": "one", "type": ["null", "zoo.deep"]},
                        ],
                    },
                ],
            }
        ],
    }
    row = envelope_row(envelope)
    assert row["namespace"] == "w"
    value = {"pairs": {"e": []}, "deeps": {"e": []}, "one": {"nested": {"n": 7}, "at": 0}}
    assert raw(row, value) == {
        "pairs": {"e": []},
        "deeps": {"e": []},
        "one": {"nested": {"n": 7}, "at": "1970-01-01T00:00:00.000000Z"},
    }
    names = Names()
    mapped = {f["name"]: search_mapping(f["type"], names, "w") for f in row["fields"]}
    assert mapped["one"] == {"type": "object", "enabled": False}


def _in_zoo(name: str, element: dict[str, Any]) -> dict[str, Any]:
    """A record of namespace ``zoo`` whose one field is an array of ``element`` (defined there)."""
    items = {"type": "array", "items": ["null", element]}
    return {"type": "record", "name": name, "namespace": "zoo", "fields": [{"name": "e", "type": items}]}


def test_document_form_agrees_with_fastavros_reading_of_the_same_bytes() -> None:
    """Dates and timestamps in document form are what fastavro's logical types make of the written bytes."""
    schema = {"type": "record", "name": "R", "fields": [{"name": "d", "type": DATE}, {"name": "t", "type": TSTZ}]}
    raw_row = {"d": 19_000, "t": 1_767_323_045_123_456}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), raw_row)
    read: dict[str, Any] = fastavro.schemaless_reader(  # type: ignore[assignment]
        io.BytesIO(buf.getvalue()), fastavro.parse_schema(schema), None
    )
    assert raw(schema, raw_row) == {
        "d": read["d"].isoformat(),
        "t": read["t"].astimezone(dt.UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z",
    }


def test_search_mappings() -> None:
    assert search_mapping(["null", "long"], Names()) == {"type": "long"}
    assert search_mapping(["null", DEC, "string"], Names())["type"] == "double"
    assert search_mapping(DATE, Names())["ignore_malformed"] is True
    assert search_mapping({"type": "array", "items": "int"}, Names()) == {"type": "object", "enabled": False}


@pytest.mark.parametrize(
    ("avro", "value"),
    [
        ({"type": "long", "logicalType": "time-micros"}, 45_296_789_000),
        ({"type": "long", "logicalType": "time-micros"}, 86_400_000_000),  # 24:00:00
        ({"type": "int", "logicalType": "date"}, 19_000),
        ({"type": "long", "logicalType": "timestamp-micros"}, 1_767_323_045_123_456),
        ({"type": "string", "logicalType": "uuid"}, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        ("long", 7),
        ("double", 1.5),
        ("bytes", b"\x00"),
    ],
)
def test_each_search_mapping_takes_the_document_form_of_its_type(avro: Any, value: Any) -> None:
    """A field's mapping must accept the document form the sink writes, or OpenSearch refuses the whole row."""
    doc = doc_converter(avro, Names(), spark=False)(value)
    accepts: dict[str, type | tuple[type, ...]] = {
        "long": int,
        "integer": int,
        "double": (int, float),
        "keyword": str,
        "date": str,
        "date_nanos": str,
        "binary": str,
        "text": str,
    }
    mapped = search_mapping(avro, Names())["type"]
    assert isinstance(doc, accepts[mapped]), f"{avro}: {doc!r} into a {mapped} field"


def test_sink_settings_read_the_shared_file_and_ignore_capture_keys(tmp_path: Any) -> None:
    path = tmp_path / "cdc.toml"
    path.write_text(
        '[source]\ndsn = "x"\n[kafka]\ntopic_prefix = "shop"\npartitions = 3\n'
        '[sinks]\nspark_jars = ["a.jar"]\n[sinks.cache]\nttl_s = 60\n'
    )
    settings = load_sink_settings(path)
    assert settings.kafka.topic_prefix == "shop"
    assert settings.sinks.cache.ttl_s == 60
    assert settings.dead_letter_topic == "shop.dead-letter"
    assert settings.topic_for('public."My.Table"') == "shop.public.My_Table"


def test_sink_settings_refuse_unknown_sink_keys(tmp_path: Any) -> None:
    path = tmp_path / "cdc.toml"
    path.write_text("[sinks.search]\nurll = 'x'\n")
    with pytest.raises(SinkConfigError, match=r"sinks\.search\.urll: unknown key"):
        load_sink_settings(path)


def test_spark_jars_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_SINKS__SPARK_JARS", "a.jar,b.jar")
    assert SinkSettings().sinks.spark_jars == ("a.jar", "b.jar")


@pytest.mark.parametrize(
    "key",
    [
        {"id": 7},
        {"a": -3, "b": 10**20},
        {"flag": True},  # a bool is not an int here: JSON says true
        {"id": 1, "name": 'q"uo\\te\n'},
        {"name": "ünï"},
        {"id": None},
        {"x": 1.5},
    ],
)
def test_a_key_s_id_is_the_json_array_of_its_values(key: dict[str, Any]) -> None:
    """Document ids and cache keys already stored were written as json.dumps made them: the shortcut for integer
    keys must give the same text."""
    assert key_id(key) == json.dumps(list(key.values()), separators=(",", ":"), ensure_ascii=False)
