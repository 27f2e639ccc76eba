#!/usr/bin/env python3
"""Sinks: replay throughput, rebuild from offset zero, freshness and keeping up, against same-run references.

    ~/.cache/pgcdc/venv/bin/python bench/sinks_bench.py [--rows 100000] [--freshness-seconds 60] [--rate 5]

1. Snapshots a scratch table of ``--rows`` rows (6 columns incl. numeric, timestamptz, jsonb) into Kafka with
   `cdc run`, then stops the capture.
2. Throughput: each sink alone (search, cache, warehouse) replays the whole topic from offset zero into a fresh
   copy as fast as it can, in this process; the reference is the same Spark query with a sink that only
   materialises the decoded, last-per-key frame (read + decode + dedupe: what every sink pays before its
   store). events/s against the reference's.
3. Freshness: `cdc run` streams again and `cdc sinks run` keeps all three stores as in production while
   ``--rate`` single-row transactions per second are committed for ``--freshness-seconds``; every store records
   when it applied each change (applied_ms), so freshness = applied - commit time (source ts_ms), p50/p99
   (limits: cache and search p99 < 2 s, warehouse p99 < 30 s). The search index makes a document searchable at
   its next refresh (1 s by default) after that. Keeping up: meanwhile, every second, each sink's lag as
   `cdc status` measures it (sinks/_progress.py: records between its checkpoint and the topics' ends, and the
   age of its oldest unapplied change) is sampled; after the load, how long each takes to reach lag 0.
4. Rebuild: with the capture and the sinks stopped, `cdc sinks rebuild NAME` (what an operator runs: a fresh
   generation from offset zero beside the served one, verified against PostgreSQL, swapped in) for each sink;
   its replay is timed from its "rebuilding" line to its "caught up" line, as events/s against the reference
   of step 2 (the whole command, Spark start-up and verify included, is in the notes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import psycopg
from psycopg import sql

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _debezium as dbz  # noqa: E402 - a sibling module: bench/ is not a package
import redis  # noqa: E402
from _capture_bench import dsn_for  # noqa: E402
from _report import Measure, Result, percentile, write_result  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from opensearchpy import OpenSearch  # noqa: E402

from sinks import BaseSink, Batch  # noqa: E402
from sinks._config import load_sink_settings  # noqa: E402
from sinks._progress import TopicEnds, sink_progress  # noqa: E402
from sinks._runner import SinkQuery, spark_session  # noqa: E402
from tests import _services  # noqa: E402 - finds (or starts) the local services like the tests do

SCENARIO = "sinks"
SINKS = ("search", "cache", "warehouse")
FRESHNESS_LIMIT_S = {"search": 2.0, "cache": 2.0, "warehouse": 30.0}
TABLE = "events"


class _Reference(BaseSink):
    """Materialises what every sink starts from, and nothing more."""

    name = "reference"

    def write(self, batch: Batch) -> None:
        for table in batch.tables:
            table.frame.count()


def _config(path: Path, dsn: str, *, kafka: str, registry: str, prefix: str, extra: str) -> None:
    path.write_text(
        f"""[source]
dsn = "{dsn}"
tables = ["public.{TABLE}"]
slot = "{prefix}"
publication = "{prefix}"

[kafka]
bootstrap_servers = "{kafka}"
topic_prefix = "{prefix}"

[registry]
url = "{registry}"

[metrics]
port = 0
{extra}
"""
    )


def _cdc(args: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "cdc.cli", *args], stdout=log, stderr=log)


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class _LagSampler(threading.Thread):
    """Each sink's lag (records, and age of its oldest unapplied change) once a second, as `cdc status` sees it."""

    def __init__(self, config: Path) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self.settings = load_sink_settings(config)
        self.samples: dict[str, list[tuple[float, int | None, float | None]]] = {n: [] for n in SINKS}
        self.started = time.monotonic()
        self.halt = threading.Event()

    def run(self) -> None:
        ends = TopicEnds(self.settings)
        try:
            while not self.halt.is_set():
                with contextlib.suppress(Exception):  # a metadata hiccup is a missing sample, not a failure
                    marks = ends.read()
                    t = time.monotonic() - self.started
                    for p in sink_progress(self.settings, marks, timestamp_at=ends.timestamp_at):
                        if p.name in self.samples:
                            self.samples[p.name].append((t, p.lag_records, p.freshness_s))
                self.halt.wait(1.0)
        finally:
            ends.close()

    def latest(self, name: str) -> int | None:
        return self.samples[name][-1][1] if self.samples[name] else None

    def window(self, name: str, start: float, end: float) -> list[tuple[float, int | None, float | None]]:
        return [s for s in self.samples[name] if start <= s[0] <= end]


def _rebuild(name: str, config: Path, log: Path) -> dict[str, float]:
    """Run `cdc sinks rebuild NAME`; seconds from launch to its 'rebuilding', 'caught up' and final lines."""
    marks: dict[str, float] = {}
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cdc.cli", "sinks", "rebuild", name, "--config", str(config), "--verify-wait", "60"],
            stdout=subprocess.PIPE,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            out.write(raw)
            now = time.monotonic() - started
            if line.startswith(f"rebuilding {name}"):
                marks["rebuilding"] = now
            elif "caught up with the topics" in line:
                marks["caught_up"] = now
        code = proc.wait(60)
    marks["exit"] = time.monotonic() - started
    if code != 0 or "rebuilding" not in marks or "caught_up" not in marks:
        raise RuntimeError(f"cdc sinks rebuild {name} failed (exit {code}); log: {log}")
    return marks


def _cleanup(prefix: str, *, kafka: str, registry: str, opensearch: str, redis_url: str) -> None:
    with contextlib.suppress(Exception):
        client = OpenSearch(opensearch)
        client.indices.delete(index=f"{prefix}*", expand_wildcards="all")
    with contextlib.suppress(Exception):
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(match=f"{prefix}:*", count=1000):
            r.delete(key)
    topic = f"{prefix}.public.{TABLE}"
    with contextlib.suppress(Exception):
        dbz.delete_topics(kafka, [topic, f"{prefix}.offsets", f"{prefix}.dead-letter"])
        dbz.delete_subjects(registry, [topic])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument(
        "--freshness-seconds", "--seconds", type=float, default=60.0, help="seconds of load while freshness is measured"
    )
    parser.add_argument("--rate", type=float, default=5.0, help="transactions per second during freshness")
    parser.add_argument("--max-offsets", type=int, default=50_000, help="maxOffsetsPerTrigger for the replays")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="after the load: wait for lag 0")
    parser.add_argument("--no-rebuild", action="store_true", help="skip step 4")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database, stores, topics and logs")
    return parser


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)

    admin = _services.find("postgres").value
    kafka, registry = _services.find("kafka").value, _services.find("registry").value
    opensearch, redis_url = _services.find("opensearch").value, _services.find("redis").value
    jars = [j for j in _services.find("spark-jars").value.split(",") if j]
    run_id = str(int(time.time()))
    prefix = f"sbench_{run_id}"
    db = f"sbench_{run_id}"
    topic = f"{prefix}.public.{TABLE}"
    work = Path(tempfile.mkdtemp(prefix="pgcdc-sinks-bench-"))
    n = int(args.freshness_seconds * args.rate)
    result = Result(
        SCENARIO,
        params={
            "rows": args.rows,
            "max_offsets_per_trigger": args.max_offsets,
            "freshness_load": f"{args.rate:g} single-row transactions/s for {args.freshness_seconds:g} s, "
            "capture and 3 sinks at once",
            "table": "id bigint PK, name text, qty int, price numeric(12,2), at timestamptz, payload jsonb",
        },
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    dsn = dsn_for(admin, db)
    log = open(work / "cdc.log", "ab")  # noqa: SIM115 - handed to the children, closed at the end
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigint PRIMARY KEY, name text, qty int, price numeric(12,2), "
                    "at timestamptz DEFAULT now(), payload jsonb)"
                ).format(sql.Identifier(TABLE))
            )
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} SELECT g, 'name ' || g, g %% 1000, g / 100.0, now(), "
                    "jsonb_build_object('g', g, 'tags', jsonb_build_array('a', 'b')) FROM generate_series(1, %s) g"
                ).format(sql.Identifier(TABLE)),
                (args.rows,),
            )
        sinks_toml = f"""
[sinks]
state_dir = "{work / "state"}"
spark_jars = {json.dumps(jars)}
trigger_interval_s = 1.0
max_offsets_per_trigger = {args.max_offsets}

[sinks.search]
url = "{opensearch}"

[sinks.cache]
url = "{redis_url}"

[sinks.warehouse]
path = "{work / "warehouse"}"
"""
        config = work / "cdc.toml"
        _config(config, dsn, kafka=kafka, registry=registry, prefix=prefix, extra=sinks_toml)

        # 1. the snapshot into Kafka
        capture = _cdc(["run", "--config", str(config)], log)
        consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"bench-{run_id}"})
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            try:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
            except Exception:
                high = 0
            if high >= args.rows:
                break
            if capture.poll() is not None:
                raise RuntimeError(f"cdc run exited with {capture.returncode}; log: {work / 'cdc.log'}")
            time.sleep(1)
        consumer.close()
        _stop(capture, 120)
        print(f"snapshot of {args.rows:,} rows in {topic}", file=sys.stderr)

        # 2. throughput, in this process
        settings = load_sink_settings(config)
        spark = spark_session(settings, "pgcdc-sinks-bench")
        throughput: dict[str, float] = {}
        # The first replay in a JVM pays for class loading and JIT: a warm-up pass of the reference is not counted.
        for name in ("warm-up", "reference", *SINKS):
            sink = _Reference() if name in ("warm-up", "reference") else None
            query = SinkQuery(name, settings, spark, 1000, follow_swaps=False, sink=sink)
            started = time.monotonic()
            query.start()
            while not query.caught_up():
                if query.query is not None and not query.query.isActive:
                    raise RuntimeError(f"{name} failed: {query.query.exception()}")
                time.sleep(0.2)
            elapsed = time.monotonic() - started
            query.stop()
            if name != "warm-up":
                throughput[name] = args.rows / elapsed
            print(f"{name}: {args.rows / elapsed:,.0f} events/s ({elapsed:.1f} s)", file=sys.stderr)
        spark.stop()
        ref = throughput["reference"]
        for name in SINKS:
            result.measures.append(
                Measure(
                    f"{name} replay events/s",
                    "events/s",
                    round(throughput[name]),
                    reference=round(ref),
                    reference_name="decode-only query",
                    note="one sink alone, in-process, from offset zero into a fresh generation",
                )
            )

        # 3. freshness and keeping up: the production shape, capture and all three sinks as processes
        live = work / "state-live"
        _config(
            config,
            dsn,
            kafka=kafka,
            registry=registry,
            prefix=prefix,
            extra=sinks_toml.replace(str(work / "state"), str(live)),
        )
        capture = _cdc(["run", "--config", str(config)], log)
        sinks_log = open(work / "sinks.log", "ab")  # noqa: SIM115 - handed to the child
        sinks_proc = _cdc(["sinks", "run", "--config", str(config)], sinks_log)
        status = [live / s / "status.json" for s in SINKS]

        def caught_up_all() -> bool:
            return all(p.exists() and json.loads(p.read_text()).get("records", 0) >= args.rows for p in status)

        deadline = time.monotonic() + 1800
        while not caught_up_all() and time.monotonic() < deadline:
            if sinks_proc.poll() is not None:
                raise RuntimeError(f"cdc sinks run exited with {sinks_proc.returncode}; log: {work / 'sinks.log'}")
            time.sleep(2)
        time.sleep(10)  # steady state: the replay's last batches are done
        sampler = _LagSampler(config)
        sampler.start()
        rnd = random.Random(1)  # noqa: S311 - workload values, not secrets
        first = args.rows + 1
        load_start = time.monotonic() - sampler.started
        insert = sql.SQL("INSERT INTO {} (id, name, qty, price, payload) VALUES (%s, 'probe', %s, 1.5, '{{}}')").format(
            sql.Identifier(TABLE)
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            t0 = time.monotonic()
            for i in range(n):
                conn.execute(insert, (first + i, rnd.randint(0, 9)))
                time.sleep(max(0.0, t0 + (i + 1) / args.rate - time.monotonic()))
        load_end = time.monotonic() - sampler.started
        drained: dict[str, float | None] = dict.fromkeys(SINKS)
        deadline = time.monotonic() + args.drain_seconds
        while time.monotonic() < deadline and any(v is None for v in drained.values()):
            time.sleep(1)
            for name in SINKS:
                if drained[name] is None and sampler.latest(name) == 0:
                    drained[name] = time.monotonic() - sampler.started - load_end
        time.sleep(2)
        sampler.halt.set()
        sampler.join(30)
        _stop(sinks_proc, 180)
        _stop(capture, 120)
        sinks_log.close()

        ids = list(range(first, first + n))
        freshness: dict[str, list[float]] = {}
        client = OpenSearch(opensearch)
        docs = client.mget(index=f"{prefix}-public.{TABLE}".lower(), body={"ids": [f"[{i}]" for i in ids]})["docs"]
        freshness["search"] = [
            d["_source"]["__cdc"]["applied_ms"] - d["_source"]["__cdc"]["ts_ms"] for d in docs if d.get("found")
        ]
        r = redis.Redis.from_url(redis_url)
        gen = int(r.get(f"{prefix}:current") or 1)
        pipe = r.pipeline()
        for i in ids:
            pipe.hmget(f"{prefix}:g{gen}:public.{TABLE}:[{i}]", "applied_ms", "ts_ms")
        freshness["cache"] = [int(a) - int(t) for a, t in pipe.execute() if a]
        settings = load_sink_settings(config)
        spark = spark_session(settings, "pgcdc-sinks-bench-read")
        current = (work / "warehouse" / "_cdc_current").read_text().strip()
        rows = (
            spark.read.format("delta")
            .load(str(work / "warehouse" / f"g{current}" / f"public.{TABLE}"))
            .where(f"id >= {first}")
            .select("__applied_ms", "__ts_ms")
            .collect()
        )
        freshness["warehouse"] = [float(x["__applied_ms"] - x["__ts_ms"]) for x in rows]
        spark.stop()

        result.series["freshness_ms"] = {k: sorted(v) for k, v in freshness.items()}
        result.series["lag"] = {
            name: {
                "t_s": [round(s[0] - load_start, 1) for s in sampler.samples[name]],
                "records": [s[1] for s in sampler.samples[name]],
                "age_s": [None if s[2] is None else round(s[2], 2) for s in sampler.samples[name]],
            }
            for name in SINKS
        }
        result.series["lag_load_window_s"] = [0.0, round(load_end - load_start, 1)]
        for name in SINKS:
            values = freshness[name]
            limit = FRESHNESS_LIMIT_S[name]
            seen = f"{len(values)}/{n} probes seen"
            result.measures += [
                Measure(f"{name} freshness p50", "s", round(percentile(values, 50) / 1000, 2), higher_is_better=False),
                Measure(
                    f"{name} freshness p99",
                    "s",
                    round(percentile(values, 99) / 1000, 2),
                    higher_is_better=False,
                    limit=limit,
                    note=f"{seen}; mean {statistics.fmean(values) / 1000 if values else float('nan'):.2f} s",
                ),
            ]
            during = sampler.window(name, load_start, load_end)
            max_records = max((s[1] for s in during if s[1] is not None), default=None)
            ages = [s[2] for s in during if s[2] is not None]
            max_age = max(ages) if ages else float("nan")
            half = (load_start + load_end) / 2
            first_half = [s[1] for s in during if s[1] is not None and s[0] < half]
            second_half = [s[1] for s in during if s[1] is not None and s[0] >= half]
            growing = bool(first_half and second_half and max(second_half) > 2 * max(first_half) + args.rate * 5)
            kept_up = drained[name] is not None and not growing
            result.measures.append(
                Measure(
                    f"{name} max lag during load",
                    "s",
                    round(max_age, 2),
                    higher_is_better=False,
                    limit=limit,
                    note=f"max {max_records} offsets behind (records and transaction markers); "
                    + (
                        f"lag 0 {drained[name]:.1f} s after the load"
                        if drained[name] is not None
                        else f"lag not back to 0 within {args.drain_seconds:g} s after the load"
                    )
                    + ("; lag grew over the load" if growing else "")
                    + f"; kept up: {'yes' if kept_up else 'NO'}",
                )
            )
            result.notes.append(f"{name} kept up with the capture: {'yes' if kept_up else 'no'} ({seen})")

        # 4. rebuild from offset zero, as an operator runs it
        if not args.no_rebuild:
            events = args.rows + n
            rebuilds: dict[str, dict[str, float]] = {}
            for name in SINKS:
                marks = _rebuild(name, config, work / f"rebuild-{name}.log")
                rebuilds[name] = marks
                replay_s = marks["caught_up"] - marks["rebuilding"]
                print(f"rebuild {name}: {marks}", file=sys.stderr)
                result.measures.append(
                    Measure(
                        f"{name} rebuild events/s",
                        "events/s",
                        round(events / replay_s),
                        reference=round(ref),
                        reference_name="decode-only query",
                        note=f"`cdc sinks rebuild {name}`: {events:,} events replayed in {replay_s:.1f} s; the "
                        f"whole command {marks['exit']:.1f} s (Spark start {marks['rebuilding']:.1f} s, "
                        f"verify and swap {marks['exit'] - marks['caught_up']:.1f} s)",
                    )
                )
            result.series["rebuild_s"] = {
                k: {m: round(v, 2) for m, v in marks.items()} for k, marks in rebuilds.items()
            }
    finally:
        log.close()
        if not args.keep:
            with psycopg.connect(admin, autocommit=True) as conn:
                for _ in range(50):
                    try:
                        conn.execute(
                            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                            (prefix,),
                        )
                        break
                    except psycopg.errors.ObjectInUse:
                        time.sleep(0.2)
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
            _cleanup(prefix, kafka=kafka, registry=registry, opensearch=opensearch, redis_url=redis_url)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        result.notes.append(f"logs and state: {work}")
    result.notes.append(
        "throughput: one sink at a time, in this process, 1 s trigger, maxOffsetsPerTrigger as in params; "
        "freshness = the store's applied_ms - the event's source ts_ms (commit time)"
    )
    return result


if __name__ == "__main__":
    write_result(run())
