"""What users and sink plugins import stays importable by the same names, with the same exit codes, whichever
package implements it (the error tree lives in pgcdc_common/errors.py; cdc.errors and sinks.errors name it)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import cdc.errors
import sinks
import sinks.errors
from pgcdc_common import errors as common_errors

CAPTURE_ERRORS = {
    "CDCError": 1,
    "TransientError": 10,
    "ConfigError": 2,
    "SourceCheckError": 3,
    "AuthenticationError": 4,
    "SchemaRegistryError": 5,
    "KafkaSetupError": 6,
    "StreamError": 7,
}
SINK_ERRORS = {
    "SinkError": 1,
    "SinkTransientError": 10,
    "SinkConfigError": 2,
    "PluginError": 8,
    "DriftError": 9,
    "StateDiskFullError": 11,
}


def test_the_sink_api_names_stay() -> None:
    assert sorted(sinks.__all__) == [
        "BaseSink",
        "Batch",
        "Change",
        "ChangesUnderRead",
        "DropsGeneration",
        "FrameRows",
        "PartitionSink",
        "PartitionWriter",
        "ReadsFields",
        "ReadsFrame",
        "ReadsInParts",
        "Rebuildable",
        "Rejected",
        "Sink",
        "SinkContext",
        "SinkError",
        "SinkTerminalError",
        "SinkTransientError",
        "StorePart",
        "TableChanges",
        "TableInfo",
        "TableRef",
        "key_id",
    ]


@pytest.mark.parametrize(("name", "code"), sorted(CAPTURE_ERRORS.items()))
def test_the_capture_errors_keep_their_names_and_exit_codes(name: str, code: int) -> None:
    assert getattr(cdc.errors, name).exit_code == code
    assert getattr(cdc.errors, name) is getattr(common_errors, name)


@pytest.mark.parametrize(("name", "code"), sorted(SINK_ERRORS.items()))
def test_the_sink_errors_keep_their_names_and_exit_codes(name: str, code: int) -> None:
    assert getattr(sinks.errors, name).exit_code == code
    assert getattr(sinks.errors, name) is getattr(common_errors, name)


def test_one_root_with_one_transient_and_one_terminal_branch() -> None:
    e = common_errors
    assert issubclass(e.SinkError, e.CDCError)
    assert issubclass(e.SinkTransientError, e.TransientError)
    assert issubclass(e.SinkTerminalError, e.TerminalError)
    assert issubclass(e.SinkConfigError, e.ConfigError)
    for name in [*CAPTURE_ERRORS, *SINK_ERRORS]:
        cls = getattr(e, name)
        assert not (issubclass(cls, e.TransientError) and issubclass(cls, e.TerminalError)), name


def test_the_command_and_spark_app_are_where_the_packaging_says(capsys: pytest.CaptureFixture[str]) -> None:
    """The installed ``cdc`` script runs the application layer's main, and ``cdc sinks spark-app`` names a file
    that exists and runs it too."""
    (script,) = entry_points(group="console_scripts", name="cdc")
    assert script.load() is importlib.import_module("pgcdc.cli").main
    assert importlib.import_module("pgcdc.cli").main(["sinks", "spark-app"]) == 0
    app = Path(capsys.readouterr().out.strip())
    assert app.is_file()
    assert app.resolve() == Path(importlib.import_module("pgcdc.spark_app").__file__ or "").resolve()
