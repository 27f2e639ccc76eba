"""The capture's Prometheus metrics (docs/observability.md), for the process that serves them."""

from __future__ import annotations

from cdc._metrics import DEAD_LETTER_OP, CaptureMetrics

__all__ = ["DEAD_LETTER_OP", "CaptureMetrics"]
