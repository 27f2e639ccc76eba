"""An example sink plugin: appends each table's changes to ``<path>/<schema>.<table>.jsonl``.

Configure it in the pipeline's TOML file and run it like a built-in:

    [sinks.plugins.jsonl]
    path = "changes"

    $ cdc sinks run jsonl --config cdc.toml

Each line is one change, in document form: {"op", "key", "row", "commit_lsn", "lsn", "ts_ms"}; a truncate is
a line with "op": "t". The runtime hands over the last change per key of each micro-batch; a batch can be
replayed after a crash, so the file may repeat changes (a reader keeps the one with the highest position).

The lines are written by :class:`JsonlWriter` inside Spark's executor tasks, one task per partition of a
table's changes, so ``path`` is a directory on the executors' machines (on ``local[*]``, this machine's).
Tasks of one batch run at the same time: each appends its lines with one locked write.

It meets the contract :class:`sinks.PartitionSink` by its methods alone (no base class): discovery accepts any
class that has them.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sinks import Change, Rejected, SinkContext, TableInfo


class JsonlSink:
    name = "jsonl"

    def open(self, context: SinkContext) -> None:
        self.path = Path(context.options.get("path", "changes")).resolve()

    def prepare(self, tables: Sequence[TableInfo]) -> None:
        """On the driver, once per batch before the writes."""
        self.path.mkdir(parents=True, exist_ok=True)

    def partition_writer(self) -> JsonlWriter:
        return JsonlWriter(str(self.path))  # pickled to the executors: settings only, no open files

    def close(self) -> None:
        """Nothing to release: the writers open and close their files within each task."""


@dataclass(frozen=True)
class JsonlWriter:
    path: str

    def write(self, table: TableInfo, changes: Iterator[Change]) -> Iterable[Rejected]:
        lines = [json.dumps(_line(change), ensure_ascii=False) + "\n" for change in changes]
        if lines:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            with (Path(self.path) / f"{table.name}.jsonl").open("a", encoding="utf-8") as out:
                fcntl.flock(out, fcntl.LOCK_EX)  # other tasks of the batch append to the same file
                out.write("".join(lines))
        return ()


def _line(change: Change) -> dict[str, object]:
    if change.op == "t":
        return {"op": "t", "commit_lsn": change.commit_lsn, "lsn": change.lsn}
    return {
        "op": change.op,
        "key": change.key,
        "row": change.row,
        "commit_lsn": change.commit_lsn,
        "lsn": change.lsn,
        "ts_ms": change.ts_ms,
    }
