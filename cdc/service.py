"""Running the capture service: what `cdc run`, `cdc attach`, `cdc detach`, `cdc snapshot` and `cdc status`
call. The source's checks and preparation (slot, publication), its connections (a primary, or a standby with
its primary), the capture loop itself, and the signal table that asks it for snapshots."""

from __future__ import annotations

from cdc._backfill import check_where
from cdc._capture import Capture, Stop, install_signal_handlers
from cdc._failover import check_standby
from cdc._signals import SignalTable
from cdc._source import SLOT_INVALIDATED, check_and_prepare, detach, slot_invalidation
from cdc._standby import source_connections
from cdc._stream import HEARTBEAT_PREFIX

__all__ = [
    "HEARTBEAT_PREFIX",
    "SLOT_INVALIDATED",
    "Capture",
    "SignalTable",
    "Stop",
    "check_and_prepare",
    "check_standby",
    "check_where",
    "detach",
    "install_signal_handlers",
    "slot_invalidation",
    "source_connections",
]
