"""The snapshot's C COPY reader reports a failure as (SQLSTATE, message); copy_error makes of it the exception
psycopg itself would raise, since the capture decides from the class whether to retry (transient) or stop."""

from __future__ import annotations

import psycopg

from cdc._chunks import copy_error


def test_known_codes_get_psycopgs_own_class() -> None:
    error = copy_error("42P01", 'relation "missing" does not exist')
    assert isinstance(error, psycopg.errors.UndefinedTable)
    assert str(error) == 'relation "missing" does not exist'


def test_unknown_codes_get_their_class_family() -> None:
    # 08 (connection exception) is transient for the capture; a code psycopg does not list keeps that family.
    error = copy_error("08Z99", "connection trouble")
    assert isinstance(error, psycopg.errors.ConnectionException)
    assert isinstance(error, psycopg.OperationalError)
    assert type(copy_error("ZZ123", "who knows")) is psycopg.DatabaseError


def test_no_code_is_a_connection_failure() -> None:
    assert type(copy_error(None, "server closed the connection unexpectedly")) is psycopg.OperationalError
