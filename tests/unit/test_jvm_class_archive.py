"""The driver JVM's class-data archive: which options a start gets, and how a written archive is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pgcdc_common.cache import cache_dir
from sinks import _jvmcache


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _jvmcache._pending.clear()


def _directory(tmp_path: Path) -> Path:
    return tmp_path / "pgcdc" / "spark-cds"


def test_a_first_start_writes_the_archive_at_exit_and_later_starts_map_it(tmp_path: Path) -> None:
    first = _jvmcache.java_options(["/jars/a.jar"])
    assert first is not None
    assert "-XX:ArchiveClassesAtExit=" in first
    assert "-Xlog:cds=off" in first
    written = Path(first.split("=", 1)[1].split()[0])
    written.write_bytes(b"archive")  # what the JVM does as it exits
    _jvmcache.keep_written()
    assert not written.exists()
    later = _jvmcache.java_options(["/jars/a.jar"])
    assert later is not None
    assert "-XX:SharedArchiveFile=" in later
    assert Path(later.split("=", 1)[1].split()[0]).read_bytes() == b"archive"


def test_other_jars_get_an_archive_of_their_own(tmp_path: Path) -> None:
    first = _jvmcache.java_options(["/jars/a.jar"])
    assert first is not None
    Path(first.split("=", 1)[1].split()[0]).write_bytes(b"archive")
    _jvmcache.keep_written()
    other = _jvmcache.java_options(["/jars/b.jar"])
    assert other is not None
    assert "-XX:ArchiveClassesAtExit=" in other


def test_a_jvm_that_wrote_nothing_leaves_nothing(tmp_path: Path) -> None:
    assert _jvmcache.java_options(["/jars/a.jar"]) is not None
    _jvmcache.keep_written()  # killed before its exit: no file
    assert list(_directory(tmp_path).iterdir()) == []


def test_a_stale_partial_archive_is_removed(tmp_path: Path) -> None:
    directory = _directory(tmp_path)
    directory.mkdir(parents=True)
    stale, fresh = directory / "x.jsa.1.tmp", directory / "x.jsa.2.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    _jvmcache.java_options(["/jars/a.jar"])
    assert not stale.exists()
    assert fresh.exists()


def test_an_unwritable_cache_means_no_archive(tmp_path: Path) -> None:
    (tmp_path / "pgcdc").write_text("a file where the directory would be")
    assert _jvmcache.java_options(["/jars/a.jar"]) is None


def test_the_cache_follows_xdg_cache_home_and_ignores_a_relative_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "pgcdc"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert cache_dir() == Path.home() / ".cache" / "pgcdc"
