# Part of the cdc._native extension module: cdc/_native.pyx includes it, and all parts share one namespace.
#
# Producing through librdkafka: the replay of spilled changes, the capture's KafkaProducer and DirectProducer.

# --- Producing rows straight through librdkafka ---------------------------------------------------------------
#
# confluent_kafka's Producer.produce() costs ~1.4 µs per event in the calling thread, with the GIL held: for a
# snapshot that was most of what the main thread did. DirectProducer hands a whole chunk of events to the
# capture's librdkafka handle (KafkaProducer's, below: the same transaction and partitioner) from C, without the
# GIL, so the reader thread reads and encodes the next chunk meanwhile. A failed delivery fails the
# transaction's commit, as for any event, and is reported with its topic and size (KafkaProducer.on_failure).

ctypedef int (*rk_produce_t)(void *rkt, int32_t partition, int msgflags, void *payload, size_t length,
                             const void *key, size_t keylen, void *msg_opaque) noexcept nogil
ctypedef void *(*rk_topic_new_t)(void *rk, const char *topic, void *conf) noexcept nogil
ctypedef void (*rk_topic_destroy_t)(void *rkt) noexcept nogil
ctypedef int (*rk_last_error_t)() noexcept nogil

cdef int32_t RD_KAFKA_PARTITION_UA = -1
cdef int RD_KAFKA_RESP_ERR__FAIL = -196
cdef int RD_KAFKA_MSG_F_COPY = 0x2


@cython.no_gc_clear  # its owner (the producer's handle) must outlive rkt, even when collected in one pass
cdef class ReplayTarget:
    """One table's Insert, Update and Delete events produced from C in one transaction
    (DirectProducer.replay_changes, ChangeReader.live_changes): the table version's TuplePlan, its topic, and the
    constant parts of its events in that transaction, as TableCodec.event_parts gives them. ``inserts``,
    ``updates`` and ``deletes`` count what was produced for it. ``owed``: the key of a delete
    whose event was produced but whose tombstone librdkafka refused (its queue full), else None — the caller
    produces that tombstone before anything else (DirectProducer._change)."""

    cdef TuplePlan plan
    cdef readonly bytes topic
    cdef bytes frame, head, middle, tail_c, tail_u, tail_d
    cdef void *rkt
    cdef rk_topic_destroy_t topic_destroy
    cdef object owner
    cdef public Py_ssize_t inserts
    cdef public Py_ssize_t updates
    cdef public Py_ssize_t deletes
    cdef public object owed

    def __cinit__(self) -> None:
        self.rkt = NULL
        self.owed = None

    def __dealloc__(self) -> None:
        if self.rkt != NULL:
            self.topic_destroy(self.rkt)


cdef tuple change_tuples(ReplayTarget t, bytes data, Py_ssize_t at, Py_ssize_t end, int kind):
    """(before, record, key, unchanged) of an Insert ('I'), Update ('U') or Delete ('D') whose tuples start at
    ``at`` of ``data`` and end at ``end``, encoded by ``t``'s plan; None when DirectProducer._change does not
    write it: an update that changes the key, an update with unchanged TOAST values and a full old row (whose
    values ChangeWriter fills in), or tuples that do not encode cleanly (ChangeWriter.change handles and
    diagnoses those)."""
    cdef const unsigned char *d = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef object before = None, old_key = None, record = None, key, unchanged = None
    cdef Py_ssize_t pos, old_at = at
    if at >= end:
        return None
    try:
        if kind != 73 and (d[at] == 75 or d[at] == 79):  # Update/Delete: the old key ('K') or row ('O')
            before, old_key, _, at = t.plan._encode(data, at + 1, None)
            if old_key is None:
                return None
        if kind == 68:  # a delete: its old key or row, and nothing after it
            if before is None or at != end:
                return None
            key, pos = old_key, end
        else:
            if at >= end or d[at] != 78:  # 'N'
                return None
            record, key, unchanged, pos = t.plan._encode(data, at + 1, None)
    except Exception:  # malformed or unconvertible: ChangeWriter.change diagnoses it
        return None
    if key is None or pos != end or (kind == 85 and old_key is not None and old_key != key):
        return None
    if unchanged and kind == 85 and d[old_at] == 79:  # a full old row: ChangeWriter fills the TOAST values from it
        return None
    return before, record, key, unchanged


cdef int put_change_event(Buf* b, ReplayTarget t, tuple parts, int kind, uint64_t lsn, int64_t commit_lsn) except -1:
    """Into ``b`` (emptied first), the event of a change's ``parts`` (change_tuples) as
    TableCodec.envelope_bytes writes it without a transaction block: the frame, before, after, then the source
    block around the change's LSN, the op, and the unchanged TOASTed columns."""
    cdef bytes tail = t.tail_c if kind == 73 else (t.tail_u if kind == 85 else t.tail_d)
    b.n = 0
    put_bytes(b, t.frame)
    put_row(b, <bytes>parts[0])
    put_row(b, <bytes>parts[1])
    put_position(b, t.head, commit_lsn, <int64_t>lsn, t.middle)
    put_bytes(b, tail)  # the op and an empty transaction block
    put_unchanged(b, <list>parts[3])
    return 0


# --- the capture's own librdkafka producer --------------------------------------------------------------------
# The C paths above produce on an rd_kafka_t; KafkaProducer makes and owns that handle through librdkafka's
# public API (rdkafka.h), found in the copy confluent_kafka loaded (cdc/_libs.py), so no other library's objects
# are read. It is the capture's only transactional producer: two with one transactional.id would fence each
# other. Its methods are the subset of confluent_kafka.Producer the capture calls, with the same errors
# (KafkaException around a KafkaError, BufferError for a full queue), so cdc/_kafka.py runs on either.

cdef extern from *:
    """
    typedef struct {
        int err;
        void *rkt;
        int32_t partition;
        void *payload;
        size_t len;
        void *key;
        size_t key_len;
        int64_t offset;
        void *_private;
    } cdc_rk_message;  /* rd_kafka_message_t, as rdkafka.h declares it */
    typedef struct { int err; size_t size; char *topic; } cdc_failure;
    typedef struct { cdc_failure *items; size_t n, cap; } cdc_failures;
    """
    ctypedef struct cdc_rk_message:
        int err
        void *rkt
        size_t len
        size_t key_len
    ctypedef struct cdc_failure:
        int err
        size_t size
        char *topic
    ctypedef struct cdc_failures:
        cdc_failure *items
        size_t n
        size_t cap

ctypedef void (*rk_dr_msg_cb_t)(void *rk, const cdc_rk_message *msg, void *opaque) noexcept nogil
ctypedef void *(*rk_conf_new_t)() noexcept nogil
ctypedef int (*rk_conf_set_t)(void *conf, const char *name, const char *value, char *errstr,
                              size_t errstr_size) noexcept nogil
ctypedef void (*rk_conf_destroy_t)(void *conf) noexcept nogil
ctypedef void (*rk_conf_set_dr_msg_cb_t)(void *conf, rk_dr_msg_cb_t cb) noexcept nogil
ctypedef void (*rk_conf_set_opaque_t)(void *conf, void *opaque) noexcept nogil
ctypedef void *(*rk_new_t)(int kind, void *conf, char *errstr, size_t errstr_size) noexcept nogil
ctypedef void (*rk_destroy_t)(void *rk) noexcept nogil
ctypedef void *(*rk_txn_t)(void *rk) noexcept nogil
ctypedef void *(*rk_txn_timed_t)(void *rk, int timeout_ms) noexcept nogil
ctypedef int (*rk_error_int_t)(const void *error) noexcept nogil
ctypedef const char *(*rk_error_string_t)(const void *error) noexcept nogil
ctypedef void (*rk_error_destroy_t)(void *error) noexcept nogil
ctypedef int (*rk_poll_t)(void *rk, int timeout_ms) noexcept nogil
ctypedef const char *(*rk_topic_name_t)(const void *rkt) noexcept nogil

cdef int RD_KAFKA_PRODUCER = 0
cdef int RD_KAFKA_CONF_OK = 0
cdef int RD_KAFKA_RESP_ERR__QUEUE_FULL = -184
cdef int RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE = 10  # the broker refused a record batch as too large

# Every librdkafka function KafkaProducer and DirectProducer call.
LIBRDKAFKA_FUNCTIONS = (
    "rd_kafka_conf_new", "rd_kafka_conf_set", "rd_kafka_conf_destroy", "rd_kafka_conf_set_dr_msg_cb",
    "rd_kafka_conf_set_opaque", "rd_kafka_new", "rd_kafka_destroy", "rd_kafka_init_transactions",
    "rd_kafka_begin_transaction", "rd_kafka_commit_transaction", "rd_kafka_abort_transaction",
    "rd_kafka_error_code", "rd_kafka_error_string", "rd_kafka_error_is_fatal", "rd_kafka_error_is_retriable",
    "rd_kafka_error_txn_requires_abort", "rd_kafka_error_destroy", "rd_kafka_poll", "rd_kafka_flush",
    "rd_kafka_topic_name", "rd_kafka_produce", "rd_kafka_topic_new", "rd_kafka_topic_destroy",
    "rd_kafka_last_error",
)

cdef rk_topic_name_t _topic_name = NULL  # set by the first KafkaProducer: one librdkafka per process


cdef void _on_delivery(void *rk, const cdc_rk_message *msg, void *opaque) noexcept nogil:
    """A failed delivery (delivery.report.only.error: only those arrive), noted for the Python side to read after
    poll, flush or commit, in the thread that called them. No GIL: it copies the topic's name and the size."""
    cdef cdc_failures *f = <cdc_failures*>opaque
    cdef cdc_failure *grown
    cdef const char *name
    cdef size_t length
    if msg.err == 0:
        return
    if f.n == f.cap:
        grown = <cdc_failure*>realloc(f.items, (f.cap * 2 + 16) * sizeof(cdc_failure))
        if grown == NULL:
            return  # the transaction's commit fails all the same; only the detail is lost
        f.items, f.cap = grown, f.cap * 2 + 16
    name = _topic_name(msg.rkt) if msg.rkt != NULL and _topic_name != NULL else NULL
    f.items[f.n].err = msg.err
    f.items[f.n].size = msg.len + msg.key_len
    f.items[f.n].topic = NULL
    if name != NULL:
        length = strlen(name)
        f.items[f.n].topic = <char*>malloc(length + 1)
        if f.items[f.n].topic != NULL:
            memcpy(f.items[f.n].topic, name, length + 1)
    f.n += 1


@cython.no_gc_clear  # __dealloc__ destroys the topic handles it lists before the producer's own handle
cdef class KafkaProducer:
    """A librdkafka producer this module owns (see above); ``on_failure(code, topic, size)`` is called for each
    failed delivery, after the call that served it."""

    cdef void *rk
    cdef cdc_failures failures
    cdef object on_failure
    cdef object kafka_error, kafka_exception
    cdef dict topics  # name -> rd_kafka_topic_t address, for produce()
    cdef rk_produce_t produce_
    cdef rk_topic_new_t topic_new
    cdef rk_topic_destroy_t topic_destroy
    cdef rk_last_error_t last_error
    cdef rk_destroy_t destroy
    cdef rk_txn_timed_t init_txn, commit_txn, abort_txn
    cdef rk_txn_t begin_txn
    cdef rk_error_int_t error_code, error_fatal, error_retriable, error_abortable
    cdef rk_error_string_t error_string
    cdef rk_error_destroy_t error_destroy
    cdef rk_poll_t poll_, flush_

    def __cinit__(self) -> None:
        self.rk = NULL
        self.failures.items = NULL
        self.failures.n = self.failures.cap = 0

    def __init__(self, dict conf not None, dict symbols not None, on_failure: object) -> None:
        """``conf``: librdkafka's settings as strings; ``symbols``: LIBRDKAFKA_FUNCTIONS' addresses."""
        global _topic_name
        from confluent_kafka import KafkaError, KafkaException
        self.kafka_error, self.kafka_exception, self.on_failure, self.topics = KafkaError, KafkaException, on_failure, {}
        self._bind(symbols)
        _topic_name = <rk_topic_name_t><size_t>symbols["rd_kafka_topic_name"]
        cdef char[512] errstr
        cdef void *c = (<rk_conf_new_t><size_t>symbols["rd_kafka_conf_new"])()
        cdef rk_conf_set_t conf_set = <rk_conf_set_t><size_t>symbols["rd_kafka_conf_set"]
        cdef bytes name, value
        for key, text in conf.items():
            name, value = str(key).encode(), str(text).encode()
            if conf_set(c, name, value, errstr, sizeof(errstr)) != RD_KAFKA_CONF_OK:
                (<rk_conf_destroy_t><size_t>symbols["rd_kafka_conf_destroy"])(c)
                raise KafkaException(KafkaError(KafkaError._INVALID_ARG, errstr.decode(errors="replace")))
        (<rk_conf_set_dr_msg_cb_t><size_t>symbols["rd_kafka_conf_set_dr_msg_cb"])(c, _on_delivery)
        (<rk_conf_set_opaque_t><size_t>symbols["rd_kafka_conf_set_opaque"])(c, &self.failures)
        self.rk = (<rk_new_t><size_t>symbols["rd_kafka_new"])(RD_KAFKA_PRODUCER, c, errstr, sizeof(errstr))
        if self.rk == NULL:  # the configuration stays ours on failure
            (<rk_conf_destroy_t><size_t>symbols["rd_kafka_conf_destroy"])(c)
            raise KafkaException(KafkaError(KafkaError._INVALID_ARG, errstr.decode(errors="replace")))

    cdef void _bind(self, dict symbols):
        self.produce_ = <rk_produce_t><size_t>symbols["rd_kafka_produce"]
        self.topic_new = <rk_topic_new_t><size_t>symbols["rd_kafka_topic_new"]
        self.topic_destroy = <rk_topic_destroy_t><size_t>symbols["rd_kafka_topic_destroy"]
        self.last_error = <rk_last_error_t><size_t>symbols["rd_kafka_last_error"]
        self.destroy = <rk_destroy_t><size_t>symbols["rd_kafka_destroy"]
        self.init_txn = <rk_txn_timed_t><size_t>symbols["rd_kafka_init_transactions"]
        self.begin_txn = <rk_txn_t><size_t>symbols["rd_kafka_begin_transaction"]
        self.commit_txn = <rk_txn_timed_t><size_t>symbols["rd_kafka_commit_transaction"]
        self.abort_txn = <rk_txn_timed_t><size_t>symbols["rd_kafka_abort_transaction"]
        self.error_code = <rk_error_int_t><size_t>symbols["rd_kafka_error_code"]
        self.error_fatal = <rk_error_int_t><size_t>symbols["rd_kafka_error_is_fatal"]
        self.error_retriable = <rk_error_int_t><size_t>symbols["rd_kafka_error_is_retriable"]
        self.error_abortable = <rk_error_int_t><size_t>symbols["rd_kafka_error_txn_requires_abort"]
        self.error_string = <rk_error_string_t><size_t>symbols["rd_kafka_error_string"]
        self.error_destroy = <rk_error_destroy_t><size_t>symbols["rd_kafka_error_destroy"]
        self.poll_ = <rk_poll_t><size_t>symbols["rd_kafka_poll"]
        self.flush_ = <rk_poll_t><size_t>symbols["rd_kafka_flush"]

    def __dealloc__(self) -> None:
        cdef size_t i
        if self.rk != NULL:
            for address in (self.topics or {}).values():
                self.topic_destroy(<void*><size_t>address)
            with nogil:
                self.destroy(self.rk)  # waits for what is in flight, as confluent_kafka's does
        for i in range(self.failures.n):
            free(self.failures.items[i].topic)
        free(self.failures.items)

    cdef int _check(self, void *error) except -1:
        """Raises the KafkaException of an rd_kafka_error_t (and frees it); nothing when it is NULL."""
        if error == NULL:
            return 0
        err = self.kafka_error(
            self.error_code(error),
            (<bytes>self.error_string(error)).decode(errors="replace"),
            fatal=bool(self.error_fatal(error)),
            retriable=bool(self.error_retriable(error)),
            txn_requires_abort=bool(self.error_abortable(error)),
        )
        self.error_destroy(error)
        raise self.kafka_exception(err)

    cdef void _served(self):
        """Hands the failed deliveries noted since the last call to ``on_failure``."""
        cdef size_t i, n = self.failures.n
        cdef list found = []
        for i in range(n):
            topic = (<bytes>self.failures.items[i].topic).decode() if self.failures.items[i].topic != NULL else ""
            found.append((self.failures.items[i].err, topic, self.failures.items[i].size))
            free(self.failures.items[i].topic)
        self.failures.n = 0
        for code, topic, size in found:
            self.on_failure(code, topic, size)

    def init_transactions(self, double timeout) -> None:
        cdef void *error
        with nogil:
            error = self.init_txn(self.rk, <int>(timeout * 1000))
        self._check(error)

    def begin_transaction(self) -> None:
        self._check(self.begin_txn(self.rk))

    cdef int _end(self, rk_txn_timed_t end, double timeout) except -1:
        """Commits or aborts (``end``), then hands on the failed deliveries it served, then its own error."""
        cdef void *error
        with nogil:
            error = end(self.rk, <int>(timeout * 1000))
        self._served()
        return self._check(error)

    def commit_transaction(self, double timeout) -> None:
        cdef size_t i
        self._drain(timeout)
        for i in range(self.failures.n):
            if self.failures.items[i].err == RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
                # The broker refused an event as too large: the transaction can only be aborted, and committing
                # would flush again, waiting up to its timeout for events queued behind the refused one. Other
                # failures go on to the commit, whose own error says more (fenced by another instance, say).
                self._served()
                raise self.kafka_exception(
                    self.kafka_error(RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE, "an event is too large", txn_requires_abort=True)
                )
        self._end(self.commit_txn, timeout)

    cdef void _drain(self, double timeout):
        """Waits, in 1 ms steps, until every event produced is acknowledged (or ``timeout`` worth of steps passed).

        commit_transaction flushes first too, but that flush waits for delivery reports in steps of 10 ms, and
        with delivery.report.only.error no report comes to end a step early for an event that was delivered:
        each commit of a light load would wait ~10 ms (measured: 10.9 ms per one-event transaction against
        2.2 with confluent_kafka's Producer, whose handle gets other wake-ups). After this its flush finds
        nothing left and returns at once. Each step is itself a flush, so the broker threads send at once
        rather than after linger.ms. It stops at the first refused event: the transaction cannot commit."""
        cdef int steps = <int>(timeout * 1000)
        with nogil:
            while steps > 0 and self.failures.n == 0 and self.flush_(self.rk, 1) != 0:
                steps -= 1

    def abort_transaction(self, double timeout) -> None:
        self._end(self.abort_txn, timeout)

    def poll(self, double timeout=0) -> int:
        cdef int served
        with nogil:
            served = self.poll_(self.rk, <int>(timeout * 1000))
        self._served()
        return served

    def flush(self, double timeout) -> int:
        """Waits up to ``timeout`` for the queue to drain: 0 when it did (each event delivered or its failure
        reported), else 1 (confluent_kafka's returns the count left; callers only compare it with 0)."""
        cdef int err
        with nogil:
            err = self.flush_(self.rk, <int>(timeout * 1000))
        self._served()
        return 0 if err == 0 else 1

    def produce(self, str topic not None, value: bytes | None, bytes key not None, int partition=-1) -> None:
        """One event; BufferError when the local queue is full, KafkaException when librdkafka refuses it."""
        cdef size_t address = self.topics.get(topic, 0)
        cdef void *rkt
        cdef const char *payload = NULL
        cdef Py_ssize_t length = 0
        cdef int err
        if address == 0:
            rkt = self.topic_new(self.rk, topic.encode(), NULL)
            if rkt == NULL:
                raise self.kafka_exception(self.kafka_error(self.last_error()))
            address = <size_t>rkt
            self.topics[topic] = address
        if value is not None:
            payload, length = PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)
        if self.produce_(<void*>address, partition, RD_KAFKA_MSG_F_COPY, <void*>payload, length,
                         PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), NULL) == -1:
            err = self.last_error()
            if err == RD_KAFKA_RESP_ERR__QUEUE_FULL:
                raise BufferError("Local: Queue full")
            raise self.kafka_exception(self.kafka_error(err))


cdef class DirectProducer:
    """Produces (key, prefix + record + suffix) events from C on a KafkaProducer's librdkafka handle."""

    cdef void *rk
    cdef object producer
    cdef rk_produce_t produce
    cdef rk_topic_new_t topic_new
    cdef rk_topic_destroy_t topic_destroy
    cdef rk_last_error_t last_error
    cdef Py_ssize_t refused_size

    def __init__(self, KafkaProducer producer not None) -> None:
        self.rk = producer.rk
        self.produce = producer.produce_
        self.topic_new = producer.topic_new
        self.topic_destroy = producer.topic_destroy
        self.last_error = producer.last_error
        self.producer = producer  # keeps the handle alive as long as this

    def produce_packed(self, bytes topic not None, bytes packed not None, bytes prefix not None,
                       bytes suffix not None, Py_ssize_t start=0) -> tuple:
        """Produces the events (key, prefix + record + suffix) of ``packed`` (TuplePlan.encode_copy_packed) from
        byte offset ``start`` on, each to the partition the producer's partitioner picks for its key, until one
        is refused. Returns (the offset of the first row not produced, len(packed) when all were; librdkafka's
        error code for it, 0 when none)."""
        cdef const unsigned char *p = <const unsigned char*>PyBytes_AS_STRING(packed)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(packed), at, reclen, keylen, longest = 0, plen, slen
        cdef char *buf = NULL
        cdef void *rkt
        cdef int err = 0
        cdef const char *ctopic = PyBytes_AS_STRING(topic)
        cdef const char *sp = PyBytes_AS_STRING(suffix)
        if start < 0 or start > size:
            raise IndexError("start out of range")
        at = start
        while at < size:  # checked here, read below without bounds checks
            at = packed_next(p, size, at, &reclen, &keylen)
            if reclen > longest:
                longest = reclen
        if start == size:
            return start, 0
        plen, slen = PyBytes_GET_SIZE(prefix), PyBytes_GET_SIZE(suffix)
        buf = <char*>malloc(plen + longest + slen)
        if buf == NULL:
            raise MemoryError()
        try:
            memcpy(buf, PyBytes_AS_STRING(prefix), plen)
            rkt = self.topic_new(self.rk, ctopic, NULL)
            if rkt == NULL:
                err = self.last_error()
                return start, (err if err != 0 else RD_KAFKA_RESP_ERR__FAIL)
            at = start
            with nogil:
                while at < size:
                    reclen, keylen = be32(p + at), be32(p + at + 4)
                    memcpy(buf + plen, p + at + 8, reclen)
                    memcpy(buf + plen + reclen, sp, slen)
                    if self.produce(rkt, RD_KAFKA_PARTITION_UA, RD_KAFKA_MSG_F_COPY, buf, plen + reclen + slen,
                                    p + at + 8 + reclen, keylen, NULL) == -1:
                        err = self.last_error()
                        break
                    at += 8 + reclen + keylen
                self.topic_destroy(rkt)
            return at, err
        finally:
            free(buf)

    def target(self, TuplePlan plan not None, bytes topic not None, tuple parts not None) -> ReplayTarget:
        """A ReplayTarget producing to ``topic`` on this handle; ``parts``: TableCodec.event_parts."""
        cdef ReplayTarget t = ReplayTarget()
        t.plan, t.topic = plan, topic
        t.frame, t.head, t.middle, t.tail_c, t.tail_u, t.tail_d = parts  # type-checked by the typed attributes
        t.topic_destroy = self.topic_destroy
        t.owner = self  # the handle outlives the topic handle
        t.rkt = self.topic_new(self.rk, PyBytes_AS_STRING(topic), NULL)
        if t.rkt == NULL:
            raise RuntimeError(f"librdkafka refused a handle for topic {topic!r}: error {self.last_error()}")
        return t

    cdef int _change(self, ReplayTarget t, bytes data, Py_ssize_t at, Py_ssize_t end, int kind, uint64_t lsn,
                     int64_t commit_lsn, Buf* b) except -2:
        """The events of the Insert ('I'), Update ('U') or Delete ('D') whose tuples start at ``at`` of ``data``
        (after the relation id; the message ends at ``end``), produced to ``t``'s topic as ChangeWriter.fast_change
        would: 1; 0 when they are not what this writes (an update that changes the key) or do not encode cleanly
        (nothing produced: ChangeWriter.change handles and diagnoses it); -1 when librdkafka refused the (first)
        event (nothing produced; its error in last_error(), its size in refused_size); 2 for a delete whose
        event was produced and whose tombstone was refused (its key is left in ``t.owed``, its error in
        last_error(): the caller must produce that tombstone before any other event, and must not hand the
        message to ChangeWriter.change, which would write the delete's event twice)."""
        cdef tuple parts = change_tuples(t, data, at, end, kind)
        cdef object key
        cdef Py_ssize_t keylen
        if parts is None:
            return 0
        key = parts[2]
        keylen = PyBytes_GET_SIZE(key)
        put_change_event(b, t, parts, kind, lsn, commit_lsn)
        if self.produce(t.rkt, RD_KAFKA_PARTITION_UA, RD_KAFKA_MSG_F_COPY, b.p, b.n,
                        PyBytes_AS_STRING(key), keylen, NULL) == -1:
            self.refused_size = keylen + b.n
            return -1
        if kind == 73:
            t.inserts += 1
        elif kind == 85:
            t.updates += 1
        else:
            t.deletes += 1
            # The tombstone after it (no value): lets compaction drop the key, as ChangeWriter._delete writes it.
            if self.produce(t.rkt, RD_KAFKA_PARTITION_UA, 0, NULL, 0, PyBytes_AS_STRING(key), keylen, NULL) == -1:
                t.owed = key
                return 2
        return 1

    def replay_changes(self, bytes block not None, Py_ssize_t at, dict targets not None, set aborted,
                       int64_t commit_lsn) -> tuple:
        """Produces the Insert, Update and Delete events of a streamed transaction's spilled messages (``block``:
        whole messages, each its LSN and length (>QI) then the pgoutput message with its xid after the type byte)
        from offset ``at`` on, each to its table's topic (``targets``: relation id -> ReplayTarget) as
        ChangeWriter.fast_change would, until the first message it does not take: another kind, of a subtransaction
        in ``aborted``, of a relation without a target, or one _change does not take (ChangeWriter.change then
        handles and diagnoses that one). Returns (the offset of the first message not produced; librdkafka's error
        code when that one was refused, else 0; then the refused event's size, key included, and topic). After
        a delete whose tombstone was refused it returns at once: the offset after that delete, the error, size
        0 and the topic, the tombstone owed in its target (see _change)."""
        cdef const unsigned char *d = <const unsigned char*>PyBytes_AS_STRING(block)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(block), m, end, length
        cdef uint64_t lsn
        cdef uint32_t relid, last_relid = 0
        cdef ReplayTarget t = None
        cdef unsigned char[STACK_BYTES] stack
        cdef Buf b
        cdef object found
        cdef int done
        if at < 0:
            raise IndexError("offset out of range")
        b.p = stack
        b.cap = STACK_BYTES
        b.heap = NULL
        try:
            while at <= size - 12:
                lsn = be64(d + at)
                length = be32(d + at + 8)
                m = at + 12
                end = m + length
                # 'I', 'U' or 'D', xid, relid, then the tuples
                if length > size - m or length < 12 or (d[m] != 73 and d[m] != 85 and d[m] != 68):
                    break
                if aborted and <object>(be32(d + m + 1)) in aborted:
                    break
                relid = be32(d + m + 5)
                if t is None or relid != last_relid:
                    found = targets.get(relid)
                    if found is None:
                        break
                    t, last_relid = <ReplayTarget?>found, relid
                    if t.rkt == NULL:  # not made by DirectProducer.target
                        raise ValueError("a ReplayTarget without a topic handle")
                done = self._change(t, block, m + 9, end, d[m], lsn, commit_lsn, &b)
                if done == 0:
                    break
                if done < 0:
                    return at, self.last_error(), self.refused_size, t.topic
                at = end
                if done == 2:  # the delete's tombstone is owed: nothing else before it
                    return at, self.last_error(), 0, t.topic
            return at, 0, 0, None
        finally:
            if b.heap != NULL:
                free(b.heap)
