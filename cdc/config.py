"""The capture's configuration, as the application layer and tools read it: the file's sections and
:func:`load_settings` (docs/configuration.md)."""

from __future__ import annotations

from cdc._config import (
    CaptureConfig,
    KafkaConfig,
    MetricsConfig,
    RegistryConfig,
    Settings,
    SourceConfig,
    load_settings,
)

__all__ = [
    "CaptureConfig",
    "KafkaConfig",
    "MetricsConfig",
    "RegistryConfig",
    "Settings",
    "SourceConfig",
    "load_settings",
]
