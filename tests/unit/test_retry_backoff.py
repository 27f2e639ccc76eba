"""`cdc run`'s retry backoff: exponential from the last attempt that made progress, not from the process start."""

from __future__ import annotations

from tenacity import RetryCallState

from pgcdc.cli import _Backoff


def _state(attempt: int) -> RetryCallState:
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return state


def test_the_backoff_grows_with_failures_and_starts_again_after_progress() -> None:
    backoff = _Backoff()
    waits = []
    for attempt in range(1, 9):  # eight quick failures in a row
        backoff.ended(progressed=False)
        waits.append(backoff(_state(attempt)))
    assert waits[0] <= 1.5  # 0.5 s and up to 1 s of jitter
    assert waits[-1] >= 30 - 1e-9  # capped
    backoff.ended(progressed=True)  # an attempt that ran a while, then failed: the run's ninth
    assert backoff(_state(9)) <= 1.5
