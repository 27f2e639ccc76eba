"""The bad-input catalogue (docs/bad-input.md): each entry, as an operator would meet it, against real services.

Each case sets the mistake up for real (a table without a key, a slot held by another consumer, a wrong
password…), runs the `cdc` command an operator would run, and checks the exit code and that the message says
what is wrong, where, and how to fix it — and never echoes a secret. The catalogue's ids are the test ids.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from pgcdc_dev.cluster import ObjectStore
from pgcdc_dev.discovery import tool_or_skip
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration._capture_helpers import scratch_database

# One worker for the module: its clean-up drops every role its cases create, by name pattern.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("bad_input")]

SECRET = "Bad-Input-Secret-7f3a"  # the password of the roles below: must never appear in any output


@dataclass
class Env:
    admin: str  # superuser DSN of the scratch database
    kafka: str
    registry: str
    work: Path
    suffix: str
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def sql(self, *statements: str, dsn: str | None = None) -> None:
        with psycopg.connect(dsn or self.admin, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement.replace("{n}", self.suffix))

    def dsn(self, **changes: str) -> str:
        params = conninfo_to_dict(self.admin)
        params.update(changes)
        return make_conninfo("", **params)


# State in a bucket of pgcdc_dev.services's S3 server; the cases change its endpoint, bucket or secret key.
_S3_STATE = """[sinks]
metrics_enabled = false
state_dir = "s3a://pgcdc/state"
[sinks.storage]
endpoint = "{s3}"
path_style = true
region = "us-east-1"
access_key = "{access}"
secret_key = "{secret}"
"""


@dataclass
class Case:
    id: str
    expect_code: int
    expect: list[str]  # fragments the message must contain: what is wrong and how to fix it
    setup: Callable[[Env], None] = lambda env: None
    source: str = ""  # lines for [source] (replacing the defaults' keys)
    kafka: str = ""  # lines for [kafka]
    tables: list[str] = field(default_factory=list)
    dsn: Callable[[Env], str] | None = None
    extra: str = ""  # extra TOML sections
    args: list[str] = field(default_factory=lambda: ["attach", "--dry-run"])
    raw_config: str | None = None  # the whole file, for syntax errors


def _no_maven(env: Env) -> None:
    """Spark's Ivy with one repository, where nothing answers, and an empty cache: as at a site without Maven."""
    (env.work / "ivysettings.xml").write_text(
        '<ivysettings><settings defaultResolver="nowhere"/><resolvers>'
        '<ibiblio name="nowhere" m2compatible="true" root="http://127.0.0.1:1/maven2"/>'
        "</resolvers></ivysettings>"
    )


def _hold_slot(env: Env) -> None:
    """A second consumer streaming from the slot (pg_recvlogical), as another tool would."""
    env.sql(
        "CREATE TABLE held_{n} (id int PRIMARY KEY)",
        "CREATE PUBLICATION p_held_{n} FOR TABLE held_{n}",
        "SELECT pg_create_logical_replication_slot('s_held_{n}', 'pgoutput')",
    )
    binary = tool_or_skip(
        "pg_recvlogical", "/usr/lib/postgresql/15/bin/pg_recvlogical", install="apt-get install postgresql"
    )
    proc = subprocess.Popen(
        [
            binary,
            "-d",
            env.admin,
            "-S",
            f"s_held_{env.suffix}",
            "--start",
            "-o",
            "proto_version=1",
            "-o",
            f"publication_names=p_held_{env.suffix}",
            "-f",
            "/dev/null",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        proc.terminate()
        proc.wait(30)

    env.cleanups.append(stop)
    for _ in range(100):
        with psycopg.connect(env.admin) as conn:
            row = conn.execute(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (f"s_held_{env.suffix}",)
            ).fetchone()
        if row and row[0]:
            return
        time.sleep(0.1)
    raise AssertionError("pg_recvlogical did not take the slot")


def _slot_elsewhere(env: Env) -> None:
    admin = conninfo_to_dict(env.admin)
    other = make_conninfo("", **{**admin, "dbname": "postgres"})
    env.sql("CREATE TABLE t_other_{n} (id int PRIMARY KEY)")
    env.sql("SELECT pg_create_logical_replication_slot('s_other_{n}', 'pgoutput')", dsn=other)
    env.cleanups.append(lambda: env.sql("SELECT pg_drop_replication_slot('s_other_{n}')", dsn=other))


def _topic(env: Env, policy: str) -> None:
    env.sql("CREATE TABLE pol_{n} (id int PRIMARY KEY)", "INSERT INTO pol_{n} VALUES (1)")
    admin = AdminClient({"bootstrap.servers": env.kafka})
    topic = f"b{env.suffix}.public.pol_{env.suffix}"
    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": policy})])[topic].result(30)


CASES = [
    # --- the configuration file (exit 2) ---------------------------------------------------------------
    Case("config-unknown-key", 2, ["source.publicaton", "unknown key", "spelling"], source='publicaton = "x"'),
    Case(
        "config-wrong-type",
        2,
        ["kafka.partitions", "CDC_KAFKA__PARTITIONS"],
        kafka='partitions = "six"',
    ),
    Case("config-bad-slot-name", 2, ["source.slot", "lower-case letters"], source='slot = "My-Slot"'),
    Case("config-table-without-schema", 2, ["schema.table"], tables=["orders"]),
    Case(
        "config-missing-password-file",
        2,
        ["source.password_file", "cannot read the password"],
        source='password_file = "/nonexistent/pg-password"',
    ),
    Case("config-missing-dsn", 2, ["source.dsn", "required", "CDC_SOURCE__DSN"], raw_config='[source]\nslot = "x"\n'),
    Case(
        "config-mask-without-a-key",
        2,
        ["source.masks hashes", "source.mask_key", "CDC_SOURCE__MASK_KEY"],
        tables=["public.x"],
        source='masks = { "public.x" = { email = "hash" } }',
    ),
    Case("config-not-toml", 2, ["is not valid TOML"], raw_config="[source\ndsn = 'x'\n"),
    Case("config-file-missing", 2, ["not found", "--config"], args=["attach", "--dry-run", "--config", "/nonexistent"]),
    # --- reaching the source (exit 4 authentication, 10 unreachable, 3 missing database) -----------------
    Case(
        "source-wrong-password",
        4,
        ["refused the login", "source.password"],
        setup=lambda env: env.sql(f"CREATE ROLE auth_{{n}} LOGIN REPLICATION PASSWORD '{SECRET}'"),
        dsn=lambda env: env.dsn(user=f"auth_{env.suffix}", password=SECRET + "-wrong"),
        tables=["public.x"],
    ),
    Case(
        "source-unknown-role",
        4,
        ["refused the login"],
        dsn=lambda env: env.dsn(user=f"nobody_{env.suffix}", password=SECRET),
        tables=["public.x"],
    ),
    Case(
        "source-unknown-database",
        3,
        ["does not exist", "source.dsn"],
        dsn=lambda env: env.dsn(dbname=f"nosuch_{env.suffix}"),
        tables=["public.x"],
    ),
    Case(
        "source-unreachable",
        10,
        ["cannot reach PostgreSQL", "port=1"],
        dsn=lambda env: env.dsn(host="127.0.0.1", port="1", connect_timeout="3"),
        tables=["public.x"],
    ),
    Case(
        "source-no-replication-privilege",
        3,
        ["lacks the REPLICATION attribute", "ALTER ROLE", "WITH REPLICATION"],
        setup=lambda env: env.sql(f"CREATE ROLE norepl_{{n}} LOGIN PASSWORD '{SECRET}'"),
        dsn=lambda env: env.dsn(user=f"norepl_{env.suffix}", password=SECRET),
        tables=["public.x"],
    ),
    # --- the tables (exit 3) -------------------------------------------------------------------------------
    Case("table-missing", 3, ["does not exist", "source.tables"], tables=["public.nosuch"]),
    Case(
        "table-without-key",
        3,
        ["has no primary key", "add a primary key", "REPLICA IDENTITY", "source.key_columns"],
        setup=lambda env: env.sql("CREATE TABLE nopk_{n} (a int, b text)"),
        tables=["public.nopk_{n}"],
    ),
    Case(
        "table-replica-identity-nothing",
        3,
        ["REPLICA IDENTITY (NOTHING)", "REPLICA IDENTITY DEFAULT"],
        setup=lambda env: env.sql(
            "CREATE TABLE rin_{n} (id int PRIMARY KEY)", "ALTER TABLE rin_{n} REPLICA IDENTITY NOTHING"
        ),
        tables=["public.rin_{n}"],
    ),
    Case(
        "key-columns-unknown",
        3,
        ["source.key_columns", "not columns of the table"],
        setup=lambda env: env.sql("CREATE TABLE kc1_{n} (a int NOT NULL)"),
        tables=["public.kc1_{n}"],
        extra='[source.key_columns]\n"public.kc1_{n}" = ["nope"]\n',
    ),
    Case(
        "key-columns-nullable",
        3,
        ["nullable", "NOT NULL"],
        setup=lambda env: env.sql("CREATE TABLE kc2_{n} (a int)", "ALTER TABLE kc2_{n} REPLICA IDENTITY FULL"),
        tables=["public.kc2_{n}"],
        extra='[source.key_columns]\n"public.kc2_{n}" = ["a"]\n',
    ),
    Case(
        "key-columns-without-full-identity",
        3,
        ["REPLICA IDENTITY FULL"],
        setup=lambda env: env.sql("CREATE TABLE kc3_{n} (a int NOT NULL)"),
        tables=["public.kc3_{n}"],
        extra='[source.key_columns]\n"public.kc3_{n}" = ["a"]\n',
    ),
    Case(
        "tables-share-a-topic",
        3,
        ["would share topic", "rename one"],
        setup=lambda env: env.sql(
            'CREATE TABLE "a.b_{n}" (id int PRIMARY KEY)', "CREATE TABLE a_b_{n} (id int PRIMARY KEY)"
        ),
        tables=['public."a.b_{n}"', "public.a_b_{n}"],
    ),
    Case(
        "topic-name-too-long",
        3,
        ["249", "kafka.topic_prefix"],
        setup=lambda env: env.sql("CREATE TABLE tl_{n} (id int PRIMARY KEY)"),
        tables=["public.tl_{n}"],
        kafka=f'topic_prefix = "{"p" * 245}"',
    ),
    Case(
        "columns-unknown",
        3,
        ["source.columns", "'nope'", "does not have", "fix the list"],
        setup=lambda env: env.sql("CREATE TABLE cu_{n} (id int PRIMARY KEY, a text)"),
        tables=["public.cu_{n}"],
        extra='[source.columns]\n"public.cu_{n}" = ["id", "nope"]\n',
    ),
    Case(
        "columns-without-the-key",
        3,
        ["source.columns", "leaves out 'id'", "add it to the list"],
        setup=lambda env: env.sql("CREATE TABLE ck_{n} (id int PRIMARY KEY, a text)"),
        tables=["public.ck_{n}"],
        extra='[source.columns]\n"public.ck_{n}" = ["a"]\n',
    ),
    Case(
        "row-filter-outside-the-identity",
        3,
        ["row filter", "reads 'qty'", "replica identity", "REPLICA IDENTITY FULL"],
        setup=lambda env: env.sql("CREATE TABLE rf_{n} (id int PRIMARY KEY, qty int)"),
        tables=["public.rf_{n}"],
        extra='[source.row_filters]\n"public.rf_{n}" = "qty > 5"\n',
    ),
    Case(
        "row-filter-invalid",
        3,
        ["refused the publication", "nosuch", "source.row_filters"],
        setup=lambda env: env.sql("CREATE TABLE ri_{n} (id int PRIMARY KEY)"),
        tables=["public.ri_{n}"],
        extra='[source.row_filters]\n"public.ri_{n}" = "nosuch > 1"\n',
    ),
    Case(
        "mask-on-a-key-column",
        3,
        ["source.masks", "'id'", "a key column", "remove the mask"],
        setup=lambda env: env.sql("CREATE TABLE mk_{n} (id int PRIMARY KEY, email text)"),
        tables=["public.mk_{n}"],
        source='mask_key = "k"\nmasks = { "public.mk_{n}" = { id = "hash" } }',
    ),
    Case(
        "table-setting-for-a-table-not-captured",
        3,
        ["source.masks names public.mz_{n}", "not captured", "fix the name"],
        setup=lambda env: env.sql("CREATE TABLE my_{n} (id int PRIMARY KEY, email text)"),
        tables=["public.my_{n}"],
        source='mask_key = "k"\nmasks = { "public.mz_{n}" = { email = "hash" } }',
    ),
    Case(
        # The publication decides what is captured: a table it does not hold that exists is only noted (the
        # setting applies once it is published); one that does not exist is a misspelt name.
        "table-setting-for-a-table-that-does-not-exist",
        3,
        ["source.masks names public.nx_{n}", "not captured", "fix the name"],
        setup=lambda env: env.sql(
            "CREATE TABLE pd_{n} (id int PRIMARY KEY, email text)",
            "CREATE TABLE later_{n} (id int PRIMARY KEY, email text)",
            "CREATE PUBLICATION p_pd_{n} FOR TABLE pd_{n}",
        ),
        source='publication = "p_pd_{n}"\nmask_key = "k"\n'
        'masks = { "public.later_{n}" = { email = "hash" }, "public.nx_{n}" = { email = "hash" } }',
    ),
    # --- the publication (exit 3) --------------------------------------------------------------------------
    Case("no-tables-no-publication", 3, ["no tables to capture", "source.tables"]),
    Case(
        "publication-empty",
        3,
        ["contains no tables"],
        setup=lambda env: env.sql("CREATE PUBLICATION p_empty_{n}"),
        source='publication = "p_empty_{n}"',
    ),
    Case(
        "publication-lacks-a-table",
        3,
        ["lacks", "ALTER PUBLICATION", "ADD TABLE"],
        setup=lambda env: env.sql(
            "CREATE TABLE in_{n} (id int PRIMARY KEY)",
            "CREATE TABLE out_{n} (id int PRIMARY KEY)",
            "CREATE PUBLICATION p_lacks_{n} FOR TABLE in_{n}",
        ),
        source='publication = "p_lacks_{n}"',
        tables=["public.in_{n}", "public.out_{n}"],
    ),
    Case(
        "publication-without-deletes",
        3,
        ["does not publish delete", "SET (publish ="],
        setup=lambda env: env.sql(
            "CREATE TABLE nd_{n} (id int PRIMARY KEY)",
            "CREATE PUBLICATION p_nd_{n} FOR TABLE nd_{n} WITH (publish = 'insert, update')",
        ),
        source='publication = "p_nd_{n}"',
        tables=["public.nd_{n}"],
    ),
    Case(
        "publication-partitions-not-via-root",
        3,
        ["publish_via_partition_root = true"],
        setup=lambda env: env.sql(
            "CREATE TABLE part_{n} (id int PRIMARY KEY) PARTITION BY RANGE (id)",
            "CREATE TABLE part_{n}_1 PARTITION OF part_{n} FOR VALUES FROM (0) TO (100)",
            "CREATE PUBLICATION p_part_{n} FOR TABLE part_{n}",
        ),
        source='publication = "p_part_{n}"',
        tables=["public.part_{n}"],
    ),
    # --- the replication slot (exit 3) ---------------------------------------------------------------------
    Case(
        "slot-other-plugin",
        3,
        ["uses plugin 'test_decoding'", "another source.slot"],
        setup=lambda env: env.sql(
            "CREATE TABLE sp_{n} (id int PRIMARY KEY)",
            "SELECT pg_create_logical_replication_slot('s_plugin_{n}', 'test_decoding')",
        ),
        source='slot = "s_plugin_{n}"',
        tables=["public.sp_{n}"],
    ),
    Case(
        "slot-of-another-database",
        3,
        ["belongs to database 'postgres'", "another source.slot"],
        setup=_slot_elsewhere,
        source='slot = "s_other_{n}"',
        tables=["public.t_other_{n}"],
    ),
    Case(
        "slot-in-use-by-another-consumer",
        3,
        ["is in use by another process", "stop that consumer"],
        setup=_hold_slot,
        source='slot = "s_held_{n}"\npublication = "p_held_{n}"',
        tables=["public.held_{n}"],
    ),
    # --- Kafka (exit 6) --------------------------------------------------------------------------------------
    Case(
        "topic-not-compacted",
        6,
        ["cleanup.policy=delete", "compacted", "--add-config cleanup.policy=compact"],
        setup=lambda env: _topic(env, "delete"),
        tables=["public.pol_{n}"],
        args=["run"],
    ),
    # --- the service's own endpoints (exit 2) -----------------------------------------------------------------
    Case(
        "metrics-port-in-use",
        2,
        ["metrics.port", "in use", "metrics.enabled = false"],
        setup=lambda env: env.sql("CREATE TABLE mp_{n} (id int PRIMARY KEY)"),
        tables=["public.mp_{n}"],
        extra="[metrics]\nport = {busy_port}\n",
        args=["run"],
    ),
    # --- the sinks (exit 2 configuration, 8 plugin) -----------------------------------------------------------
    Case(
        "sinks-unknown-key", 2, ["sinks.enable", "unknown key"], extra="[sinks]\nenable = []\n", args=["sinks", "run"]
    ),
    Case(
        "sinks-connectors-unresolvable",
        2,
        ["resolving its connectors from Maven", "spark-sql-kafka-0-10", "sinks.spark_jars", "spark.jars.repositories"],
        setup=_no_maven,
        extra=(
            '[sinks]\nspark_jars = []\nmetrics_enabled = false\nstate_dir = "{work}/state"\n[sinks.spark_conf]\n'
            '"spark.jars.ivySettings" = "{work}/ivysettings.xml"\n"spark.jars.ivy" = "{work}/ivy"\n'
        ),
        args=["sinks", "run", "cache"],
    ),
    Case("sinks-unknown-sink", 8, ["nosuch", "cdc sinks list"], args=["sinks", "run", "nosuch"]),
    Case(
        "sinks-wrong-spark-master",
        2,
        ["sinks.spark_master = 'spark://127.0.0.1:1'", "no Spark master answers at 127.0.0.1:1", "fix sinks."],
        extra='[sinks]\nspark_master = "spark://127.0.0.1:1"\nmetrics_enabled = false\nstate_dir = "{work}/state"\n',
        args=["sinks", "run", "cache"],
    ),
    Case(
        "sinks-object-store-unreachable",
        10,
        ["object store of sinks.state_dir (s3a://pgcdc/state) does not answer", "sinks.storage.endpoint"],
        extra=_S3_STATE.replace("{s3}", "http://127.0.0.1:1"),
        args=["sinks", "run", "cache"],
    ),
    Case(
        "sinks-bucket-missing",
        2,
        ["bucket 'nosuch-bucket-pgcdc' of sinks.state_dir", "does not exist: create it, or fix sinks.state_dir"],
        extra=_S3_STATE.replace("s3a://pgcdc/", "s3a://nosuch-bucket-pgcdc/"),
        args=["sinks", "run", "cache"],
    ),
    Case(
        "sinks-object-store-refuses-the-keys",
        2,
        ["refused to let pgcdc write s3a://pgcdc/state", "access denied", "sinks.storage.access_key and secret_key"],
        extra=_S3_STATE.replace("{secret}", SECRET),
        args=["sinks", "run", "cache"],
    ),
    Case(
        "verify-a-sink-that-never-ran",
        2,
        ["has never run", "nothing to verify"],
        extra='[sinks]\nstate_dir = "{work}/state"\n[sinks.cache]\nnamespace = "never_{n}"\nurl = "{redis}"\n',
        args=["verify", "cache"],
    ),
]


@pytest.fixture(scope="module")
def database(pg_dsn: str) -> Iterator[str]:
    with scratch_database(pg_dsn, f"bad_{os.getpid()}") as dsn:
        yield dsn
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for (role,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname ~ '^(auth|norepl)_[0-9]+_'").fetchall():
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _section(base: dict[str, str], lines: str) -> str:
    """TOML key lines: the case's own lines replace the base's keys of the same name."""
    own = [line for line in lines.splitlines() if line.strip()]
    overridden = {line.split("=", 1)[0].strip() for line in own}
    return "".join(f"{k} = {v}\n" for k, v in base.items() if k not in overridden) + "".join(f"{x}\n" for x in own)


def _config(
    case: Case, env: Env, dsn: str, *, redis_url: str, busy_port: int | None, store: ObjectStore | None = None
) -> str:
    if case.raw_config is not None:
        return case.raw_config
    n = env.suffix
    tables = ", ".join(f"'{t}'" for t in case.tables)  # literal strings: names may hold double quotes
    text = (
        "[source]\n"
        + _section(
            {"dsn": f"'{dsn}'", "tables": f"[{tables}]", "slot": f"'s_{n}'", "publication": f"'p_{n}'"}, case.source
        )
        + "[kafka]\n"
        + _section({"bootstrap_servers": f"'{env.kafka}'", "topic_prefix": f"'b{n}'"}, case.kafka)
        + f"[registry]\nurl = '{env.registry}'\n"
        # Any free port for the metrics, unless the case is about them: a demo on 9464 must not change results.
        + ("" if "[metrics]" in case.extra else "[metrics]\nport = 0\n")
        + case.extra
    )
    text = text.replace("{n}", n).replace("{work}", str(env.work)).replace("{redis}", redis_url)
    if store is not None:
        text = text.replace("{s3}", store.url).replace("{access}", store.access_key)
        text = text.replace("{secret}", store.secret_key)
    return text.replace("{busy_port}", str(busy_port))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly(
    case: Case,
    *,
    database: str,
    kafka_bootstrap: str,
    registry_url: str,
    redis_url: str,
    tmp_path: Path,
    unique: str,
    request: pytest.FixtureRequest,
) -> None:
    store = request.getfixturevalue("object_store") if "s3a://" in case.extra else None
    if store is not None:
        store.ensure_bucket("pgcdc")  # the bucket the cases' state_dir names
    # The `unique` suffix, not just the case's index: the run's topics then carry it, and conftest's clean-up
    # deletes them at the end of the run.
    env = Env(database, kafka_bootstrap, registry_url, tmp_path, f"{unique}_{CASES.index(case)}")
    busy = socket.socket() if "{busy_port}" in case.extra else None  # a port something else already holds
    try:
        if busy is not None:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
        case.setup(env)
        dsn = case.dsn(env) if case.dsn else database
        config = tmp_path / "cdc.toml"
        config.write_text(
            _config(case, env, dsn, redis_url=redis_url, busy_port=busy.getsockname()[1] if busy else None, store=store)
        )
        args = case.args if "--config" in case.args else [*case.args, "--config", str(config)]
        # Only the file speaks: no CDC_* override from the test run's environment.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CDC_") or k.startswith("CDC_TEST_")}
        result = subprocess.run(
            [sys.executable, "-m", "pgcdc", *args],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env=clean,
        )
        output = result.stdout + result.stderr
        assert result.returncode == case.expect_code, output
        for fragment in case.expect:
            assert fragment.replace("{n}", env.suffix) in output, f"{fragment!r} missing from:\n{output}"
        assert SECRET not in output, "a password reached the output"
        assert "Traceback" not in output, output
    finally:
        if busy is not None:
            busy.close()
        for cleanup in reversed(env.cleanups):
            cleanup()
