"""Checks made before Spark starts, for faults Spark reports late or obscurely.

A wrong standalone master URL makes ``getOrCreate()`` retry for about a minute and then fail with "Cannot
call methods on a stopped SparkContext"; an object store that is down, refuses the credentials or lacks the
bucket surfaces as a JVM stack trace from the first checkpoint write. Each is found here in a second and
named by the setting to fix.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from sinks._storage import Location
from sinks.errors import SinkConfigError, SinkError, SinkTransientError

_PROBE = ".pgcdc-write-check"


def check_master(master: str, setting: str) -> None:
    """A ``spark://host:port[,host:port…]`` master answers on at least one of its addresses."""
    if not master.startswith("spark://"):
        return  # local[…], yarn, k8s://: their own clients say what is wrong
    addresses = master.removeprefix("spark://").split(",")  # several: standalone masters with ZooKeeper
    tried = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                return
        except ValueError:
            raise SinkConfigError(
                f"{setting} = {master!r}: {address!r} is not host:port; write it as spark://HOST:7077"
            ) from None
        except OSError as exc:
            tried.append(f"{address} ({exc.strerror or exc})")
    raise SinkConfigError(
        f"{setting} = {master!r}: no Spark master answers at {', '.join(tried)}. Start the master, or fix "
        f"{setting} to the spark://HOST:PORT its log and web UI show"
    )


def check_writable(where: Location, setting: str) -> None:
    """``where`` can be written, read back and cleaned up (a probe file), or a named error."""
    probe = where / f"{_PROBE}-{os.getpid()}"
    try:
        where.make_dirs()
        probe.write_text("pgcdc checks that it may write here\n")
        probe.read_text()
        probe.remove()
    except OSError as exc:
        raise storage_error(exc, where, setting) from exc


def storage_error(exc: OSError, where: Location, setting: str) -> SinkError:
    """What a failed read or write of ``where`` means for the operator: what, where, how to fix."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = text.lower()
    bucket = urlsplit(where.uri).netloc
    if not where.object_store:
        return SinkConfigError(
            f"{setting} = {where.uri!r} cannot be written ({text}): make it a directory this user may write, "
            f"or point {setting} elsewhere"
        )
    if any(s in lowered for s in ("network_connection", "could not connect", "timed out", "timeout was reached")):
        return SinkTransientError(
            f"the object store of {setting} ({where.uri}) does not answer ({text}). Nothing was written. Check "
            "that it is up and that sinks.storage.endpoint (CDC_SINKS__STORAGE__ENDPOINT) is its URL"
        )
    if "nosuchbucket" in lowered.replace(" ", "") or "bucket does not exist" in lowered:
        return SinkConfigError(
            f"bucket {bucket!r} of {setting} ({where.uri}) does not exist: create it, or fix {setting}"
        )
    if "access_denied" in lowered or "accessdenied" in lowered or "forbidden" in lowered or "403" in lowered:
        return SinkConfigError(
            f"the object store refused to let pgcdc write {where.uri} ({setting}): access denied. Give the "
            f"credentials (sinks.storage.access_key and secret_key, or the AWS_* environment) read and write "
            f"access to bucket {bucket!r}, or fix the keys"
        )
    return SinkConfigError(f"cannot write {where.uri} ({setting}): {text}")


__all__ = ["check_master", "check_writable", "storage_error"]
