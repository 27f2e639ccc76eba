"""Which pg_attribute number each column of a Relation message is: its identity through renames."""

from __future__ import annotations

from cdc._attach import relation_attnums

INT, TEXT = 23, 25


def test_columns_the_catalogs_still_name_take_their_numbers() -> None:
    now = {"id": (1, INT), "title": (2, TEXT), "qty": (3, INT)}
    assert relation_attnums([("id", INT), ("title", TEXT), ("qty", INT)], now, None) == [1, 2, 3]


def test_a_column_renamed_again_since_takes_the_number_at_its_place_in_the_previous_relation() -> None:
    now = {"id": (1, INT), "label": (2, TEXT), "qty": (3, INT)}  # name -> title (this message) -> label (later)
    previous = [("id", INT, 1), ("name", TEXT, 2), ("qty", INT, 3)]
    assert relation_attnums([("id", INT), ("title", TEXT), ("qty", INT)], now, previous) == [1, 2, 3]


def test_a_column_dropped_and_one_added_in_its_place_is_not_taken_for_a_rename() -> None:
    # name (2) dropped, title (3) added, then title renamed to label: the message still says title.
    now = {"id": (1, INT), "label": (3, TEXT)}
    previous = [("id", INT, 1), ("name", TEXT, 2)]
    assert relation_attnums([("id", INT), ("title", TEXT)], now, previous) == [1, None]


def test_a_column_of_another_type_or_numbers_out_of_order_give_no_identity() -> None:
    now = {"id": (1, INT), "name": (2, INT)}
    assert relation_attnums([("id", INT), ("name", TEXT)], now, None) == [1, None]
    swapped = {"id": (1, INT), "a": (3, TEXT), "b": (2, TEXT)}  # a stale message against a later catalog
    assert relation_attnums([("id", INT), ("a", TEXT), ("b", TEXT)], swapped, None) == [None, None, None]
