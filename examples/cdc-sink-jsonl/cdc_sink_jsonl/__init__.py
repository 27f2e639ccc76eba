"""An example sink plugin: appends each table's changes to ``<path>/<schema>.<table>.jsonl``.

Configure it in the pipeline's TOML file and run it like a built-in:

    [sinks.plugins.jsonl]
    path = "changes"

    $ cdc sinks run jsonl --config cdc.toml

Each line is one change, in document form: {"op", "key", "row", "commit_lsn", "lsn", "ts_ms"}; a truncate is
a line with "op": "t". The runtime hands over the last change per key of each micro-batch; a batch can be
replayed after a crash, so the file may repeat changes (a reader keeps the one with the highest position).
"""

from __future__ import annotations

import json
from pathlib import Path

from sinks import BaseSink, Batch, SinkContext


class JsonlSink(BaseSink):
    name = "jsonl"

    def open(self, context: SinkContext) -> None:
        super().open(context)
        self.path = Path(context.options.get("path", "changes"))
        self.path.mkdir(parents=True, exist_ok=True)

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            with (self.path / f"{table.name}.jsonl").open("a", encoding="utf-8") as out:
                if table.truncate is not None:
                    out.write(json.dumps({"op": "t", "commit_lsn": table.truncate[0], "lsn": table.truncate[1]}) + "\n")
                for change in table.changes():
                    line = {
                        "op": change.op,
                        "key": change.key,
                        "row": change.row,
                        "commit_lsn": change.commit_lsn,
                        "lsn": change.lsn,
                        "ts_ms": change.ts_ms,
                    }
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
