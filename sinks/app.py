"""The sinks' Spark side, as `cdc sinks run`, `cdc sinks rebuild` and `cdc verify` drive it: the app and its
supervisor (:func:`run`), rebuilds and verification, one sink's query on its own (:class:`SinkQuery`, for
benchmarks), and the Spark session built from the settings. Importing it loads the sinks' runtime (pyspark
itself only when a session starts): the command line imports it only when a command needs it."""

from __future__ import annotations

from sinks._query import SinkQuery
from sinks._rebuild import never_ran, rebuild, verify
from sinks._spark import build_session, kill_started, spark_session, stop_session
from sinks._supervisor import reach_kafka, run


def sqlalchemy_url(dsn: str) -> str:
    """The SQLAlchemy URL (psycopg driver) of a libpq connection string, as the SQL sink names a PostgreSQL
    target. SQLAlchemy is imported here, not with this module: only the SQL sink and its readers need it."""
    from sinks._sql import sqlalchemy_url as url

    return url(dsn)


__all__ = [
    "SinkQuery",
    "build_session",
    "kill_started",
    "never_ran",
    "reach_kafka",
    "rebuild",
    "run",
    "spark_session",
    "sqlalchemy_url",
    "stop_session",
    "verify",
]
