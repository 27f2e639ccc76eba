"""Reading what the running processes expose, as an operator's tools do: Prometheus text, the status JSON."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - a local test URL
        return bytes(resp.read())


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """name + sorted labels -> value, as Prometheus would scrape them."""
    out = {}
    for family in text_string_to_metric_families(http_get(f"http://127.0.0.1:{port}/metrics").decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def metric_sum(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of a metric over the label sets that match ``labels``."""
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def api_status(port: int) -> dict[str, Any]:
    return dict(json.loads(http_get(f"http://127.0.0.1:{port}/api/status")))
