# Part of the cdc._native extension module: cdc/_native.pyx includes it, and all parts share one namespace.
#
# Reading a COPY through libpq (CopyReader) and the COPY output's rows.

# --- Reading a COPY through libpq ------------------------------------------------------------------------------
#
# PostgreSQL sends COPY … TO STDOUT one CopyData message per row, and psycopg's Copy hands each to Python: ~1 µs
# per row of the snapshot's reader thread, GIL held. CopyReader runs one COPY on a psycopg connection's PGconn
# (psycopg exposes its address: PGconn.pgconn_ptr) with libpq's own calls, in the libpq psycopg runs, without
# the GIL, and returns the whole output at once. The connection is idle before and after, as psycopg left it.

ctypedef int (*pq_int_conn_t)(void *conn) noexcept nogil
ctypedef int (*pq_set_nonblocking_t)(void *conn, int arg) noexcept nogil
ctypedef int (*pq_send_query_t)(void *conn, const char *query) noexcept nogil
ctypedef void *(*pq_get_result_t)(void *conn) noexcept nogil
ctypedef int (*pq_result_status_t)(const void *res) noexcept nogil
ctypedef void (*pq_clear_t)(void *res) noexcept nogil
ctypedef int (*pq_get_copy_data_t)(void *conn, char **buffer, int async_) noexcept nogil
ctypedef void (*pq_freemem_t)(void *ptr) noexcept nogil
ctypedef char *(*pq_error_message_t)(const void *conn) noexcept nogil
ctypedef char *(*pq_result_error_message_t)(const void *res) noexcept nogil
ctypedef char *(*pq_result_error_field_t)(const void *res, int fieldcode) noexcept nogil

cdef int PGRES_COMMAND_OK = 1
cdef int PGRES_COPY_OUT = 3
cdef int PG_DIAG_SQLSTATE = 67  # 'C'
cdef int PG_DIAG_MESSAGE_PRIMARY = 77  # 'M': the message without "ERROR:  " and the query's LINE lines


cdef struct CopyPart:
    # what CopyReader.receive_part has read: out[:n] of cap bytes (grown up to ceiling), its rows and messages;
    # failed: 1 the COPY failed, 2 out of memory; ended: the COPY is over
    char *out
    Py_ssize_t n, cap, ceiling, rows, messages
    int failed, ended


cdef class CopyReader:
    """Runs ``COPY … TO STDOUT`` statements on psycopg connections through libpq, without the GIL."""

    cdef pq_int_conn_t is_nonblocking
    cdef pq_set_nonblocking_t set_nonblocking
    cdef pq_send_query_t send_query
    cdef pq_get_result_t get_result
    cdef pq_result_status_t result_status
    cdef pq_clear_t clear
    cdef pq_get_copy_data_t get_copy_data
    cdef pq_freemem_t freemem
    cdef pq_error_message_t error_message
    cdef pq_result_error_message_t result_error_message
    cdef pq_result_error_field_t result_error_field

    def __init__(self, symbols: dict) -> None:
        """``symbols``: the addresses of the libpq functions of the same names (PQisnonblocking, …)."""
        self.is_nonblocking = <pq_int_conn_t><size_t>symbols["PQisnonblocking"]
        self.set_nonblocking = <pq_set_nonblocking_t><size_t>symbols["PQsetnonblocking"]
        self.send_query = <pq_send_query_t><size_t>symbols["PQsendQuery"]
        self.get_result = <pq_get_result_t><size_t>symbols["PQgetResult"]
        self.result_status = <pq_result_status_t><size_t>symbols["PQresultStatus"]
        self.clear = <pq_clear_t><size_t>symbols["PQclear"]
        self.get_copy_data = <pq_get_copy_data_t><size_t>symbols["PQgetCopyData"]
        self.freemem = <pq_freemem_t><size_t>symbols["PQfreemem"]
        self.error_message = <pq_error_message_t><size_t>symbols["PQerrorMessage"]
        self.result_error_message = <pq_result_error_message_t><size_t>symbols["PQresultErrorMessage"]
        self.result_error_field = <pq_result_error_field_t><size_t>symbols["PQresultErrorField"]

    def send(self, size_t pgconn, bytes query not None) -> tuple | None:
        """Sends ``query`` (a COPY … TO STDOUT) on the idle PGconn at address ``pgconn`` without waiting for
        its answer (the server starts on it while the caller does something else): None, or (None, None,
        error message) when it could not be sent. :meth:`receive` takes the output."""
        cdef void *conn = <void*>pgconn
        cdef const char *q = PyBytes_AS_STRING(query)
        cdef int ok, was_nonblocking
        if conn == NULL:
            raise ValueError("no connection")
        with nogil:
            was_nonblocking = self.is_nonblocking(conn)
            self.set_nonblocking(conn, 0)  # blocking: the whole query is written before this returns
            ok = self.send_query(conn, q)
            self.set_nonblocking(conn, was_nonblocking)
        if ok:
            return None
        message = <bytes>self.error_message(conn)
        return None, None, message.decode(errors="replace").strip()

    def receive(self, size_t pgconn) -> tuple:
        """The answer to the COPY :meth:`send` sent on the PGconn at address ``pgconn``: (the whole output,
        None, None), or (None, SQLSTATE or None, error message) when it failed; the connection is idle again
        either way (its transaction, if any, failed with the statement, as with psycopg)."""
        data, _, sqlstate, message = self.receive_part(pgconn, b"", PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, True)
        return data, sqlstate, message

    def receive_part(
        self, size_t pgconn, bytes prefix not None, Py_ssize_t most, Py_ssize_t most_rows, bint first
    ) -> tuple:
        """About ``most`` bytes or ``most_rows`` rows more (whichever comes first) of the COPY :meth:`send` sent
        on the PGconn at ``pgconn``, whole rows:
        (``prefix`` + the output read, done, None, None), or (None, True, SQLSTATE or None, error message) when
        it failed. Until done the COPY stays open on the connection (call again, or drain it). ``first``: the
        first call after :meth:`send`, which takes the COPY's start. A part that is not the last gets the
        binary COPY trailer (-1 fields) appended, so every part parses as a whole COPY output once the caller
        gives the later ones the first part's header as ``prefix``."""
        cdef void *conn = <void*>pgconn
        cdef CopyPart c
        cdef int was_nonblocking
        cdef void *res = NULL
        cdef tuple error = None
        cdef Py_ssize_t start = len(prefix)
        cdef const char *pre = PyBytes_AS_STRING(prefix)
        if conn == NULL:
            raise ValueError("no connection")
        if most < 1 or most_rows < 1:
            raise ValueError("a part holds at least one byte and one row")
        memset(&c, 0, sizeof(c))
        # Doubling stops near the part's size (a part of ~8 MB not in 16 MB); no overflow for "no limit".
        c.ceiling = most + start + 2 if most < PY_SSIZE_T_MAX - start - 2 else PY_SSIZE_T_MAX
        with nogil:
            was_nonblocking = self.is_nonblocking(conn)
            self.set_nonblocking(conn, 0)
            if first:
                res = self._started(conn, &c)
            if not c.failed:
                c.cap = min(most, 1 << 20) + start + 2  # grown as the rows come
                c.out = <char*>malloc(c.cap)
                if c.out == NULL:
                    c.failed = 2
                else:
                    memcpy(c.out, pre, start)
                    c.n = start
                self._read_rows(conn, &c, most, most_rows, first)
                if c.ended:
                    res = self.get_result(conn)  # the COPY's own result: success or the error
                    if res == NULL or self.result_status(res) != PGRES_COMMAND_OK:
                        c.failed = c.failed or 1
            if c.failed:
                with gil:
                    error = self._error(conn, res)
            if c.ended:
                while res != NULL:  # the results left, until libpq says the statement is over
                    self.clear(res)
                    res = self.get_result(conn)
            self.set_nonblocking(conn, was_nonblocking)
        try:
            if c.failed == 2:
                raise MemoryError()
            if c.failed:
                return (None, True) + error
            return PyBytes_FromStringAndSize(c.out, c.n), bool(c.ended), None, None
        finally:
            free(c.out)

    cdef void *_started(self, void *conn, CopyPart *c) noexcept nogil:
        """Takes the result that starts the COPY :meth:`send` sent: NULL when it did; else the COPY failed (kept
        in ``c``) and this is its result, or NULL when there is none."""
        cdef void *res = self.get_result(conn)
        if res != NULL and self.result_status(res) == PGRES_COPY_OUT:
            self.clear(res)
            return NULL
        c.failed = 1
        c.ended = 1
        return res

    cdef void _read_rows(
        self, void *conn, CopyPart *c, Py_ssize_t most, Py_ssize_t most_rows, bint first
    ) noexcept nogil:
        """receive_part's reading: the COPY's messages into ``c.out`` until the part is full (then the binary
        trailer closes it) or the COPY ends (``c.ended``). Out of memory (``c.failed`` 2), the rest is read and
        dropped: libpq must leave the COPY state."""
        cdef char *row = NULL
        cdef char *grown
        cdef int got
        cdef bint trailer
        while True:
            got = self.get_copy_data(conn, &row, 0)
            if got < 0:  # -1: the COPY is done; -2: an error, told by the result after it
                c.ended = 1
                return
            if c.failed == 0 and c.n + got + 2 > c.cap:  # 2: room for a trailer
                c.cap = max(min(c.cap * 2, c.ceiling), c.n + got + 2)
                grown = <char*>realloc(c.out, c.cap)
                if grown == NULL:
                    c.failed = 2
                else:
                    c.out = grown
            if c.failed == 0:
                memcpy(c.out + c.n, row, got)
                c.n += got
            # A CopyData message is a row (the first also holds the header), or the trailer: a message of its
            # own, -1 as the field count (with the header before it when there are no rows). A part never ends
            # at the trailer, so the COPY's end comes in the same part: ended there, the next part would be a
            # bare header.
            trailer = (
                (got == 2 or (first and c.messages == 0 and got == 21))
                and <unsigned char>row[got - 2] == 0xff
                and <unsigned char>row[got - 1] == 0xff
            )
            c.messages += 1
            self.freemem(row)
            if trailer:
                continue
            c.rows += 1
            if c.failed == 0 and (c.n >= most or c.rows >= most_rows):
                c.out[c.n] = <char>0xff  # the trailer: this part ends here
                c.out[c.n + 1] = <char>0xff
                c.n += 2
                return

    cdef tuple _error(self, void *conn, void *res):
        """(SQLSTATE or None, message) of a failed COPY: from its result when there is one, else the
        connection's."""
        cdef const char *field
        cdef bytes sqlstate = None, message = None
        if res != NULL:
            field = self.result_error_field(res, PG_DIAG_SQLSTATE)
            if field != NULL:
                sqlstate = field
            field = self.result_error_field(res, PG_DIAG_MESSAGE_PRIMARY)
            message = field if field != NULL else self.result_error_message(res)
        if not message:
            message = self.error_message(conn)
        return (sqlstate.decode() if sqlstate else None), message.decode(errors="replace").strip()




def copy_rows_and_last(bytes data not None) -> tuple:
    """(the number of rows of a ``COPY … (FORMAT binary)`` output, the raw fields of its last row — None for a
    NULL — or None without rows): what the snapshot needs to ask for its next chunk before encoding this one."""
    cdef const unsigned char* d = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(data), pos, last = -1, rows = 0, j
    cdef int32_t length
    cdef int16_t nfields
    cdef list fields
    pos = copy_body_start(d, size)
    while True:
        if pos > size - 2:
            raise ValueError("truncated COPY output")
        nfields = <int16_t>be16(d + pos)
        if nfields == -1:
            break
        if nfields < 0:
            raise ValueError("negative field count")
        last = pos
        pos = skip_fields(d, size, pos + 2, nfields)
        rows += 1
    if last < 0:
        return 0, None
    fields = []
    nfields = <int16_t>be16(d + last)
    pos = last + 2
    for j in range(nfields):
        length = <int32_t>be32(d + pos)
        pos += 4
        if length < 0:
            fields.append(None)
        else:
            fields.append(PyBytes_FromStringAndSize(<const char*>d + pos, length))
            pos += length
    return rows, fields


def packed_rows(bytes packed not None, bint records=True) -> tuple:
    """TuplePlan.encode_copy_packed's rows as (their keys, their records), each a list in order; the records are
    None when not asked for."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(packed)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(packed), at = 0, row, reclen, keylen
    cdef list keys = [], recs = [] if records else None
    while at < size:
        row = at
        at = packed_next(p, size, at, &reclen, &keylen)
        keys.append(PyBytes_FromStringAndSize(<const char*>p + row + 8 + reclen, keylen))
        if records:
            recs.append(PyBytes_FromStringAndSize(<const char*>p + row + 8, reclen))
    return keys, recs
