# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The capture's per-row hot spot in C: a pgoutput TupleData (or a binary COPY row) straight to Avro bytes.

:class:`TuplePlan` is :meth:`cdc._events.TableCodec.encode_tuple_python` compiled for one table: the same
contract, the same bytes (tests/unit/test_fast_path.py runs both against the general path). It writes the
common case of the usual column types itself — integers, floats, bool, text, jsonb, timestamps, dates, uuid,
bytea, numeric(p,s) that fits in 63 bits — and hands every other value (another type, text format,
±infinity, NaN, a wide numeric, a malformed value) to the column's Python converter and field writer, so
whatever the Python path accepts, raises or writes, this does too.

Optional: without a C compiler the package installs without it and the capture runs the Python path.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t, INT64_MIN, INT32_MAX, INT32_MIN
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

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


cdef int check_utf8(const unsigned char* p, Py_ssize_t n) except -1:
    """Raise UnicodeDecodeError unless the bytes are UTF-8 (what bytes.decode checks): Avro strings must be."""
    cdef Py_ssize_t i
    for i in range(n):
        if p[i] & 0x80:
            PyUnicode_DecodeUTF8(<const char*>p, n, "strict")  # raises on invalid input
            return 0
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


cdef int put_fast(Buf* b, int wire, int scale, const unsigned char* p, Py_ssize_t n) except -1:
    """One binary value of a nullable field (union index 1, byte 2, then the value). 1: written; 0: nothing
    written, the value is not this wire's common case."""
    cdef int64_t v
    cdef uint32_t u32
    cdef uint64_t u64
    cdef int i
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
        put_byte(b, 2)
        put_long(b, v)
    elif wire == W_TEXT:
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
    elif wire == W_TIMESTAMP:
        if n != 8:
            return 0
        v = <int64_t>be64(p)
        if not (INT64_MIN < v < FINITE_HIGH):
            return 0
        put_byte(b, 2)
        put_long(b, v + EPOCH_MICROS)
    elif wire == W_DATE:
        if n != 4:
            return 0
        v = <int32_t>be32(p)
        if v == INT32_MAX or v == INT32_MIN:
            return 0
        put_byte(b, 2)
        put_long(b, v + EPOCH_DAYS)
    elif wire == W_BOOL:
        put_byte(b, 2)
        put_byte(b, 1 if n == 1 and p[0] == 1 else 0)
    elif wire == W_FLOAT8:
        if n != 8:
            return 0
        u64 = be64(p)
        if (u64 & 0x7FF0000000000000) == 0x7FF0000000000000 and (u64 & 0x000FFFFFFFFFFFFF):
            return 0  # NaN: whatever Python makes of its payload
        put_byte(b, 2)
        reserve(b, 8)
        for i in range(8):
            b.p[b.n + i] = p[7 - i]  # Avro doubles are little-endian
        b.n += 8
    elif wire == W_FLOAT4:
        if n != 4:
            return 0
        u32 = be32(p)
        if (u32 & 0x7F800000) == 0x7F800000 and (u32 & 0x007FFFFF):
            return 0
        put_byte(b, 2)
        reserve(b, 4)
        for i in range(4):
            b.p[b.n + i] = p[3 - i]
        b.n += 4
    elif wire == W_UUID:
        if n != 16:
            return 0
        put_byte(b, 2)
        put_byte(b, 72)  # 36, zig-zagged
        reserve(b, 36)
        for i in range(16):
            if i == 4 or i == 6 or i == 8 or i == 10:
                b.p[b.n] = 45  # '-'
                b.n += 1
            b.p[b.n] = HEX[p[i] >> 4]
            b.p[b.n + 1] = HEX[p[i] & 15]
            b.n += 2
    elif wire == W_BYTES:
        put_byte(b, 2)
        put_long(b, n)
        put_raw(b, p, n)
    elif wire == W_DECIMAL:
        return put_decimal(b, p, n, scale)
    else:
        return 0
    return 1


cdef class TuplePlan:
    """How one table version's tuples become its Value record (see TableCodec.encode_tuple)."""

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
        cdef const unsigned char* d = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(data)
        cdef const unsigned char* modes = NULL
        cdef Py_ssize_t ncols = self.ncols, i, k, start, length, keylen
        cdef int kind
        cdef int32_t l32
        cdef unsigned char[STACK_BYTES] stack
        cdef Py_ssize_t[STACK_COLUMNS] stack_marks
        cdef Py_ssize_t* marks = stack_marks
        cdef Buf b
        cdef list unchanged = []
        cdef bytes key
        cdef char* kp
        if pos < 0 or pos > size - 2:
            raise ValueError("truncated tuple")
        if copy_modes is None:
            if be16(d + pos) != ncols:
                raise ValueError("column count differs from the relation's")
        else:
            if <int16_t>be16(d + pos) < ncols:
                raise ValueError("the COPY row has fewer fields than the table columns")
            if PyBytes_GET_SIZE(copy_modes) < ncols:
                raise ValueError("fewer COPY modes than columns")
            modes = <const unsigned char*>PyBytes_AS_STRING(copy_modes)
        pos += 2
        b.p = stack
        b.n = 0
        b.cap = STACK_BYTES
        b.heap = NULL
        if ncols + 1 > STACK_COLUMNS:
            marks = <Py_ssize_t*>malloc((ncols + 1) * sizeof(Py_ssize_t))
            if marks == NULL:
                raise MemoryError()
        try:
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
                    if not put_fast(&b, self.wires[i], self.scales[i], d + start, length):
                        self._through_python(&b, self.binary[i], i, d + start, length)
                elif kind == K_NULL:
                    put_byte(&b, 0)
                elif kind == K_UNCHANGED:
                    put_byte(&b, 0)
                    unchanged.append(self.names[i])
                elif kind == K_TEXT:
                    if length < 0 or length > size - start:
                        raise ValueError("truncated column")
                    pos = start + length
                    self._through_python(&b, self.text[i], i, d + start, length)
                else:
                    raise ValueError(f"unknown value kind {kind:#04x}")
            marks[ncols] = b.n
            record = PyBytes_FromStringAndSize(<const char*>b.p, b.n)
            keylen = PyBytes_GET_SIZE(self.key_frame)
            for k in self.key_indexes:
                if b.p[marks[k]] == 0:  # null branch: the key column is missing
                    return record, None, unchanged, pos
                keylen += marks[k + 1] - marks[k]
            # Key's fields are Value's key fields with the same types: the key is cut from the record.
            key = PyBytes_FromStringAndSize(NULL, keylen)
            kp = PyBytes_AS_STRING(key)
            keylen = PyBytes_GET_SIZE(self.key_frame)
            memcpy(kp, PyBytes_AS_STRING(self.key_frame), keylen)
            for k in self.key_indexes:
                memcpy(kp + keylen, b.p + marks[k], marks[k + 1] - marks[k])
                keylen += marks[k + 1] - marks[k]
            return record, key, unchanged, pos
        finally:
            if b.heap != NULL:
                free(b.heap)
            if marks != stack_marks:
                free(marks)


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
    cdef Py_ssize_t seq_start, digits_at, seq_len
    b.p = stack
    b.n = 0
    b.cap = STACK_BYTES
    b.heap = NULL
    try:
        put_raw(&b, <const unsigned char*>PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame))
        put_row(&b, before)
        put_row(&b, after)
        put_raw(&b, <const unsigned char*>PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head))
        # sequence: the string '["<commit_lsn>","<lsn>"]', its length first (one byte: at most 47 < 64).
        seq_start = b.n
        put_byte(&b, 0)
        digits_at = b.n
        put_raw(&b, <const unsigned char*>b'["', 2)
        put_decimal_text(&b, <uint64_t>commit_lsn)
        put_raw(&b, <const unsigned char*>b'","', 3)
        put_decimal_text(&b, <uint64_t>lsn)
        put_raw(&b, <const unsigned char*>b'"]', 2)
        seq_len = b.n - digits_at
        b.p[seq_start] = <unsigned char>(seq_len << 1)
        put_raw(&b, <const unsigned char*>PyBytes_AS_STRING(middle), PyBytes_GET_SIZE(middle))
        put_long(&b, lsn)
        put_raw(&b, <const unsigned char*>PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail))
        if transaction is None:
            put_byte(&b, 0)
        else:
            if len(transaction) != 3:  # read below without bounds checks
                raise ValueError("transaction must be (id, total_order, data_collection_order)")
            put_byte(&b, 2)
            put_str(&b, transaction[0])
            put_long(&b, transaction[1])
            put_long(&b, transaction[2])
        put_raw(&b, <const unsigned char*>PyBytes_AS_STRING(ops), PyBytes_GET_SIZE(ops))
        if unchanged:
            put_long(&b, len(unchanged))
            for name in unchanged:
                put_str(&b, name)
        put_byte(&b, 0)
        return PyBytes_FromStringAndSize(<const char*>b.p, b.n)
    finally:
        if b.heap != NULL:
            free(b.heap)
