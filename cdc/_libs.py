"""The C libraries our dependencies already loaded (librdkafka under confluent_kafka, libpq under psycopg), for
the C build's hot loops (cdc/_native.pyx) to call into the same copy: same state, same handles.

Each library is found through the extension module that links it, by public means only: the module's file
(its ``__file__``) opened with ``RTLD_NOLOAD`` (a module already in the process; never a second copy) and
``dlsym`` on that handle, which POSIX defines to search the module and then the libraries it was loaded with.
The version the library reports must equal the one its Python package reports (``psycopg.pq.version()``,
``confluent_kafka.libversion()``); on any failure the callers keep their Python path and log why.
"""

from __future__ import annotations

import ctypes
import os
import sys

import psycopg


def linked_library(module_file: str, version: int, version_function: str) -> ctypes.CDLL:
    """A handle on the loaded extension module ``module_file`` whose symbols include the library it links, if
    that library's ``version_function`` returns ``version``; OSError (saying why) otherwise."""
    try:
        lib = ctypes.CDLL(module_file, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        function = getattr(lib, version_function)
    except (OSError, AttributeError) as exc:
        raise OSError(f"{version_function} is not reachable through {module_file}: {exc}") from exc
    function.restype = ctypes.c_int
    found = function()
    if found != version:
        raise OSError(f"{module_file} links a library of version {found}, not the {version} its package reports")
    return lib


def addresses(lib: ctypes.CDLL, names: tuple[str, ...]) -> dict[str, int]:
    """The addresses of ``names`` in ``lib``; raises AttributeError for one it does not have."""
    found = {}
    for name in names:
        address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        if not address:
            raise AttributeError(name)
        found[name] = address
    return found


def libpq_module_file() -> str:
    """The extension module of psycopg's libpq wrapper (``psycopg.pq.PGconn``'s module: psycopg_binary's or
    psycopg_c's); OSError when psycopg runs its ctypes implementation, which no extension module links."""
    module = sys.modules.get(psycopg.pq.PGconn.__module__)
    path = getattr(module, "__file__", None) or ""
    if not path.endswith((".so", ".pyd", ".dylib")):
        raise OSError(f"psycopg runs its {psycopg.pq.__impl__!r} libpq wrapper, not a compiled one")
    return path


def libpq_addresses(names: tuple[str, ...]) -> dict[str, int]:
    """The addresses of ``names`` in the libpq psycopg runs; OSError when that library is not found,
    AttributeError for a function it does not have."""
    lib = linked_library(libpq_module_file(), psycopg.pq.version(), "PQlibVersion")
    return addresses(lib, names)


def librdkafka_addresses(names: tuple[str, ...]) -> dict[str, int]:
    """The addresses of ``names`` in the librdkafka confluent_kafka runs (linked by its extension module,
    ``confluent_kafka.cimpl``); OSError when it is not found, AttributeError for a missing function."""
    from confluent_kafka import cimpl, libversion  # noqa: PLC0415 - only the C build's producer path needs it

    lib = linked_library(str(cimpl.__file__), libversion()[1], "rd_kafka_version")
    return addresses(lib, names)
