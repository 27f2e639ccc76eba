"""How far each sink is behind, measured from outside it: its checkpoint's offsets against the topics' ends.

Measured like consumer-lag exporters do (from outside the consumer), so the lag keeps climbing while a sink
is stopped, crashed or backing off — exactly when it matters. Reads only files and Kafka metadata: no Spark,
so the capture service and ``cdc status`` can use it.

Spark's checkpoint keeps, per micro-batch N, ``offsets/N`` (written before the batch runs: line 1 the
version, line 2 batch metadata, then one JSON line per source with the *end* offsets of the batch) and
``commits/N`` (written once the batch is done). The newest committed batch's end offsets are what the sink
has applied.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pgcdc_common.topics import superseded
from sinks._config import SinkSettings
from sinks._storage import Location

if TYPE_CHECKING:
    from sinks._served import ServedTopics

STATUS_FILE = "status.json"
REBUILD_FILE = "rebuild.json"
HEARTBEAT_S = 5.0  # how often `cdc sinks run` says it is alive in each sink's status file
HEARTBEAT_STALE_S = 20.0


def checkpoint_offsets(checkpoint: Location) -> dict[tuple[str, int], int] | None:
    """The end offsets of the newest committed batch; None when no batch has completed yet."""
    done = [int(p.name) for p in (checkpoint / "commits").children() if p.name.isdigit()]
    for batch in sorted(done, reverse=True):
        offsets = batch_offsets(checkpoint, batch)
        if offsets is None:  # purged between listing and reading: take the next newest
            continue
        return offsets
    return None


def reached(done: Mapping[tuple[str, int], int], ends: Mapping[tuple[str, int], tuple[int, int]]) -> bool:
    """Whether a checkpoint's committed offsets (``done``) reach every partition's high watermark in ``ends``
    ((low, high)); a partition the checkpoint does not name yet has read nothing (its low)."""
    return all(done.get(tp, low) >= high for tp, (low, high) in ends.items())


def checkpoint_location(state: Location, sink: str, generation: int) -> Location:
    """Where the query of ``sink``'s generation ``generation`` keeps its checkpoint, under ``sinks.state_dir``."""
    return state / sink / f"g{generation}" / "checkpoint"


def batch_offsets(checkpoint: Location, batch: int) -> dict[tuple[str, int], int] | None:
    """The end offsets of batch ``batch`` (Spark writes ``offsets/N`` before it runs N); None when absent."""
    text = (checkpoint / "offsets" / str(batch)).read_text()
    if text is None:
        return None
    lines = text.splitlines()
    offsets: dict[tuple[str, int], int] = {}
    for line in lines[2:]:
        if line.startswith("{"):
            for topic, parts in json.loads(line).items():
                for partition, offset in parts.items():
                    offsets[(topic, int(partition))] = int(offset)
    return offsets


@dataclass
class PartitionLag:
    topic: str
    partition: int
    end: int
    committed: int  # what the sink has applied: its checkpoint's offset, or its lane's when further
    lag: int


@dataclass
class SinkProgress:
    """One sink as seen from outside: what the dashboard, ``cdc status`` and the metrics show."""

    name: str
    generation: int | None
    state: str  # running | backoff | stopped | given_up | unknown (from the app's status file)
    lag_records: int | None  # None: never completed a batch or the topics' ends are unknown
    freshness_s: float | None
    dead_letters: int = 0
    batches: int = 0
    records: int = 0
    last_batch_s: float | None = None
    last_source_ts_ms: int | None = None
    last_error: str | None = None
    updated_at: float | None = None
    partitions: list[PartitionLag] = field(default_factory=list)
    rebuild: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_json(path: Location) -> dict[str, Any]:
    return _parse_json(path.read_text() or "{}")


def _parse_json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # caught mid-replace on some filesystems
        return {}
    return data if isinstance(data, dict) else {}


def _lag(
    checkpoint: Location | None,
    ends: Mapping[tuple[str, int], tuple[int, int]],
    lane: Mapping[tuple[str, int], int] | None = None,
) -> tuple[int, list[PartitionLag]]:
    """The sink's lag per partition: from its checkpoint, or from where its lane has applied to when that is
    further (``lane``: the status file's ``lane_applied`` of the same generation)."""
    # A sink that has not completed a batch yet (or never started a query) has applied nothing: it is behind
    # by everything, so the lag alerts can fire for a sink that fails on its first batch.
    committed = (checkpoint_offsets(checkpoint) if checkpoint is not None else None) or {}
    parts = []
    for (topic, partition), (low, high) in sorted(ends.items()):
        # A topic the query has not reached yet starts at the earliest offset (startingOffsets=earliest).
        done = committed.get((topic, partition), low)
        done = max(done, (lane or {}).get((topic, partition), done))
        parts.append(PartitionLag(topic, partition, high, done, max(0, high - done)))
    return sum(p.lag for p in parts), parts


def lane_offsets(status: Mapping[str, Any], generation: Any) -> dict[tuple[str, int], int]:
    """Where a sink's lane has applied to (sinks._lane), from its status file: per partition, the offset before
    which everything is in the store. Empty when the lane wrote another generation (a swap since) or none."""
    applied = status.get("lane_applied")
    if status.get("lane_generation") != generation or not isinstance(applied, list):
        return {}
    out = {}
    for item in applied:
        if isinstance(item, list) and len(item) == 3:
            topic, partition, offset = item
            if isinstance(topic, str) and isinstance(partition, int) and isinstance(offset, int):
                out[(topic, partition)] = offset
    return out


def sinks_present(settings: SinkSettings) -> bool:
    """Whether any sink has a status file under ``sinks.state_dir`` (before the first, there is nothing to show)."""
    return any((d / STATUS_FILE).read_text() is not None for d in settings.state.children())


def sink_progress(
    settings: SinkSettings,
    ends: Mapping[tuple[str, int], tuple[int, int]],
    *,
    now: float | None = None,
    timestamp_at: Callable[[str, int, int], float | None] | None = None,
) -> list[SinkProgress]:
    """Every sink with a state directory, against ``ends`` ((topic, partition) -> (low, high) watermarks).

    Freshness is the age of the oldest change the sink has not applied: 0 when it has applied everything,
    else now minus the Kafka timestamp of the first unapplied record (``timestamp_at(topic, partition,
    offset)``), falling back to the time since the newest event it applied when that is unknown.
    """
    now = time.time() if now is None else now
    base = settings.state
    pattern = re.compile(settings.topic_pattern())
    ends = {tp: v for tp, v in ends.items() if pattern.fullmatch(tp[0])}
    out = []
    for sink_dir in sorted(base.children(), key=lambda d: d.name):
        name = sink_dir.name
        text = (sink_dir / STATUS_FILE).read_text()
        if text is None:
            continue  # not a sink's directory
        status = _parse_json(text)
        generation = status.get("generation")
        checkpoint = checkpoint_location(base, name, generation) if isinstance(generation, int) else None
        lag, parts = _lag(checkpoint, ends, lane_offsets(status, generation))
        last_ts = status.get("last_source_ts_ms")
        out.append(
            SinkProgress(
                name=name,
                generation=generation if isinstance(generation, int) else None,
                state=_state(status, now),
                lag_records=lag,
                freshness_s=_freshness(lag, parts, last_ts, now, timestamp_at),
                dead_letters=int(status.get("dead_letters", 0)),
                batches=int(status.get("batches", 0)),
                records=int(status.get("records", 0)),
                last_batch_s=status.get("last_batch_s"),
                last_source_ts_ms=last_ts,
                last_error=status.get("last_error"),
                updated_at=status.get("updated_at"),
                partitions=parts,
                rebuild=_rebuild(base, name, ends, now),
            )
        )
    return out


def _state(status: dict[str, Any], now: float) -> str:
    state = str(status.get("state", "unknown"))
    beat = status.get("heartbeat_at")
    if state in ("running", "backoff") and (not isinstance(beat, int | float) or now - beat > HEARTBEAT_STALE_S):
        state = "not running"  # the app said running but has not been heard from: killed, or its host is gone
    return state


def _freshness(
    lag: int,
    parts: list[PartitionLag],
    last_ts: int | None,
    now: float,
    timestamp_at: Callable[[str, int, int], float | None] | None,
) -> float | None:
    if lag == 0:
        return 0.0
    oldest = [
        ts
        for p in parts
        if p.lag and timestamp_at is not None
        for ts in [timestamp_at(p.topic, p.partition, p.committed)]
        if ts is not None
    ]
    since = min(oldest) if oldest else (last_ts / 1000 if last_ts else None)
    return max(0.0, now - since) if since is not None else None


def _rebuild(
    base: Location, name: str, ends: Mapping[tuple[str, int], tuple[int, int]], now: float
) -> dict[str, Any] | None:
    """The sink's rebuild status, if any, with its progress while it runs."""
    rebuild = _read_json(base / name / REBUILD_FILE) or None
    if rebuild and rebuild.get("state") in ("running", "verifying") and now - rebuild.get("updated_at", 0) > 600:
        rebuild = {**rebuild, "state": "interrupted"}  # its process is gone; a new rebuild starts over
    if rebuild is not None and rebuild.get("state") == "running" and isinstance(rebuild.get("generation"), int):
        rlag, rparts = _lag(checkpoint_location(base, name, rebuild["generation"]), ends)
        total = sum(p.end - (ends[(p.topic, p.partition)][0]) for p in rparts) if rparts else None
        rebuild = {
            **rebuild,
            "lag_records": rlag,
            "total": total,
            "done": None if total is None else total - (rlag or 0),
        }
    return rebuild


class TopicEnds:
    """The change topics' watermarks, read_committed (the high watermark is the last stable offset)."""

    def __init__(self, settings: SinkSettings, *, timeout_s: float = 5.0, served: ServedTopics | None = None) -> None:
        """``served``: a store generation's choice of topic generations (sinks._served); without it, each
        table's newest."""
        from confluent_kafka import Consumer

        self._served = served
        self._pattern = re.compile(settings.topic_pattern())
        self._prefix = settings.kafka.topic_prefix
        self._timeout = timeout_s
        self._stamps: dict[tuple[str, int, int], float | None] = {}
        self._consumer = Consumer(
            {
                # kafka.consumer holds the Java client's names (for Spark): brokers and security only here.
                **settings.kafka.client_conf(),
                "group.id": "pgcdc-lag-probe",  # never joins or commits: only metadata and watermarks
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "socket.timeout.ms": int(timeout_s * 1000),
            }
        )

    def topics(self) -> list[str]:
        """The change topics, every generation of each table's."""
        md = self._consumer.list_topics(timeout=self._timeout)
        return [t for t, meta in md.topics.items() if meta.error is None and self._pattern.fullmatch(t)]

    def superseded(self) -> set[str]:
        """The change topics not read (pgcdc_common.topics.superseded): earlier generations of a moved table's."""
        return self._skipped(self.topics())

    def _skipped(self, topics: Iterable[str]) -> set[str]:
        return superseded(topics, self._prefix) if self._served is None else self._served.superseded(topics)

    def read(self) -> dict[tuple[str, int], tuple[int, int]]:
        from confluent_kafka import TopicPartition

        md = self._consumer.list_topics(timeout=self._timeout)
        ends: dict[tuple[str, int], tuple[int, int]] = {}
        for topic, meta in md.topics.items():
            if meta.error is None and self._pattern.fullmatch(topic):
                for partition in meta.partitions:
                    low, high = self._consumer.get_watermark_offsets(
                        TopicPartition(topic, partition), timeout=self._timeout, cached=False
                    )
                    ends[(topic, partition)] = (low, high)
        old = self._skipped({topic for topic, _ in ends})  # a table moved to a later topic generation
        return {tp: v for tp, v in ends.items() if tp[0] not in old}

    def timestamp_at(self, topic: str, partition: int, offset: int) -> float | None:
        """The Kafka timestamp (seconds) of the first committed record at or after ``offset``; cached."""
        from confluent_kafka import TopicPartition

        key = (topic, partition, offset)
        if key not in self._stamps:
            if len(self._stamps) > 10_000:
                self._stamps.clear()
            self._consumer.assign([TopicPartition(topic, partition, offset)])
            # Short: below the end there is a committed record unless only aborted ones and markers remain.
            msg = self._consumer.poll(min(1.0, self._timeout))
            self._consumer.unassign()
            _kind, ms = msg.timestamp() if msg is not None and msg.error() is None else (0, -1)
            if ms < 0:
                return None  # not cached: nothing readable yet (an open transaction), ask again next time
            self._stamps[key] = ms / 1000
        return self._stamps[key]

    def close(self) -> None:
        self._consumer.close()


__all__ = [
    "PartitionLag",
    "SinkProgress",
    "TopicEnds",
    "batch_offsets",
    "checkpoint_offsets",
    "sink_progress",
    "sinks_present",
]


def topic_names(settings: SinkSettings) -> list[str]:
    """The change topics, every generation of each table's (one metadata request)."""
    ends = TopicEnds(settings)
    try:
        return ends.topics()
    finally:
        ends.close()
