"""Locations of the sinks' files (sinks._storage) and the checks made before Spark starts (sinks._preflight)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import SecretStr

from sinks._preflight import check_master, check_writable, storage_error
from sinks._storage import StorageConfig, hadoop_conf, location
from sinks.config import SinksConfig, SinkSettings
from sinks.errors import SinkConfigError, SinkTransientError


def test_a_local_location_reads_writes_lists_and_removes(tmp_path: Path) -> None:
    base = location(tmp_path / "state", StorageConfig())
    assert base.local
    assert base.uri == str(tmp_path / "state")
    assert base.children() == []
    assert not base.exists()
    (base / "cache" / "status.json").write_text('{"a": 1}')
    assert (base / "cache" / "status.json").read_text() == '{"a": 1}'
    assert [c.name for c in base.children()] == ["cache"]
    assert not list((tmp_path / "state" / "cache").glob("*.tmp")), "replaced by rename, no leftovers"
    assert (base / "nosuch").read_text() is None
    assert (base / "cache" / "status.json" / "x").read_text() is None  # under a file: absent, not an error
    (base / "cache").remove_tree()
    (base / "cache").remove_tree()  # twice: absent is fine
    assert base.children() == []


def test_uris_name_the_same_places_for_spark_and_for_pgcdc(tmp_path: Path) -> None:
    assert location(f"file://{tmp_path}", StorageConfig()).uri == str(tmp_path)
    s3 = StorageConfig(endpoint="http://127.0.0.1:1", region="us-east-1", path_style=True)
    for uri in ("s3a://bucket/pgcdc/state/", "s3://bucket/pgcdc/state"):
        where = location(uri, s3)
        assert (where.path, where.uri, where.object_store) == ("bucket/pgcdc/state", "s3a://bucket/pgcdc/state", True)
        assert (where / "cache").uri == "s3a://bucket/pgcdc/state/cache"
    settings = SinkSettings(sinks=SinksConfig(state_dir=tmp_path))  # type: ignore[arg-type]  # a Path: its text
    assert settings.state.uri == str(tmp_path)


def test_storage_settings_become_s3a_settings_with_only_what_is_set() -> None:
    assert hadoop_conf(StorageConfig()) == {}
    conf = hadoop_conf(StorageConfig(endpoint="http://s3.local:9000", path_style=True, secret_key=SecretStr("s3cr3t")))
    assert conf == {
        "spark.hadoop.fs.s3a.endpoint": "http://s3.local:9000",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.secret.key": "s3cr3t",  # a name Spark's redaction pattern matches
    }
    assert "s3cr3t" not in repr(StorageConfig(secret_key=SecretStr("s3cr3t")))


def test_a_master_that_does_not_answer_is_named_with_its_setting() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(SinkConfigError, match=rf"sinks.spark_master = 'spark://127.0.0.1:{port}'.*no Spark master"):
        check_master(f"spark://127.0.0.1:{port}", "sinks.spark_master")
    with pytest.raises(SinkConfigError, match="is not host:port"):
        check_master("spark://master", "sinks.spark_master")
    check_master("local[2]", "sinks.spark_master")  # not a standalone master: nothing to probe
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        # One of several (standalone masters with ZooKeeper) answering is enough.
        check_master(f"spark://127.0.0.1:{port},127.0.0.1:{listening.getsockname()[1]}", "sinks.spark_master")


def test_object_store_faults_are_told_apart() -> None:
    where = location("s3a://bucket/state", StorageConfig(endpoint="http://127.0.0.1:1"))
    down = storage_error(OSError("AWS Error NETWORK_CONNECTION during HeadObject: Could not connect"), where, "x")
    assert isinstance(down, SinkTransientError)
    missing = storage_error(OSError("Bucket 'bucket' not found. AWS Error NO_SUCH_BUCKET ... NoSuchBucket"), where, "x")
    assert isinstance(missing, SinkConfigError)
    assert "bucket 'bucket' of x" in str(missing)
    denied = storage_error(OSError("AWS Error ACCESS_DENIED during PutObject operation"), where, "x")
    assert isinstance(denied, SinkConfigError)
    assert "access denied" in str(denied)


def test_a_local_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SinkConfigError, match=r"sinks.state_dir = .* cannot be written"):
        check_writable(location(tmp_path / "file" / "state", StorageConfig()), "sinks.state_dir")
    check_writable(location(tmp_path / "ok", StorageConfig()), "sinks.state_dir")
    assert list((tmp_path / "ok").iterdir()) == [], "the probe is removed"


def test_each_sink_takes_its_own_trigger_interval_else_the_shared_one() -> None:
    shipped = SinksConfig()
    # Cache and search start their next batch as soon as the last ended; the warehouse commits every 5 s.
    assert (shipped.trigger_for("cache"), shipped.trigger_for("search"), shipped.trigger_for("warehouse")) == (0, 0, 5)
    assert shipped.trigger_for("jsonl") == 0  # a plugin: the shared interval
    cfg = SinksConfig.model_validate({"trigger_interval_s": 2, "cache": {"trigger_interval_s": 0.5}})
    assert (cfg.trigger_for("cache"), cfg.trigger_for("search"), cfg.trigger_for("warehouse")) == (0.5, 2, 5)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        SinksConfig.model_validate({"search": {"trigger_interval_s": -1}})


def test_a_jar_directory_stands_for_its_jars_and_an_empty_one_is_refused(tmp_path: Path) -> None:
    jars = tmp_path / "jars"
    jars.mkdir()
    for name in ("b.jar", "a.jar", "notes.txt"):
        (jars / name).write_text("")
    cfg = SinksConfig(spark_jars=f"/elsewhere/x.jar,{jars}")  # type: ignore[arg-type]  # as the environment gives it
    assert cfg.spark_jars == ("/elsewhere/x.jar", str(jars / "a.jar"), str(jars / "b.jar"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no \.jar files"):
        SinksConfig(spark_jars=(str(empty),))
