"""The sinks' Spark daemon (sinks._daemon) may import only what starts no thread: a fork copies one thread,
and a lock held by another at the fork would never be released in the worker."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import os, sys
import sinks._daemon as d
d.preload()
threads = len(os.listdir('/proc/self/task'))
missing = [m for m in d.PRELOADED if m not in sys.modules]
sys.stderr.write(f"{threads} {missing}\\n")
"""


def test_the_preload_starts_no_thread_and_prints_nothing_on_stdout() -> None:
    # stdout is the daemon's channel to Spark (it writes its port there): an import that prints breaks it.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == ""
    threads, missing = done.stderr.strip().splitlines()[-1].split(" ", 1)
    assert missing == "[]", f"not imported: {missing}"
    assert threads == "1", f"the preload started {int(threads) - 1} thread(s)"


def test_a_module_that_fails_to_import_is_said_and_skipped() -> None:
    probe = (
        "import sinks._daemon as d\n"
        "d.PRELOADED = ('no_such_module_pgcdc', 'sinks._verify')\n"
        "d.preload()\n"
        "import sys; assert 'sinks._verify' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert "workers will import no_such_module_pgcdc themselves" in done.stderr
