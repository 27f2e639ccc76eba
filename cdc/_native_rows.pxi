# Part of the cdc._native extension module: cdc/_native.pyx includes it, and all parts share one namespace.
#
# Rows to Avro: TuplePlan (a TupleData or COPY row to Avro) and the change envelope.

cdef class TuplePlan:
    """How one table version's tuples become its Value record (cdc._encoder.RowEncoder)."""

    cdef Py_ssize_t ncols
    cdef int* wires
    cdef int* scales
    cdef tuple text, binary, writers, names, key_indexes
    cdef bytes key_frame

    def __cinit__(self) -> None:
        self.wires = NULL
        self.scales = NULL

    def __init__(
        self,
        wires: list[tuple[int, int]],
        text: tuple,
        binary: tuple,
        writers: tuple,
        names: tuple,
        key_indexes: tuple,
        key_frame: bytes,
    ) -> None:
        cdef Py_ssize_t i, ncols = len(wires)
        # encode() indexes these without bounds checks: refuse anything inconsistent here.
        if self.wires != NULL:
            raise RuntimeError("a TuplePlan is initialised once")
        if not (len(text) == len(binary) == len(writers) == len(names) == ncols):
            raise ValueError("one wire, converter, writer and name per column")
        if any(not 0 <= k < ncols for k in key_indexes):
            raise ValueError("key column index out of range")
        self.ncols = ncols
        self.wires = <int*>malloc(max(self.ncols, 1) * sizeof(int))
        self.scales = <int*>malloc(max(self.ncols, 1) * sizeof(int))
        if self.wires == NULL or self.scales == NULL:
            raise MemoryError()
        for i in range(self.ncols):
            self.wires[i], self.scales[i] = wires[i]
        self.text, self.binary, self.writers, self.names = text, binary, writers, names
        self.key_indexes = key_indexes
        self.key_frame = key_frame

    def __dealloc__(self) -> None:
        free(self.wires)
        free(self.scales)

    cdef int _through_python(self, Buf* b, object conv, Py_ssize_t i, const unsigned char* p, Py_ssize_t n) except -1:
        """A value the fast cases do not write: the column's converter and field writer, as the Python path."""
        if conv is None:
            raise ValueError("binary value without a binary reader")
        out = bytearray()
        self.writers[i](conv(PyBytes_FromStringAndSize(<const char*>p, n)), out)
        put_raw(b, <const unsigned char*>PyByteArray_AS_STRING(out), PyByteArray_GET_SIZE(out))
        return 0

    def encode(self, bytes data not None, Py_ssize_t pos, bytes copy_modes=None) -> tuple:
        return self._encode(data, pos, copy_modes)

    cdef tuple _encode(self, bytes data, Py_ssize_t pos, bytes copy_modes):
        """(record, key or None, the unchanged TOASTed columns' names, the position after the tuple)."""
        cdef list unchanged = []
        cdef Py_ssize_t end = 0
        cdef PyObject* key = NULL
        record = self._encode_row(data, pos, copy_modes, unchanged, &end, &key)
        if key == NULL:
            return record, None, unchanged, end
        found = <object>key
        Py_XDECREF(key)
        return record, found, unchanged, end

    cdef const unsigned char* _modes(self, const unsigned char* d, Py_ssize_t pos, bytes copy_modes) except? NULL:
        """Checks the field count of the tuple or COPY row at ``pos``; the COPY modes (NULL for a pgoutput tuple)."""
        if copy_modes is None:
            if be16(d + pos) != self.ncols:
                raise ValueError("column count differs from the relation's")
            return NULL
        if <int16_t>be16(d + pos) < self.ncols:
            raise ValueError("the COPY row has fewer fields than the table columns")
        if PyBytes_GET_SIZE(copy_modes) < self.ncols:
            raise ValueError("fewer COPY modes than columns")
        return <const unsigned char*>PyBytes_AS_STRING(copy_modes)

    cdef int _put_record(self, const unsigned char* d, Py_ssize_t size, Py_ssize_t pos, const unsigned char* modes,
                         list unchanged, Py_ssize_t* end, Buf* b, Py_ssize_t* marks) except -1:
        """Appends the Value record of the tuple whose fields start at ``pos`` (after its field count) to ``b``:
        column i's bytes from ``marks[i]`` (offsets in ``b``) to ``marks[i + 1]``; the position after the tuple
        to ``end``; the names of unchanged TOASTed columns to ``unchanged`` (None: there can be none, as in COPY
        rows). ``modes``: read a binary COPY row (each field's mode, ord "b" or "t"), NULL for pgoutput."""
        cdef Py_ssize_t ncols = self.ncols, i, start, length
        cdef int kind
        cdef int32_t l32
        for i in range(ncols):
            marks[i] = b.n
            if modes == NULL:
                if pos >= size:
                    raise ValueError("truncated tuple")
                kind = d[pos]
                if kind == K_BINARY or kind == K_TEXT:
                    if pos + 5 > size:
                        raise ValueError("truncated tuple")
                    length = be32(d + pos + 1)
                    start = pos + 5
                else:
                    start = length = 0
                    pos += 1
            else:
                if pos + 4 > size:
                    raise ValueError("truncated row")
                l32 = <int32_t>be32(d + pos)
                start = pos + 4
                if l32 < 0:
                    kind = K_NULL
                    length = 0
                    pos = start
                else:
                    kind = modes[i]
                    length = l32
            if kind == K_BINARY:
                if length < 0 or length > size - start:  # < 0: a length >= 2**31 where Py_ssize_t is 32 bits
                    raise ValueError("truncated column")
                pos = start + length
                if not put_fast(b, self.wires[i], self.scales[i], d + start, length):
                    self._through_python(b, self.binary[i], i, d + start, length)
            elif kind == K_NULL:
                put_byte(b, 0)
            elif kind == K_UNCHANGED:
                if unchanged is None:
                    raise ValueError("an unchanged TOASTed value where there can be none")
                put_byte(b, 0)
                unchanged.append(self.names[i])
            elif kind == K_TEXT:
                if length < 0 or length > size - start:
                    raise ValueError("truncated column")
                pos = start + length
                self._through_python(b, self.text[i], i, d + start, length)
            else:
                raise ValueError(f"unknown value kind {kind:#04x}")
        marks[ncols] = b.n
        end[0] = pos
        return 0

    cdef Py_ssize_t _key_length(self, const unsigned char* p, Py_ssize_t* marks):
        """The length of the framed key cut from the record whose columns ``marks`` locates in ``p`` (see
        _put_record); -1 when a key column is NULL (its union's null branch)."""
        cdef Py_ssize_t keylen = PyBytes_GET_SIZE(self.key_frame), k
        for k in self.key_indexes:
            if p[marks[k]] == 0:
                return -1
            keylen += marks[k + 1] - marks[k]
        return keylen

    cdef void _cut_key(self, char* kp, const unsigned char* p, Py_ssize_t* marks):
        """Writes the framed key (_key_length bytes) to ``kp``. Key's fields are Value's key fields with the same
        types: the key is cut from the record."""
        cdef Py_ssize_t keylen = PyBytes_GET_SIZE(self.key_frame), k
        memcpy(kp, PyBytes_AS_STRING(self.key_frame), keylen)
        for k in self.key_indexes:
            memcpy(kp + keylen, p + marks[k], marks[k + 1] - marks[k])
            keylen += marks[k + 1] - marks[k]

    cdef bytes _encode_row(self, bytes data, Py_ssize_t pos, bytes copy_modes, list unchanged, Py_ssize_t* end,
                           PyObject** key_out):
        """The tuple at ``pos``'s Value record. The position after it goes to ``end``; its key to ``key_out``, a
        reference the caller owns (NULL when a key column is NULL; set only on success); the names of unchanged
        TOASTed columns are appended to ``unchanged`` (None: there can be none, as in COPY rows). No tuple, list
        or int per row."""
        cdef const unsigned char* d = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(data), keylen
        cdef const unsigned char* modes
        cdef unsigned char[STACK_BYTES] stack
        cdef Py_ssize_t[STACK_COLUMNS] stack_marks
        cdef Py_ssize_t* marks = stack_marks
        cdef Buf b
        cdef bytes key
        if pos < 0 or pos > size - 2:
            raise ValueError("truncated tuple")
        modes = self._modes(d, pos, copy_modes)
        b.p = stack
        b.n = 0
        b.cap = STACK_BYTES
        b.heap = NULL
        if self.ncols + 1 > STACK_COLUMNS:
            marks = <Py_ssize_t*>malloc((self.ncols + 1) * sizeof(Py_ssize_t))
            if marks == NULL:
                raise MemoryError()
        try:
            self._put_record(d, size, pos + 2, modes, unchanged, end, &b, marks)
            record = PyBytes_FromStringAndSize(<const char*>b.p, b.n)
            keylen = self._key_length(b.p, marks)
            if keylen < 0:
                key_out[0] = NULL
                return record
            key = PyBytes_FromStringAndSize(NULL, keylen)
            self._cut_key(PyBytes_AS_STRING(key), b.p, marks)
            Py_INCREF(key)  # handed to the caller (key_out), beside the local reference released on return
            key_out[0] = <PyObject*>key
            return record
        finally:
            if b.heap != NULL:
                free(b.heap)
            if marks != stack_marks:
                free(marks)

    def encode_copy_packed(self, bytes data not None, bytes copy_modes not None) -> tuple:
        """A whole ``COPY … (FORMAT binary)`` chunk's rows (fields after the table's columns are skipped) packed
        into one bytes object, not two per row: per row, its Value record's and its framed key's lengths (two
        big-endian uint32), then the record, then the key (DirectProducer.produce_packed and packed_rows read
        this). Returns (that, the number of rows). Raises on anything it does not take, a NULL key included."""
        cdef const unsigned char* d = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(data), pos, head, reclen, keylen, rows = 0
        cdef int16_t nfields
        cdef const unsigned char* modes
        cdef Py_ssize_t* marks
        cdef Buf b
        b.p = NULL
        b.n = 0
        b.cap = 0
        b.heap = NULL
        marks = <Py_ssize_t*>malloc((self.ncols + 1) * sizeof(Py_ssize_t))
        if marks == NULL:
            raise MemoryError()
        try:
            grow(&b, size + (size >> 1) + 64)  # about the COPY output's size: encoded rows are rarely longer
            pos = copy_body_start(d, size)
            while True:
                if pos > size - 2:
                    raise ValueError("truncated COPY output")
                nfields = <int16_t>be16(d + pos)
                if nfields == -1:
                    return PyBytes_FromStringAndSize(<const char*>b.p, b.n), rows
                modes = self._modes(d, pos, copy_modes)
                reserve(&b, 8)
                head = b.n
                b.n += 8
                self._put_record(d, size, pos + 2, modes, None, &pos, &b, marks)
                reclen = b.n - head - 8
                keylen = self._key_length(b.p, marks)
                if keylen < 0:
                    raise ValueError("a key column is NULL")
                reserve(&b, keylen)  # may move b.p: the marks are offsets
                self._cut_key(<char*>b.p + b.n, b.p, marks)
                b.n += keylen
                put_be32(b.p + head, <uint32_t>reclen)
                put_be32(b.p + head + 4, <uint32_t>keylen)
                rows += 1
                pos = skip_fields(d, size, pos, nfields - self.ncols)
        finally:
            free(marks)
            if b.heap != NULL:
                free(b.heap)


cdef inline int put_decimal_text(Buf* b, uint64_t v) except -1:
    cdef unsigned char[20] digits
    cdef int n = 0
    while True:
        digits[n] = 48 + v % 10
        n += 1
        v //= 10
        if v == 0:
            break
    reserve(b, n)
    while n:
        n -= 1
        b.p[b.n] = digits[n]
        b.n += 1
    return 0


cdef inline int put_str(Buf* b, str s) except -1:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(s, &n)
    put_long(b, n)
    put_raw(b, <const unsigned char*>p, n)
    return 0


cdef inline int put_row(Buf* b, bytes row) except -1:
    if row is None:
        put_byte(b, 0)
    else:
        put_byte(b, 2)
        put_raw(b, <const unsigned char*>PyBytes_AS_STRING(row), PyBytes_GET_SIZE(row))
    return 0


cdef inline int put_bytes(Buf* b, bytes part) except -1:
    put_raw(b, <const unsigned char*>PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part))
    return 0


cdef int put_position(Buf* b, bytes head, int64_t commit_lsn, int64_t lsn, bytes middle) except -1:
    """The source block's part that changes with every event, between the transaction's constant ``head`` and
    ``middle``: the sequence string '["<commit_lsn>","<lsn>"]' (its length first, one byte: at most 47 < 64),
    then, after ``middle``, the LSN."""
    cdef Py_ssize_t seq_start, digits_at
    put_bytes(b, head)
    seq_start = b.n
    put_byte(b, 0)
    digits_at = b.n
    put_raw(b, <const unsigned char*>b'["', 2)
    put_decimal_text(b, <uint64_t>commit_lsn)
    put_raw(b, <const unsigned char*>b'","', 3)
    put_decimal_text(b, <uint64_t>lsn)
    put_raw(b, <const unsigned char*>b'"]', 2)
    b.p[seq_start] = <unsigned char>((b.n - digits_at) << 1)
    put_bytes(b, middle)
    put_long(b, lsn)
    return 0


cdef int put_unchanged(Buf* b, list unchanged) except -1:
    """The envelope's last field: the unchanged TOASTed columns' names (an empty array when there are none)."""
    if unchanged:
        put_long(b, len(unchanged))
        for name in unchanged:
            put_str(b, name)
    put_byte(b, 0)
    return 0


def envelope(
    bytes frame not None,
    bytes before,
    bytes after,
    bytes head not None,
    int64_t commit_lsn,
    int64_t lsn,
    bytes middle not None,
    bytes tail not None,
    tuple transaction,
    bytes ops not None,
    list unchanged,
) -> bytes:
    """TableCodec.envelope_bytes's per-change part: the transaction's constant parts (head, middle, tail, ops,
    as TableCodec._transaction_parts makes them) around the rows, the change's LSN and its unchanged fields."""
    cdef unsigned char[STACK_BYTES] stack
    cdef Buf b
    b.p = stack
    b.n = 0
    b.cap = STACK_BYTES
    b.heap = NULL
    try:
        put_bytes(&b, frame)
        put_row(&b, before)
        put_row(&b, after)
        put_position(&b, head, commit_lsn, lsn, middle)
        put_bytes(&b, tail)
        if transaction is None:
            put_byte(&b, 0)
        else:
            if len(transaction) != 3:  # read below without bounds checks
                raise ValueError("transaction must be (id, total_order, data_collection_order)")
            put_byte(&b, 2)
            put_str(&b, transaction[0])
            put_long(&b, transaction[1])
            put_long(&b, transaction[2])
        put_bytes(&b, ops)
        put_unchanged(&b, unchanged)
        return PyBytes_FromStringAndSize(<const char*>b.p, b.n)
    finally:
        if b.heap != NULL:
            free(b.heap)
