"""A TCP proxy between a client and a service, for fault tests: cut, stalled, restored."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading

import pytest


class Proxy:
    """A TCP proxy the test can cut (every connection dropped, nothing accepted) and restore, or stall (the
    connections stay open and nothing is forwarded either way, as with a broker that stopped answering) and
    let flow again."""

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        if not port:
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
            probe.close()
        self.port = port
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self.held = 0  # bytes clients sent since the last stall, held back while it lasts
        self.restore()

    def stall(self) -> None:
        self.held = 0
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            for a, b, asks in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(a, b, asks), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, asks: bool) -> None:
        """``asks``: ``src`` is the client (what it sends while stalled is counted in :attr:`held`)."""
        try:
            while data := src.recv(65536):
                if asks and not self._flowing.is_set():
                    self.held += len(data)
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def kafka_proxied(bootstrap: str) -> tuple[int, int]:
    """Kafka's PROXIED listener (pgcdc_dev.services): (the port it listens on, the port it advertises). Only the
    local services' broker has it: a run on another broker (``bootstrap``) skips, saying so."""
    out = subprocess.run(
        [sys.executable, "-m", "pgcdc_dev.services", "endpoints"], capture_output=True, text=True, check=True
    )
    kafka = json.loads(out.stdout)["kafka"]
    if kafka["bootstrap"] != bootstrap:
        pytest.skip(f"needs the local services' Kafka (its PROXIED listener); this run uses {bootstrap}")
    return int(kafka["proxied"]["listener"]), int(kafka["proxied"]["advertised"])
