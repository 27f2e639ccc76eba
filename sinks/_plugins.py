"""Finding sinks: every entry point in the group ``cdc.sinks`` (the built-ins are announced the same way).

A sink is whatever meets one of the documented contracts, :class:`sinks.PartitionSink` (rows written by
executor tasks) or :class:`sinks.Sink` (a frame written with Spark); subclassing :class:`sinks.BaseSink` is a
convenience, never a requirement. A plugin that fails to import, or meets neither contract, is reported with
the reason and left out; it never keeps the other sinks from loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from sinks._api import PartitionSink, Rebuildable, Sink
from sinks.errors import PluginError

GROUP = "cdc.sinks"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    name: str
    target: str  # "module:attr"
    origin: str  # "distribution version"
    factory: Any | None  # the class (or callable) that makes the sink; None when it failed to load
    error: str | None
    rebuildable: bool = False


def discover() -> dict[str, Found]:
    found: dict[str, Found] = {}
    for ep in entry_points(group=GROUP):
        origin = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown distribution"
        if ep.name in found:
            log.warning(
                "sink %r announced twice (%s and %s); keeping the first", ep.name, found[ep.name].origin, origin
            )
            continue
        try:
            factory = ep.load()
            probe = factory()
            if not isinstance(probe, (PartitionSink, Sink)):
                raise TypeError(_not_a_sink(probe))
            found[ep.name] = Found(ep.name, ep.value, origin, factory, None, isinstance(probe, Rebuildable))
        except Exception as exc:  # a broken plugin is reported, never fatal for the others
            log.warning("sink plugin %r (%s, %s) cannot be loaded: %s", ep.name, ep.value, origin, exc)
            found[ep.name] = Found(ep.name, ep.value, origin, None, f"{type(exc).__name__}: {exc}")
    return found


def load(name: str) -> Any:
    """A new, unopened instance of the sink called ``name``."""
    found = discover()
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise PluginError(f"no sink named {name!r} (found: {known}); `cdc sinks list` shows them")
    entry = found[name]
    if entry.factory is None:
        raise PluginError(f"sink {name!r} ({entry.target}, {entry.origin}) cannot be loaded: {entry.error}")
    return entry.factory()


def _not_a_sink(probe: object) -> str:
    """What ``probe`` lacks of each contract, so that a plugin's author sees the nearest one."""
    contracts = {
        "sinks.PartitionSink": ("name", "open", "prepare", "partition_writer", "close"),
        "sinks.Sink": ("name", "open", "write", "close"),
    }
    gaps = [
        f"{name} needs {', '.join(missing)}"
        for name, members in contracts.items()
        if (missing := [m for m in members if not hasattr(probe, m)])
    ]
    return f"{type(probe).__name__} meets no sink contract: " + "; ".join(gaps) + " (docs/sinks.md, 'Write a sink')"
