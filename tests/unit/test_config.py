"""Configuration: file, environment overrides, strictness, secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc.config import load_settings
from cdc.errors import ConfigError
from pgcdc_common.topics import split_table_name

BASE = """
[source]
dsn = "postgresql://app:s3cret-pw@db.example:5432/shop"
tables = ["public.orders", '"Odd.Schema"."T"']
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cdc.toml"
    path.write_text(text)
    return path


def test_file_values_and_defaults(tmp_path: Path) -> None:
    s = load_settings(_write(tmp_path, BASE))
    assert s.source.tables == ("public.orders", '"Odd.Schema"."T"')
    assert (s.source.slot, s.source.publication) == ("pgcdc", "pgcdc")
    assert s.transactional_id == "pgcdc-pgcdc"
    assert s.offsets_topic == "pgcdc.offsets"
    assert s.topic_for("public", "orders") == "pgcdc.public.orders"
    assert s.kafka.transaction_gap_ms == 2.0  # cdc/_kafka.py's _TXN_GAP_S


def test_transaction_gap_is_set_and_bounded(tmp_path: Path) -> None:
    s = load_settings(_write(tmp_path, BASE + "\n[kafka]\ntransaction_gap_ms = 7.5\n"))
    assert s.kafka.transaction_gap_ms == 7.5
    with pytest.raises(ConfigError, match=r"kafka\.transaction_gap_ms"):
        load_settings(_write(tmp_path, BASE + "\n[kafka]\ntransaction_gap_ms = -1\n"))


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_KAFKA__BOOTSTRAP_SERVERS", "broker:9092")
    monkeypatch.setenv("CDC_SOURCE__SLOT", "from_env")
    s = load_settings(_write(tmp_path, BASE + '\n[kafka]\nbootstrap_servers = "file:1"\n'))
    assert s.kafka.bootstrap_servers == "broker:9092"
    assert s.source.slot == "from_env"
    assert s.source.tables  # the rest of [source] still comes from the file


def test_secrets_never_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_SOURCE__PASSWORD", "env-pw")
    s = load_settings(_write(tmp_path, BASE))
    shown = repr(s) + str(s) + s.source.display_dsn()
    assert "s3cret-pw" not in shown
    assert "env-pw" not in shown
    assert "password=env-pw" in s.source.conninfo()  # the effective password reaches libpq only


def test_password_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    s = load_settings(_write(tmp_path, BASE.replace("[source]", f'[source]\npassword_file = "{tmp_path / "pw"}"')))
    assert "password=from-file" in s.source.conninfo()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("publicaton = 'x'", r"source\.publicaton: unknown key"),
        ("slot = 'Bad-Slot'", "lower-case letters, digits and '_'"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(_write(tmp_path, BASE + extra + "\n"))


def test_wrong_type_names_the_key_and_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(_write(tmp_path, BASE + "\n[kafka]\npartitions = 'many'\n"))
    assert "kafka.partitions" in str(exc.value)
    assert "CDC_KAFKA__PARTITIONS" in str(exc.value)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(_write(tmp_path, "[source\n"))


def test_missing_dsn(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"source\.dsn: required"):
        load_settings(_write(tmp_path, "[source]\ntables = []\n"))


def test_bad_input_is_not_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(_write(tmp_path, BASE + "\n[capture]\nsnapshot = 'sup3r-secret-typo'\n"))
    assert "sup3r-secret-typo" not in str(exc.value)


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("public.orders", ("public", "orders")),
        ('"my.schema"."t"', ("my.schema", "t")),
        ('s."with ""quote"""', ("s", 'with "quote"')),
    ],
)
def test_split_table_name(name: str, parts: tuple[str, str]) -> None:
    assert split_table_name(name) == parts


@pytest.mark.parametrize("bad", ["orders", "a.b.c", ".x", "a."])
def test_split_table_name_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match=r"schema\.table"):
        split_table_name(bad)
