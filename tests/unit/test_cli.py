from __future__ import annotations

import pytest

from cdc import __version__
from pgcdc.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"cdc {__version__}"


def test_public_surface_is_explicit() -> None:
    import cdc

    # source_tables/SourceTable/KeyRange: the source's rows as events carry them, in key ranges, for `cdc verify`
    # (docs/sinks.md); report_keys/request_keys/wait_for_backfills: `cdc verify --repair` asking for keys.
    assert sorted(cdc.__all__) == [
        "CDCError",
        "KeyRange",
        "SourceTable",
        "TerminalError",
        "TransientError",
        "__version__",
        "report_keys",
        "request_keys",
        "source_tables",
        "wait_for_backfills",
    ]
    assert issubclass(cdc.TransientError, cdc.CDCError)
    assert issubclass(cdc.TerminalError, cdc.CDCError)
    assert not issubclass(cdc.TransientError, cdc.TerminalError)
