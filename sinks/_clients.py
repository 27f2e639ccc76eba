"""One store client per process and settings, for the writers that run many times in it.

A partition writer's ``write`` runs once per table and partition of each batch, and on the driver once per
chunk of a lane (tens of times a second under load). A client opened and closed around each call paid a TCP
connection, the client library's set-up (redis-py looks its own version up in the package metadata and sends
CLIENT SETINFO on every connection) and its teardown every time: at 200 changes/s a quarter of the driver's
time went there. The built-in writers take their client from here instead; the client libraries' own pools
are thread-safe, replace a broken connection on the next call, and redis-py's notices a fork. A process made
by fork (Spark's Python workers are forked from a daemon) never takes a client its parent made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class _Clients:
    """The process's clients by key; emptied when the process is found to be a fork of the one that made them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.made: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        with self.lock:
            if os.getpid() != self.pid:
                self.made.clear()
                self.pid = os.getpid()
            client = self.made.get(key)
            if client is None:
                client = self.made[key] = make()
            return client


_CLIENTS = _Clients()


def shared(key: Hashable, make: Callable[[], T]) -> T:
    """The process's client for ``key`` (the settings it is made from), made by ``make`` the first time."""
    return _CLIENTS.get(key, make)
