"""The sinks' configuration: the ``[sinks]`` section and each built-in's, read from the same file as the
capture's (docs/configuration.md), and :func:`load_sink_settings`."""

from __future__ import annotations

from sinks._config import (
    CacheConfig,
    SearchConfig,
    SinksConfig,
    SinkSettings,
    SqlConfig,
    WarehouseConfig,
    load_sink_settings,
)

__all__ = [
    "CacheConfig",
    "SearchConfig",
    "SinkSettings",
    "SinksConfig",
    "SqlConfig",
    "WarehouseConfig",
    "load_sink_settings",
]
