"""Nothing the sinks app emits holds a password, whether it runs well or fails on its credentials.

The capture-side scan is in test_observability.py. Here the cache sink logs in to Redis as an ACL user with a
distinctive password (in sinks.cache.url) and the registry is given basic-auth credentials; the app runs
(rows applied, a poison record dead-lettered), then its Redis user's password changes under it (every
request fails on its credentials), then it is put back (the app recovers). At each stage everything an
operator can see is searched for both passwords: the app's JSON log, its metrics, status.json, the
dead-letter topic, `cdc status` (text and --json), `cdc verify cache`, and the capture's log, metrics,
dashboard and /api/status.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from confluent_kafka import Producer

from tests.integration._capture_helpers import CdcProcess, ChildProcess, scratch_database, wait_for
from tests.integration._observe_helpers import api_status, free_port, http_get
from tests.integration._sinks_helpers import SPARK_WORKER, Stack, cdc, dead_letters

pytestmark = [pytest.mark.slow, SPARK_WORKER]


@contextmanager
def _redis_user(url: str, user: str, password: str) -> Iterator[str]:
    """An ACL user with ``password`` on the Redis at ``url`` (deleted afterwards): a URL that logs in as it."""
    admin = redis.Redis.from_url(url)
    _set_user(admin, user, password)
    parts = urlsplit(url)
    try:
        yield urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))
    finally:
        admin.acl_deluser(user)
        admin.close()


def _set_user(admin: redis.Redis, user: str, password: str) -> None:
    """ACL SETUSER <user> reset on ><password> ~* &* +@all: everything, with only this password."""
    admin.acl_setuser(
        user, reset=True, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"], categories=["+@all"]
    )


def _everything_shown(
    config: Path, sinks: ChildProcess, capture: CdcProcess, ports: tuple[int, int], *, kafka: str, prefix: str
) -> dict[str, str]:
    """Every output of the sinks app, and what the capture and the commands show of it, by where it came from."""
    port, sinks_port = ports
    plain = cdc("status", "--config", str(config), timeout=120)
    as_json = cdc("status", "--config", str(config), "--json", timeout=120)
    verify = cdc("verify", "cache", "--config", str(config), timeout=300)
    return {
        "sinks app log": sinks.log.read_text(errors="replace"),
        "sinks /metrics": http_get(f"http://127.0.0.1:{sinks_port}/metrics").decode(),
        "status.json": (config.parent / "state" / "cache" / "status.json").read_text(),
        "dead letters": json.dumps(dead_letters(kafka, f"{prefix}.dead-letter")),
        "cdc status": plain.stdout + plain.stderr,
        "cdc status --json": as_json.stdout + as_json.stderr,
        "cdc verify cache": verify.stdout + verify.stderr,
        "capture log": capture.log.read_text(errors="replace"),
        "capture /metrics": http_get(f"http://127.0.0.1:{port}/metrics").decode(),
        "capture /api/status": json.dumps(api_status(port)),
        "capture /": http_get(f"http://127.0.0.1:{port}/").decode(),
    }


def test_nothing_the_sinks_app_emits_holds_a_password(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_secret, registry_secret = f"Redis-{unique}-must-not-leak", f"Registry-{unique}-must-not-leak"
    ports = port, sinks_port = free_port(), free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    # The local registry does not check credentials; they are sent (and could leak) all the same.
    monkeypatch.setenv("CDC_REGISTRY__BASIC_AUTH_USER_INFO", f"pgcdc:{registry_secret}")
    user, prefix = f"sinks_{unique}", f"sec{unique}"
    admin = redis.Redis.from_url(stack.redis)
    with scratch_database(pg_dsn, f"sec_{unique}") as dsn, _redis_user(stack.redis, user, redis_secret) as cache_url:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (k int PRIMARY KEY, v int)")
            conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 3) g")
        secured = Stack(stack.kafka, stack.registry, stack.opensearch, cache_url, stack.spark_jars)
        cfg = secured.config(dsn, ["public.t"], prefix=prefix, unique=unique, workdir=tmp_path)
        config = cfg.write(tmp_path / "cdc.toml")
        capture = cfg.start(tmp_path)
        sinks = ChildProcess(["--log-json", "sinks", "run", "cache", "--config", str(config)], tmp_path / "sinks.log")

        def cached(k: int) -> bool:
            return admin.hget(f"{prefix}:g1:public.t:[{k}]", "row") is not None

        try:
            capture.wait_streaming(180)
            poison = Producer({"bootstrap.servers": stack.kafka})
            poison.produce(f"{prefix}.public.t", key=b"not avro", value=b"garbage")
            poison.flush(30)
            sinks.start()
            wait_for(lambda: cached(3), 300, "the rows in the cache", capture)
            wait_for(lambda: dead_letters(stack.kafka, f"{prefix}.dead-letter"), 120, "the dead letter", None)
            running = _everything_shown(config, sinks, capture, ports, kafka=stack.kafka, prefix=prefix)
            assert "cache public.t: no drift" in running["cdc verify cache"], running["cdc verify cache"]

            # The password changes under the running app: deleting the user drops its connections, and the
            # new one has another password. Every request of the sink now fails on its credentials.
            admin.acl_deluser(user)
            _set_user(admin, user, f"{redis_secret}-rotated")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (4, 4)")

            def refused_shown() -> bool:
                status = json.loads((tmp_path / "state" / "cache" / "status.json").read_text())
                return status.get("state") == "backoff" and "refused the credentials" in status.get("last_error", "")

            wait_for(refused_shown, 300, "the sink to back off on its credentials", capture)
            failing = _everything_shown(config, sinks, capture, ports, kafka=stack.kafka, prefix=prefix)
            assert "Redis refused the credentials of sinks.cache.url" in failing["cdc verify cache"]
            assert "refused the credentials" in failing["capture /api/status"]

            # Put back: the app recovers by itself and applies what it missed.
            _set_user(admin, user, redis_secret)
            wait_for(lambda: cached(4), 300, "the sink to recover", capture)
            assert sinks.alive(), sinks.tail()
            assert sinks.terminate(120) == 0, sinks.tail()
            stopped = {"sinks app log": sinks.log.read_text(errors="replace")}
        finally:
            if sinks.alive():
                sinks.kill()
            capture.stop()
            admin.close()
    for stage, outputs in (("running", running), ("failing", failing), ("stopped", stopped)):
        for where, text in outputs.items():
            assert redis_secret not in text, f"the Redis password leaked into {where} ({stage})"
            assert registry_secret not in text, f"the registry password leaked into {where} ({stage})"
    # A store refusing the credentials is a known fault: said in one line, not as a crash.
    assert "Traceback" not in stopped["sinks app log"], stopped["sinks app log"][-5000:]
    # The app's own lines are JSON (--log-json); Spark's JVM writes its own format beside them.
    ours = [json.loads(line) for line in stopped["sinks app log"].splitlines() if line.startswith('{"ts"')]
    assert any("batch" in line["msg"] for line in ours), ours[-5:]
