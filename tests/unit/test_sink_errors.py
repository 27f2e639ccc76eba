"""How the sinks app words a failed query: one line of ours, and a full state disk told apart from others."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from sinks._reader import _topic_error
from sinks._status import short, state_disk_full
from sinks.config import SinkSettings
from sinks.errors import SinkConfigError, SinkTerminalError, SinkTransientError, StateDiskFullError

# What str() of Spark's StreamingQueryException holds when a batch raised one of our errors.
_WRAPPED = """An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/py4j/clientserver.py", line 617, in _call_proxy
    return_value = getattr(self.pool[obj_id], method)(*params)
redis.exceptions.AuthenticationError: invalid username-password pair or user is disabled.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/work/main/sinks/_cache.py", line 190, in _call
    raise SinkTransientError(
{TYPE}: Redis refused the credentials of sinks.cache.url (invalid …); check them
""".replace("{TYPE}", f"{SinkTransientError.__module__}.{SinkTransientError.__qualname__}")  # as Python prints it


def test_a_batch_that_raised_our_error_is_summed_up_by_its_message() -> None:
    assert short(_WRAPPED) == "Redis refused the credentials of sinks.cache.url (invalid …); check them"


def test_other_errors_keep_their_first_line() -> None:
    assert short("[STREAM_FAILED] Query q terminated with exception: boom\nat x") == (
        "[STREAM_FAILED] Query q terminated with exception: boom"
    )
    assert short(_WRAPPED.replace(SinkTransientError.__module__, "mypackage")).startswith("An exception was raised")
    assert short(None) == "stopped"


def test_enospc_is_the_state_disk_only_when_that_disk_is_full(tmp_path: Path) -> None:
    settings = SinkSettings(sinks={"state_dir": tmp_path})  # type: ignore[arg-type]
    # tmp_path's filesystem has room: a "no space" from elsewhere (a store's disk) is that sink's fault.
    assert state_disk_full(settings, "warehouse", OSError(errno.ENOSPC, "No space left on device")) is None
    assert state_disk_full(settings, "cache", "java.io.IOException: No space left on device") is None
    assert state_disk_full(settings, "cache", "Connection refused") is None


def test_a_full_state_disk_has_its_own_exit_code() -> None:
    assert issubclass(StateDiskFullError, SinkTerminalError)
    assert StateDiskFullError.exit_code == 11


def test_enospc_with_the_state_disk_nearly_full_is_the_state_disk_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real case needs a full filesystem (the tmpfs integration test, root only); here the free-space
    # reading is what decides, so it is the one thing replaced.
    def nearly_full(path: object) -> shutil._ntuple_diskusage:
        return shutil._ntuple_diskusage(16 << 20, 16 << 20, 4096)

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    settings = SinkSettings(sinks={"state_dir": tmp_path})  # type: ignore[arg-type]
    for error in (OSError(errno.ENOSPC, "No space left on device"), "java.io.IOException: No space left on device"):
        found = state_disk_full(settings, "cache", error)
        assert isinstance(found, StateDiskFullError)
        assert "the disk is full" in str(found)
        assert str(tmp_path.resolve() / "cache") in str(found)
        assert "4,096 bytes free" in str(found)
    assert state_disk_full(settings, "cache", "Connection refused") is None


def test_kafka_not_answering_is_retried_and_a_refusal_is_not() -> None:
    """The sinks' first contact with Kafka (their dead-letter topic): what the app retries, what ends it."""
    where = "the dead-letter topic p.dead-letter on k:9092"
    for code in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.NOT_CONTROLLER):
        assert isinstance(_topic_error(where, KafkaException(KafkaError(code)), 30), SinkTransientError)
    timed_out = _topic_error(where, TimeoutError(), 30)
    assert isinstance(timed_out, SinkTransientError)
    assert str(timed_out) == f"cannot check or create {where}: no answer within 30 s"
    refused = _topic_error(where, KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), 30)
    assert isinstance(refused, SinkConfigError)
    assert "sinks.dead_letter_topic" in str(refused)
    assert where in str(refused)
