"""Configuration: a TOML file, overridden by environment variables, validated strictly.

Every key can be set in the file or as ``CDC_<SECTION>__<KEY>`` (e.g. ``CDC_SOURCE__DSN``,
``CDC_KAFKA__BOOTSTRAP_SERVERS``); the environment wins. Unknown keys are errors, not silently ignored —
a mistyped ``publicaton`` must not fall back to a default. Secrets (the database password, Kafka SASL and
registry credentials) are ``SecretStr`` and can come from files; they never appear in ``repr`` or logs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from pgcdc_common.config import (
    FileSettings,
    KafkaConnection,
    RegistryConnection,
    explain,
    read_config_file,
    settings_config,
)
from pgcdc_common.errors import ConfigError
from pgcdc_common.topics import split_table_name, topic_name
from schemas import TEXT_OUTPUT_SETTINGS, Mask

_IDENT = re.compile(r"^[^\x00]{1,63}$")  # PostgreSQL names: any character but NUL, at most 63 bytes


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceConfig(_Section):
    """The PostgreSQL database to capture."""

    dsn: SecretStr = Field(description="libpq connection string or URI; a password in it is kept secret")
    password: SecretStr | None = Field(default=None, description="overrides any password in dsn")
    primary_dsn: SecretStr | None = Field(
        default=None,
        description="when dsn names a hot standby (PostgreSQL 16+): its primary, where the capture writes what a "
        "standby cannot (heartbeats, backfill watermarks, the publication, the signal table); the password "
        "settings apply to it too",
    )
    password_file: Path | None = Field(default=None, description="file whose first line is the password")
    tables: tuple[str, ...] = Field(
        default=(), description="'schema.table' names to capture; empty = every table in the publication"
    )
    key_columns: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="'schema.table' -> key columns, for tables without a primary key (needs REPLICA IDENTITY FULL)",
    )
    columns: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="'schema.table' -> the columns to publish (PostgreSQL 15+ column list); the others never "
        "leave the database. Must keep the key and replica identity columns",
    )
    row_filters: dict[str, str] = Field(
        default_factory=dict,
        description="'schema.table' -> a SQL condition on its replica identity columns (PostgreSQL 15+ row "
        "filter); rows outside it are neither streamed nor snapshotted, and a row leaving it arrives as a delete",
    )
    masks: dict[str, dict[str, Mask]] = Field(
        default_factory=dict,
        description="'schema.table' -> {column = 'hash' | 'null'}: captured but not exposed. 'hash' writes the "
        "hex HMAC-SHA256 of the value under source.mask_key (a string field), 'null' always null; never a key column",
    )
    mask_key: SecretStr | None = Field(default=None, description="the HMAC key of 'hash' masks; kept secret")
    mask_key_file: Path | None = Field(default=None, description="file whose first line is source.mask_key")
    publication: str = "pgcdc"
    slot: str = "pgcdc"
    failover: bool = Field(
        default=True,
        description="PostgreSQL 17+: the slot is a failover slot, kept in step on standbys that set "
        "sync_replication_slots, so a promoted standby resumes the capture (docs/operations.md#high-availability); "
        "an existing slot is altered to match at start",
    )
    signal_table: str = Field(
        default="public.pgcdc_signal",
        description="'schema.table' where `cdc snapshot` (or anyone with INSERT on it) asks the running capture "
        "for backfills; created by `cdc attach`/`cdc run` when absent (needs CREATE on the schema)",
    )

    @field_validator("publication", "slot")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _IDENT.match(value) or len(value.encode()) > 63:
            raise ValueError("must be 1 to 63 bytes and contain no NUL character")
        return value

    @field_validator("slot")
    @classmethod
    def _slot_name(cls, value: str) -> str:
        # PostgreSQL restricts slot names further than other identifiers.
        if not re.fullmatch(r"[a-z0-9_]{1,63}", value):
            raise ValueError("replication slot names may contain only lower-case letters, digits and '_'")
        return value

    @field_validator("tables")
    @classmethod
    def _tables(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            split_table_name(name)
        return value

    def conninfo(self, **extra: str) -> str:
        """The libpq connection string with the effective password (never log it)."""
        return self._conninfo(self.dsn, extra)

    def primary_conninfo(self, **extra: str) -> str | None:
        """source.primary_dsn's connection string as :meth:`conninfo` makes dsn's; None when it is not set."""
        return self._conninfo(self.primary_dsn, extra) if self.primary_dsn is not None else None

    def _conninfo(self, dsn: SecretStr, extra: dict[str, str]) -> str:
        params: dict[str, Any] = conninfo_to_dict(dsn.get_secret_value())
        password = self.effective_password()
        if password is not None:
            params["password"] = password
        params.setdefault("application_name", "pgcdc")
        # Text values (pgoutput's text mode, snapshot ::text columns) are parsed in one fixed format: ISO
        # dates, UTF-8, hex bytea… These session settings make the server produce exactly that.
        fixed = " ".join(f"-c {k}={v}" for k, v in TEXT_OUTPUT_SETTINGS.items())
        params["options"] = f"{params['options']} {fixed}" if params.get("options") else fixed
        params.update(extra)
        return make_conninfo("", **params)

    def effective_password(self) -> str | None:
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is not None:
            try:
                return self.password_file.read_text().splitlines()[0]
            except (OSError, IndexError) as exc:
                raise ConfigError(
                    f"cannot read the password from source.password_file {str(self.password_file)!r}: {exc}"
                ) from exc
        return None

    def mask_key_bytes(self) -> bytes | None:
        """The HMAC key of hash masks (source.mask_key, else the first line of source.mask_key_file)."""
        if self.mask_key is not None and self.mask_key.get_secret_value():  # an empty one is unset
            return self.mask_key.get_secret_value().encode()
        if self.mask_key_file is not None:
            try:
                key = self.mask_key_file.read_text().splitlines()[0].encode()
                if not key:
                    raise IndexError("its first line is empty")
                return key
            except (OSError, IndexError) as exc:
                raise ConfigError(
                    f"cannot read the mask key from source.mask_key_file {str(self.mask_key_file)!r}: {exc}"
                ) from exc
        return None

    def display_dsn(self, *, primary: bool = False) -> str:
        """The DSN (or, with ``primary``, source.primary_dsn) with any password masked: safe for logs and status
        output."""
        dsn = self.primary_dsn if primary and self.primary_dsn is not None else self.dsn
        params = conninfo_to_dict(dsn.get_secret_value())
        if "password" in params or self.password or self.password_file:
            params["password"] = "***"  # noqa: S105 - the mask, not a password
        if "sslpassword" in params:
            params["sslpassword"] = "***"
        return make_conninfo("", **params)


class KafkaConfig(_Section, KafkaConnection):
    """The brokers, the topic prefix, TLS and SASL (shared with the sinks: pgcdc_common/config.py), and the
    capture's own producer keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    partitions: int = Field(default=1, ge=1, description="partitions of newly created change topics")
    replication_factor: int = Field(default=-1, description="-1 = the broker's default")
    transactional_id: str | None = Field(
        default=None, description="default: pgcdc-<slot>; a second instance with the same id fences the first"
    )
    transaction_gap_ms: float = Field(
        default=2.0,
        ge=0,
        le=1000,
        description="a Kafka transaction begins at least this long after the previous one ended: until the "
        "coordinator has written a commit's markers it refuses the next transaction's first partitions, and "
        "librdkafka retries that after a fixed 20 ms (raise it where markers take longer, e.g. replicated)",
    )
    producer: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="extra librdkafka producer settings (compression, linger, …)"
    )

    def client_conf(self) -> dict[str, Any]:
        """librdkafka settings for every client of the capture: brokers, security, extras. Never log it."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.librdkafka(), **self.producer}


class RegistryConfig(_Section, RegistryConnection):
    model_config = ConfigDict(extra="forbid", frozen=True)

    extra: dict[str, str] = Field(default_factory=dict, description="extra SchemaRegistryClient settings")

    def client_conf(self) -> dict[str, Any]:
        """SchemaRegistryClient settings (credentials included: never log them)."""
        return {**self.extra, "url": self.url, **self.security_conf()}


class CaptureConfig(_Section):
    snapshot: Literal["initial", "never"] = "initial"
    snapshot_workers: int = Field(default=2, ge=1)
    snapshot_chunk_rows: int = Field(default=10_000, ge=1)
    snapshot_scan_max_mb: int = Field(
        default=8192,
        ge=0,
        description="plain tables up to this size are read in block ranges of the slot's snapshot (~15 % less "
        "PostgreSQL CPU than key order), and one interrupted is read again from its first row; larger ones are "
        "read in key order and resume after the last committed key; 0: always key order",
    )
    snapshot_commit_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="the snapshot's Kafka transaction (rows and progress) is committed this often, and when a "
        "table is done; 0: after every chunk",
    )
    heartbeat_interval_s: float = Field(default=10.0, gt=0)
    status_interval_s: float = Field(default=1.0, gt=0)
    emit_truncates: bool = True
    emit_transactions: bool = Field(
        default=False,
        description="BEGIN/END events on <topic_prefix>.transaction and a transaction block in every change event",
    )
    emit_messages: bool = Field(
        default=True, description="publish pg_logical_emit_message() messages to <topic_prefix>.messages"
    )
    max_batch_events: int = Field(default=50_000, ge=1)
    binary: bool = Field(default=True, description="ask pgoutput for binary values where supported")
    backfill_new_tables: bool = Field(
        default=True,
        description="a table new to the capture (added to source.tables or the publication) is backfilled while "
        "streaming; false: only its changes from now on are captured",
    )
    backfill_chunk_rows: int = Field(default=5_000, ge=1, description="rows per backfill chunk")
    backfills_at_once: int = Field(default=1, ge=1, description="backfills running at once; the others wait")
    backfill_rows_per_s: float = Field(default=0, ge=0, description="backfill rows per second at most; 0: no limit")
    backfill_pause_behind_s: float = Field(
        default=10.0, gt=0, description="backfills wait while the stream is further behind the source than this"
    )
    backfill_statement_timeout_s: float = Field(
        default=60.0, gt=0, description="each backfill chunk's read (its --where included) is cancelled after this"
    )
    signal_poll_s: float = Field(default=1.0, gt=0, description="how often the signal table is read")
    shutdown_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="after SIGTERM, how long a commit waits for a broker that does not answer before the open "
        "Kafka transaction is abandoned (nothing of it acknowledged to PostgreSQL: the next run writes it again)",
    )
    on_type_change: Literal["stop", "new-topic"] = Field(
        default="new-topic",
        description="a column type change a table's topic cannot take (its subject's compatibility refuses it, "
        "or its key's bytes would change): move the table to a new topic generation (<topic>.g2…) filled by a "
        "backfill while the other tables go on, and which `cdc sinks run` rebuilds the stores from; or stop "
        "saying what changed, for a person to decide (docs/events.md)",
    )
    on_unencodable: Literal["stop", "dead-letter"] = Field(
        default="stop",
        description="a change or snapshot row with a value Avro cannot hold (docs/types.md) or without its key: "
        "stop naming it, or write it to <topic_prefix>.capture-dead-letter and go on",
    )


class MetricsConfig(_Section):
    """Prometheus metrics and the live dashboard served by `cdc run`."""

    enabled: bool = True
    host: str = Field(default="127.0.0.1", description="address to bind; 0.0.0.0 exposes metrics and dashboard")
    port: int = Field(default=9464, ge=0, le=65535, description="0 = any free port (logged)")
    sample_interval_s: float = Field(default=1.0, gt=0, description="how often slot and sink lag are measured")
    history_s: float = Field(default=900.0, gt=0, description="how much history the dashboard's charts keep")


class Settings(FileSettings):
    """The whole configuration (see the module docstring for its sources)."""

    model_config = settings_config(extra="forbid")

    source: SourceConfig
    kafka: KafkaConfig = KafkaConfig()
    registry: RegistryConfig = RegistryConfig()
    capture: CaptureConfig = CaptureConfig()
    metrics: MetricsConfig = MetricsConfig()
    # The derived views' section: read and validated by the sinks (sinks/_config.py), opaque to the capture.
    sinks: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _key_columns_name_listed_tables(self) -> Settings:
        for name in [*self.source.key_columns, *self.source.columns, *self.source.row_filters, *self.source.masks]:
            split_table_name(name)
        hashed = [t for t, cols in self.source.masks.items() if "hash" in cols.values()]
        key = self.source.mask_key
        if hashed and (key is None or not key.get_secret_value()) and self.source.mask_key_file is None:
            raise ValueError(
                f"source.masks hashes columns of {', '.join(hashed)} but no key is set: set source.mask_key "
                "(or CDC_SOURCE__MASK_KEY, or source.mask_key_file)"
            )
        split_table_name(self.source.signal_table)
        return self

    @property
    def transactional_id(self) -> str:
        return self.kafka.transactional_id or f"pgcdc-{self.source.slot}"

    @property
    def offsets_topic(self) -> str:
        return self.kafka.offsets_topic_name()

    @property
    def signal_topic(self) -> str | None:
        """The Kafka topic of requests (None: off)."""
        return self.kafka.signal_topic_name()

    def masks_of(self, schema: str, table: str) -> dict[str, Mask]:
        """source.masks of one table: column -> how."""
        for name, columns in self.source.masks.items():
            if split_table_name(name) == (schema, table):
                return dict(columns)
        return {}

    def topic_for(self, schema: str, table: str) -> str:
        """``<prefix>.<schema>.<table>``; characters Kafka refuses (and dots inside a part) become '_'."""
        return topic_name(self.kafka.topic_prefix, schema, table)


def load_settings(path: Path | None) -> Settings:
    """Read the TOML file (if any), apply environment overrides, validate; ConfigError says what is wrong."""
    data = read_config_file(path)
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, path)) from exc
