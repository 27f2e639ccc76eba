"""How the stores name what PostgreSQL names: reversible, distinct where the source's names are distinct."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc._catalog import qualified_name
from cdc.config import Settings
from sinks._delta_names import delta_columns
from sinks._search import column_of, field_name, index_alias
from sinks._warehouse import history_path
from sinks.config import SinkSettings

_NAMES = st.text(alphabet=st.sampled_from([*"._%% \t\n\"'\\aAbB0éİ😀"]), min_size=1, max_size=12)


@settings(max_examples=200)
@given(st.lists(_NAMES, min_size=1, max_size=6, unique=True))
def test_search_field_names_round_trip_and_stay_distinct(columns: list[str]) -> None:
    fields = [field_name(c) for c in columns]
    assert [column_of(f) for f in fields] == columns
    assert len(set(fields)) == len(fields)
    for f in fields:
        # What OpenSearch refuses or misreads: a dot (object path), a leading '_' (metadata), a blank name.
        assert "." not in f
        assert not f.startswith("_")
        assert f.strip()
        assert f != "__cdc"


def test_search_field_names_of_ordinary_columns_are_unchanged() -> None:
    ordinary = ["id", "first name", "Ünïcødé 表", "a_b"]
    assert [field_name(c) for c in ordinary] == ordinary
    assert [field_name(c) for c in ("a.b", "_id", "__cdc", " ", "%2E")] == ["a%2Eb", "%5Fid", "%5F_cdc", "%20", "%252E"]


def test_index_aliases_of_tables_differing_only_in_case_differ() -> None:
    assert index_alias("shop", "public.orders") == "shop-public.orders"  # unchanged for lower-case names
    upper, lower = index_alias("shop", "sch.Mixed"), index_alias("shop", "sch.mixed")
    assert upper != lower
    assert lower == "shop-sch.mixed"
    assert re.fullmatch(r"shop-sch\.mixed~[0-9a-f]{8}", upper)
    assert upper == upper.lower()  # OpenSearch index names are lower case


@settings(max_examples=150)
@given(st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=8, unique=True))
def test_delta_columns_are_distinct_ignoring_case_and_stable_when_fields_are_added(fields: list[str]) -> None:
    columns = delta_columns(fields)
    assert list(columns) == fields
    lowered = [c.lower() for c in columns.values()]
    assert len(set(lowered)) == len(lowered)
    assert not {"__op", "__commit_lsn", "__lsn", "__ts_ms", "__applied_ms", "__unchanged"} & set(lowered)
    # An added column never renames an existing one.
    assert delta_columns(fields[:-1]) == {f: columns[f] for f in fields[:-1]}


def test_delta_columns_keep_names_unless_delta_would_refuse_them() -> None:
    columns = delta_columns(["id", "Order", "order", "__op", "ORDER"])
    assert columns["id"] == "id"
    assert columns["Order"] == "Order"
    assert re.fullmatch(r"order__[0-9a-f]{8}", columns["order"])
    assert re.fullmatch(r"__op__[0-9a-f]{8}", columns["__op"])
    assert re.fullmatch(r"ORDER__[0-9a-f]{8}", columns["ORDER"])


_CAPTURE = Settings(source={"dsn": "dbname=x"}, kafka={"topic_prefix": "p"})  # type: ignore[arg-type]
_SINKS = SinkSettings(kafka={"topic_prefix": "p"})  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(_NAMES, _NAMES)
def test_sinks_tables_name_the_topics_the_capture_writes(schema: str, table: str) -> None:
    # sinks.tables takes the names as source.tables does: parts with dots or quotes quoted, quotes doubled.
    quoted = '"' + schema.replace('"', '""') + '"."' + table.replace('"', '""') + '"'
    assert _SINKS.topic_for(quoted) == _CAPTURE.topic_for(schema, table)
    assert _SINKS.topic_for(qualified_name(schema, table)) == _CAPTURE.topic_for(schema, table)


@settings(max_examples=100, deadline=None)
@given(_NAMES, _NAMES, _NAMES, _NAMES)
def test_a_history_table_is_never_another_tables_directory(s1: str, t1: str, s2: str, t2: str) -> None:
    def table(schema: str, name: str) -> str:
        return _SINKS.table_name(_CAPTURE.topic_for(schema, name))  # what the warehouse names the directory

    assert history_path(table(s1, t1)) != table(s2, t2)
    assert history_path(table("s", "x")) != table("s", "x__history")


def test_a_field_keeps_its_delta_column_when_its_case_twin_is_renamed_or_dropped() -> None:
    before = delta_columns(["id", "Order", "order"])
    assert before["order"] != "order"  # the later twin got a suffix
    table = list(before.values())
    # "Order" renamed to "x" (or dropped): "order" must keep its column, not take the name Delta still has.
    after = delta_columns(["id", "x", "order"], table)
    assert after["order"] == before["order"]
    assert after["id"] == "id"
    assert after["x"] == "x"
    # A new field whose name only differs in case from an existing column gets a suffix too.
    assert delta_columns(["id", "ID"], ["id"])["ID"] != "ID"


def test_a_field_named_like_the_sinks_own_column_keeps_its_suffixed_column() -> None:
    # The Delta table holds the sink's own __op next to the field's column: the field must not take __op
    # (found by the hostile-names test: "Reference s.__op is ambiguous").
    first = delta_columns(["id", "__op"])
    table = [*first.values(), "__op", "__commit_lsn", "__lsn", "__ts_ms", "__applied_ms"]
    assert delta_columns(["id", "__op"], table) == first
    assert first["__op"] != "__op"


def test_the_capture_s_own_topics_are_never_change_topics_whatever_their_names() -> None:
    settings = SinkSettings.model_validate(
        {
            "kafka": {"topic_prefix": "demo", "offsets_topic": "demo.offsets.r1", "signal_topic": "demo.signals.r1"},
            "sinks": {"dead_letter_topic": "demo.dead.letters"},
        }
    )
    pattern = re.compile(settings.topic_pattern())
    assert pattern.fullmatch("demo.public.orders")
    assert pattern.fullmatch("demo.offsets.r2")  # a table named like them is still a table
    for own in ("demo.offsets.r1", "demo.signals.r1", "demo.dead.letters"):
        assert not pattern.fullmatch(own), own
    defaults = re.compile(SinkSettings.model_validate({"kafka": {"topic_prefix": "p"}}).topic_pattern())
    assert defaults.fullmatch("p.s.t")
    assert not defaults.fullmatch("p.offsets")
    assert not defaults.fullmatch("p.signals")
