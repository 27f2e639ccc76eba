"""The sinks' configuration: the ``[sinks]`` section of the same TOML file the capture service reads.

The sinks read only what they need from the shared file — ``[kafka]`` (where the topics are), ``[registry]``
(how to decode them) and ``[sinks]`` — and ignore the capture's other keys, which the capture validates.
``CDC_<SECTION>__<KEY>`` environment variables override the file, as for the capture.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import NoDecode

from pgcdc_common.config import (
    FileSettings,
    KafkaConnection,
    RegistryConnection,
    explain,
    read_config_file,
    settings_config,
)
from pgcdc_common.errors import SinkConfigError
from pgcdc_common.topics import GENERATION, split_generation, split_table_name, topic_name
from sinks._storage import Location, StorageConfig, location

_BUILTINS = ("search", "cache", "warehouse", "sql")
_ENABLED = ("search", "cache", "warehouse")  # sql needs a database named first (sinks.sql.url)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_TRIGGER = "seconds between the starts of this sink's micro-batches; default: sinks.trigger_interval_s"


class _SinkSection(_Section):
    """What every built-in sink's section has besides its store's settings."""

    trigger_interval_s: float | None = Field(default=None, ge=0, description=_TRIGGER)


class _Foreign(BaseModel):
    """A section the capture owns: the sinks read a few keys and leave the rest to the capture's checks."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class KafkaSection(_Foreign, KafkaConnection):
    """The brokers, the topic prefix and their security (the keys the capture reads too: pgcdc_common/config.py)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    consumer: dict[str, str] = Field(
        default_factory=dict, description="extra Java consumer settings for Spark's Kafka source"
    )

    def client_conf(self) -> dict[str, Any]:
        """librdkafka settings for the sinks' own Kafka clients (lag probe, admin). Never log it."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.librdkafka()}


class RegistrySection(_Foreign, RegistryConnection):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SearchConfig(_SinkSection):
    url: str = "http://127.0.0.1:9200"
    username: str | None = None
    password: SecretStr | None = None
    verify_certs: bool = True
    index_prefix: str | None = Field(default=None, description="default: the Kafka topic prefix")
    replicas: int = Field(default=0, ge=0, description="number_of_replicas of created indices")
    shards: int = Field(default=1, ge=1)


class CacheConfig(_SinkSection):
    url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    namespace: str | None = Field(default=None, description="key prefix; default: the Kafka topic prefix")
    ttl_s: int | None = Field(default=None, gt=0, description="expire entries this long after their last change")


class WarehouseConfig(_SinkSection):
    # Each warehouse batch is a Delta commit (a MERGE, new files and a log entry): a few seconds apart, so the
    # table's log and small files grow by a bounded number per minute.
    trigger_interval_s: float | None = Field(default=5.0, ge=0, description=_TRIGGER)
    path: str = Field(default="warehouse", description="base directory or URI of the Delta tables")
    history: bool = Field(default=False, description="also keep an append-only change history table per table")


class SqlConfig(_SinkSection):
    url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL of the database kept (postgresql+psycopg://…, sqlite:///path, "
        "mariadb+pymysql://…); its password is kept secret",
    )
    schema_: str | None = Field(
        default=None,
        alias="schema",
        description="schema of the tables, views and state tables; default: the database's (PostgreSQL)",
    )


class SinksConfig(_Section):
    enabled: tuple[str, ...] = Field(default=_ENABLED, description="sinks `cdc sinks run` starts by default")
    state_dir: str = Field(
        default=".cdc-sinks", description="checkpoints and status of the queries: a directory or a URI (s3a://…)"
    )
    tables: tuple[str, ...] = Field(default=(), description="'schema.table' names to keep; empty = every table")
    trigger_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="seconds between the starts of micro-batches (0: the next batch starts as soon as the last "
        "has ended and new records are there); a sink's own section can set its own",
    )
    max_offsets_per_trigger: int | None = Field(default=200_000, ge=1, description="records a batch reads at most")
    rebuild_max_offsets_per_trigger: int | None = Field(
        default=5_000_000,
        ge=1,
        description="records a rebuild's batch reads at most: large, so a rebuild dedupes across much of the topic "
        "and its first batch is a bulk load (null: no bound)",
    )
    lane: bool = Field(
        default=True,
        description="search and cache apply changes as they arrive, ahead of Spark's micro-batches, which then "
        "apply only what the lane has not (docs/sinks.md, Freshness); false: the micro-batches apply everything",
    )
    lane_trigger_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="with the lane on, seconds between the starts of search's and cache's micro-batches at least: "
        "the lane applies changes as they arrive, the batches confirm it in the checkpoint, and each costs Spark "
        "~0.2-0.4 s of CPU however little it holds (0: as trigger_interval_s says)",
    )
    lane_linger_ms: int = Field(
        default=50,
        ge=0,
        le=1_000,
        description="how long the broker may hold the lanes' reader's fetch to gather changes (0: each fetch returns "
        "as soon "
        "as one change is there): at a light load each change otherwise becomes a chunk of its own, and every "
        "chunk costs the driver a fold and a write, and the store a request",
    )
    shared_decode_records: int = Field(
        default=50_000,
        ge=0,
        description="decoded change records `cdc sinks run` keeps for its sinks' other readers on the driver (the "
        "warehouse's live batches and the bridges take what the lanes' reader decoded): each record is decoded "
        "once, not once per sink (0: each decodes its own)",
    )
    dead_letter_topic: str | None = Field(default=None, description="default: <topic_prefix>.dead-letter")
    spark_master: str | None = Field(default="local[2]", description="null: leave it to spark-submit")
    spark_jars: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="local jars: Spark's Kafka source, spark-avro, Delta, for a site without Maven; a directory "
        "stands for every .jar in it (none: Spark resolves them by Maven coordinates, sinks.connectors)",
    )
    spark_conf: dict[str, str] = Field(default_factory=dict)
    shutdown_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="after SIGTERM, how long `cdc sinks run` may take to stop (a batch writing to a store or "
        "reading Kafka that does not answer, Spark's own stop) before it exits anyway, ending Spark's processes: "
        "every write is idempotent, and the next run resumes from the last checkpoint",
    )
    rebuild_moved_tables: bool = Field(
        default=True,
        description="when the capture moves a table to a new topic generation (a type change its topic could not "
        "take: docs/events.md), `cdc sinks run` rebuilds the stores beside the served copies, verifies and swaps "
        "them in; the moved table's served copy stays as it was until then (false: `cdc sinks rebuild` does it)",
    )
    swap_grace_s: float = Field(
        default=15.0, ge=0, description="after a rebuild's swap, how long the replaced copy stays for reads in flight"
    )
    jvm_class_archive: bool = Field(
        default=True,
        description="start Spark's driver JVM with a class-data archive kept under ~/.cache/pgcdc/spark-cds "
        "(~150 MB, written by the first run that ends cleanly): each start ~3-4 s sooner",
    )
    metrics_enabled: bool = Field(default=True, description="serve Prometheus metrics from `cdc sinks run`")
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics bind to; 0.0.0.0 exposes them")
    metrics_port: int = Field(default=9465, ge=0, le=65535, description="0 = any free port (logged)")
    search: SearchConfig = SearchConfig()
    cache: CacheConfig = CacheConfig()
    warehouse: WarehouseConfig = WarehouseConfig()
    sql: SqlConfig = SqlConfig()
    storage: StorageConfig = StorageConfig()
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="settings handed to plugin sinks, by sink name"
    )

    def trigger_for(self, sink: str) -> float:
        """The micro-batch interval of ``sink``: its own section's, else ``trigger_interval_s``."""
        section = getattr(self, sink, None) if sink in _BUILTINS else None
        own = section.trigger_interval_s if isinstance(section, _SinkSection) else None
        return own if own is not None else self.trigger_interval_s

    @field_validator("state_dir", mode="before")
    @classmethod
    def _path_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, Path) else value

    @field_validator("spark_jars", mode="before")
    @classmethod
    def _split_jars(cls, value: Any) -> Any:
        # From the environment the list arrives as one comma-separated string (as deploy prints it).
        if isinstance(value, str):
            return tuple(part for part in value.split(",") if part)
        return value

    @field_validator("spark_jars", mode="after")
    @classmethod
    def _expand_jar_directories(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """A directory (an image's jars, say) stands for the jars in it, in name order."""
        jars: list[str] = []
        for entry in value:
            path = Path(entry)
            if not path.is_dir():
                jars.append(entry)
                continue
            found = sorted(str(jar) for jar in path.glob("*.jar"))
            if not found:
                raise ValueError(f"{entry} is a directory with no .jar files in it")
            jars.extend(found)
        return tuple(jars)


class SinkSettings(FileSettings):
    model_config = settings_config(extra="ignore")

    kafka: KafkaSection = KafkaSection()
    registry: RegistrySection = RegistrySection()
    sinks: SinksConfig = SinksConfig()

    @property
    def dead_letter_topic(self) -> str:
        return self.sinks.dead_letter_topic or f"{self.kafka.topic_prefix}.dead-letter"

    def topic_pattern(self) -> str:
        """The change topics: ``<prefix>.<schema>.<table>`` (parts never contain dots, see docs/events.md),
        except the capture's own topics (offsets, signals) and the dead-letter topic, whatever their names.

        Java and Python regular expressions alike (Spark's ``subscribePattern``, the lag probe's ``fullmatch``).
        """
        if self.sinks.tables:
            return "|".join(re.escape(self.topic_for(name)) + GENERATION for name in self.sinks.tables)
        own = [self.kafka.offsets_topic_name(), self.kafka.signal_topic_name(), self.dead_letter_topic]
        not_ours = "".join(f"(?!{re.escape(t)}$)" for t in sorted({t for t in own if t}))
        return not_ours + re.escape(self.kafka.topic_prefix) + r"\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+" + GENERATION

    def table_name(self, topic: str) -> str:
        """``<schema>.<table>`` of a change topic, as stores name their objects (the topic without its prefix,
        and without its generation: a table moved to a new topic generation keeps its name in the stores)."""
        prefix, base = self.kafka.topic_prefix + ".", split_generation(topic, self.kafka.topic_prefix)[0]
        return base[len(prefix) :] if base.startswith(prefix) else base

    def topic_for(self, qualified: str) -> str:
        try:
            schema, table = split_table_name(qualified)
        except ValueError as exc:
            raise SinkConfigError(f"sinks.tables: {exc}") from exc
        return topic_name(self.kafka.topic_prefix, schema, table)

    # The two places the sinks keep files, each parsed once (settings never change once read): what is local,
    # what is on an object store, is asked of the location, never of the configured text again.
    @cached_property
    def state(self) -> Location:
        """``sinks.state_dir``: where checkpoints and status files are."""
        return location(self.sinks.state_dir, self.sinks.storage)

    @cached_property
    def warehouse_root(self) -> Location:
        """``sinks.warehouse.path``: where the warehouse's Delta tables are."""
        return location(self.sinks.warehouse.path, self.sinks.storage)

    def registry_conf(self) -> dict[str, Any]:
        return {"url": self.registry.url, "timeout": 30, **self.registry.security_conf()}


def load_sink_settings(path: Path | None) -> SinkSettings:
    data = read_config_file(path, SinkConfigError)
    try:
        return SinkSettings(**{k: v for k, v in data.items() if k in ("kafka", "registry", "sinks")})
    except ValidationError as exc:
        raise SinkConfigError(explain(exc, path, what="sinks configuration")) from exc
