"""pgcdc's one error hierarchy: the capture, the sinks and the command line raise from the same root.

    CDCError                        root: everything pgcdc raises on purpose          exit 1
    ├── TransientError              may succeed if retried (network blip, leader     exit 10
    │                               change); long-running commands retry, one-shot
    │                               commands stop
    ├── TerminalError               retrying cannot help: the operator has to act
    │   ├── ConfigError             bad or missing configuration                       exit 2
    │   ├── SourceCheckError        the database is not ready for capture (attach)     exit 3
    │   ├── AuthenticationError     wrong password, no such role                       exit 4
    │   ├── SchemaRegistryError     the registry rejected a schema (incompatible)      exit 5
    │   ├── KafkaSetupError         topic misconfigured, producer fenced, too large    exit 6
    │   └── StreamError             the replication stream broke its own rules         exit 7
    └── SinkError                   raised by the derived views (the sinks)            exit 1
        ├── SinkTransientError      also a TransientError: a store or Kafka is        exit 10
        │                           unreachable for now; the query retries
        └── SinkTerminalError       also a TerminalError
            ├── SinkConfigError     also a ConfigError: bad sinks settings,          exit 2
            │                       unknown sink
            ├── PluginError         a plugin failed to load or to start              exit 8
            ├── DriftError          `cdc verify` found the store differs             exit 9
            └── StateDiskFullError  the disk under sinks.state_dir is full           exit 11

One code means one thing whichever part raised it, so whatever supervises a process (systemd, Kubernetes, a
scheduler) can act on the code alone: 10 is worth a restart with backoff, every other code needs a person.
A sink author catches ``SinkError``; an operator's wrapper can catch ``TransientError``/``TerminalError``
across both halves.

A full state disk is terminal, not retried in the sinks app: every sink of the app checkpoints there, so none
can make progress until the operator frees space, and while the disk is full the app cannot even record its
state in status.json (`cdc status` would show it as "not running" after a while, not why). Exiting with a
code of its own says why, at once, to the supervisor (whose restart policy is the backoff); a rerun after
space is freed resumes every sink from its last completed batch, so nothing is lost.

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


class SinkError(CDCError):
    """Root of the errors the derived views raise (the one a sink plugin catches)."""

    exit_code = 1


class SinkTransientError(SinkError, TransientError):
    """Retrying may help: the store or Kafka did not answer."""

    exit_code = 10


class SinkTerminalError(SinkError, TerminalError):
    """Retrying cannot help."""

    exit_code = 1


class SinkConfigError(SinkTerminalError, ConfigError):
    """The sinks' settings are invalid, or a sink is unknown."""

    exit_code = 2


class PluginError(SinkTerminalError):
    """A sink plugin failed to load or to start."""

    exit_code = 8


class DriftError(SinkTerminalError):
    """``cdc verify`` found that a store differs from its topics."""

    exit_code = 9


class StateDiskFullError(SinkTerminalError):
    """The disk under ``sinks.state_dir`` is full (see the module docstring for why this is terminal)."""

    exit_code = 11
