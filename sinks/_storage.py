"""Where the sinks keep files: a local directory or an object store, named by a path or a URI.

One location is handed to Spark as a URI (checkpoints and Delta tables go through Hadoop's FileSystem API:
``s3a://bucket/key``, ``hdfs://…``, a local path) and is read and written by the sinks' own Python (status
files, the warehouse's served generation, the checkpoint offsets the lag is measured from) through pyarrow's
filesystems. No Spark is needed for the second, so ``cdc status`` and the capture's metrics read a state
directory on S3 as they read a local one.

Object stores have no rename and no directories: a file is replaced by one PUT (atomic per object on S3),
and a "directory" is the keys under a prefix. Local files are replaced by rename, as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr

if TYPE_CHECKING:
    from pyarrow import fs as pafs

# Hadoop's S3 connector is s3a; s3:// and s3n:// name the same buckets (the connector is the same since
# Hadoop 3), and pyarrow knows the buckets by name alone.
S3_SCHEMES = ("s3a", "s3", "s3n")


class StorageConfig(BaseModel):
    """The object store of ``s3a://`` locations (state_dir, warehouse.path), for Spark's S3A and for pgcdc.

    Unset keys fall back to the AWS defaults of each client (environment variables, profiles, instance
    roles). The secret goes to Spark as ``spark.hadoop.fs.s3a.secret.key``, which Spark redacts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = Field(default=None, description="an S3-compatible server's URL; default: AWS S3")
    region: str | None = None
    access_key: str | None = None
    secret_key: SecretStr | None = None
    path_style: bool = Field(default=False, description="bucket in the path, not the host name (most non-AWS stores)")
    timeout_s: float = Field(default=10.0, gt=0, description="connect and request timeout of pgcdc's own reads")


@dataclass(frozen=True)
class Location:
    """A file or directory: ``fs`` and ``path`` for Python, ``uri`` for Spark."""

    fs: pafs.FileSystem
    path: str  # in fs's terms: an absolute local path, or "bucket/key" on S3
    uri: str

    @property
    def local(self) -> bool:
        return str(self.fs.type_name) == "local"

    @property
    def object_store(self) -> bool:
        return str(self.fs.type_name) == "s3"

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, part: str) -> Location:
        return replace(self, path=f"{self.path.rstrip('/')}/{part}", uri=f"{self.uri.rstrip('/')}/{part}")

    def __str__(self) -> str:
        return self.uri

    def read_text(self) -> str | None:
        """The file's text; None when it does not exist."""
        try:
            with self.fs.open_input_stream(self.path) as f:
                data: bytes = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data.decode()

    def write_text(self, text: str) -> None:
        """Replace the file as a whole: readers see the old text or the new, never a part."""
        if self.local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{self.path}.tmp"
            with self.fs.open_output_stream(tmp) as f:
                f.write(text.encode())
            os.replace(tmp, self.path)
        else:  # one PUT: an object appears whole (there is no rename to make it so)
            with self.fs.open_output_stream(self.path) as f:
                f.write(text.encode())

    def write_from(self, local: Path) -> None:
        """Replace the file with a copy of the local file ``local``, streamed (it may be large)."""
        if self.local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{self.path}.tmp" if self.local else self.path
        with open(local, "rb") as source, self.fs.open_output_stream(tmp) as out:
            while block := source.read(1 << 20):
                out.write(block)
        if self.local:
            os.replace(tmp, self.path)

    def exists(self) -> bool:
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(self.path)
        if info.type != pafs.FileType.NotFound:
            return True
        # An object store's "directory" exists when a key is under it (get_file_info asks the prefix too,
        # but only S3 does): ask for one child to be sure on every filesystem.
        return bool(self.children())

    def children(self) -> list[Location]:
        """What is directly inside this directory (empty when it does not exist)."""
        from pyarrow import fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except NotADirectoryError:
            return []
        return [self / info.base_name for info in infos]

    def make_dirs(self) -> None:
        """Create the directory where directories exist (an object store needs none)."""
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def remove(self) -> None:
        """Delete the file, if it exists."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path)

    def remove_tree(self) -> None:
        """Delete the directory and everything under it, if it exists."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path)


def location(where: str | Path, storage: StorageConfig) -> Location:
    """The location named by a local path, a ``file://`` URI or a filesystem URI (``s3a://bucket/key``…)."""
    from pyarrow import fs as pafs

    text = str(where)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme == "file":
        path = str(Path(rest if sep else text).expanduser().resolve())
        return Location(pafs.LocalFileSystem(), path, path)
    if scheme in S3_SCHEMES:
        rest = rest.strip("/")
        return Location(s3_filesystem(storage), rest, f"s3a://{rest}")
    fs, path = pafs.FileSystem.from_uri(text)  # hdfs://, gs://, abfs://: as pyarrow knows them
    return Location(fs, path, text.rstrip("/"))


@functools.lru_cache(maxsize=8)  # a client per store, not per file read (settings are frozen: hashable)
def s3_filesystem(storage: StorageConfig) -> pafs.S3FileSystem:
    from pyarrow import fs as pafs

    secret = storage.secret_key.get_secret_value() if storage.secret_key is not None else None
    return pafs.S3FileSystem(
        access_key=storage.access_key,
        secret_key=secret,
        region=storage.region,
        endpoint_override=storage.endpoint,
        force_virtual_addressing=not storage.path_style,
        connect_timeout=storage.timeout_s,
        request_timeout=storage.timeout_s,
    )


def hadoop_conf(storage: StorageConfig) -> dict[str, str]:
    """``sinks.storage`` as Spark's S3A settings (``spark.hadoop.fs.s3a.*``); only what is set."""
    conf: dict[str, str] = {}
    if storage.endpoint:
        conf["fs.s3a.endpoint"] = storage.endpoint
        if storage.endpoint.startswith("http://"):
            conf["fs.s3a.connection.ssl.enabled"] = "false"
    if storage.region:
        conf["fs.s3a.endpoint.region"] = storage.region
    if storage.path_style:
        conf["fs.s3a.path.style.access"] = "true"
    if storage.access_key:
        conf["fs.s3a.access.key"] = storage.access_key
    if storage.secret_key is not None:
        conf["fs.s3a.secret.key"] = storage.secret_key.get_secret_value()
    return {f"spark.hadoop.{k}": v for k, v in conf.items()}


__all__ = ["S3_SCHEMES", "Location", "hadoop_conf", "location", "s3_filesystem"]
