"""The capture's coordinator, for the one place that runs it (`cdc run`, pgcdc/cli.py): :class:`Capture` orders
attach, snapshot and stream, :class:`Stop` asks it to end, and :func:`install_signal_handlers` ties that to
SIGTERM and SIGINT. The layering test lets nothing else import it, so no phase reaches back into what runs it."""

from __future__ import annotations

from cdc._capture import Capture, Stop, install_signal_handlers

__all__ = ["Capture", "Stop", "install_signal_handlers"]
