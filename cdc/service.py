"""What `cdc run`, `cdc attach`, `cdc detach`, `cdc snapshot` and `cdc status` call around the capture: the
source's checks and preparation (slot, publication), its connections (a primary, or a standby with its primary),
and the signal table that asks a running capture for snapshots. The capture loop itself is cdc.runner's."""

from __future__ import annotations

from cdc._backfill import check_where
from cdc._failover import check_standby
from cdc._signals import SignalTable
from cdc._source import SLOT_INVALIDATED, check_and_prepare, detach, slot_invalidation
from cdc._standby import source_connections
from cdc._stream import HEARTBEAT_PREFIX

__all__ = [
    "HEARTBEAT_PREFIX",
    "SLOT_INVALIDATED",
    "SignalTable",
    "check_and_prepare",
    "check_standby",
    "check_where",
    "detach",
    "slot_invalidation",
    "source_connections",
]
