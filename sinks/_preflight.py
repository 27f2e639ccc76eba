"""Checks made before Spark starts, for faults Spark reports late or obscurely.

A wrong standalone master URL makes ``getOrCreate()`` retry for about a minute and then fail with "Cannot
call methods on a stopped SparkContext"; an object store that is down, refuses the credentials or lacks the
bucket surfaces as a JVM stack trace from the first checkpoint write. Each is found here in a second and
named by the setting to fix. One check runs once Spark has started (check_executors): that a cluster's executors
can import the sinks' code at all.
"""

from __future__ import annotations

import os
import re
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sinks._storage import Location
from sinks.errors import SinkConfigError, SinkError, SinkTransientError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

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


def _imports_the_sinks(_: object) -> bool:
    """Run on an executor: pickled by reference, so unpickling it already imports ``sinks``; the import below
    adds what a batch's code on an executor needs (pyarrow, the decoders)."""
    import sinks._write  # noqa: F401

    return True


def check_executors(session: SparkSession) -> None:
    """On a cluster, each executor's Python can import the sinks' code, or a SinkConfigError saying how to ship it.

    Small batches are applied by the driver, so without this check an application submitted without the PEX
    would run until its first large batch (a backfill, a burst) and only then stop.
    """
    context = session.sparkContext
    if (context.master or "local").startswith("local"):
        return  # the driver's own Python runs the tasks
    slots = max(1, context.defaultParallelism)
    try:
        context.parallelize(range(slots), slots).map(_imports_the_sinks).collect()
    except Exception as exc:
        missing = missing_module(exc)
        if missing is not None:
            raise missing from None
        raise


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '(?P<module>[\w.]+)'")


def missing_module(error: Any) -> SinkConfigError | None:
    """The operator's error when the executors' Python lacks pgcdc or a library it needs (a cluster whose
    executors were not given the PEX), else None: every retry would fail the same way."""
    found = _NO_MODULE.search(str(error)) if error is not None else None
    if found is None:
        return None
    return SinkConfigError(
        f"the executors' Python cannot import {found['module']!r}: they lack pgcdc[sinks] or a library it needs. "
        "Ship it with the application: build pgcdc.pex and pass spark-submit --files pgcdc.pex "
        "--conf spark.pyspark.python=./pgcdc.pex (docs/sinks.md, On a cluster)"
    )


__all__ = ["check_executors", "check_master", "check_writable", "missing_module", "storage_error"]
