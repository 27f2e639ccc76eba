# Part of the cdc._native extension module: cdc/_native.pyx includes it, and all parts share one namespace.
#
# Reading a streamed transaction's changes through libpq (ChangeReader).

# --- Reading a streamed transaction's changes through libpq --------------------------------------------------------
#
# While PostgreSQL streams a large transaction, every change is only written to the spill: in Python that was
# ~5 µs per message (read, checks, two file writes), about as much CPU as the walsender spends producing it.
# ChangeReader takes the messages libpq has (or the socket already holds) in one call and frames them as the
# spill does.

ctypedef int (*pq_consume_input_t)(void *conn) noexcept nogil

cdef enum:
    XLOG_PAYLOAD_AT = 25  # 'w', start LSN, end LSN, send time: then the pgoutput message


cdef ReplayTarget live_change_target(const unsigned char *d, Py_ssize_t got, dict targets, ReplayTarget last,
                                     uint32_t *last_relid):
    """The target of a replication message (ChangeReader.live_changes) that is an XLogData holding an Insert,
    Update or Delete of a relation in ``targets``, else None. ``last`` (the previous message's target) and
    ``*last_relid`` (its relation, updated here) spare the dict look-up in a run of one table's changes."""
    cdef uint32_t relid
    cdef object found
    cdef ReplayTarget t
    # the XLogData header, then 'I', 'U' or 'D', the relation id and the tuples
    if got < XLOG_PAYLOAD_AT + 8 or d[0] != 119 or (
        d[XLOG_PAYLOAD_AT] != 73 and d[XLOG_PAYLOAD_AT] != 85 and d[XLOG_PAYLOAD_AT] != 68
    ):
        return None
    relid = be32(d + XLOG_PAYLOAD_AT + 1)
    if last is not None and relid == last_relid[0]:
        return last
    found = targets.get(relid)
    if found is None:
        return None
    t = <ReplayTarget?>found
    if t.rkt == NULL:  # not made by DirectProducer.target
        raise ValueError("a ReplayTarget without a topic handle")
    last_relid[0] = relid
    return t


cdef class ChangeReader:
    """Reads a replication stream's row changes in bulk from libpq: a streamed transaction's, framed for its spill
    (:meth:`read`), or a live transaction's Inserts, Updates and Deletes, produced as they are read
    (:meth:`live_changes`)."""

    cdef pq_get_copy_data_t get_copy_data
    cdef pq_freemem_t freemem
    cdef pq_consume_input_t consume_input

    def __init__(self, symbols: dict) -> None:
        """``symbols``: the addresses of PQgetCopyData, PQfreemem and PQconsumeInput."""
        self.get_copy_data = <pq_get_copy_data_t><size_t>symbols["PQgetCopyData"]
        self.freemem = <pq_freemem_t><size_t>symbols["PQfreemem"]
        self.consume_input = <pq_consume_input_t><size_t>symbols["PQconsumeInput"]

    cdef int _next(self, void *conn, char **msg) noexcept nogil:
        """The next CopyData message without waiting: PQgetCopyData, and when nothing complete is buffered, one
        PQconsumeInput (what the socket holds) and a second try. > 0: its length (PQfreemem it); 0: nothing yet;
        -1: the stream ended; -2: it failed (PQconsumeInput's failure included)."""
        cdef int got = self.get_copy_data(conn, msg, 1)
        if got == 0:
            if not self.consume_input(conn):
                return -2
            got = self.get_copy_data(conn, msg, 1)
        return got

    def read(self, size_t pgconn, Py_ssize_t limit) -> tuple:
        """The CopyData messages of a replication stream (the PGconn at ``pgconn``, in COPY BOTH, non-blocking)
        that libpq has buffered or the socket holds, without waiting, while each is an XLogData whose pgoutput
        message is an Insert, Update or Delete, up to about ``limit`` bytes. Returns (those messages framed as
        the capture's spill frames them: start LSN and length (>QI), then the pgoutput message; how many; the
        largest end LSN among them, 0 without any; the first message not taken, as bytes, or None; and
        PQgetCopyData's last result when it was negative: -1 the stream ended, -2 it failed, else 0)."""
        cdef void *conn = <void*>pgconn
        cdef char *out = NULL
        cdef char *grown
        cdef char *msg = NULL
        cdef Py_ssize_t n = 0, cap = 0, count = 0, body
        cdef int got = 0
        cdef uint64_t end, largest = 0
        cdef bytes held = None
        if conn == NULL:
            raise ValueError("no connection")
        try:
            with nogil:
                while n < limit:
                    got = self._next(conn, &msg)
                    if got <= 0:
                        break
                    if got <= XLOG_PAYLOAD_AT or msg[0] != 119 or not (
                        msg[XLOG_PAYLOAD_AT] == 73 or msg[XLOG_PAYLOAD_AT] == 85 or msg[XLOG_PAYLOAD_AT] == 68
                    ):
                        with gil:
                            try:
                                held = PyBytes_FromStringAndSize(msg, got)
                            finally:
                                self.freemem(msg)
                        got = 0
                        break
                    body = got - XLOG_PAYLOAD_AT
                    if n + 12 + body > cap:
                        cap = max(cap * 2, n + 12 + body, 1 << 20)
                        grown = <char*>realloc(out, cap)
                        if grown == NULL:
                            self.freemem(msg)
                            with gil:
                                raise MemoryError()
                        out = grown
                    memcpy(out + n, msg + 1, 8)  # the start LSN, big-endian as in the message
                    out[n + 8] = <char>((body >> 24) & 0xFF)
                    out[n + 9] = <char>((body >> 16) & 0xFF)
                    out[n + 10] = <char>((body >> 8) & 0xFF)
                    out[n + 11] = <char>(body & 0xFF)
                    memcpy(out + n + 12, msg + XLOG_PAYLOAD_AT, body)
                    n += 12 + body
                    end = be64(<const unsigned char*>msg + 9)
                    if end > largest:
                        largest = end
                    count += 1
                    self.freemem(msg)
            return PyBytes_FromStringAndSize(out, n), count, largest, held, (got if got < 0 else 0)
        finally:
            free(out)

    def live_changes(self, size_t pgconn, DirectProducer producer not None, dict targets not None,
                     int64_t commit_lsn, Py_ssize_t limit) -> tuple:
        """The Inserts, Updates and Deletes of a live transaction that libpq has buffered or the socket holds,
        without waiting, each produced to its table's topic (``targets``: relation id -> ReplayTarget, made for
        this transaction) as ChangeWriter.fast_change would, up to about ``limit`` bytes, until the first message it
        does not take: not an XLogData holding an Insert, Update or Delete, of a relation without a target, one
        DirectProducer._change does not take, or an event librdkafka refused (ChangeWriter.change produces that
        one again and reports what is wrong). It also stops after a delete whose tombstone was refused: that
        delete is counted, its tombstone owed in its target (see DirectProducer._change).
        Returns (how many were produced; the largest end LSN among them, 0 without any; the message not taken,
        as bytes, or None; PQgetCopyData's last result when it was negative, else 0)."""
        cdef void *conn = <void*>pgconn
        cdef char *msg = NULL
        cdef const unsigned char *d
        cdef Py_ssize_t count = 0, n = 0
        cdef int got = 0
        cdef uint64_t end, largest = 0
        cdef uint32_t last_relid = 0
        cdef ReplayTarget t = None
        cdef bytes data, held = None
        cdef int done
        cdef unsigned char[STACK_BYTES] stack
        cdef Buf b
        if conn == NULL:
            raise ValueError("no connection")
        b.p = stack
        b.cap = STACK_BYTES
        b.heap = NULL
        try:
            while n < limit:
                got = self._next(conn, &msg)
                if got <= 0:
                    break
                try:
                    data = PyBytes_FromStringAndSize(msg, got)
                finally:
                    self.freemem(msg)
                d = <const unsigned char*>PyBytes_AS_STRING(data)
                t = live_change_target(d, got, targets, t, &last_relid)
                if t is None:
                    held, got = data, 0
                    break
                done = producer._change(t, data, XLOG_PAYLOAD_AT + 5, got, d[XLOG_PAYLOAD_AT], be64(d + 1),
                                        commit_lsn, &b)
                if done <= 0:
                    held, got = data, 0
                    break
                end = be64(d + 9)
                if end > largest:
                    largest = end
                count += 1
                n += got
                if done == 2:  # the delete's tombstone is owed: nothing else before it
                    got = 0
                    break
            return count, largest, held, (got if got < 0 else 0)
        finally:
            if b.heap != NULL:
                free(b.heap)
