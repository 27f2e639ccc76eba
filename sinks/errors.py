"""The sinks' errors, by the names sink plugins import; the one tree lives in pgcdc_common/errors.py."""

from __future__ import annotations

from pgcdc_common.errors import (
    DriftError,
    PluginError,
    SinkConfigError,
    SinkError,
    SinkTerminalError,
    SinkTransientError,
    StateDiskFullError,
)

__all__ = [
    "DriftError",
    "PluginError",
    "SinkConfigError",
    "SinkError",
    "SinkTerminalError",
    "SinkTransientError",
    "StateDiskFullError",
]
