"""The Spark standalone cluster, run from the pyspark install: a master and two workers (one core and 2 GiB of
executor memory each), by one name spark-cluster (on demand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pgcdc_dev.services._base import DATA, LOGS, PORTS, SPARK_VERSION, DeployError
from pgcdc_dev.services._install import java_home
from pgcdc_dev.services._process import SERVICES, Service, ServiceGroup, http_get, running_pid, spawn


def spark_home() -> Path:
    """The Spark installation pyspark carries (bin/spark-class, jars/): the cluster runs what the sinks link."""
    try:
        import pyspark  # the project's virtualenv has it
    except ImportError as exc:
        raise DeployError(
            "the Spark cluster runs from the pyspark install: run ./dev once to create the virtualenv"
        ) from exc
    return Path(pyspark.__file__).parent


def spark_daemon(kind: str, args: list[str]) -> list[str]:
    return [str(spark_home() / "bin" / "spark-class"), f"org.apache.spark.deploy.{kind}", *args]


def spark_env(work: Path) -> dict[str, str]:
    # Hadoop's login (UserGroupInformation) calls Subject.getSubject, which Java 23+ refuses.
    jh = java_home(17, 21)
    if jh is None:
        raise DeployError("Spark 4 needs Java 17 to 21: apt-get install -y openjdk-17-jre-headless")
    return {
        "JAVA_HOME": str(jh),
        "SPARK_HOME": str(spark_home()),
        # The daemons only schedule; executors get their own heap (spark.executor.memory).
        "SPARK_DAEMON_MEMORY": "384m",
        "SPARK_LOG_DIR": str(LOGS),
        "SPARK_LOCAL_DIRS": str(work / "tmp"),
        "SPARK_NO_DAEMONIZE": "1",
    }


def spark_master_state() -> dict[str, Any] | None:
    status, body = http_get(f"http://127.0.0.1:{PORTS['spark-master-ui']}/json/")
    if status != 200:
        return None
    try:
        state: dict[str, Any] = json.loads(body)
    except ValueError:
        return None
    return state


class SparkDaemon(Service):
    """A JVM of the standalone cluster, run from the pyspark install with its own data directory."""

    ready_timeout = 90.0
    on_demand = True

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} standalone"

    def install(self) -> None:
        spark_home()
        (DATA / self.name / "tmp").mkdir(parents=True, exist_ok=True)


class SparkMaster(SparkDaemon):
    """A Spark standalone master: ``spark://127.0.0.1:<port>``; web UI and ``/json/`` beside it."""

    name = "spark-master"

    def start(self) -> None:
        args = ["--host", "127.0.0.1", "--port", str(PORTS["spark-master"])]
        args += ["--webui-port", str(PORTS["spark-master-ui"])]
        spawn(self.name, spark_daemon("master.Master", args), env=spark_env(DATA / self.name))

    def ready(self) -> bool:
        state = spark_master_state()
        return bool(state and state.get("status") == "ALIVE")

    def endpoint(self) -> dict[str, Any]:
        port, ui = PORTS["spark-master"], PORTS["spark-master-ui"]
        return {"port": port, "url": f"spark://127.0.0.1:{port}", "ui": f"http://127.0.0.1:{ui}"}


class SparkWorker(SparkDaemon):
    """A worker of the standalone cluster: one core and 2 GiB for executors, its own work dir."""

    needs = ("spark-master",)

    def __init__(self, number: int) -> None:
        self.number = number
        self.name = f"spark-worker-{number}"

    def start(self) -> None:
        work = DATA / self.name
        args = [f"spark://127.0.0.1:{PORTS['spark-master']}", "--host", "127.0.0.1"]
        args += ["--cores", "1", "--memory", "2g", "--work-dir", str(work / "work")]
        args += ["--webui-port", str(self.ui_port())]
        spawn(self.name, spark_daemon("worker.Worker", args), env=spark_env(work))

    def ui_port(self) -> int:
        return PORTS["spark-master-ui"] + self.number

    def ready(self) -> bool:
        state = spark_master_state()
        if not state or running_pid(self.name) is None:
            return False
        ui = f":{self.ui_port()}"
        return any(w.get("state") == "ALIVE" and str(w.get("webuiaddress", "")).endswith(ui) for w in state["workers"])

    def endpoint(self) -> dict[str, Any]:
        master = f"spark://127.0.0.1:{PORTS['spark-master']}"
        ui = f"http://127.0.0.1:{self.ui_port()}"
        return {"ui": ui, "master": master, "display": f"{ui} (worker of {master})"}


class SparkCluster(ServiceGroup):
    """The master and both workers, by one name."""

    name = "spark-cluster"
    needs = ("spark-master", "spark-worker-1", "spark-worker-2")

    def version(self) -> str:
        return f"Spark {SPARK_VERSION} standalone, 2 workers"

    def endpoint(self) -> dict[str, Any]:
        return SERVICES["spark-master"].endpoint()
