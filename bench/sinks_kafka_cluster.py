#!/usr/bin/env python3
"""sinks-kafka-cluster: the sinks' light-load freshness on a replicated Kafka cluster, beside the single broker.

    ./dev python -m bench.sinks_kafka_cluster [--rows 100000] [--freshness-seconds 60] [--rate 200]

The same steps twice in one run, first on the single broker, then on the three-broker cluster (`./dev services up
kafka-cluster registry-cluster`: replication factor 3, min.insync.replicas 2, the registry's schemas stored there
too): a scratch database of ``--rows`` rows (bench.sinks_bench's table), `cdc run` (snapshot, then streaming) and
`cdc sinks run` on it until caught up and warmed by one row, then bench.sinks_bench's light load: single-row
transactions at ``--rate`` for ``--freshness-seconds``, each row's freshness as the store's plain client first
sees it. Measures: each sink's p50 and p99 on the cluster against the single broker's (no target: the three
brokers share this machine's two cores with PostgreSQL, the capture and the sinks).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pgcdc_dev import discovery
from pgcdc_dev.bench.report import Measure, Result, write_result

from bench import sinks_bench as sb

SCENARIO = "sinks-kafka-cluster"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--freshness-seconds", type=float, default=60.0, help="seconds of light load")
    parser.add_argument("--rate", type=float, default=200.0, help="transactions per second of the light load")
    return parser


def light_freshness(env: sb.Env, args: argparse.Namespace) -> Result:
    """bench.sinks_bench's light load on ``env``'s brokers, after the live steps' start (a fresh table captured,
    the sinks caught up and warmed by one row); its measures and series."""
    part = Result(SCENARIO, params={})
    try:
        sb.create_source(env, args.rows)
        config = env.config("state-live")
        with open(env.work / "live.log", "ab") as log, open(env.work / "sinks.log", "ab") as out:
            capture = sb.run_cdc(["run", "--config", str(config)], log)
            sinks = sb.run_cdc(["sinks", "run", *sb.SINKS, "--config", str(config)], out)
            sampler = sb.LagSampler(config)
            sampler.start()
            try:
                sb.wait_until(sampler.caught_up, sinks, "the sinks' catch-up")
                sb.Load(env.dsn, sb.next_id(env.dsn, args.rows), 1, 1, 1).run()
                sb.wait_until(lambda: all(sb.batches_done(env, n) > 0 for n in sb.SINKS), sinks, "the first batches")
                sb.light_load(env, sampler, args.rows, args, part, sinks_pid=sinks.pid)
            finally:
                sampler.halt.set()
                sb.stop_process(sinks, 180)
                sb.stop_process(capture, 120)
    finally:
        sb.cleanup(env)
    return part


def run(argv: list[str] | None = None) -> Result:
    args = build_parser().parse_args(argv)
    result = Result(SCENARIO, params={"rows": args.rows, "rate": args.rate, "seconds": args.freshness_seconds})
    single = light_freshness(dataclasses.replace(sb.make_env(), prefix=f"skc_{int(time.time())}_single"), args)
    cluster_env = dataclasses.replace(
        sb.make_env(),
        kafka=str(discovery.deploy_record("kafka-cluster")["bootstrap"]),
        registry=str(discovery.deploy_record("registry-cluster")["url"]),
        prefix=f"skc_{int(time.time())}_cluster",
    )
    cluster = light_freshness(cluster_env, args)
    before = {m.name: m.ours for m in single.measures}
    for m in cluster.measures:
        if "freshness" in m.name and m.name in before:
            result.measures.append(
                Measure(
                    f"{m.name} on a 3-broker cluster",
                    "s",
                    m.ours,
                    reference=before[m.name],
                    reference_name="the single broker",
                    higher_is_better=False,
                    note="replication factor 3, min.insync.replicas 2; the same load, after the single broker's run",
                )
            )
    result.series = {"single": single.series, "cluster": cluster.series}
    return result


if __name__ == "__main__":
    write_result(run())
