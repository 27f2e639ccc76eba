"""A class-data archive of the sinks' driver JVM (AppCDS): Spark's classes mapped in, not loaded one by one.

PySpark starts a JVM for every `cdc sinks run`, `cdc sinks rebuild` and `cdc verify`, which loads some tens of
thousands of classes from Spark's jars before the first job. Measured on two cores, a session plus its first job
takes 8.3-9.4 s without an archive and 5.1 s with one. The JVM writes the archive itself when it exits
(``-XX:ArchiveClassesAtExit``, JDK 13 on) after a run without one, and maps it at later starts
(``-XX:SharedArchiveFile``). An archive the JVM cannot use (another JDK, another classpath) is ignored by the
JVM, which then starts as it would without one; its name carries the JVM, PySpark and jars it was made with,
so a change of any makes a new one.

Where: ``$XDG_CACHE_HOME/pgcdc/spark-cds`` (``~/.cache/pgcdc/spark-cds``), ~150 MB per combination.
``sinks.jvm_class_archive = false`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from pgcdc_common.cache import cache_dir

log = logging.getLogger(__name__)

# The JVM's account of classes it leaves out of an archive (one line each, thousands) is not the app's log.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
_STALE_S = 3600.0
_pending: list[tuple[Path, Path]] = []  # archives being written by a running JVM: (written, final)


def _directory() -> Path:
    return cache_dir() / "spark-cds"


def _identity(jars: Sequence[str]) -> str:
    """The JVM binary, PySpark and the jars: what an archive is only good for."""
    import pyspark

    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java") or "java"
    parts = [os.path.realpath(java), pyspark.__version__, *sorted(jars)]
    with contextlib.suppress(OSError):
        parts.append(str(os.stat(os.path.realpath(java)).st_mtime_ns))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def java_options(jars: Sequence[str]) -> str | None:
    """The driver JVM's options to use the archive, or to write it at exit when there is none yet; None when
    the cache directory cannot be written."""
    directory = _directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.debug("no JVM class archive: %s", exc)
        return None
    final = directory / f"spark-driver-{_identity(jars)}.jsa"
    if final.exists():
        return f"-XX:SharedArchiveFile={final} {_QUIET}"
    if not os.access(directory, os.W_OK):
        return None
    _remove_stale(directory)
    written = directory / f"{final.name}.{os.getpid()}.tmp"
    _pending.append((written, final))
    return f"-XX:ArchiveClassesAtExit={written} {_QUIET}"


def _remove_stale(directory: Path) -> None:
    """Archives a JVM was killed while writing (their process gone for an hour): never renamed into place."""
    now = time.time()
    for leftover in directory.glob("*.tmp"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > _STALE_S:
                leftover.unlink()


def keep_written() -> None:
    """After the JVM has exited: an archive it wrote becomes the one later starts map (a whole file, renamed
    into place: a JVM killed while writing leaves only its temporary file, which is removed)."""
    while _pending:
        written, final = _pending.pop()
        try:
            if written.exists() and written.stat().st_size > 0:
                os.replace(written, final)
                log.info("JVM class archive written: %s (later starts map it)", final)
        except OSError as exc:
            log.debug("cannot keep the JVM class archive %s: %s", written, exc)
        finally:
            with contextlib.suppress(OSError):
                written.unlink()
