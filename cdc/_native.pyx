# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The capture's per-row hot spot in C: a pgoutput TupleData (or a binary COPY row) straight to Avro bytes.

:class:`TuplePlan` is cdc._encoder.PythonRowEncoder compiled for one table: the same contract (RowEncoder), the
same bytes (tests/unit/test_fast_path.py runs both against the decoded-row oracle). It writes the
common case of the usual column types itself — integers, floats, bool, text, jsonb, timestamps, dates, uuid,
bytea, numeric(p,s) that fits in 63 bits — and hands every other value (another type, text format,
±infinity, NaN, a wide numeric, a malformed value) to the column's Python converter and field writer, so
whatever the Python path accepts, raises or writes, this does too.

Optional: without a C compiler the package installs without it and the capture runs the Python encoder.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t, INT64_MIN, INT32_MAX, INT32_MIN
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
cimport cython
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset, strlen

from schemas._datetime import UNIX_EPOCH_DAYS as _EPOCH_DAYS_PY, UNIX_EPOCH_MICROS as _EPOCH_MICROS_PY

cdef int64_t EPOCH_DAYS = _EPOCH_DAYS_PY
cdef int64_t EPOCH_MICROS = _EPOCH_MICROS_PY
# _timestamp_bin's finite range: beyond it the converter says ±infinity or raises.
cdef int64_t FINITE_HIGH = 0x7FFFFFFFFFFFFFFF - EPOCH_MICROS

cdef enum Wire:
    W_GENERIC = 0
    W_INT16
    W_INT32
    W_INT64
    W_UINT32
    W_FLOAT4
    W_FLOAT8
    W_BOOL
    W_TEXT
    W_VTEXT
    W_TIMESTAMP
    W_DATE
    W_UUID
    W_BYTES
    W_DECIMAL

# The wire names (schemas' Conv.wire and fixed struct codes) this module writes itself.
WIRES = {
    "h": W_INT16,
    "i": W_INT32,
    "q": W_INT64,
    "I": W_UINT32,
    "f": W_FLOAT4,
    "d": W_FLOAT8,
    "bool": W_BOOL,
    "text": W_TEXT,
    "vtext": W_VTEXT,
    "ts": W_TIMESTAMP,
    "date": W_DATE,
    "uuid": W_UUID,
    "bytes": W_BYTES,
    "decimal": W_DECIMAL,
}

cdef enum:
    K_TEXT = 116  # 't'
    K_BINARY = 98  # 'b'
    K_NULL = 110  # 'n'
    K_UNCHANGED = 117  # 'u'
    STACK_BYTES = 2048
    STACK_COLUMNS = 128

cdef const char* HEX = b"0123456789abcdef"
cdef uint64_t[20] POW10
cdef int _k
POW10[0] = 1
for _k in range(1, 20):
    POW10[_k] = POW10[_k - 1] * 10


cdef struct Buf:
    unsigned char* p
    Py_ssize_t n
    Py_ssize_t cap
    unsigned char* heap  # NULL while p is the caller's stack array


cdef int grow(Buf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap = b.cap * 2
    cdef unsigned char* q
    if cap < b.n + extra:
        cap = b.n + extra
    if b.heap == NULL:
        q = <unsigned char*>malloc(cap)
        if q == NULL:
            raise MemoryError()
        memcpy(q, b.p, b.n)
    else:
        q = <unsigned char*>realloc(b.heap, cap)
        if q == NULL:
            raise MemoryError()
    b.heap = q
    b.p = q
    b.cap = cap
    return 0


cdef inline int reserve(Buf* b, Py_ssize_t extra) except -1:
    if b.n + extra > b.cap:
        grow(b, extra)
    return 0


cdef inline int put_byte(Buf* b, unsigned char c) except -1:
    reserve(b, 1)
    b.p[b.n] = c
    b.n += 1
    return 0


cdef inline int put_long(Buf* b, int64_t v) except -1:
    """Avro int/long: zig-zag, then base-128 varint (schemas.write_long)."""
    cdef uint64_t z = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    reserve(b, 10)
    while z > 0x7F:
        b.p[b.n] = <unsigned char>((z & 0x7F) | 0x80)
        b.n += 1
        z >>= 7
    b.p[b.n] = <unsigned char>z
    b.n += 1
    return 0


cdef inline int put_raw(Buf* b, const unsigned char* src, Py_ssize_t n) except -1:
    reserve(b, n)
    memcpy(b.p + b.n, src, n)
    b.n += n
    return 0


cdef inline uint16_t be16(const unsigned char* p) noexcept nogil:
    return (<uint16_t>p[0] << 8) | p[1]


cdef inline uint32_t be32(const unsigned char* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t be64(const unsigned char* p) noexcept nogil:
    return (<uint64_t>be32(p) << 32) | be32(p + 4)


cdef Py_ssize_t packed_next(const unsigned char* p, Py_ssize_t size, Py_ssize_t at, Py_ssize_t* reclen,
                            Py_ssize_t* keylen) except -1:
    """The row of packed rows (TuplePlan.encode_copy_packed) at ``at``: its record's and key's lengths, checked
    to lie within ``size``; returns where the next row starts."""
    if size - at < 8:
        raise ValueError("truncated packed rows")
    reclen[0], keylen[0] = be32(p + at), be32(p + at + 4)
    if reclen[0] > size - at - 8 or keylen[0] > size - at - 8 - reclen[0]:
        raise ValueError("truncated packed rows")
    return at + 8 + reclen[0] + keylen[0]


cdef inline void put_be32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef int check_utf8(const unsigned char* p, Py_ssize_t n) except -1:
    """Raise UnicodeDecodeError unless the bytes are UTF-8 (what bytes.decode checks): Avro strings must be.

    ASCII, the common case, is recognised 32 bytes per step (a byte at a time, this was ~8 % of the capture's
    main thread replaying 1 kB text values); any byte with its high bit set hands the whole value to CPython's
    decoder, which decides."""
    cdef Py_ssize_t i = 0
    cdef uint64_t w[4]
    while i + 32 <= n:
        memcpy(w, p + i, 32)  # no alignment assumed
        if (w[0] | w[1] | w[2] | w[3]) & 0x8080808080808080ULL:
            break  # the byte loop below finds which
        i += 32
    while i < n and not (p[i] & 0x80):
        i += 1
    if i < n:
        PyUnicode_DecodeUTF8(<const char*>p, n, "strict")  # raises on invalid input
    return 0


cdef int put_decimal(Buf* b, const unsigned char* p, Py_ssize_t n, int scale) except -1:
    """numeric's send format as the decimal branch (1) of ["null", decimal, "string"]: the two's-complement
    big-endian unscaled integer sized as fastavro sizes it. Returns 0 (nothing written) unless it fits in
    63 bits and is a plain number: the converter handles NaN, errors and wide values."""
    cdef int ndigits, weight, exp, i, bits, size
    cdef uint16_t sign, digit
    cdef uint64_t acc = 0, m
    cdef int64_t v
    if n < 8:
        return 0
    ndigits = <int16_t>be16(p)
    weight = <int16_t>be16(p + 2)
    sign = be16(p + 4)
    if ndigits < 0 or n < 8 + 2 * ndigits or (sign != 0 and sign != 0x4000):
        return 0
    for i in range(ndigits):
        digit = be16(p + 8 + 2 * i)
        # A digit above 9999 is no numeric PostgreSQL writes, but the converter reads it: so must the result.
        if digit > 9999 or acc > (0xFFFFFFFFFFFFFFFF - 9999) // 10000:
            return 0
        acc = acc * 10000 + digit
    exp = 4 * (weight - ndigits + 1) + scale
    if exp >= 0:
        if exp > 19 or (acc != 0 and acc > 0xFFFFFFFFFFFFFFFF // POW10[exp]):
            return 0
        m = acc * POW10[exp]
    elif exp < -19:
        m = 0
    else:
        m = acc // POW10[-exp]
    if m >= (<uint64_t>1 << 63):
        return 0
    v = -<int64_t>m if sign == 0x4000 else <int64_t>m
    bits = 0
    while m:
        bits += 1
        m >>= 1
    size = (bits + 8) // 8
    put_byte(b, 2)
    put_long(b, size)
    reserve(b, size)
    for i in range(size):
        b.p[b.n + i] = <unsigned char>((<uint64_t>v >> (8 * (size - 1 - i))) & 0xFF)
    b.n += size
    return 1


cdef inline int put_reversed(Buf* b, const unsigned char* p, int n) except -1:
    """``n`` bytes from ``p`` in the reverse order: a big-endian float as Avro's little-endian one."""
    cdef int i
    reserve(b, n)
    for i in range(n):
        b.p[b.n + i] = p[n - 1 - i]
    b.n += n
    return 0


cdef inline int put_fast_number(Buf* b, int wire, const unsigned char* p, Py_ssize_t n) except -1:
    """put_fast for the integers, timestamps, dates and floats: fixed widths, and the values Python would
    turn into something else (infinities, NaN payloads) left to it."""
    cdef int64_t v
    cdef uint32_t u32
    cdef uint64_t u64
    if wire == W_INT64 or wire == W_INT32 or wire == W_INT16 or wire == W_UINT32:
        if n != (8 if wire == W_INT64 else 2 if wire == W_INT16 else 4):
            return 0
        if wire == W_INT64:
            v = <int64_t>be64(p)
        elif wire == W_INT32:
            v = <int32_t>be32(p)
        elif wire == W_INT16:
            v = <int16_t>be16(p)
        else:
            v = be32(p)
    elif wire == W_TIMESTAMP:
        if n != 8:
            return 0
        v = <int64_t>be64(p)
        if not (INT64_MIN < v < FINITE_HIGH):
            return 0
        v += EPOCH_MICROS
    elif wire == W_DATE:
        if n != 4:
            return 0
        v = <int32_t>be32(p)
        if v == INT32_MAX or v == INT32_MIN:
            return 0
        v += EPOCH_DAYS
    elif wire == W_FLOAT8:
        if n != 8:
            return 0
        u64 = be64(p)
        if (u64 & 0x7FF0000000000000) == 0x7FF0000000000000 and (u64 & 0x000FFFFFFFFFFFFF):
            return 0  # NaN: whatever Python makes of its payload
        put_byte(b, 2)
        put_reversed(b, p, 8)  # Avro doubles are little-endian
        return 1
    elif wire == W_FLOAT4:
        if n != 4:
            return 0
        u32 = be32(p)
        if (u32 & 0x7F800000) == 0x7F800000 and (u32 & 0x007FFFFF):
            return 0
        put_byte(b, 2)
        put_reversed(b, p, 4)
        return 1
    else:
        return 0
    put_byte(b, 2)
    put_long(b, v)
    return 1


cdef inline int put_uuid_text(Buf* b, const unsigned char* p) except -1:
    """A uuid's 16 bytes as Avro's string of its 36-character text form."""
    cdef int i
    put_long(b, 36)
    reserve(b, 36)
    for i in range(16):
        if i == 4 or i == 6 or i == 8 or i == 10:
            b.p[b.n] = 45  # '-'
            b.n += 1
        b.p[b.n] = HEX[p[i] >> 4]
        b.p[b.n + 1] = HEX[p[i] & 15]
        b.n += 2
    return 0


cdef int put_fast(Buf* b, int wire, int scale, const unsigned char* p, Py_ssize_t n) except -1:
    """One binary value of a nullable field (union index 1, byte 2, then the value). 1: written; 0: nothing
    written, the value is not this wire's common case."""
    if wire == W_TEXT or wire == W_BYTES:
        if wire == W_TEXT:
            check_utf8(p, n)
        put_byte(b, 2)
        put_long(b, n)
        put_raw(b, p, n)
    elif wire == W_VTEXT:
        if n < 1 or p[0] != 1:
            return 0
        check_utf8(p + 1, n - 1)
        put_byte(b, 2)
        put_long(b, n - 1)
        put_raw(b, p + 1, n - 1)
    elif wire == W_BOOL:
        put_byte(b, 2)
        put_byte(b, 1 if n == 1 and p[0] == 1 else 0)
    elif wire == W_UUID:
        if n != 16:
            return 0
        put_byte(b, 2)
        put_uuid_text(b, p)
    elif wire == W_DECIMAL:
        return put_decimal(b, p, n, scale)
    else:
        return put_fast_number(b, wire, p, n)
    return 1


cdef Py_ssize_t copy_body_start(const unsigned char* d, Py_ssize_t size) except -1:
    """Where the rows of a ``COPY … (FORMAT binary)`` output start: after its signature, flags and extension."""
    cdef int32_t extension
    if size < 19 or memcmp(d, b"PGCOPY\n\xff\r\n\0", 11) != 0:
        raise ValueError("COPY output does not start with the binary COPY signature")
    extension = <int32_t>be32(d + 15)
    if extension < 0 or extension > size - 19:
        raise ValueError("truncated COPY header")
    return 19 + extension


cdef Py_ssize_t skip_fields(const unsigned char* d, Py_ssize_t size, Py_ssize_t pos, Py_ssize_t n) except -1:
    """The position after the ``n`` fields of a binary COPY row that start at ``pos`` (each an Int32 length, -1
    for NULL, then the value)."""
    cdef Py_ssize_t j
    cdef int32_t length
    for j in range(n):
        if pos > size - 4:
            raise ValueError("truncated COPY row")
        length = <int32_t>be32(d + pos)
        pos += 4
        if length > 0:
            if length > size - pos:
                raise ValueError("truncated COPY row")
            pos += length
    return pos


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
        self._drain(timeout)
        self._end(self.commit_txn, timeout)

    cdef void _drain(self, double timeout):
        """Waits, in 1 ms steps, until every event produced is acknowledged (or ``timeout`` worth of steps passed).

        commit_transaction flushes first too, but that flush waits for delivery reports in steps of 10 ms, and
        with delivery.report.only.error no report comes to end a step early for an event that was delivered:
        each commit of a light load would wait ~10 ms (measured: 10.9 ms per one-event transaction against
        2.2 with confluent_kafka's Producer, whose handle gets other wake-ups). After this its flush finds
        nothing left and returns at once. Each step is itself a flush, so the broker threads send at once
        rather than after linger.ms."""
        cdef int steps = <int>(timeout * 1000)
        with nogil:
            while steps > 0 and self.flush_(self.rk, 1) != 0:
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
