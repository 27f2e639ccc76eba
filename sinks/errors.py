"""The sinks' errors: one root, transient and terminal branches, an exit code each.

SinkError                       root                                           exit 1
├── SinkTransientError          a store or Kafka is unreachable for now; the   exit 10
│                               query retries, one-shot commands stop
└── SinkTerminalError           the operator has to act
    ├── SinkConfigError         bad configuration, unknown sink                exit 2
    ├── PluginError             a plugin failed to load or to start            exit 8
    ├── DriftError              `cdc verify` found the store differs           exit 9
    └── StateDiskFullError      the disk under sinks.state_dir is full         exit 11

A full state disk is terminal, not retried in the app: every sink of the app checkpoints there, so none can
make progress until the operator frees space, and while the disk is full the app cannot even record its
state in status.json (`cdc status` would show it as "not running" after a while, not why). Exiting with a
code of its own says why, at once, to whatever supervises the app (whose restart policy is the backoff); a
rerun after space is freed resumes every sink from its last completed batch, so nothing is lost.
"""

from __future__ import annotations


class SinkError(Exception):
    exit_code = 1


class SinkTransientError(SinkError):
    """Retrying may help: the store or Kafka did not answer."""

    exit_code = 10


class SinkTerminalError(SinkError):
    """Retrying cannot help."""


class SinkConfigError(SinkTerminalError):
    exit_code = 2


class PluginError(SinkTerminalError):
    exit_code = 8


class DriftError(SinkTerminalError):
    exit_code = 9


class StateDiskFullError(SinkTerminalError):
    exit_code = 11
