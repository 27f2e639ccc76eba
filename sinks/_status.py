"""The sinks' status files, and how a failed query is told: what readers outside the app see of it.

A sink's status file (sinks._progress.STATUS_FILE under its state directory; a rebuild's own beside it) is what
`cdc status`, the dashboard and the capture's metrics read: :class:`Status` merges each write with what the file
holds (the app's loop and the query's batches write it from different threads) and writes a batch's figures off
the batch's thread. A failed query's error becomes one line for that file and the log (:func:`short`: our own
message when one of our errors ended a batch), and a full state disk is told apart from a store's own full disk
(:func:`state_disk_full`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgcdc_common.errors import CDCError
from sinks._progress import STATUS_FILE
from sinks._storage import Location
from sinks.errors import StateDiskFullError

if TYPE_CHECKING:
    from sinks._config import SinkSettings

log = logging.getLogger(__name__)

_STATUS_LOCK = threading.Lock()
_NO_SPACE = "No space left on device"  # ENOSPC as the JVM (Spark's checkpoint writes) and the C library say it
_NEARLY_FULL = 64 * 2**20  # free bytes under which an ENOSPC is taken to be the state disk's


@dataclass
class Status:
    """A sink's status file: what `cdc status`, the dashboard and the capture's metrics read from outside."""

    path: Location
    data: dict[str, Any] = field(default_factory=dict)
    _staged: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Location) -> Status:
        return cls(path, cls._read(path))

    @staticmethod
    def _read(path: Location) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):  # absent, unreadable, or torn by a crash mid-write
            data = json.loads(path.read_text() or "{}")
            if isinstance(data, dict):
                return data
        return {}

    def update(self, **values: Any) -> None:
        """Writes ``values`` (and whatever :meth:`stage` held) now."""
        # Read, merge, replace: the app's loop (heartbeats, backoff) and the query's batches write the same
        # file from different threads and objects; none may undo another's fields.
        # Best effort: a full or read-only state disk must not end the app over a status line (the query's
        # own checkpoint writes fail loudly where it matters).
        with _STATUS_LOCK:
            values, self._staged = {**self._staged, **values}, {}
            try:
                self.data = {**self._read(self.path), **values, "updated_at": time.time()}
                self.path.write_text(json.dumps(self.data, indent=2))
            except OSError as exc:
                log.warning("cannot write %s: %s", self.path, exc)

    def stage(self, **values: Any) -> None:
        """Takes ``values`` at once (``data``) and writes them within a second, off the caller's thread.

        A batch's figures are written this way: a status file is a read and a write (two requests on an
        object store), which a batch of a few rows must not wait for.
        """
        with _STATUS_LOCK:
            self.data.update(values)
            self._staged.update(values)
        _FLUSHER.add(self)

    def flush(self) -> None:
        if self._staged:
            self.update()


class _Flusher:
    """Writes staged status values every half second, on a thread of its own (started on first use)."""

    def __init__(self) -> None:
        self._statuses: dict[int, Status] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, status: Status) -> None:
        with self._lock:
            self._statuses[id(status)] = status
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pgcdc-status", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                statuses, self._statuses = list(self._statuses.values()), {}
            for status in statuses:
                status.flush()


_FLUSHER = _Flusher()


def sink_status(settings: SinkSettings, name: str, file: str = STATUS_FILE) -> Status:
    return Status.load(settings.state / name / file)


def state_disk_full(settings: SinkSettings, name: str, error: Any) -> StateDiskFullError | None:
    """The operator's error when ``error`` is the sinks' state disk being full, else None.

    Spark reports a failed checkpoint write as the JVM's IOException text, without the path, so the text is
    matched and the state directory's free space decides whose disk it was: a store's own full disk (say, the
    warehouse's) is that sink's problem, retried with backoff like any store fault.
    """
    if not ((isinstance(error, OSError) and error.errno == errno.ENOSPC) or _NO_SPACE in str(error)):
        return None
    state = settings.state
    if not state.local:
        return None  # an object store has no disk to fill
    state_dir = Path(state.path)
    try:
        free = shutil.disk_usage(state_dir).free
    except OSError:
        return None
    if free > _NEARLY_FULL:
        return None
    return StateDiskFullError(
        f"sink {name} cannot write its checkpoint under {state_dir / name}: the disk is full ({_NO_SPACE}; "
        f"{free:,} bytes free there). Nothing is lost: every sink resumes from its last completed batch. Free "
        "space on that disk, or stop the sinks and move sinks.state_dir (with everything in it) to a larger disk "
        "and set the new path (sinks.state_dir or CDC_SINKS__STATE_DIR); then run `cdc sinks run` again"
    )


# The last line of a Python traceback: "pgcdc_common.errors.SinkTransientError: Redis refused …".
_RAISED = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (?P<message>.*)$")


_OURS = CDCError.__module__ + "."  # where our error classes live, as a traceback names them


def raised_by(error: Any) -> str | None:
    """What one of our errors (sinks.errors) said, when it ended a batch: Spark wraps it in a Python traceback."""
    lines = str(error).splitlines() if error is not None else []
    raised = [m for m in map(_RAISED.match, lines) if m is not None]
    if raised and raised[-1]["type"].startswith(_OURS):
        return raised[-1]["message"]
    return None


def short(error: Any) -> str:
    """One line for status.json, the dashboard and the log: our own message, else the error's first line."""
    text = raised_by(error) or (str(error) if error is not None else "stopped")
    return text.splitlines()[0][:500] if text else "stopped"
