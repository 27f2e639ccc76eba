"""pgcdc's per-user cache directory, where the XDG base directory specification puts it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pgcdc``, by default ``~/.cache/pgcdc``: what pgcdc can rebuild (the JVM's class
    archives, the lock and the Ivy settings of Spark's connector resolution)."""
    given = os.environ.get("XDG_CACHE_HOME", "")
    # The specification has a relative value ignored, as if unset.
    return (Path(given) if os.path.isabs(given) else Path.home() / ".cache") / "pgcdc"
