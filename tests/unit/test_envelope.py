"""Event schemas: Debezium-shaped, valid Avro, evolution-friendly."""

from __future__ import annotations

import io
from typing import Any, cast

import fastavro
from fastavro.schema import parse_schema

from schemas import ColumnHistory, ColumnShape, PgType, avro_name, envelope_schema, field_names, key_schema

INT4 = PgType(23, "int4")
TEXT = PgType(25, "text")


def _cols() -> list[ColumnShape]:
    return [
        ColumnShape("id", INT4, -1, "int"),
        ColumnShape("first name", TEXT, -1, "string"),
        ColumnShape("first_name", TEXT, -1, "string"),
        ColumnShape("2nd", TEXT, -1, "string"),
    ]


def _read(buf: io.BytesIO, writer: Any, reader: Any) -> dict[str, Any]:
    return cast(dict[str, Any], fastavro.schemaless_reader(buf, writer, reader))


def test_names_are_sanitised_and_unique() -> None:
    assert avro_name("émoji 😀") == "_moji__"
    assert field_names(_cols()) == ("id", "first_name", "first_name_2", "_2nd")


def test_envelope_round_trips_and_keeps_original_names() -> None:
    schema = envelope_schema("pgcdc.public.people", _cols())
    parsed = parse_schema(schema)
    value = next(f for f in schema["fields"] if f["name"] == "before")["type"][1]
    assert [f.get("pgcdc.column") for f in value["fields"]] == [None, "first name", "first_name", "2nd"]
    record = {
        "before": None,
        "after": {"id": 1, "first_name": "Ada", "first_name_2": None, "_2nd": "x"},
        "source": {
            "version": "0",
            "connector": "postgresql",
            "name": "pgcdc",
            "ts_ms": 1,
            "snapshot": "false",
            "db": "shop",
            "sequence": None,
            "ts_us": 1000,
            "schema": "public",
            "table": "people",
            "txId": 5,
            "lsn": 10,
            "xmin": None,
            "commit_lsn": 20,
        },
        "transaction": None,
        "op": "c",
        "ts_ms": 2,
        "ts_us": 2000,
        "unchanged_toast": ["first_name_2"],
    }
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    buf.seek(0)
    assert fastavro.schemaless_reader(buf, parsed, None) == record


def test_adding_a_column_is_readable_both_ways() -> None:
    """Old events read with the new schema and new events with the old one (FULL compatibility)."""
    old = parse_schema(envelope_schema("ns", _cols()[:2]))
    new = parse_schema(envelope_schema("ns", [*_cols()[:2], ColumnShape("extra", INT4, -1, "int")]))
    src = {
        "version": "0",
        "connector": "postgresql",
        "name": "n",
        "ts_ms": 1,
        "db": "d",
        "schema": "s",
        "table": "t",
    }
    rec = {"after": {"id": 1, "first_name": "a"}, "source": src, "op": "c"}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, rec)
    buf.seek(0)
    assert _read(buf, old, new)["after"] == {"id": 1, "first_name": "a", "extra": None}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, new, {**rec, "after": {"id": 1, "first_name": "a", "extra": 3}})
    buf.seek(0)
    assert _read(buf, new, old)["after"] == {"id": 1, "first_name": "a"}


_SOURCE = {"version": "0", "connector": "postgresql", "name": "n", "ts_ms": 1, "db": "d", "schema": "s", "table": "t"}


def _numbered(*names: tuple[str, int | None]) -> list[ColumnShape]:
    return [
        ColumnShape(n, INT4 if n == "id" else TEXT, -1, "int" if n == "id" else "string", attnum=a) for n, a in names
    ]


def _after(writer: dict[str, Any], reader: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parse_schema(writer), {"after": row, "source": _SOURCE, "op": "c"})
    buf.seek(0)
    return cast(dict[str, Any], _read(buf, parse_schema(writer), parse_schema(reader))["after"])


def test_a_renamed_column_names_its_earlier_names_so_old_events_read_into_the_new_one() -> None:
    history = ColumnHistory()
    v1 = envelope_schema("ns", history.identify(_numbered(("id", 1), ("name", 2))))
    v2 = envelope_schema("ns", history.identify(_numbered(("id", 1), ("title", 2))))
    value = v2["fields"][0]["type"][1]["fields"]
    assert [(f["name"], f.get("aliases"), f["pgcdc.attnum"]) for f in value] == [
        ("id", None, 1),
        ("title", ["name"], 2),
    ]
    assert _after(v1, v2, {"id": 1, "name": "a"}) == {"id": 1, "title": "a"}
    # Renamed again, learnt from the registered schema by a capture that starts afresh: both names carry over.
    later = ColumnHistory()
    later.learn(v2)
    v3 = envelope_schema("ns", later.identify(_numbered(("id", 1), ("label", 2))))
    assert _after(v1, v3, {"id": 1, "name": "a"}) == {"id": 1, "label": "a"}
    assert _after(v2, v3, {"id": 1, "title": "b"}) == {"id": 1, "label": "b"}


def test_names_a_column_had_are_aliases_in_either_order_and_never_another_fields_name() -> None:
    history = ColumnHistory()
    newer = history.identify(_numbered(("id", 1), ("title", 2)))
    older = history.identify(_numbered(("id", 1), ("name", 2)))  # the stream behind a snapshot of today's table
    assert older[1].aliases == ("title",)
    assert newer[1].aliases == ()
    swapped = history.identify(_numbered(("id", 1), ("name", 3), ("title", 2)))  # a new column took the old name
    assert swapped[1].aliases == ()
    assert swapped[2].aliases == ()


def test_the_key_schema_carries_no_column_numbers_or_aliases_so_framed_keys_keep_their_bytes() -> None:
    history = ColumnHistory()
    history.identify(_numbered(("id", 1), ("name", 2)))
    renamed = history.identify(_numbered(("key", 1), ("name", 2)))
    assert renamed[0].aliases == ("id",)
    assert key_schema("ns", renamed[:1]) == key_schema("ns", [ColumnShape("key", TEXT, -1, "string")])


def test_a_name_two_columns_had_is_no_ones_alias() -> None:
    history = ColumnHistory()
    history.identify(_numbered(("id", 1), ("a", 2)))
    history.identify(_numbered(("id", 1), ("b", 2)))  # a -> b
    history.identify(_numbered(("id", 1), ("b", 2), ("a", 3)))  # a new column takes the name a
    later = history.identify(_numbered(("id", 1), ("b", 2), ("d", 3)))  # and is renamed
    assert later[1].aliases == ()
    assert later[2].aliases == ()


def test_schemas_of_another_table_of_the_same_name_teach_nothing() -> None:
    old = envelope_schema("ns", ColumnHistory(7).identify(_numbered(("id", 1), ("name", 2))), relid=7)
    assert old["fields"][0]["type"][1]["pgcdc.relid"] == 7
    remade = ColumnHistory(8)  # the table dropped and created again: a new oid, its numbers another table's
    remade.learn(old)
    assert remade.identify(_numbered(("id", 1), ("title", 2)))[1].aliases == ()
    same = ColumnHistory(7)
    same.learn(old)
    assert same.identify(_numbered(("id", 1), ("title", 2)))[1].aliases == ("name",)


def test_a_table_restored_under_new_numbers_keeps_the_names_its_columns_had() -> None:
    history = ColumnHistory(7)
    history.identify(_numbered(("id", 1), ("name", 3)))
    renamed = envelope_schema("ns", history.identify(_numbered(("id", 1), ("title", 3))), relid=7)
    restored = ColumnHistory(9)  # a dump restored: a new oid, the dropped column 2 gone, so title is 2 now
    restored.learn(renamed)
    again = restored.identify(_numbered(("id", 1), ("title", 2)))
    assert again[1].aliases == ("name",)
    assert _after(renamed, envelope_schema("ns", again, relid=9), {"id": 1, "title": "t"}) == {"id": 1, "title": "t"}


def test_a_column_of_unknown_number_keeps_the_identity_its_name_had() -> None:
    history = ColumnHistory()
    history.identify(_numbered(("id", 1), ("name", 2)))
    unknown = history.identify(_numbered(("id", None), ("name", None)))
    assert [c.attnum for c in unknown] == [1, 2]
    assert history.identify(_numbered(("id", 1), ("other", None)))[1].attnum is None  # a name never seen


def test_truncate_key_is_all_null_and_not_empty() -> None:
    parsed = parse_schema(key_schema("ns", _cols()[:1]))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, {"id": None})
    assert buf.getvalue() == b"\x00"  # one byte: Kafka accepts it on a compacted topic (a null key it would not)


def test_a_key_column_has_the_same_field_name_in_key_and_value() -> None:
    # Columns a_b, "a b" keyed by "a b" (then a_b): sanitised on its own, the key would call "a b" a_b,
    # which is the other column's name in Value; the warehouse's MERGE and `cdc verify` join them by name.
    from cdc.encoding import SourceInfo, TableCodec, TableShape
    from schemas import avro_mapping

    columns = [ColumnShape("a_b", TEXT, -1, "string"), ColumnShape("a b", INT4, -1, "int")]
    mappings = [avro_mapping(TEXT, -1), avro_mapping(INT4, -1)]
    codec = TableCodec(
        TableShape("s", "t", "p.s.t", "p.s.t", columns, mappings, ["a b", "a_b"]),
        source=SourceInfo("9.9.9", "p", "db"),
        register=lambda _subject, _schema: 1,
    )
    value = {f["name"]: f.get("pgcdc.column", f["name"]) for f in codec.value_schema["fields"][0]["type"][1]["fields"]}
    key = {f["name"]: f.get("pgcdc.column", f["name"]) for f in codec.key_schema["fields"]}
    assert value == {"a_b": "a_b", "a_b_2": "a b"}
    assert key == {"a_b_2": "a b", "a_b": "a_b"}
    assert codec.key_field_names == ("a_b_2", "a_b")
    assert [f["name"] for f in codec.key_schema["fields"]] == ["a_b_2", "a_b"]  # key order kept
