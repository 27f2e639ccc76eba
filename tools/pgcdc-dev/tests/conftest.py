"""The development package's own tests: its pure parts, and the broker warm-up against the real broker."""

from __future__ import annotations

import pytest
from pgcdc_dev import discovery


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The broker, found as the product's tests find it (the warm-up deletes the one topic it makes)."""
    return discovery.find_or_skip("kafka")
