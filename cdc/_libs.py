"""The C libraries our dependencies already loaded (librdkafka under confluent_kafka, libpq under psycopg), for
the C build's hot loops (cdc/_native.pyx) to call into the same copy: same state, same handles.

Linux only (read from /proc/self/maps); elsewhere nothing is found and the callers keep the Python path.
"""

from __future__ import annotations

import ctypes
import os

import psycopg


def loaded_library(name: str, version: int, version_function: str) -> ctypes.CDLL | None:
    """The library already loaded whose file name starts with ``name`` (e.g. "librdkafka"), if its
    ``version_function`` returns ``version`` (the one the Python package reports): never a second copy."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if f"/{name}" in line}
    except OSError:  # not Linux
        return None
    found = []
    for path in sorted(paths):
        if not os.path.basename(path).startswith(name):
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)  # RTLD_NOLOAD: only a library already in the process
            function = getattr(lib, version_function)
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        if function() == version:
            found.append(lib)
    # Two copies of the same version (a wheel's bundled one and the system's): which one owns the handles is
    # not known, and a call into the other would use another copy's state (its own OpenSSL, say).
    return found[0] if len(found) == 1 else None


def addresses(lib: ctypes.CDLL, names: tuple[str, ...]) -> dict[str, int]:
    """The addresses of ``names`` in ``lib``; raises AttributeError for one it does not have."""
    found = {}
    for name in names:
        address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        if not address:
            raise AttributeError(name)
        found[name] = address
    return found


def libpq_addresses(names: tuple[str, ...]) -> dict[str, int]:
    """The addresses of ``names`` in the libpq psycopg runs; OSError when that library is not found,
    AttributeError for a function it does not have."""
    lib = loaded_library("libpq", psycopg.pq.version(), "PQlibVersion")
    if lib is None:
        raise OSError("the libpq psycopg runs is not found")
    return addresses(lib, names)
