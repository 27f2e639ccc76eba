"""What the sinks' executor tasks do to the Python worker they run in."""

from __future__ import annotations

import importlib
import sys
import zipfile
import zipimport
from pathlib import Path

import pytest

from sinks._write import forget_zip_finders


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 invalidates zip finders lazily (gh-103200)")
def test_zip_finders_leave_the_cache_and_their_modules_stay_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pgcdc_zip_probe/__init__.py", "VALUE = 1\n")
        z.writestr("pgcdc_zip_probe/inner.py", "VALUE = 2\n")
    monkeypatch.syspath_prepend(str(archive))  # as Spark's worker has its archives: undone after the test
    try:
        importlib.import_module("pgcdc_zip_probe")
        assert isinstance(sys.path_importer_cache[str(archive)], zipimport.zipimporter)
        plain = [
            p for p, f in sys.path_importer_cache.items() if f is not None and not isinstance(f, zipimport.zipimporter)
        ]

        forget_zip_finders()

        assert not [p for p, f in sys.path_importer_cache.items() if isinstance(f, zipimport.zipimporter)]
        assert all(p in sys.path_importer_cache for p in plain)  # directory finders are left alone
        importlib.invalidate_caches()  # what Spark's worker does before each task: no zip finder to re-read
        assert importlib.import_module("pgcdc_zip_probe.inner").VALUE == 2  # a new finder, from zipimport's cache
    finally:
        for name in ("pgcdc_zip_probe.inner", "pgcdc_zip_probe"):
            sys.modules.pop(name, None)
        sys.path_importer_cache.pop(str(archive), None)
