# Part of the cdc._native extension module: cdc/_native.pyx includes it, and all parts share one namespace.
#
# The byte buffer and the writers of single values (Avro longs, strings, decimals, the fast wire types).

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
