"""Store clients are made once per process and settings (sinks._clients), never taken across a fork."""

from __future__ import annotations

import os
import threading

from sinks import _clients
from sinks._clients import shared


def test_one_client_per_key_however_many_writers_and_threads_ask() -> None:
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(shared(("t", "a"), make))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1
    assert all(g is made[0] for g in got)
    assert shared(("t", "b"), make) is not made[0]  # other settings: a client of their own
    assert len(made) == 2


def test_a_forked_process_makes_its_own() -> None:
    first = shared(("t", "fork"), object)
    _clients._CLIENTS.pid = os.getpid() + 1  # as a child of a fork finds it: made by another process
    try:
        again = shared(("t", "fork"), object)
    finally:
        _clients._CLIENTS.pid = os.getpid()
    assert again is not first
    assert shared(("t", "fork"), object) is again
