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


# The module's parts, by what they do; included in this order (a part uses only those before it).
include "_native_values.pxi"
include "_native_rows.pxi"
include "_native_producer.pxi"
include "_native_copy.pxi"
include "_native_replication.pxi"
