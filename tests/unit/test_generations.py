"""Topic generations (cdc/_generations.py): what a refused type change says, and what a move records."""

from __future__ import annotations

from typing import Any

from pgcdc_dev.codecs import make_codec

from cdc._generations import (
    Generations,
    TypeChange,
    changed_columns,
    known_columns,
    registered_columns,
    scale_changes,
)
from cdc._offsets import CaptureState
from cdc.config import Settings
from pgcdc_common.topics import generation_topic, split_generation, superseded
from schemas import PgType

INT4, TEXT, NUMERIC = PgType(23, "int4"), PgType(25, "text"), PgType(1700, "numeric")
VARCHAR = PgType(1043, "varchar")


def _columns(qty: PgType, typmod: int = -1) -> list[tuple[str, PgType, int]]:
    return [("id", INT4, -1), ("qty", qty, typmod), ("name", VARCHAR, 14)]


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "source": {"dsn": "postgresql://u:p@h/db", "tables": ["public.items"]},
            "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "shop"},
            "registry": {"url": "https://reg-user:s3cret@registry.example:8081/apis/ccompat/v7/"},
        }
    )


def test_the_changed_columns_are_named_with_their_types_before_and_now() -> None:
    before = make_codec(_columns(INT4), topic="shop.public.items")
    now = make_codec(_columns(NUMERIC, ((12 << 16) | 2) + 4), topic="shop.public.items")
    found = changed_columns(known_columns(before.columns), known_columns(now.columns))
    assert found == (("qty", "int4", "numeric(12,2)"),)
    # Known only from the registered schema (after a restart): the type before is its Avro type.
    from_registry = changed_columns(registered_columns(before.value_schema), known_columns(now.columns))
    assert from_registry == (("qty", "Avro int", "numeric(12,2)"),)


def test_a_move_records_the_generation_and_the_backfill_that_fills_it() -> None:
    generations = Generations(_settings())
    state = CaptureState(lsn=1)
    generations.bind(state)
    change = TypeChange(
        "public.items", "shop.public.items", 1, (("qty", "int4", "text"),), "shop.public.items-value", "409"
    )
    assert generations.move(change) == "shop.public.items.g2"
    assert state.generations == {"public.items": 2}
    assert [(b.id, b.table, b.reason, b.status) for b in state.backfills] == [
        ("public.items.g2", "public.items", "type-change", "queued")
    ]
    assert generations.of("public.items") == 2
    assert generation_topic("shop.public.items", 3) == "shop.public.items.g3"


def test_the_stop_says_what_changed_and_both_ways_on_without_the_registrys_credentials() -> None:
    change = TypeChange(
        "public.items", "shop.public.items", 1, (("qty", "int4", "text"),), "shop.public.items-value", "HTTP 409: x"
    )
    text = str(Generations(_settings()).stop_error(change))
    assert text.startswith("table public.items: column qty int4 → text, which subject 'shop.public.items-value'")
    assert 'capture.on_type_change = "new-topic"' in text
    assert "'shop.public.items.g2'" in text
    assert "https://registry.example:8081/apis/ccompat/v7/config/shop.public.items-value" in text
    assert "s3cret" not in text
    assert "reg-user" not in text


def test_a_tables_older_generations_are_superseded_by_its_newest() -> None:
    assert split_generation("p.public.items.g12", "p") == ("p.public.items", 12)
    assert split_generation("p.public.items", "p") == ("p.public.items", 1)
    assert split_generation("my.app.public.g2", "my.app") == ("my.app.public.g2", 1)  # a table named g2
    topics = ["p.public.items", "p.public.items.g2", "p.public.items.g3", "p.public.other", "p.public.g2"]
    assert superseded(topics, "p") == {"p.public.items", "p.public.items.g2"}
    # A store generation's own choice (sinks._served): the chosen generation, a table not in it its first.
    chosen = {"p.public.items": 2}
    assert superseded(topics, "p", chosen) == {"p.public.items", "p.public.items.g3"}


def test_a_decimals_new_scale_is_refused_as_its_topic_cannot_take_it() -> None:
    def envelope(scale: int) -> dict[str, Any]:
        typmod = ((10 << 16) | scale) + 4
        return make_codec([("id", INT4, -1), ("price", NUMERIC, typmod)], topic="shop.public.items").value_schema

    assert scale_changes(envelope(2), envelope(4)) == ["price"]
    assert scale_changes(envelope(2), envelope(2)) == []
