"""``cdc verify``'s comparison of a store with the source, in memory that does not grow with the table.

Both sides stream through: the source in keyset chunks (cdc's ``SourceTable.rows``), the store as its sink
reads it back (``read_table``). Each row, in document form, is kept pickled with a digest in an on-disk SQLite
ledger (a temporary file, removed afterwards), keyed by its key; SQLite's joins then find the keys that are
missing from the store, extra in it, or whose digests differ (those rows are compared again as values: two
encodings of one value, such as 0.0 and -0.0, are not a drift). Memory holds a chunk of rows and the first few
keys of each kind, whatever the table's size; the disk holds the ledger.

Every key found is written to ``<state_dir>/<sink>/verify/<schema>.<table>.jsonl`` (docs/sinks.md), one JSON
object per line: ``{"kind": "missing" | "extra" | "different", "key": <key>, "columns": {<column>: <text>}}``
where ``<key>`` is the store's key of the row (the key fields' JSON) and ``columns`` the same key as PostgreSQL
reads it, each key column's value as text (what ``cdc verify --repair`` and ``cdc snapshot --keys`` hand the
capture; absent for a key type whose store form PostgreSQL cannot read back, such as a composite); a source row
with a value Avro cannot hold, which has no event (the capture dead-letters or stops on it:
capture.on_unencodable), is ``{"kind": "unencodable", "key": <its key columns as
PostgreSQL prints them, a JSON object>, "error": …}``. The file is replaced at each verify and removed when
there is no drift.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import pickle
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinks._api import TableRef, key_id
from sinks._storage import Location
from sinks._values import Names, column_name, doc_converter

SAMPLE = 10  # keys of each kind kept for the report on the terminal
_BATCH = 5_000  # rows per SQLite insert


@dataclass
class Drift:
    """One table's comparison: counts, the first keys of each kind, and where the full list is."""

    table: str
    missing: list[str] = field(default_factory=list)  # the first SAMPLE
    extra: list[str] = field(default_factory=list)
    different: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    # Source rows with a value Avro cannot hold: (the key as PostgreSQL prints it, why); the capture dead-letters
    # or stops on them (capture.on_unencodable), so no store has them.
    unencodable: list[tuple[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"missing": 0, "extra": 0, "different": 0, "unencodable": 0})
    report: str | None = None  # the file listing every key found
    location: Location | None = None  # the same, to read it back (a repair does)

    @property
    def clean(self) -> bool:
        return not any(self.counts.values())


def compare(
    sink: Any, source_tables: Sequence[Any], generation: int, table_name: Any, reports: Location | None
) -> list[Drift]:
    """Each source table against the sink's copy of generation ``generation``, key by key, in document form.

    ``table_name(topic)`` is the store's name of a table; ``reports`` the directory for the key lists.
    """
    drifts = []
    for src in source_tables:
        ref = TableRef(src.topic, table_name(src.topic), src.key_fields, src.row_schema)
        with tempfile.TemporaryDirectory(prefix="pgcdc-verify-") as tmp, closing(_ledger(Path(tmp))) as db:
            columns = _fill(db, "src", _source_docs(src, db))
            _fill(db, "dst", ((k, {c: row.get(c) for c in columns}) for k, row in sink.read_table(ref, generation)))
            drift = Drift(src.qualified)
            report = reports / f"{ref.name}.jsonl" if reports is not None else None
            _collect(db, drift, report, Path(tmp) / "report.jsonl", key_texts(src))
        drifts.append(drift)
    return drifts


def _source_docs(src: Any, db: sqlite3.Connection) -> Iterator[tuple[str, dict[str, Any]]]:
    """The source's rows in document form by key id; a row with no event (a value Avro cannot hold) goes to the
    ledger's ``bad`` table instead, with its key as PostgreSQL prints it and its key id when it has one."""
    names = Names()
    fields = src.row_schema["fields"]
    convs = {f["name"]: (column_name(f), doc_converter(f["type"], names, spark=False)) for f in fields}

    def doc_key(raw: dict[str, Any]) -> str:
        return key_id({convs[k][0]: convs[k][1](raw[k]) for k in src.key_fields})

    def unencodable(row: Any) -> None:
        key = doc_key(row.key) if row.key is not None else None
        text = json.dumps(row.key_text, ensure_ascii=False)
        db.execute("INSERT OR REPLACE INTO bad VALUES (?, ?, ?)", (text, key, row.error))

    key_cols = [convs[k][0] for k in src.key_fields]
    for raw in src.rows(unencodable=unencodable):
        row = {col: conv(raw[name]) for name, (col, conv) in convs.items()}
        yield key_id({c: row[c] for c in key_cols}), row


def _ledger(directory: Path) -> sqlite3.Connection:
    db = sqlite3.connect(directory / "ledger.db")
    db.execute("PRAGMA journal_mode = OFF")  # a scratch file: nothing to recover after a crash
    db.execute("PRAGMA synchronous = OFF")
    db.execute("PRAGMA cache_size = -65536")  # 64 MiB of pages at most
    for side in ("src", "dst"):
        db.execute(f"CREATE TABLE {side} (key TEXT PRIMARY KEY, digest BLOB NOT NULL, row BLOB NOT NULL)")
    # Source rows with no event: the key as PostgreSQL prints it (JSON), its key id (None: the key itself cannot
    # be encoded), why.
    db.execute("CREATE TABLE bad (text TEXT PRIMARY KEY, key TEXT, error TEXT NOT NULL)")
    return db


def _fill(db: sqlite3.Connection, side: str, rows: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    """Insert ``rows`` into ``side``; the columns of the first row (every row has the same)."""
    columns: list[str] = []
    batch: list[tuple[str, bytes, bytes]] = []
    for key, row in rows:
        if not columns:
            columns = list(row)
        blob = pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL)
        batch.append((key, hashlib.blake2b(blob, digest_size=16).digest(), blob))
        if len(batch) >= _BATCH:
            db.executemany(f"INSERT OR REPLACE INTO {side} VALUES (?, ?, ?)", batch)  # noqa: S608 - side is ours
            batch.clear()
    db.executemany(f"INSERT OR REPLACE INTO {side} VALUES (?, ?, ?)", batch)  # noqa: S608
    db.commit()
    return columns


_MISSING = "SELECT s.key FROM src s LEFT JOIN dst d ON d.key = s.key WHERE d.key IS NULL ORDER BY s.key"
# A key the store holds whose source row cannot be encoded any more is reported as that, not as extra.
_EXTRA = (
    "SELECT d.key FROM dst d LEFT JOIN src s ON s.key = d.key WHERE s.key IS NULL"
    " AND d.key NOT IN (SELECT key FROM bad WHERE key IS NOT NULL) ORDER BY d.key"
)
_UNENCODABLE = "SELECT text, error FROM bad ORDER BY text"
_DIGESTS_DIFFER = (
    "SELECT s.key, s.row, d.row FROM src s JOIN dst d ON d.key = s.key WHERE s.digest <> d.digest ORDER BY s.key"
)


def key_texts(src: Any) -> Callable[[str], dict[str, str] | None]:
    """A function from a key id (the key's document-form values, JSON) to the key's columns as text PostgreSQL
    reads as their types (None when one cannot be written so)."""
    names = Names()
    fields = {f["name"]: f for f in src.row_schema["fields"]}
    for f in src.row_schema["fields"]:
        names.resolve(f["type"], None)  # named types defined before the key fields refer to them
    texts = [(column_name(fields[k]), _text_of(fields[k]["type"], names)) for k in src.key_fields]

    def columns(key: str) -> dict[str, str] | None:
        try:  # an extra key is the store's: whatever was written there by hand
            values = json.loads(key)
            if not isinstance(values, list) or len(values) != len(texts):
                return None
            out = {}
            for (column, text), value in zip(texts, values, strict=True):
                written = text(value)
                if written is None:
                    return None
                out[column] = written
        except (ValueError, TypeError, RecursionError, binascii.Error):
            return None
        return out

    return columns


def _text_of(avro: Any, names: Names) -> Callable[[Any], str | None]:
    """Document form -> PostgreSQL's text for one key field's type: numbers, text, UUIDs, dates and times (ISO
    8601) as they are, booleans as true/false, bytes (base64 in documents) as bytea's hex."""
    avro = names.resolve(avro, None)
    if isinstance(avro, list):
        real = [b for b in avro if b != "null"]
        return _text_of(real[0], names) if len(real) == 1 else lambda _: None
    kind = avro if isinstance(avro, str) else avro["type"]
    if isinstance(kind, (dict, list)):
        return _text_of(kind, names)
    logical = None if isinstance(avro, str) else avro.get("logicalType")
    if kind in ("record", "array", "map"):
        return lambda _: None
    if kind in ("bytes", "fixed") and logical != "decimal":
        return lambda v: None if not isinstance(v, str) else "\\x" + base64.b64decode(v).hex()
    if logical in ("timestamp-micros", "local-timestamp-micros", "date"):
        return lambda v: v if isinstance(v, str) else None  # an int: out of what a document writes as a date
    if kind == "boolean":
        return lambda v: "true" if v else "false"
    return lambda v: None if v is None else str(v)


def _collect(
    db: sqlite3.Connection,
    drift: Drift,
    report: Location | None,
    scratch: Path,
    columns: Callable[[str], dict[str, str] | None],
) -> None:
    """Count and sample each kind of difference; list every one in ``report`` (removed when there is none)."""
    with scratch.open("w") as lines:

        def found(kind: str, key: str, error: str | None = None) -> None:
            drift.counts[kind] += 1
            line: dict[str, Any] = {"kind": kind, "key": key}
            if error is not None:
                line["error"] = error
            elif (text := columns(key)) is not None:
                line["columns"] = text
            lines.write(json.dumps(line) + "\n")

        _differences(db, drift, found)
    if report is None:
        return
    if drift.clean:
        report.remove()
    else:
        report.write_from(scratch)
        drift.report, drift.location = report.uri, report


def _differences(db: sqlite3.Connection, drift: Drift, found: Any) -> None:
    for (key,) in db.execute(_MISSING):
        found("missing", key)
        if len(drift.missing) < SAMPLE:
            drift.missing.append(key)
    for (key,) in db.execute(_EXTRA):
        found("extra", key)
        if len(drift.extra) < SAMPLE:
            drift.extra.append(key)
    for text, error in db.execute(_UNENCODABLE):
        found("unencodable", text, error)
        if len(drift.unencodable) < SAMPLE:
            drift.unencodable.append((text, error))
    for key, want_blob, got_blob in db.execute(_DIGESTS_DIFFER):
        want, got = pickle.loads(want_blob), pickle.loads(got_blob)  # noqa: S301 - written above, by this process
        if all(got.get(c) == v for c, v in want.items()):
            continue  # equal values, encoded differently
        found("different", key)
        if len(drift.different) < SAMPLE:
            drift.different.append((key, want, {c: got.get(c) for c in want}))


__all__ = ["SAMPLE", "Drift", "compare", "key_texts"]
