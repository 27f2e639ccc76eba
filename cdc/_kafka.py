"""Kafka and the schema registry: compacted topics, the transactional producer, the offsets topic.

confluent-kafka's errors are translated here, once, into pgcdc's own (cdc.errors).
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError as _RegistryHTTPError

from cdc._encoder import PACKED_HEAD, native_module, packed_rows
from cdc._libs import librdkafka_addresses
from cdc._offsets import CaptureState, NewerStateError, OffsetsStateError
from cdc.errors import AuthenticationError, CDCError, KafkaSetupError, SchemaRegistryError, TransientError
from pgcdc_common.kafka_refusals import NOT_AUTHORISED, SETTING_REFUSED

log = logging.getLogger(__name__)

_TIMEOUT_S = 30.0
_SLICE_S = 1.0  # a commit waits in slices this long, so that a stop is seen between them
# A transaction begun within this long of the previous commit (or abort) waits out the rest first. The
# coordinator answers EndTxn before it has written the commit markers, and until they are written it refuses
# the next transaction's AddPartitionsToTxn with CONCURRENT_TRANSACTIONS, which librdkafka retries after a
# fixed 20 ms (not retry.backoff.ms). At 2,000 txn/s here that retry set the commit -> Kafka p99 (38-40 ms;
# with this gap 14-19 ms, p50 unchanged). Batches only grow meanwhile: the stream is read after the wait.
# KIP-890's transactions v2 (no AddPartitionsToTxn) would make it unnecessary; librdkafka 2.16 lacks it.
# The default of kafka.transaction_gap_ms (a replicated cluster writes its markers to every replica: slower).
_TXN_GAP_S = 0.002
_QUEUE_FULL_WAIT_S = 0.002  # see TransactionalProducer._queue_full
# Fatal producer states that a new producer (a new epoch) gets past; other fatal errors are configuration.
_RECOVERABLE_FATAL = frozenset(
    getattr(KafkaError, name)
    for name in ("INVALID_TXN_STATE", "OUT_OF_ORDER_SEQUENCE_NUMBER", "UNKNOWN_PRODUCER_ID", "_GAPLESS_GUARANTEE")
    if hasattr(KafkaError, name)
)


# What a producer whose epoch was bumped under it meets: another instance's init_transactions did that, or the
# transaction coordinator, when it aborted a transaction open longer than transaction.timeout.ms.
_FENCING = frozenset((KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH))


def _kafka_error(exc: KafkaException, doing: str) -> Exception:
    err: KafkaError = exc.args[0]
    code = err.code()
    if code in _FENCING:
        return KafkaSetupError(
            f"{doing}: another pgcdc instance with the same transactional id took over (fenced); "
            "this instance stops so that only one writes"
        )
    if code == KafkaError.TOPIC_EXCEPTION:  # e.g. an invalid topic name
        return KafkaSetupError(f"{doing}: Kafka refused the topic name: {err.str()}")
    if code == KafkaError.MSG_SIZE_TOO_LARGE:  # TransactionalProducer says which event, how large, which limit
        return KafkaSetupError(
            f"{doing}: a message is larger than the broker accepts; raise the topic's max.message.bytes "
            "and the producer's message.max.bytes (kafka.producer in the config)"
        )
    if err.name() in NOT_AUTHORISED:
        return KafkaSetupError(f"{doing}: not authorised by Kafka: {err.str()}")
    if err.name() in SETTING_REFUSED:  # a replication factor above the brokers', a broker's topic policy
        return KafkaSetupError(f"{doing}: Kafka refused it: {err.str()}")
    if err.fatal() and code in _RECOVERABLE_FATAL:
        # librdkafka's remedy for these fatal producer errors is a new producer; the next attempt makes one,
        # whose init_transactions aborts whatever this one left open (nothing written without its offset
        # counts). Found by the fault suite: INVALID_TXN_STATE after broker and database restarts.
        return TransientError(f"{doing}: fatal Kafka producer error, the producer is recreated: {err.str()}")
    if err.fatal():
        return KafkaSetupError(f"{doing}: fatal Kafka error: {err.str()}")
    return TransientError(f"{doing}: {err.str()}")


class _SecurityErrors:
    """librdkafka reports refused credentials and failed TLS handshakes only to ``error_cb``; the request itself
    just times out with "transport failure". Keeping the last such error lets that timeout say what is wrong."""

    def __init__(self) -> None:
        self.last: KafkaError | None = None

    def __call__(self, err: KafkaError) -> None:
        if err.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL):
            self.last = err

    def explain(self, doing: str) -> CDCError | None:
        err = self.last
        if err is None:
            return None
        if err.code() == KafkaError._AUTHENTICATION:
            return AuthenticationError(
                f"{doing}: Kafka refused the credentials ({err.str()}); check kafka.sasl_mechanism, "
                "kafka.sasl_username and the password (kafka.sasl_password, CDC_KAFKA__SASL_PASSWORD or "
                "kafka.sasl_password_file)"
            )
        return KafkaSetupError(
            f"{doing}: the TLS connection to Kafka failed ({err.str()}); check that kafka.security_protocol "
            "matches the listener, that kafka.ssl_ca_location holds the CA that signed the broker's certificate, "
            "and that bootstrap_servers names a host the certificate is for"
        )


class Topics:
    """Creates change topics as compacted topics and refuses existing topics that are not compacted."""

    def __init__(self, conf: Mapping[str, Any], *, partitions: int, replication_factor: int) -> None:
        self._security = _SecurityErrors()
        admin_conf: dict[str, Any] = {**conf, "error_cb": self._security}
        self._admin = AdminClient(admin_conf)
        self._partitions = partitions
        self._replication_factor = replication_factor
        self._known: dict[str, int] = {}

    def ensure(self, topic: str, *, partitions: int | None = None, policy: str = "compact") -> int:
        """Make sure ``topic`` exists with cleanup.policy=compact (or ``policy``); return its partition count."""
        if topic in self._known:
            return self._known[topic]
        md = self._metadata(topic)
        found = md.topics.get(topic)
        if found is None or found.error is not None:
            new = NewTopic(
                topic,
                num_partitions=partitions or self._partitions,
                replication_factor=self._replication_factor,
                config={"cleanup.policy": policy},
            )
            try:
                self._admin.create_topics([new], operation_timeout=_TIMEOUT_S)[topic].result(_TIMEOUT_S)
                log.info("created compacted topic %s", topic)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise _kafka_error(exc, f"creating topic {topic!r}") from exc
            found = self._wait_for_partitions(topic)
        if policy == "compact":
            self._check_compacted(topic)
        self._known[topic] = len(found.partitions)
        return self._known[topic]

    def _metadata(self, topic: str) -> Any:
        """The topic's metadata; refused credentials or a failed TLS handshake fail at once, saying so."""
        deadline = time.monotonic() + _TIMEOUT_S
        self._security.last = None  # only what is reported during this call explains its failure
        while True:
            try:
                # Short tries: between them error_cb is served, so a refusal is not waited out for 30 s.
                return self._admin.list_topics(topic, timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
            except KafkaException as exc:
                self._admin.poll(0)  # serves error_cb
                explained = self._security.explain(f"looking up topic {topic!r}")
                if explained is not None:
                    raise explained from exc
                if time.monotonic() >= deadline or exc.args[0].code() != KafkaError._TRANSPORT:
                    raise _kafka_error(exc, f"looking up topic {topic!r}") from exc

    def _wait_for_partitions(self, topic: str) -> Any:
        """Metadata of a just-created topic; its partitions may take a moment to appear."""
        for _ in range(100):
            try:
                found = self._admin.list_topics(topic, timeout=_TIMEOUT_S).topics.get(topic)
            except KafkaException as exc:
                raise _kafka_error(exc, f"looking up topic {topic!r}") from exc
            if found is not None and found.error is None and found.partitions:
                return found
            time.sleep(0.1)
        raise TransientError(f"topic {topic!r} was created but has no partitions yet")

    def _check_compacted(self, topic: str) -> None:
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        try:
            configs = self._admin.describe_configs([resource])[resource].result(_TIMEOUT_S)
        except KafkaException as exc:
            raise _kafka_error(exc, f"reading the configuration of topic {topic!r}") from exc
        policy = configs["cleanup.policy"].value or ""
        if "compact" not in policy.split(","):
            raise KafkaSetupError(
                f"topic {topic!r} exists with cleanup.policy={policy}; pgcdc needs a compacted topic "
                f"(kafka-configs --alter --entity-type topics --entity-name {topic} "
                "--add-config cleanup.policy=compact), or delete the topic and let pgcdc create it"
            )


def _librdkafka_conf(settings: Mapping[str, Any]) -> dict[str, str]:
    """The producer's settings as librdkafka's strings (what confluent_kafka does with Python values)."""
    return {
        key: ("true" if value else "false") if isinstance(value, bool) else str(value)
        for key, value in settings.items()
    }


def _native_producer(settings: Mapping[str, Any], on_failure: Any) -> tuple[Any, Any] | None:
    """cdc._native's KafkaProducer on ``settings`` and a DirectProducer on it, or None (confluent_kafka's Producer
    runs, and the events go through its produce()) without the C build, with CDC_PURE_PYTHON, when librdkafka is
    not found, or when the settings hold Python callbacks (a ``logger``, say), which only confluent_kafka serves."""
    _native = native_module()
    if _native is None:
        return None
    python_values = sorted(
        key for key, value in settings.items() if callable(value) or isinstance(value, logging.Logger)
    )
    if python_values:
        log.info("the Kafka producer is confluent_kafka's: the settings hold Python callbacks (%s)", python_values)
        return None
    try:
        symbols = librdkafka_addresses(_native.LIBRDKAFKA_FUNCTIONS)
    except (OSError, AttributeError) as exc:
        log.info("the Kafka producer is confluent_kafka's: %s", exc)
        return None
    producer = _native.KafkaProducer(_librdkafka_conf(settings), symbols, on_failure)
    return producer, _native.DirectProducer(producer)


class ShutdownTimeoutError(TransientError):
    """A stop was asked for and the broker did not let the open transaction end in time (transient: the retry
    loop sees the stop and ends the process)."""


class TransactionTimedOutError(TransientError):
    """The coordinator aborted the open transaction, which had outlived transaction.timeout.ms, and fenced this
    producer (a broker restart or a stall held the transaction up): a new producer starts from the last commit."""


class TransactionalProducer:
    """A producer whose writes become visible together, at commit, or not at all."""

    def __init__(
        self,
        conf: Mapping[str, Any],
        transactional_id: str,
        *,
        gap_s: float = _TXN_GAP_S,
        stop: threading.Event | None = None,
        shutdown_s: float = 10.0,
    ) -> None:
        """``gap_s``: how long after the previous transaction ended the next one may begin (_TXN_GAP_S);
        ``stop``: set when the capture is asked to stop, after which a commit or the close waits ``shutdown_s``
        at most for an unresponsive broker."""
        self._gap_s = gap_s
        self._stop, self._shutdown_s, self._stop_seen = stop, shutdown_s, 0.0
        settings: dict[str, Any] = {
            "enable.idempotence": True,
            "acks": "all",
            # Java's default partitioner: other Kafka tools put the same key in the same partition.
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            # Small requests (a commit's EndTxn, a light load's produce) must not wait for Nagle's algorithm
            # to meet the broker's delayed ACK: visibility latency is the point of committing eagerly.
            "socket.nagle.disable": True,
            "compression.type": "lz4",
            # The local queue is what bounds memory for a huge transaction (the rest is spilled to disk):
            # 64 MB keeps batches large without letting a 1 GB transaction sit in RAM.
            "queue.buffering.max.messages": 200_000,
            "queue.buffering.max.kbytes": 64 * 1024,
            # One PostgreSQL transaction is one Kafka transaction, so a very large one (1 GB) must fit in
            # this; 15 min is the broker's default ceiling (transaction.max.timeout.ms). A crashed instance's
            # open transaction is aborted at once by the next instance's init_transactions, not after this.
            "transaction.timeout.ms": 900_000,
            # commit_transaction fails on any failed delivery; successful reports are just work to serve.
            "delivery.report.only.error": True,
            **conf,
            "transactional.id": transactional_id,
        }
        # The capture's one transactional producer: cdc._native's own librdkafka producer (whose events C
        # also produces), else confluent_kafka's. Never both: two with one transactional.id fence each other.
        native = _native_producer(settings, self._failed)
        if native is None:
            # The default delivery callback: produce() then takes positional arguments only (the hot path).
            self._producer, self._direct = Producer({**settings, "on_delivery": self._on_delivery}), None
        else:
            self._producer, self._direct = native
        self._conf = settings
        self._admin_conf = dict(conf)  # what Topics uses: the settings for an AdminClient on the same cluster
        self._errors: list[KafkaError] = []
        self._too_large: list[tuple[str, int]] = []  # (topic, bytes) of events the broker refused as too large
        self._produced = 0
        self._ended_at = 0.0
        self._begun_at: float | None = None  # when the open transaction began; None between transactions
        self._txn_timeout_s = int(settings["transaction.timeout.ms"]) / 1000
        self.transactional_id = transactional_id
        try:
            # Fences any earlier instance with our id and aborts what it left open.
            self._producer.init_transactions(_TIMEOUT_S)
        except KafkaException as exc:
            raise _kafka_error(exc, "initialising Kafka transactions") from exc
        self._not_from_c: set[str] = set()  # topics DirectProducer has no handle for: asked and logged once

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        """confluent_kafka's delivery callback (only failures arrive: delivery.report.only.error)."""
        if err is not None:
            self._failed(err.code(), msg.topic() or "", len(msg.key() or b"") + len(msg.value() or b""))

    def _failed(self, code: int, topic: str, size: int) -> None:
        """A failed delivery of an event of ``size`` bytes to ``topic``, whichever producer and path sent it."""
        self._errors.append(KafkaError(code))
        if code == KafkaError.MSG_SIZE_TOO_LARGE:
            self._too_large.append((topic, size))

    def _message_too_large(self, topic: str, size: int) -> KafkaSetupError:
        """The operator's error for an event over a size limit: which topic, how large, which limits, the fix.

        Two limits apply: the producer's message.max.bytes (librdkafka refuses a larger event itself; default
        1,000,000) and the topic's max.message.bytes (the broker refuses a larger record batch; default the
        broker's message.max.bytes, 1,048,588). The topic's is read back so the message shows the one in force.
        """
        producer_limit = int(self._conf.get("message.max.bytes", 1_000_000))
        topic_limit = self._topic_limit(topic)
        fix = f"kafka-configs --alter --entity-type topics --entity-name {topic} --add-config max.message.bytes=N"
        if size + 1_000 >= producer_limit:  # N above the producer's limit would be refused by the producer next
            fix += ', and the producer\'s (kafka.producer = { "message.max.bytes" = N } in the config)'
        batch = ""
        if topic_limit is not None and size + 1_000 < topic_limit:
            # Each event fits: the broker refused a record batch of several (librdkafka fills up to batch.size).
            batch = f"; the broker limits whole record batches: keep kafka.producer's batch.size below {topic_limit:,}"
        return KafkaSetupError(
            f"an event for topic {topic!r} is {size:,} bytes, larger than Kafka accepts (the topic's "
            f"max.message.bytes is {'unknown' if topic_limit is None else f'{topic_limit:,}'}, the producer's "
            f"message.max.bytes {producer_limit:,}). Nothing after the last commit was acknowledged to PostgreSQL, "
            f"so no change is lost: raise the topic's limit ({fix}) with N at least {size + 1_000:,} (the event "
            f"plus framing){batch}, then run again"
        )

    def _topic_limit(self, topic: str) -> int | None:
        """The topic's max.message.bytes, None when it cannot be read (only for an error's message)."""
        try:
            admin = AdminClient(self._admin_conf)
            resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
            # A fresh client's first request waits for its connection and metadata: on a loaded machine 10 s
            # was seen to fall short, and the operator's message then lacked the limit in force.
            return int(admin.describe_configs([resource])[resource].result(30)["max.message.bytes"].value)
        except Exception as lookup:  # only detail for the error being reported: it must never replace it
            log.debug("cannot read max.message.bytes of %r: %s", topic, lookup)
            return None

    def begin(self) -> None:
        self._errors.clear()
        self._too_large.clear()
        wait = self._ended_at + self._gap_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._error(exc, "beginning a Kafka transaction") from exc
        self._begun_at = time.monotonic()

    def produce(self, topic: str, key: bytes, value: bytes | None, partition: int | None = None) -> None:
        self._produced += 1
        if self._produced % 16384 == 0:
            # Serve the (error-only) delivery reports now and then, not only at commit or when the queue is full.
            # Rarely: poll() gives up the GIL, and getting it back from a busy thread (the snapshot's reader)
            # can take the interpreter's switch interval (5 ms) — once per 1,000 events that was ~15 % of the
            # snapshot's main thread.
            self._producer.poll(0)
        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, value, key)
                else:
                    self._producer.produce(topic, value, key, partition)
                return
            except BufferError:
                self._queue_full()
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:  # over the producer's own limit
                    raise self._message_too_large(topic, len(key) + len(value or b"")) from exc
                raise self._refused_as_too_large() or self._error(exc, f"producing to {topic!r}") from exc

    @property
    def produces_from_c(self) -> bool:
        """Whether :meth:`produce_packed` hands its events to librdkafka from C (cdc._native.DirectProducer)."""
        return self._direct is not None

    def produce_packed(self, topic: str, packed: bytes, rows: int, prefix: bytes, suffix: bytes) -> None:
        """The ``rows`` events (key, prefix + record + suffix) of ``packed`` (cdc._native's
        TuplePlan.encode_copy_packed: a snapshot chunk), each to the topic's partition for its key, from C without
        the GIL (cdc._native.DirectProducer): the reader thread reads and encodes the next chunk meanwhile.
        Without the C build, one produce() per event."""
        if self._direct is None:
            keys, records = packed_rows(packed)
            assert records is not None
            for key, record in zip(keys, records, strict=True):
                self.produce(topic, key, prefix + record + suffix)
            return
        self._producer.poll(0)  # serve the delivery reports: once per chunk
        name = topic.encode()
        at = 0
        while True:
            at, err = self._direct.produce_packed(name, packed, prefix, suffix, at)
            if err == 0:
                self._produced += rows
                return
            if err == KafkaError._QUEUE_FULL:  # go on from the event refused
                self._queue_full()
                continue
            reclen, keylen = PACKED_HEAD.unpack_from(packed, at)
            self._refused(err, topic, keylen + len(prefix) + reclen + len(suffix), f"producing to {topic!r}")

    def _queue_full(self) -> None:
        """The local queue is full (queue.buffering.max.*): let librdkafka send some. Its events leave the queue
        when the broker acknowledges them, and with error-only delivery reports that serves nothing poll() would
        return for: a long poll sleeps its whole timeout."""
        self._producer.poll(_QUEUE_FULL_WAIT_S)

    def _refused(self, err: int, topic: str, size: int, doing: str) -> NoReturn:
        """Raises the error for an event of ``size`` bytes to ``topic`` that librdkafka refused with ``err``."""
        exc = KafkaException(KafkaError(err))
        if err == KafkaError.MSG_SIZE_TOO_LARGE:  # over the producer's own limit
            raise self._message_too_large(topic, size) from exc
        raise self._refused_as_too_large() or self._error(exc, doing) from exc

    def replay_target(self, topic: str, plan: Any, parts: tuple[bytes, ...]) -> Any | None:
        """A cdc._native.ReplayTarget for :meth:`replay_changes` (``plan``: the table's TuplePlan, ``parts``:
        TableCodec.event_parts), or None when events cannot be produced from C here."""
        if self._direct is None or plan is None or topic in self._not_from_c:
            return None
        try:
            return self._direct.target(plan, topic.encode(), parts)
        except RuntimeError as exc:  # no topic handle: the events go through produce()
            # Remembered: a live transaction asks again for each of its changes, and a log line each would flood.
            self._not_from_c.add(topic)
            log.info("events for %r go through produce(), not from C: %s", topic, exc)
            return None

    def replay_changes(self, block: bytes, at: int, targets: dict[int, Any], aborted: set[int], commit_lsn: int) -> int:
        """The Insert, Update and Delete events of a streamed transaction's spilled messages in ``block`` from
        ``at`` on, from C (cdc._native.DirectProducer.replay_changes), up to the first message it does not take:
        returns that message's offset (``len(block)`` when all were taken). The events count in their targets'
        ``inserts``, ``updates`` and ``deletes``."""
        assert self._direct is not None  # targets exist only with it
        self._producer.poll(0)  # serve the delivery reports: once per block
        while True:
            at, err, size, topic = self._direct.replay_changes(block, at, targets, aborted, commit_lsn)
            if err == 0:
                break
            if err == KafkaError._QUEUE_FULL:  # go on from the event refused
                self._queue_full()
                self._pay_owed(targets)
                continue
            self._refused(err, topic.decode(), size, "producing a replayed transaction")
        self.produced_from_c(targets)
        return at

    @property
    def direct(self) -> Any | None:
        """The cdc._native.DirectProducer on this producer's handle, None without it."""
        return self._direct

    def produced_from_c(self, targets: dict[int, Any], count: int = 0) -> None:
        """``count`` events were produced from C to ``targets`` (ReplayTargets): pay the tombstones owed, and
        serve the delivery reports now and then, as :meth:`produce` does."""
        self._pay_owed(targets)
        before, self._produced = self._produced, self._produced + count
        if before // 16384 != self._produced // 16384:
            self._producer.poll(0)

    def _pay_owed(self, targets: dict[int, Any]) -> None:
        """The tombstone of a delete produced from C whose own tombstone librdkafka refused (ReplayTarget.owed):
        produced now, waiting for room, before any later event of its transaction."""
        for target in targets.values():
            if target.owed is not None:
                key, target.owed = target.owed, None
                self.produce(target.topic.decode(), key, None)

    def _refused_as_too_large(self) -> KafkaSetupError | None:
        """The size error behind a failed transaction, if the broker refused an event as too large.

        Such a refusal makes the open transaction abortable, so the next produce() or the commit fails with a
        generic state error; without this, that error would read as transient and the capture would retry
        the same too-large event for ever (found by the bad-input test). The delivery reports say why.
        """
        self._producer.poll(0)  # serve the delivery reports that arrived with the broker's refusal
        if self._too_large:  # every event's failure names its topic and size, from C or not
            topic, size = max(self._too_large, key=lambda found: found[1])
            return self._message_too_large(topic, size)
        return None

    def commit(self) -> None:
        """Commits in slices of a second, so that a stop is seen while a broker does not answer (the signal's
        handler runs between them): ``shutdown_s`` after it, the transaction is given up (ShutdownTimeoutError)."""
        deadline = time.monotonic() + _TIMEOUT_S * 4
        self._stopping_for()  # a stop asked before the commit began counts from then
        while True:
            try:
                self._producer.commit_transaction(max(0.001, min(_SLICE_S, deadline - time.monotonic())))
                break
            except KafkaException as exc:
                # Only a call that ran out of its slice is tried again. A transaction that failed (its events timed
                # out while a partition's leader or the coordinator moved: the same error code, but not retriable)
                # returns the same error at once on every call, so it is given up to the retry loop, which starts
                # a new producer; nothing of it was acknowledged to PostgreSQL.
                error = exc.args[0]
                again = error.code() == KafkaError._TIMED_OUT and error.retriable() and not error.txn_requires_abort()
                if again and self._stopping_for() >= self._shutdown_s:
                    raise self._given_up() from exc
                if not again or time.monotonic() >= deadline:
                    raise self._refused_as_too_large() or self._error(exc, "committing a Kafka transaction") from exc
        self._ended_at, self._begun_at = time.monotonic(), None
        if self._errors:  # commit raises on failed deliveries; this is belt and braces
            raise self._error(KafkaException(self._errors[0]), "delivering a message")

    def _error(self, exc: KafkaException, doing: str) -> Exception:
        """pgcdc's error for ``exc`` (_kafka_error), told apart for a fencing: the coordinator's or an instance's.

        librdkafka reports both as _FENCED, and brokers return PRODUCER_FENCED for either in some races
        (KIP-588 meant INVALID_PRODUCER_EPOCH for a timeout; KAFKA-20785). What tells them apart is how long the
        transaction was open: the coordinator aborts one only after transaction.timeout.ms from its first
        partition, which is after begin() here. A fencing that ends a younger transaction is another instance's
        (a misread one costs a retry, never an event: the slot and the offsets in each transaction decide).
        """
        open_for = 0.0 if self._begun_at is None else time.monotonic() - self._begun_at
        if exc.args[0].code() in _FENCING and open_for >= self._txn_timeout_s * 0.9:
            return TransactionTimedOutError(
                f"{doing}: the transaction coordinator aborted the open transaction after {open_for:.1f} s, "
                f"longer than transaction.timeout.ms ({self._txn_timeout_s:g} s), and fenced this producer; a "
                "new producer goes on from the last commit (nothing of the aborted transaction was acknowledged "
                "to PostgreSQL). If this recurs while the brokers are healthy, raise kafka.producer's "
                "transaction.timeout.ms (at most the brokers' transaction.max.timeout.ms)"
            )
        return _kafka_error(exc, doing)

    def abort(self) -> None:
        try:
            self._producer.abort_transaction(_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("aborting the Kafka transaction failed: %s", exc)
        self._ended_at, self._begun_at = time.monotonic(), None  # abort markers are written after the response too

    def _stopping_for(self) -> float:
        """Seconds since the stop was first seen here; 0 while none is asked for."""
        if self._stop is None or not self._stop.is_set():
            return 0.0
        now = time.monotonic()
        self._stop_seen = self._stop_seen or getattr(self._stop, "asked_at", 0.0) or now
        return now - self._stop_seen

    def _given_up(self) -> ShutdownTimeoutError:
        """The open transaction abandoned: aborted if the broker answers at once, else left to the next
        instance's init_transactions, which aborts it; the slot stays where the last commit put it."""
        with contextlib.suppress(KafkaException):
            self._producer.abort_transaction(1.0)
        return ShutdownTimeoutError(
            f"the broker did not answer within capture.shutdown_timeout_s ({self._shutdown_s:g} s) of the stop: "
            "the open Kafka transaction is abandoned, and nothing of it was acknowledged to PostgreSQL, so the "
            "next run writes it again"
        )

    def close(self) -> None:
        # Called on the way out of an attempt, often because of an error: it must not replace that error.
        try:
            self._producer.flush(1.0 if self._stopping_for() else _TIMEOUT_S)
        except KafkaException as exc:
            log.warning("closing the Kafka producer: %s", exc)


class OffsetStore:
    """The committed position of one capture (keyed by slot) in a compacted topic, read read_committed."""

    def __init__(self, conf: Mapping[str, Any], topic: str, slot: str) -> None:
        self._conf = dict(conf)
        self.topic = topic
        self.key = slot.encode()

    def load(self) -> CaptureState | None:
        """The last committed state for our slot, or None when we never committed one."""
        consumer = Consumer(
            {
                **self._conf,
                "group.id": f"pgcdc-offsets-reader-{self.key.decode()}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
            }
        )
        try:
            md = consumer.list_topics(self.topic, timeout=_TIMEOUT_S)
            partitions = list(md.topics[self.topic].partitions)
            value: bytes | None = None
            for p in partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=_TIMEOUT_S)
                if high <= low:
                    continue
                consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING)])
                value = self._read_to(consumer, p, high) or value
        except KafkaException as exc:
            raise _kafka_error(exc, f"reading offsets topic {self.topic!r}") from exc
        finally:
            consumer.close()
        return self._decode(value) if value else None

    def _read_to(self, consumer: Consumer, partition: int, high: int) -> bytes | None:
        """Our slot's last record in ``partition`` up to ``high`` (its end when we looked). read_committed stops
        at the last stable offset, so ``high`` may never be reached: the partition EOF event says we have seen
        everything committed. While a capture commits on, EOF may never come either (each fetch brings its new
        records): what was written after we looked is not waited for."""
        value: bytes | None = None
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            msg = consumer.poll(1.0)
            if msg is None:
                if consumer.position([TopicPartition(self.topic, partition)])[0].offset >= high:
                    return value
                if time.monotonic() > deadline:
                    raise TransientError(f"timed out reading offsets topic {self.topic!r}")
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return value
                raise _kafka_error(KafkaException(err), f"reading offsets topic {self.topic!r}")
            if msg.key() == self.key:
                value = msg.value()
            offset = msg.offset()
            if offset is not None and offset >= high - 1:
                return value
            deadline = time.monotonic() + _TIMEOUT_S

    def _decode(self, value: bytes) -> CaptureState:
        where = f"the committed state of slot {self.key.decode()!r} in topic {self.topic!r}"
        try:
            return CaptureState.from_json(json.loads(value))
        except NewerStateError as exc:
            raise NewerStateError(f"{where}: {exc}") from exc
        except (ValueError, OffsetsStateError) as exc:
            # The slot is untouched: the record can be fixed by hand (it is JSON), or the capture started over.
            raise OffsetsStateError(
                f"{where} cannot be resumed: {exc}. Nothing was read from the slot; either produce a corrected "
                "record under the same key, or run `cdc detach` then `cdc run` to start over with a snapshot"
            ) from exc

    def encode(self, state: CaptureState) -> bytes:
        return json.dumps(state.to_json(), separators=(",", ":"), sort_keys=True).encode()


def _certificate_refused(exc: BaseException) -> bool:
    """A failed certificate verification somewhere in the chain (httpx wraps httpcore wraps ssl); other TLS
    errors (a connection reset mid-handshake) stay transient."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def _registry_call(subject: str, doing: str) -> Iterator[None]:
    """A registry request's failures as pgcdc's errors: refused credentials and an untrusted certificate are
    terminal (retrying cannot fix them: the message says which setting does), anything else transient. A status
    the caller handles itself is caught inside this block."""
    try:
        yield
    except _RegistryHTTPError as exc:
        if exc.http_status_code in (401, 403):
            # The body may be a proxy's HTML page: the status says enough.
            raise AuthenticationError(
                f"the schema registry refused our credentials (HTTP {exc.http_status_code}) {doing} {subject!r}; "
                "check registry.basic_auth_user_info ('user:password', or CDC_REGISTRY__BASIC_AUTH_USER_INFO, or "
                "registry.basic_auth_user_info_file)"
            ) from exc
        raise TransientError(f"schema registry error for {subject!r}: {exc.error_message}") from exc
    except CDCError:
        raise
    except Exception as exc:  # the client's transport errors (httpx) share no base class we can name
        if _certificate_refused(exc):
            raise SchemaRegistryError(
                f"the TLS connection to the schema registry failed ({exc}); set registry.ssl_ca_location to the "
                "PEM file of the CA that signed the registry's certificate"
            ) from exc
        raise TransientError(f"cannot reach the schema registry: {type(exc).__name__}: {exc}") from exc


class SchemaRefusedError(SchemaRegistryError):
    """The registry refused a schema under its subject's compatibility level (HTTP 409 or 422): the table's
    topic cannot take it (cdc/_generations.py says what the capture does then)."""

    def __init__(self, message: str, *, subject: str, reason: str) -> None:
        super().__init__(message)
        self.subject = subject
        self.reason = reason


class Registry:
    """Registers schemas (once each) and returns their ids."""

    def __init__(self, conf: Mapping[str, Any]) -> None:
        # A registry request that never answers must not hang the capture (seen with Apicurio under load):
        # time out, and the retry loop restarts from the committed offset.
        self._client = SchemaRegistryClient({"timeout": 30, **conf})
        self._ids: dict[tuple[str, str], int] = {}

    def register(self, subject: str, schema: Mapping[str, Any], *, table: str) -> int:
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
        cached = self._ids.get((subject, text))
        if cached is not None:
            return cached
        with _registry_call(subject, "registering"):
            try:
                schema_id = int(self._client.register_schema(subject, Schema(text, "AVRO")))
            except _RegistryHTTPError as exc:
                if exc.http_status_code not in (409, 422):
                    raise
                raise SchemaRefusedError(
                    f"the schema registry rejected the new schema of table {table} under subject {subject!r} "
                    f"({exc.error_message})",
                    subject=subject,
                    reason=f"HTTP {exc.http_status_code}: {exc.error_message}",
                ) from exc
        self._ids[(subject, text)] = schema_id
        return schema_id

    def latest(self, subject: str) -> dict[str, Any] | None:
        """The subject's latest registered schema, None when it has none yet."""
        with _registry_call(subject, "reading"):
            try:
                registered = self._client.get_latest_version(subject)
            except _RegistryHTTPError as exc:
                if exc.http_status_code == 404:
                    return None
                raise
        text = registered.schema.schema_str if registered.schema is not None else None
        parsed = json.loads(text) if text else None
        if not isinstance(parsed, dict):
            return None
        if registered.schema_id is not None:
            # Registering it again as parsed returns this id without a request: the registry may not take
            # its own text, reformatted, for the same schema, and a new id would change every framed key.
            self._ids[(subject, json.dumps(parsed, separators=(",", ":"), sort_keys=True))] = int(registered.schema_id)
        return parsed
