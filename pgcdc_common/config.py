"""The one configuration file, as the capture and the sinks both read it.

Each side validates only its own sections (the capture: ``[source]``, ``[kafka]``, ``[registry]``,
``[capture]``, ``[metrics]``; the sinks: ``[kafka]``, ``[registry]``, ``[sinks]``) but both read the file the
same way: TOML first, then ``CDC_<SECTION>__<KEY>`` environment variables over it, and a failure explained the
same way, naming each key, the variable that sets it and the fix, never echoing a value (it may be a secret).
The connection keys of ``[kafka]`` and ``[registry]`` are declared once, here, so a key cannot mean one thing
to the capture and another to the sinks.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pgcdc_common.errors import ConfigError
from pgcdc_common.security import KafkaSecurity, RegistrySecurity

ENV_PREFIX = "CDC_"


def settings_config(*, extra: Literal["forbid", "ignore"]) -> SettingsConfigDict:
    """``CDC_<SECTION>__<KEY>`` variables, case-insensitive; settings never change once read."""
    return SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra=extra, frozen=True, case_sensitive=False
    )


class FileSettings(BaseSettings):
    """Settings built from the file's sections (passed as arguments), which the environment overrides."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings


class KafkaConnection(KafkaSecurity):
    """Where the brokers are and how topics are named: the keys of ``[kafka]`` both sides read."""

    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "pgcdc"
    offsets_topic: str | None = Field(default=None, description="default: <topic_prefix>.offsets")
    signal_topic: str | None = Field(
        default=None,
        description="where requests to the running capture can also be produced (default: <topic_prefix>.signals; "
        '"" turns it off)',
    )

    def offsets_topic_name(self) -> str:
        """The capture's offsets topic (never a change topic, whatever its name)."""
        return self.offsets_topic or f"{self.topic_prefix}.offsets"

    def signal_topic_name(self) -> str | None:
        """The Kafka topic of requests to the capture (None: off; never a change topic, whatever its name)."""
        return f"{self.topic_prefix}.signals" if self.signal_topic is None else self.signal_topic or None


class RegistryConnection(RegistrySecurity):
    """Where the schema registry is: the key of ``[registry]`` both sides read (with its security)."""

    url: str = "http://127.0.0.1:8081"


def read_config_file(path: Path | None, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The TOML file's sections ({} without a file); ``error`` says what is wrong with it and how to fix it."""
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise error(f"config file {str(path)!r} not found; pass --config with an existing file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise error(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


def explain(exc: ValidationError, path: Path | None, *, what: str = "configuration") -> str:
    """One line per invalid key: which key, why, and where to set it. Never the offending input."""
    where = f"in {str(path)!r} or CDC_* environment variables" if path else "in CDC_* environment variables"
    lines = [f"invalid {what} ({where}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        env = ENV_PREFIX + "__".join(str(p).upper() for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check its spelling (see docs/configuration.md)")
        elif err["type"] == "missing":
            lines.append(f"  {key}: required; set it in the file or as {env}")
        else:
            lines.append(f"  {key}: {err['msg']} (set via the file or {env})")
    return "\n".join(lines)
