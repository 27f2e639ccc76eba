"""pgcdc on a Spark standalone cluster as users run it, and the S3-compatible server's buckets: what the
cluster and object-store tests and the sinks benchmark share.

``pgcdc_pex`` ships pgcdc to the executors as docs/sinks.md tells users to (a wheel, then a PEX file);
``submit_command`` is spark-submit in client mode up to the ``cdc`` arguments.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcdc_dev import CHECKOUT

_PACKAGED = tuple(tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


@dataclass(frozen=True)
class ObjectStore:
    """The S3-compatible server (pgcdc_dev.services's s3proxy) and the jars Spark needs to reach it."""

    url: str
    access_key: str
    secret_key: str
    classpath: str  # hadoop-aws, the AWS SDK bundle, spark-hadoop-cloud: for extraClassPath

    def filesystem(self) -> Any:
        from pyarrow import fs

        return fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=self.url,
            force_virtual_addressing=False,
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def ensure_bucket(self, name: str) -> None:
        from pyarrow import fs

        store = self.filesystem()
        if store.get_file_info(name).type == fs.FileType.NotFound:
            store.create_dir(name)

    def keys(self, bucket: str) -> list[str]:
        """Every object's path (``bucket/key``) in ``bucket``."""
        from pyarrow import fs

        return [i.path for i in self.filesystem().get_file_info(fs.FileSelector(bucket, recursive=True))]

    def bucket(self, name: str) -> ObjectStoreBucket:
        """A new, empty bucket (each test its own: the server is shared)."""
        self.filesystem().create_dir(name)
        return ObjectStoreBucket(self, name)


@dataclass(frozen=True)
class ObjectStoreBucket:
    store: ObjectStore
    name: str

    def uri(self, key: str) -> str:
        return f"s3a://{self.name}/{key}"

    def toml(self) -> str:
        """``[sinks.storage]`` and the classpath, inside a ``[sinks]`` table."""
        s = self.store
        classpath = {"spark.driver.extraClassPath": s.classpath, "spark.executor.extraClassPath": s.classpath}
        conf = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in classpath.items())
        return f"""spark_conf = {{ {conf} }}

[sinks.storage]
endpoint = "{s.url}"
region = "us-east-1"
access_key = "{s.access_key}"
secret_key = "{s.secret_key}"
path_style = true
"""


def pgcdc_pex(cache: Path) -> Path:
    """pgcdc and its sinks' dependencies as one PEX file for the executors (built once per source tree).

    It is made the way docs/sinks.md tells users to: a wheel of the project, then ``pex 'pgcdc[sinks]'``
    without pyspark and delta-spark (Spark puts its own pyspark on the workers' PYTHONPATH, which
    ``--inherit-path=fallback`` keeps).
    """
    digest = hashlib.sha256()
    for path in sorted(p for d in _PACKAGED for p in (CHECKOUT / d).rglob("*") if p.is_file() and _shipped(p)):
        digest.update(str(path.relative_to(CHECKOUT)).encode() + b"\0" + path.read_bytes())
    for name in ("pyproject.toml", "setup.py"):
        digest.update((CHECKOUT / name).read_bytes())
    out = cache / "pex" / f"pgcdc-{digest.hexdigest()[:16]}.pex"
    if out.exists():
        return out
    pex = Path(sys.executable).parent / "pex"
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        wheels = Path(tmp) / "wheels"
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(CHECKOUT), "-w", str(wheels)])
        built = Path(tmp) / "pgcdc.pex"
        _run([str(pex), "-f", str(wheels), "pgcdc[sinks]", "--exclude", "pyspark", "--exclude", "delta-spark",
              "--inherit-path=fallback", "--python", sys.executable, "-o", str(built)])  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        built.replace(out)
    return out


def _shipped(path: Path) -> bool:
    return "__pycache__" not in path.parts and path.suffix not in (".so", ".c", ".pyc")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def submit_command(
    *, master: str, pex: Path | None, jars: list[str], ui_port: int, classpath: str = "", java_options: str = ""
) -> list[str]:
    """spark-submit in client mode on ``master`` as docs/sinks.md gives it, up to the application's arguments
    (cdc's: ``sinks run …``, ``sinks rebuild NAME …``). ``java_options`` go to the executors' JVMs, which the
    workers start with their own environment, not the submitter's."""
    spark_submit = Path(sys.executable).parent / "spark-submit"
    # Jars already on the machines (the S3 connector): on the JVMs' classpath, not copied to each executor.
    extra = ["--driver-class-path", classpath, "--conf", f"spark.executor.extraClassPath={classpath}"]
    return [
        str(spark_submit),
        "--master", master,
        "--deploy-mode", "client",
        # No PEX: the executors run the machine's plain python3.11, which lacks pgcdc.
        *(["--files", str(pex), "--conf", f"spark.pyspark.python=./{pex.name}"] if pex else []),
        *([] if pex else ["--conf", "spark.pyspark.python=python3.11"]),
        "--conf", f"spark.pyspark.driver.python={sys.executable}",
        "--jars", ",".join(jars),
        "--driver-memory", "1g",
        "--executor-memory", "1g",
        "--conf", f"spark.ui.port={ui_port}",
        "--conf", "spark.ui.showConsoleProgress=false",
        *(extra if classpath else []),
        *(["--conf", f"spark.executor.extraJavaOptions={java_options}"] if java_options else []),
        spark_app(),
    ]  # fmt: skip


def spark_app() -> str:
    """The file spark-submit runs, where the installed pgcdc keeps it (``cdc sinks spark-app``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pgcdc", "sinks", "spark-app"], capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


def submit_env() -> dict[str, str]:
    """pyspark's bin/spark-submit looks for Spark with whatever `python3` is first on PATH otherwise."""
    import pyspark

    return {"SPARK_HOME": str(Path(pyspark.__file__).parent)}
