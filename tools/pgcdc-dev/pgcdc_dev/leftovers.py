"""The topics test runs make on the local broker, and their removal.

    python -m pgcdc_dev.leftovers sweep      delete every test-made topic on the local broker (./dev test, first)

Every test names what it makes with a ``unique`` suffix: ten hex digits, a letter among them. A run deletes its
own topics at its end (tests/conftest.py), but a run that is killed leaves them, and a broker that stops
uncleanly recovers every partition's log when it starts again: ~1,000 leftover partitions took it 48 s on an
idle machine and more than two minutes beside a starting test run. ``sweep`` runs when no test runs, so every
test-made topic is a leftover; topics without the suffix (a demo's, the broker's own) are never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

UNIQUE_LEN = 10  # hex digits of the tests' `unique` suffix
UNIQUE = re.compile(f"[0-9a-f]{{{UNIQUE_LEN}}}")


def made_by_a_test(topic: str) -> bool:
    """A name that carries a test's `unique` suffix (a digit-only run could be a date or a count)."""
    return not topic.startswith("_") and any(set(run) & set("abcdef") for run in UNIQUE.findall(topic))


def topics(admin: AdminClient) -> set[str]:
    return set(admin.list_topics(timeout=30).topics)


def delete_topics(admin: AdminClient, doomed: Iterable[str], budget_s: float = 180.0) -> None:
    """Deletes ``doomed`` in batches within ``budget_s``; a failure is a warning (a broker a fault test left
    down, say): what a run found stands either way."""
    from confluent_kafka import KafkaException

    names = sorted(doomed)
    deadline = time.monotonic() + budget_s
    try:
        for i in range(0, len(names), 200):
            left = deadline - time.monotonic()
            if left <= 0:
                warnings.warn(f"left {len(names) - i} test topics undeleted: out of time", stacklevel=1)
                return
            for future in admin.delete_topics(names[i : i + 200], operation_timeout=min(60.0, left)).values():
                with contextlib.suppress(KafkaException):  # already gone, say
                    future.result(timeout=max(1.0, deadline - time.monotonic()))
    except Exception as exc:
        warnings.warn(f"could not delete the test topics: {type(exc).__name__}: {exc}", stacklevel=1)


def sweep() -> int:
    """Deletes every test-made topic on the local broker; the number deleted (0 when none runs here)."""
    from confluent_kafka.admin import AdminClient

    from pgcdc_dev import discovery

    try:
        found = discovery.find("kafka")
    except discovery.ServiceUnavailableError:
        return 0
    if found.source != "deploy":  # a broker named by the environment may be shared: not ours to clean
        return 0
    admin = AdminClient({"bootstrap.servers": found.value})
    doomed = {t for t in topics(admin) if made_by_a_test(t)}
    delete_topics(admin, doomed)
    return len(doomed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgcdc_dev.leftovers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sweep")
    parser.parse_args(argv)
    print(f"leftovers: deleted {sweep()} topics earlier test runs left on the local broker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
