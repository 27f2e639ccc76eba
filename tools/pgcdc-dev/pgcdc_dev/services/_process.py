"""Running the services: reachability probes (an open port, an HTTP answer), pid files that name one process,
starting a service detached with its log rotated, stopping its process group, waiting until it is ready; and the
base classes every service derives from, :class:`Service` and :class:`ServiceGroup`, with :data:`SERVICES`, the
table every service is looked up in by name."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import IS_ROOT, LOGS, RUN, DeployError, say


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError):  # a half-up service answers garbage
        return 0, b""


# --- process bookkeeping -----------------------------------------------------------------------


def pid_file(name: str) -> Path:
    return RUN / f"{name}.pid"


_CHILDREN: dict[str, subprocess.Popen[bytes]] = {}


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command's ")" start at field 3


def write_pid(name: str, pid: int) -> None:
    """Record a service's pid with its start time, atomically: a reader never sees a half-written file."""
    tmp = pid_file(name).with_suffix(f".pid.{os.getpid()}")
    tmp.write_text(f"{pid} {_started_at(pid) or ''}".strip())
    tmp.replace(pid_file(name))


def running_pid(name: str) -> int | None:
    """The service's live pid, or None. A pid file outlives a machine's processes (they are gone when a session
    ends, the files in /var/tmp are not) and pids wrap at pid_max, so the recorded start time must match too:
    otherwise an unrelated process that got the same pid would pass for the service (and `down` signal it)."""
    child = _CHILDREN.get(name)
    if child is not None and child.poll() is not None:  # our own child: reap it, or it lingers as a zombie
        return None
    try:
        recorded = pid_file(name).read_text().split()
        pid = int(recorded[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return None
    except PermissionError:
        pass  # alive, owned by the service user
    if len(recorded) > 1 and _started_at(pid) != recorded[1]:
        return None  # the pid now belongs to another process
    return pid


LOG_ROTATE_BYTES = 64 * 1024 * 1024


def rotate_log(path: Path, limit: int = LOG_ROTATE_BYTES) -> bool:
    """At a start, a service's log over ``limit`` bytes becomes ``<name>.log.1`` (replacing the one before):
    the services append to their logs across starts, and test runs made the broker's grow past 1.6 GB."""
    try:
        if path.stat().st_size <= limit:
            return False
    except FileNotFoundError:
        return False
    try:
        path.replace(path.with_name(path.name + ".1"))
    except OSError:  # a log that cannot be moved is no reason not to start the service
        return False
    return True


def service_environ() -> dict[str, str]:
    """The environment a service starts with: a test that restarts Kafka gets the broker `./dev services up`
    started, not one with the test run's JIT options. `./dev test` keeps the caller's own JAVA_TOOL_OPTIONS
    (a trust store, a proxy) in CDC_SERVICES_JAVA_TOOL_OPTIONS; the services get exactly that back."""
    environ = dict(os.environ)
    if "CDC_SERVICES_JAVA_TOOL_OPTIONS" in environ:
        own = environ.pop("CDC_SERVICES_JAVA_TOOL_OPTIONS")
        environ.pop("JAVA_TOOL_OPTIONS", None)
        if own:
            environ["JAVA_TOOL_OPTIONS"] = own
    return environ


def spawn(
    name: str,
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> int:
    """Start cmd detached in its own session (so `down` can signal the whole group), log to logs/."""
    LOGS.mkdir(parents=True, exist_ok=True)
    RUN.mkdir(parents=True, exist_ok=True)
    rotate_log(LOGS / f"{name}.log")
    with open(LOGS / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**service_environ(), **(env or {})},
            start_new_session=True,
            user=user if (user and IS_ROOT) else None,
            group=user if (user and IS_ROOT) else None,
            extra_groups=[] if (user and IS_ROOT) else None,
        )
    write_pid(name, proc.pid)
    _CHILDREN[name] = proc
    return proc.pid


def stop_pid(name: str, sig: int = signal.SIGTERM, timeout: float = 45.0) -> None:
    pid = running_pid(name)
    if pid is None:
        pid_file(name).unlink(missing_ok=True)
        return
    say(f"stopping {name} (pid {pid})")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        say(f"{name} did not stop within {timeout:.0f}s; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pid_file(name).unlink(missing_ok=True)


def wait_until(what: str, check: Callable[[], bool], name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if running_pid(name) is None:
            raise DeployError(f"{what} exited during start-up; see {LOGS / (name + '.log')}")
        time.sleep(0.5)
    raise DeployError(f"{what} not ready after {timeout:.0f}s; see {LOGS / (name + '.log')}")


# --- services ----------------------------------------------------------------------------------


class Service:
    name = ""
    needs: tuple[str, ...] = ()
    ready_timeout = 120.0
    on_demand = False  # started only when named (`up spark-cluster`), not by a bare `up`

    def install(self) -> None: ...
    def start(self) -> None: ...
    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        stop_pid(self.name)

    def endpoint(self) -> dict[str, Any]:
        return {}

    def version(self) -> str:
        return ""

    def up(self) -> None:
        self.install()
        if running_pid(self.name) is not None and self.ready():
            say(f"{self.name} already running")
            return
        if running_pid(self.name) is None:
            port = self.endpoint().get("port")
            if port and port_open(port):
                raise DeployError(
                    f"port {port} for {self.name} is taken by another process; "
                    f"stop it or choose another port (see `./dev services --help`)"
                )
            self.start()

    def wait(self) -> None:
        wait_until(self.name, self.ready, self.name, self.ready_timeout)


class ServiceGroup(Service):
    """Several services by one name (``needs``); nothing of its own runs. On demand."""

    on_demand = True

    def up(self) -> None:
        pass

    def ready(self) -> bool:
        return all(SERVICES[n].ready() for n in self.needs)

    def stop(self) -> None:
        pass


SERVICES: dict[str, Service] = {}
"""Every service by its name, in the order ``up`` starts them and ``status`` lists them. pgcdc_dev.services.cli,
which imports every service's module, fills it; a :class:`ServiceGroup` finds its members here."""
