"""The capture's errors, by the names it has always exported; the one tree lives in pgcdc_common/errors.py."""

from __future__ import annotations

from pgcdc_common.errors import (
    AuthenticationError,
    CDCError,
    ConfigError,
    KafkaSetupError,
    SchemaRegistryError,
    SourceCheckError,
    StreamError,
    TerminalError,
    TransientError,
)

__all__ = [
    "AuthenticationError",
    "CDCError",
    "ConfigError",
    "KafkaSetupError",
    "SchemaRegistryError",
    "SourceCheckError",
    "StreamError",
    "TerminalError",
    "TransientError",
]
