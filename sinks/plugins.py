"""The sinks installed: built-ins and those registered under the ``pgcdc.sinks`` entry point group
(docs/sinks.md, "Write a sink"), listed without loading Spark."""

from __future__ import annotations

from sinks._plugins import discover

__all__ = ["discover"]
