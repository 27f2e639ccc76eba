"""The project's error hierarchy.

    CDCError                        root: everything pgcdc raises on purpose          exit 1
    ├── TransientError              may succeed if retried (network blip, leader     exit 10
    │                               change); `cdc run` retries, one-shot commands stop
    └── TerminalError               retrying cannot help: the operator has to act
        ├── ConfigError             bad or missing configuration                       exit 2
        ├── SourceCheckError        the database is not ready for capture (attach)     exit 3
        ├── AuthenticationError     wrong password, no such role                       exit 4
        ├── SchemaRegistryError     the registry rejected a schema (incompatible)      exit 5
        ├── KafkaSetupError         topic misconfigured, producer fenced, too large    exit 6
        └── StreamError             the replication stream broke its own rules         exit 7

Errors raised by the libraries we use are translated once, at the boundary where we call them, with
``raise ... from exc`` so the original stays attached. Messages are short, name the object they concern
(table, slot, topic, LSN) and say how to fix the problem. They never contain secrets.
"""

from __future__ import annotations


class CDCError(Exception):
    """Root of every error pgcdc raises on purpose."""

    exit_code = 1


class TransientError(CDCError):
    """A fault that retrying, with backoff, may get past (when a command gives up: exit 10)."""

    exit_code = 10


class TerminalError(CDCError):
    """A fault that retrying cannot fix: the operator has to act."""


class ConfigError(TerminalError):
    """The configuration is invalid or incomplete."""

    exit_code = 2


class SourceCheckError(TerminalError):
    """The source database is not set up for logical replication as pgcdc needs it."""

    exit_code = 3

    def __init__(self, message: str, *, check: str) -> None:
        super().__init__(message)
        self.check = check


class AuthenticationError(TerminalError):
    """The source refused our credentials or our role lacks a privilege."""

    exit_code = 4


class SchemaRegistryError(TerminalError):
    """The schema registry refused a schema; nothing was acknowledged to PostgreSQL."""

    exit_code = 5


class KafkaSetupError(TerminalError):
    """Kafka refused what we need: topic configuration, transactions, message size, fencing."""

    exit_code = 6


class StreamError(TerminalError):
    """The replication stream contained something that breaks the protocol's rules."""

    exit_code = 7
