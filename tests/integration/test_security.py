"""TLS and credentials end to end: PostgreSQL over verified TLS, Kafka over SASL_SSL, the registry over HTTPS with
basic authentication — the capture, the sinks, `cdc status` and `cdc verify` all through them — and wrong or
missing security settings each ending in a clear error with its own exit code.

The endpoints are pgcdc_dev.services's: PostgreSQL refuses plaintext to members of a TLS-only role, Kafka has a
SASL_SSL listener next to the plaintext one, the registry sits behind nginx with HTTPS and a password. Their
certificates come from a local CA that the clients are given (verify-full, hostname checks on).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcdc_dev.discovery import tls_endpoints_or_skip
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration._capture_helpers import (
    CdcConfig,
    capture_role,
    drop_role,
    scratch_database,
    source_items,
    topic_items,
    wait_for,
)
from tests.integration._observe_helpers import free_port, http_get
from tests.integration._sinks_helpers import SPARK_WORKER, SinksProcess, Stack, cdc

pytestmark = pytest.mark.slow


@contextmanager
def _tls_only_role(dsn: str, unique: str) -> Iterator[tuple[str, str]]:
    """A capture role that pg_hba lets in over TLS only: (its name, its password)."""
    role, password = f"tls_{unique}", f"Db-{unique}-tls-secret"
    tls_only = "pgcdc_tls_only"  # pgcdc_dev.services's pg_hba: hostnossl … +pgcdc_tls_only reject
    with psycopg.connect(dsn, autocommit=True) as conn, suppress(psycopg.errors.DuplicateObject):
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(tls_only)))  # shared by every run
    with capture_role(dsn, role, password, member_of=tls_only):
        yield role, password


def _role_dsn(dsn: str, role: str, **params: str) -> str:
    base = conninfo_to_dict(dsn)
    base.pop("password", None)
    base.update(user=role, **params)
    return make_conninfo("", **base)


def _secure_config(cfg: CdcConfig, ep: dict[str, Any], workdir: Path, *, kafka_pw_env: bool = True) -> CdcConfig:
    """``cfg`` moved to the SASL_SSL listener and the HTTPS registry; secrets from a file or the environment."""
    kafka, reg = ep["kafka"]["sasl_ssl"], ep["registry-tls"]
    user_info = workdir / "registry-user-info"
    user_info.write_text(f"{reg['username']}:{reg['password']}\n")
    kafka_keys = [
        'security_protocol = "sasl_ssl"',
        f'sasl_mechanism = "{kafka["mechanism"]}"',
        f'sasl_username = "{kafka["username"]}"',
        f'ssl_ca_location = "{kafka["ca"]}"',
    ]
    if not kafka_pw_env:
        pw_file = workdir / "kafka-password"
        pw_file.write_text(kafka["password"] + "\n")
        kafka_keys.append(f'sasl_password_file = "{pw_file}"')
    return dataclasses.replace(
        cfg,
        kafka=kafka["bootstrap"],
        registry=reg["url"],
        kafka_extra="\n".join(kafka_keys),
        registry_extra=f'basic_auth_user_info_file = "{user_info}"\nssl_ca_location = "{reg["ca"]}"',
    )


@SPARK_WORKER
def test_capture_and_sinks_run_over_tls_with_credentials(
    *, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = tls_endpoints_or_skip()
    reg = ep["registry-tls"]
    # The registry's credentials also travel as an HTTP Basic header: look for that form too.
    header = base64.b64encode(f"{reg['username']}:{reg['password']}".encode()).decode()
    secrets = [ep["kafka"]["sasl_ssl"]["password"], reg["password"], header]
    port, sinks_port = free_port(), free_port()
    monkeypatch.setenv("CDC_METRICS__PORT", str(port))
    monkeypatch.setenv("CDC_SINKS__METRICS_PORT", str(sinks_port))
    # The Kafka password from the environment, the database's and the registry's from files.
    monkeypatch.setenv("CDC_KAFKA__SASL_PASSWORD", ep["kafka"]["sasl_ssl"]["password"])
    try:
        with scratch_database(pg_dsn, f"tls_{unique}") as dsn, _tls_only_role(dsn, unique) as (role, password):
            secrets.append(password)
            (tmp_path / "db-password").write_text(password + "\n")
            monkeypatch.setenv("CDC_SOURCE__PASSWORD_FILE", str(tmp_path / "db-password"))
            # The role cannot get in without TLS: nothing below can have fallen back to plaintext.
            with pytest.raises(psycopg.OperationalError, match="no encryption"):
                psycopg.connect(_role_dsn(dsn, role, password=password, sslmode="disable")).close()
            tls_dsn = _role_dsn(dsn, role, sslmode="verify-full", sslrootcert=ep["postgres"]["tls_ca"])
            with psycopg.connect(tls_dsn, password=password, autocommit=True) as conn:
                conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
                conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 300) g")
            plain = stack.config(tls_dsn, ["public.items"], prefix=f"t{unique}", unique=unique, workdir=tmp_path)
            cfg = _secure_config(plain, ep, tmp_path)
            config = cfg.write(tmp_path / "cdc.toml")
            assert all(s not in config.read_text() for s in secrets), "the test must keep secrets out of the file"
            _run_and_check(
                cfg=cfg,
                config=config,
                dsn=tls_dsn,
                password=password,
                role=role,
                stack=stack,
                ports=(port, sinks_port),
                workdir=tmp_path,
                secrets=secrets,
            )
    finally:
        drop_role(pg_dsn, f"tls_{unique}")


def _run_and_check(
    *,
    cfg: CdcConfig,
    config: Path,
    dsn: str,
    password: str,
    role: str,
    stack: Stack,
    ports: tuple[int, int],
    workdir: Path,
    secrets: list[str],
) -> None:
    capture = cfg.start(workdir)
    sinks = SinksProcess(config, workdir / "sinks.log", ["cache"])
    topic = f"{cfg.prefix}.public.items"
    try:
        capture.wait_streaming(180)
        with psycopg.connect(dsn, password=password, autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT g, 'new ' || g, g FROM generate_series(1001, 1050) g")
            conn.execute("UPDATE items SET qty = qty * 10 WHERE id <= 20")
            conn.execute("DELETE FROM items WHERE id BETWEEN 21 AND 30")
            # Every connection of the capture's role is encrypted: the SQL session and the walsender.
            rows = conn.execute(
                "SELECT a.backend_type, s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
                "WHERE a.usename = %s AND a.application_name = 'pgcdc'",
                (role,),
            ).fetchall()
        assert {backend for backend, _ in rows} >= {"client backend", "walsender"}, rows
        assert all(ssl for _, ssl in rows), rows
        expected = source_items_as(dsn, password)
        assert len(expected) == 340
        # Read back through the plaintext listener of the same broker: the capture wrote via SASL_SSL only.
        wait_for(
            lambda: topic_items(stack.kafka, stack.registry, topic) == expected, 120, "the topic to equal the table"
        )
        sinks.start()
        wait_for(lambda: _cache_lag(config) == 0, 300, "the cache sink to catch up over SASL_SSL", sinks)
        verify = cdc("verify", "cache", "--config", str(config))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        status = cdc("status", "--json", "--config", str(config))
        body = json.loads(status.stdout)
        assert "kafka_error" not in body["capture"], body["capture"]
        assert any(t["topic"] == topic and t["records"] > 0 for t in body["topics"]), body["topics"]
        plain_status = cdc("status", "--config", str(config))
        outputs = {
            "capture log": capture.log.read_text(errors="replace"),
            "sinks log": sinks.log.read_text(errors="replace"),
            "cdc status --json": status.stdout + status.stderr,
            "cdc status": plain_status.stdout + plain_status.stderr,
            "cdc verify": verify.stdout + verify.stderr,
            "capture /metrics": http_get(f"http://127.0.0.1:{ports[0]}/metrics").decode(),
            "capture /api/status": http_get(f"http://127.0.0.1:{ports[0]}/api/status").decode(),
            "sinks /metrics": http_get(f"http://127.0.0.1:{ports[1]}/metrics").decode(),
        }
        # Every file the sinks keep: status, Spark's checkpoints (offsets, commits, metadata), the rest.
        for state_file in (workdir / "state").rglob("*"):
            if state_file.is_file():
                outputs[str(state_file)] = state_file.read_text(errors="replace")
        for where, text in outputs.items():
            for secret in secrets:
                assert secret not in text, f"a secret leaked into {where}"
    finally:
        if sinks.proc is not None:
            sinks.stop()
        capture.stop()
        cdc("detach", "--yes", "--config", str(config))


def source_items_as(dsn: str, password: str) -> dict[int, tuple[str, int]]:
    params = conninfo_to_dict(dsn)
    params["password"] = password
    return source_items(make_conninfo("", **params))


def _cache_lag(config: Path) -> int | None:
    proc = cdc("status", "--json", "--config", str(config), timeout=120)
    try:
        sinks = json.loads(proc.stdout).get("sinks", [])
    except json.JSONDecodeError:
        return None
    lags = [s.get("lag_records") for s in sinks if s.get("name") == "cache"]
    return lags[0] if lags else None


# --- wrong or missing security settings: each a clear error, its own exit code, no secret in the output ------


def _without(text: str, key: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(key))


def _kafka_wrong_password(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    env["CDC_KAFKA__SASL_PASSWORD"] = "not-the-password"
    return cfg


def _kafka_untrusted_certificate(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    return dataclasses.replace(cfg, kafka_extra=_without(cfg.kafka_extra, "ssl_ca_location"))


def _kafka_sasl_without_username(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    return dataclasses.replace(cfg, kafka_extra=_without(cfg.kafka_extra, "sasl_username"))


def _registry_wrong_password(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    (workdir / "registry-user-info").write_text("pgcdc:not-the-password\n")
    return cfg


def _registry_untrusted_certificate(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    return dataclasses.replace(cfg, registry_extra=_without(cfg.registry_extra, "ssl_ca_location"))


def _pg_missing_root_certificate(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    dsn = make_conninfo(cfg.dsn, sslmode="verify-full", sslrootcert=str(workdir / "no-such-ca.pem"))
    return dataclasses.replace(cfg, dsn=dsn)


def _pg_plaintext_for_a_tls_only_role(cfg: CdcConfig, env: dict[str, str], workdir: Path) -> CdcConfig:
    return cfg  # the test connects as the TLS-only role with sslmode=disable (below)


BAD_SECURITY = {
    # case: (how to break the working secure config, exit code, fragments of the message)
    "kafka-wrong-password": (_kafka_wrong_password, 4, ["Kafka refused the credentials", "sasl_password"]),
    "kafka-untrusted-certificate": (_kafka_untrusted_certificate, 6, ["TLS connection to Kafka", "ssl_ca_location"]),
    "kafka-sasl-without-username": (_kafka_sasl_without_username, 2, ["kafka", "needs sasl_username"]),
    "registry-wrong-password": (_registry_wrong_password, 4, ["refused our credentials", "basic_auth_user_info"]),
    "registry-untrusted-certificate": (
        _registry_untrusted_certificate,
        5,
        ["TLS connection to the schema registry", "registry.ssl_ca_location"],
    ),
    "pg-missing-root-certificate": (_pg_missing_root_certificate, 2, ["TLS to PostgreSQL", "sslrootcert"]),
    "pg-plaintext-for-a-tls-only-role": (_pg_plaintext_for_a_tls_only_role, 4, ["only over TLS", "sslmode"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SECURITY))
def test_wrong_security_settings_give_clear_errors(
    *, case: str, pg_dsn: str, stack: Stack, unique: str, tmp_path: Path
) -> None:
    ep = tls_endpoints_or_skip()
    breaks, code, fragments = BAD_SECURITY[case]
    secrets = [ep["kafka"]["sasl_ssl"]["password"], ep["registry-tls"]["password"]]
    env = {"CDC_KAFKA__SASL_PASSWORD": ep["kafka"]["sasl_ssl"]["password"], "CDC_METRICS__ENABLED": "false"}
    try:
        with scratch_database(pg_dsn, f"bs_{unique}") as dsn, _tls_only_role(dsn, unique) as (role, password):
            secrets.append(password)
            env["CDC_SOURCE__PASSWORD"] = password
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
                conn.execute(sql.SQL("ALTER TABLE items OWNER TO {}").format(sql.Identifier(role)))
                conn.execute("INSERT INTO items VALUES (1, 'one', 1)")
            sslmode = "disable" if case == "pg-plaintext-for-a-tls-only-role" else "verify-full"
            role_dsn = _role_dsn(dsn, role, sslmode=sslmode, sslrootcert=ep["postgres"]["tls_ca"])
            plain = stack.config(role_dsn, ["public.items"], prefix=f"b{unique}", unique=unique, workdir=tmp_path)
            cfg = breaks(_secure_config(plain, ep, tmp_path), env, tmp_path)
            config = cfg.write(tmp_path / "cdc.toml")
            proc = subprocess.run(
                [sys.executable, "-m", "pgcdc", "run", "--config", str(config)],
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
                env={**os.environ, **env},
            )
            out = proc.stdout + proc.stderr
            assert proc.returncode == code, out
            for fragment in fragments:
                assert fragment in out, f"{fragment!r} missing from:\n{out}"
            assert "Traceback" not in out, out
            for secret in secrets:
                assert secret not in out, "a secret leaked into the error output"
    finally:
        drop_role(pg_dsn, f"tls_{unique}")


def test_sinks_with_wrong_kafka_credentials_stop_at_once_saying_so(
    *, stack: Stack, unique: str, tmp_path: Path
) -> None:
    ep = tls_endpoints_or_skip()
    plain = stack.config("dbname=unused", ["public.items"], prefix=f"w{unique}", unique=unique, workdir=tmp_path)
    config = _secure_config(plain, ep, tmp_path, kafka_pw_env=False)
    (tmp_path / "kafka-password").write_text("not-the-password\n")
    path = config.write(tmp_path / "cdc.toml")
    proc = subprocess.run(
        [sys.executable, "-m", "pgcdc", "sinks", "run", "cache", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Kafka refused the sinks' credentials" in out, out
    assert "sasl_password" in out, out
    assert "Traceback" not in out, out
    assert "not-the-password" not in out
    assert ep["registry-tls"]["password"] not in out
