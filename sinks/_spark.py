"""Building the SparkSession the sinks run in, with all of its settings assembled here.

:func:`spark_session` turns the sinks' configuration into a session's settings (the master checked, the stores'
Hadoop settings, the checkpoint manager the state directory needs, sinks.spark_conf) and checks the executors it
gets; :func:`build_session` builds a session with the connectors on its classpath and the settings every session
has (:data:`_SESSION_CONF`), fitted to the machine or the cluster. :func:`stop_session` ends it with its processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pgcdc_common.cache import cache_dir
from sinks import connectors
from sinks._preflight import check_executors, check_master
from sinks._storage import hadoop_conf

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sinks._config import SinkSettings

# Every session, wherever it runs. Delta Lake plugs into Spark SQL through the first two settings; without
# them MERGE and the delta format fail.
_SESSION_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # Avro and PostgreSQL names are case-sensitive: a table may have columns "Order" and "order". Spark's
    # default (case-insensitive) resolution finds two matches for either in a struct's fields.
    "spark.sql.caseSensitive": "true",
    # One scheduler pool per sink's query (sinks._query.SinkQuery.start): the queries share the cores
    # instead of queueing behind whichever submitted its tasks first.
    "spark.scheduler.mode": "FAIR",
    # Parquet timestamps as int64 µs: exact for every reader; INT96 (Spark's default) wraps for ±infinity.
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    # Dates and timestamps become day and µs counts in UTC (sinks._values): never the machine's zone.
    "spark.sql.session.timeZone": "UTC",
    # Credentials stay out of the UI, the REST API and event logs: Spark's own pattern, plus the Kafka
    # source's SASL settings (a JAAS line holds the password) and the stores' basic-auth settings.
    "spark.redaction.regex": "(?i)secret|password|token|access[.]key|jaas|sasl|credential|auth",
    "spark.sql.redaction.options.regex": "(?i)url|secret|password|token|access[.]key|jaas|sasl|credential|auth",
}

# How many tasks a shuffle, and Delta's reading of a table's log, are split into. A streaming batch's plan
# gets no adaptive coalescing, so Spark's 200 (and Delta's 50) would be that many tasks per MERGE, nearly all
# empty: on a cluster both are fitted to the executors' cores unless set.
_DRIVER_OPTIONS = "spark.driver.extraJavaOptions"

PARALLELISM_KEYS = ("spark.sql.shuffle.partitions", "spark.databricks.delta.snapshotPartitions")

# Small-machine defaults: 200 shuffle partitions cost far more than they bring on a few cores.
_LOCAL_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.databricks.delta.snapshotPartitions": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}

_CHECKPOINT_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"


def spark_session(settings: SinkSettings, app: str) -> SparkSession:
    """The sinks' session for ``app``: :func:`build_session` with the configuration's settings, its master and
    executors checked."""
    import pyspark  # here, not at the top: this module loads without Spark (sinks/__init__)

    cfg = settings.sinks
    if under_spark_submit():
        check_master(submitted_master(), "spark-submit's --master")
    elif cfg.spark_master:
        check_master(cfg.spark_master, "sinks.spark_master")
    conf = {"spark.sql.session.timeZone": "UTC", **hadoop_conf(cfg.storage), **cfg.spark_conf}
    if settings.state.object_store and _CHECKPOINT_MANAGER not in conf:
        # Spark's default checkpoint manager commits a file by rename, which S3 does not have (a copy and a
        # delete, not atomic): this one writes each file in one upload that becomes visible whole, or never.
        conf[_CHECKPOINT_MANAGER] = "org.apache.spark.internal.io.cloud.AbortableStreamBasedCheckpointFileManager"
    elif settings.state.local and _CHECKPOINT_MANAGER not in conf:
        # A local disk: Spark's default (Hadoop's FileContext) takes ~90 ms to write each of a batch's two
        # checkpoint files here, the FileSystem API ~25 ms, with the same write-then-rename (atomic on a local
        # file system). Two of them per batch and sink were a fifth of a live batch's time.
        conf[_CHECKPOINT_MANAGER] = _local_checkpoint_manager(pyspark.__version__)
    session = build_session(
        app,
        list(cfg.spark_jars),
        master=cfg.spark_master,
        conf=conf,
        class_archive=cfg.jvm_class_archive,
        s3=settings.state.object_store or settings.warehouse_root.object_store,  # then Spark needs S3A
    )
    try:
        check_executors(session)
    except BaseException:
        stop_session(session)
        raise
    return session


def _local_checkpoint_manager(spark_version: str) -> str:
    """Spark's FileSystem-API checkpoint manager: Spark 4.1 moved it into a ``checkpointing`` package."""
    major, minor = (int(part) for part in spark_version.split(".")[:2])
    package = "org.apache.spark.sql.execution.streaming"
    return (
        f"{package}.checkpointing.FileSystemBasedCheckpointFileManager"
        if (major, minor) >= (4, 1)
        else (f"{package}.FileSystemBasedCheckpointFileManager")
    )


def build_session(
    app_name: str,
    jars: Sequence[str],
    *,
    master: str | None = "local[2]",
    conf: Mapping[str, str] | None = None,
    class_archive: bool = False,
    s3: bool = False,
) -> SparkSession:
    """A SparkSession with the Kafka source, spark-avro and Delta Lake on its classpath.

    ``jars`` are local paths (an air-gapped site's, or `./dev services`'); without them Spark resolves the
    connectors by Maven coordinates (sinks.connectors; with ``s3``, the S3A connector too). ``master=None``
    leaves the master to spark-submit, so the same code runs on a cluster. Under spark-submit, its ``--master``,
    ``--jars`` and ``--packages`` win: its JVM is running already, with the classpath it was given.
    ``class_archive``: start the driver's JVM with a class-data archive of Spark's classes (sinks._jvmcache).
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if under_spark_submit():
        if master is not None or jars:
            logging.getLogger(__name__).info(
                "run by spark-submit: its --master, --jars and --conf apply (sinks.spark_master and "
                "sinks.spark_jars are not used)"
            )
        master, jars = None, ()
    if master is not None:
        builder = builder.master(master)
        for key, value in _LOCAL_CONF.items():
            builder = builder.config(key, value)
        if master.startswith("local"):
            # The sinks' writers run in Python worker processes; on this machine they must be this Python
            # (with pgcdc and the store clients installed), not whatever `python3` is first on PATH. PySpark
            # reads the variable when the SparkContext is made.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    elif not under_spark_submit():
        builder = _by_coordinates(builder, s3=s3)
    conf = _with_class_archive(dict(conf or {}), jars) if class_archive else dict(conf or {})
    for key, value in {**_SESSION_CONF, **conf}.items():
        builder = builder.config(key, value)
    running = _running_session()
    resolving = not jars and running is None and not under_spark_submit()
    session = _get_or_create(builder, Path(conf.get("spark.jars.ivy", _default_ivy())) if resolving else None)
    if running is None:
        _STARTED.add(session)
    else:
        _BORROWED[session] = _BORROWED.get(session, 0) + 1
        # An application that embeds the sinks (a notebook, a job of its own, a test run) already runs Spark:
        # the sinks run in it, with the settings a running session can still take, and leave it running.
        logging.getLogger(__name__).info("running in the application's SparkSession (%s)", session.sparkContext.appName)
    if master is None:
        _fit_shuffle_partitions(session, conf or {})
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # --log-level debug keeps Spark's account
        _quiet_session(session)
    return session


def _with_class_archive(conf: dict[str, str], jars: Sequence[str]) -> dict[str, str]:
    """``conf`` with the driver's JVM options to map (or write) its class-data archive (sinks._jvmcache)."""
    if under_spark_submit():  # the JVM is running already
        return conf
    from sinks._jvmcache import java_options

    options = java_options(jars)
    if options:
        given = conf.get(_DRIVER_OPTIONS)
        conf[_DRIVER_OPTIONS] = f"{given} {options}" if given else options
    return conf


def _by_coordinates(builder: SparkSession.Builder, *, s3: bool) -> SparkSession.Builder:
    """The builder with the sinks' connectors as ``spark.jars.packages``: Delta's by delta-spark's own helper
    (its artifact for the installed PySpark), the others by sinks.connectors."""
    from delta import configure_spark_with_delta_pip

    builder = configure_spark_with_delta_pip(builder, extra_packages=connectors.packages(s3=s3))
    # [sinks.spark_conf] is applied after these, so a site's own Ivy settings or cache win.
    builder = builder.config("spark.jars.ivySettings", str(connectors.ivy_settings(cache_dir())))
    builder = builder.config("spark.jars.ivy", str(_default_ivy()))
    excluded = connectors.excludes(s3=s3)
    return builder.config("spark.jars.excludes", ",".join(excluded)) if excluded else builder


def _default_ivy() -> Path:
    return Path.home() / ".ivy2.5.2"  # Spark's own default Ivy directory


@contextlib.contextmanager
def _resolving(ivy: Path) -> Iterator[None]:
    """Held while a Spark application of this machine resolves its connectors into the Ivy directory ``ivy``:
    Ivy's cache is not safe for two resolutions at once (the sinks and `cdc verify` started together failed with
    "impossible to move part file" and half-written jars). The lock is a file in that directory, so every process
    resolving into it takes the same one. Resolution ends before the JVM's gateway answers: it is held seconds."""
    ivy.mkdir(parents=True, exist_ok=True)
    with open(ivy / ".pgcdc-resolve.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _get_or_create(builder: SparkSession.Builder, ivy: Path | None) -> SparkSession:
    """``builder.getOrCreate()``; when Spark starts by resolving the connectors (into ``ivy``), a failure says
    how to go on."""
    if ivy is None:
        return builder.getOrCreate()
    try:
        with _resolving(ivy):
            return builder.getOrCreate()
    except Exception as exc:
        from pgcdc_common.errors import SinkConfigError

        raise SinkConfigError(
            f"Spark did not start while resolving its connectors from Maven ({', '.join(connectors.packages())}, "
            f"and Delta Lake's): {exc}. Spark's output above names the artifact it could not fetch. Without access "
            "to Maven Central, list local jars in sinks.spark_jars, or name a mirror in sinks.spark_conf "
            '("spark.jars.repositories")'
        ) from exc


def _quiet_session(session: SparkSession) -> None:
    session.sparkContext.setLogLevel("WARN")  # spark-submit's default is INFO: a line per task
    for logger in _QUERY_FAILURE_LOGGERS:
        _quiet(session, logger)
    # Pools are made on first use, each time with a warning that no allocation file configured it.
    _quiet(session, _POOL_LOGGER, "ERROR")
    # py4j logs the Python traceback of a batch that raised; the sinks report it (in full unless ours).
    logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)
    logging.getLogger().addFilter(_PY4J_ON_ROOT)  # once: a filter already there is not added again


class _Py4jOnRoot(logging.Filter):
    """Keeps py4j's records on the root logger for ``--log-level debug``.

    py4j's client logs a failed call and its retry on the root logger, with a traceback, at INFO (ERROR when
    the retry fails too) and then raises to its caller. A stop can meet it: Python may free its last references to
    JVM objects while the JVM exits, and such a release finds the connection closed. The
    caller reports a failure that matters; this account of it reads as a crash.
    """

    def __init__(self) -> None:
        super().__init__()
        import py4j

        self._package = os.path.dirname(os.path.abspath(py4j.__file__)) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        if not os.path.abspath(record.pathname).startswith(self._package):
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


_PY4J_ON_ROOT = _Py4jOnRoot()


# Sessions build_session started, and how many of its callers found a session already running: each such
# caller's stop_session leaves it running for whoever started it.
_STARTED: weakref.WeakSet[SparkSession] = weakref.WeakSet()
_BORROWED: weakref.WeakKeyDictionary[SparkSession, int] = weakref.WeakKeyDictionary()


def _running_session() -> SparkSession | None:
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    try:
        return SparkSession.active()
    except PySparkException:  # none: NO_ACTIVE_OR_DEFAULT_SESSION
        return None


def stop_session(session: SparkSession, timeout_s: float = 60.0) -> None:
    """Stop Spark and wait until every process it started from this one has ended: its JVM and, under it, the
    Python workers. A session that was running before the sinks asked for one is the embedding application's,
    and is left running.

    Without this they outlive the app: PySpark's JVM exits only when it reads the end of the pipe from this
    process, that is after this process has gone, and a supervisor (systemd, a container runtime, a test)
    that waits for the whole group then finds them still running and kills them. Under spark-submit the JVM is
    this process's parent, not its child, and is left to spark-submit.
    """
    import psutil

    borrowed = _BORROWED.get(session, 0)
    if borrowed:
        _BORROWED[session] = borrowed - 1
        return
    if session not in _STARTED:
        return
    # Spark's processes only: the JVMs this process started and what runs under them (other children of an
    # application that embeds the sinks are not ours to end).
    jvm, started = [], []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended meanwhile
            if child.name() == "java":
                jvm.append(child)
                started += [child, *child.children(recursive=True)]
    session.stop()  # the SparkContext first: executors, Python workers, checkpoints closed cleanly
    for p in jvm:  # its context is stopped: a SIGTERM runs the JVM's shutdown hooks, which have nothing left to do
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _gone, alive = psutil.wait_procs(started, timeout=timeout_s)
    for p in alive:
        logging.getLogger(__name__).warning("process %d did not end with Spark; killing it", p.pid)
        with contextlib.suppress(psutil.NoSuchProcess):  # it may end between the wait and the kill
            p.kill()
    from sinks._jvmcache import keep_written

    keep_written()


def kill_started() -> None:
    """SIGKILL the processes Spark started from this one (its JVMs and what runs under them), without waiting for
    Spark: the last resort of a stop that did not end in time (pgcdc.sinks_cli). Under spark-submit there are
    none: the JVM is this process's parent."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name() == "java":
                for p in [*child.children(recursive=True), child]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()


def _fit_shuffle_partitions(session: SparkSession, conf: Mapping[str, str]) -> None:
    """Each of PARALLELISM_KEYS not set by the user = the cores the application has when it starts."""
    given = session.sparkContext.getConf()
    cores = max(2, session.sparkContext.defaultParallelism)
    for key in PARALLELISM_KEYS:
        if key not in conf and not given.contains(key):
            session.conf.set(key, str(cores))
            logging.getLogger(__name__).info("%s = %d (the executors' cores; set it to override)", key, cores)


def under_spark_submit() -> bool:
    """Whether spark-submit started this Python (its PythonRunner hands over a running JVM gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def submitted_master() -> str:
    """The master spark-submit was given (``--master``), from the JVM it started."""
    from pyspark import SparkConf

    return str(SparkConf().get("spark.master", ""))


# Spark logs a query that fails as a JVM stack trace of some 40 lines (around the Python traceback, when a
# batch raised). The sinks report every failed query themselves (sinks._supervisor; a rebuild's, sinks._rebuild):
# one line for a failure they know (a full state disk, a store refusing its credentials: what, where, how to
# fix), the whole error for the others. Spark's own copy is silenced so that a known fault does not read as a
# crash.
_QUERY_FAILURE_LOGGERS = (
    "org.apache.spark.sql.execution.streaming.MicroBatchExecution",  # Spark 4.0
    "org.apache.spark.sql.execution.streaming.runtime.MicroBatchExecution",  # Spark 4.1 on
)
_POOL_LOGGER = "org.apache.spark.scheduler.FairSchedulableBuilder"


def _quiet(session: SparkSession, logger: str, level: str = "OFF") -> None:
    try:
        jvm = session.sparkContext._jvm
        assert jvm is not None
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            logger, jvm.org.apache.logging.log4j.Level.getLevel(level)
        )
    except Exception as exc:  # only log tidiness: a Spark without log4j 2 keeps its default
        logging.getLogger(__name__).debug("cannot quieten %s: %s", logger, exc)
