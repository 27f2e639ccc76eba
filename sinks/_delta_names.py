"""The columns of a warehouse table: the row's fields by their Avro names, as far as Delta takes them, and ours."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

META = ("__op", "__commit_lsn", "__lsn", "__ts_ms", "__applied_ms")
UNCHANGED = "__unchanged"  # in the MERGE source only (and in histories)


def history_app(sink: str, table: str, generation: int) -> str:
    """The Delta transaction id (txnAppId) of a table's history appends; their version is the batch id, so a
    batch's history is appended once whichever path (Spark's, delta-rs's) writes it first."""
    return f"pgcdc-{sink}-{table}-g{generation}"


def create_app(sink: str, table: str, generation: int) -> str:
    """The Delta transaction id of the append that creates a table (version: the batch id)."""
    return f"{history_app(sink, table, generation)}-create"


def delta_columns(fields: Sequence[str], existing: Sequence[str] = ()) -> dict[str, str]:
    """The Delta column of each Avro field of a row: its name, unless Delta would refuse it.

    Delta compares column names ignoring case, so Avro fields ``Order`` and ``order`` (columns "Order" and
    "order") cannot both keep their names, and a column named like one of ours (``__op``…) would clash. Such
    a field, in field order, gets ``__`` and 8 hex digits of its name's SHA-256 (``order__1a2b3c4d``).

    ``existing``: the Delta table's columns. A field that already has a column keeps it, whatever happened to
    the other fields since: a dropped or renamed case-twin must not hand its name over (``order`` would then
    become ``order``, which Delta refuses next to the old ``Order``, and its values would be stranded).
    """
    ours = {m.lower() for m in (*META, UNCHANGED)}
    present = {c for c in existing if c.lower() not in ours}  # the sink's own columns are never a field's
    taken = ours | {c.lower() for c in existing}
    out: dict[str, str] = {}
    for name in fields:
        for candidate in _candidates(name):
            if candidate in present:
                out[name] = candidate
                break
            if candidate.lower() not in taken:
                break  # the first free name: nothing further on can be this field's existing column
    for name in fields:
        if name in out:
            continue
        for column in _candidates(name):
            if column.lower() not in taken:
                break
        taken.add(column.lower())
        out[name] = column
    return out


def _candidates(name: str) -> Iterator[str]:
    """The names a field's column may have, in the order they are given out."""
    yield name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    yield f"{name}__{digest}"
    n = 3
    while True:
        yield f"{name}__{digest}_{n}"
        n += 1
