# Included by _worker_loop.pyx: the main process's loops over the segment's
# columns (marked [main]); the workers' are in _worker_loop.pyx itself.

def count_ended(SlotColumns slot, Py_ssize_t rows=-1):
    """[main] How many rows of ``slot`` (its first ``rows``; -1: all) ended an
    episode (terminated or truncated)."""
    cdef Py_ssize_t row, ended = 0
    if rows < 0 or rows > slot.terminations.shape[0]:
        rows = slot.terminations.shape[0]
    for row in range(rows):
        ended += (slot.terminations[row] | slot.truncations[row]) != 0
    return ended


def uniform_codes(const uint8_t[:, ::1] codes, list columns, Py_ssize_t rows):
    """[main] Per info column of ``columns``: the type code that rows ``0 ..
    rows-1`` all have (shmvec/infos.py), or 0 when one lacks the key or the
    codes differ."""
    cdef list out = []
    cdef Py_ssize_t row, column
    cdef uint8_t first
    for column in columns:
        first = codes[0, column] if rows else 0
        for row in range(1, rows):
            if codes[row, column] != first:
                first = 0
                break
        out.append(first)
    return out


def row_messages(SlotColumns slot):
    """[main] Whether a row of ``slot`` has a pickled message (async mode)."""
    cdef Py_ssize_t row
    for row in range(slot.messages.shape[0]):
        if slot.messages[row]:
            return True
    return False


@cython.no_gc_clear
cdef class RegionLease:
    """[main] One lease region of the segment (shmvec/engine/leases.py) as a
    writable buffer: arrays made over it keep it, and the segment's mapping,
    alive. When the last of them is gone, ``free.append(region)`` hands the
    region back for a later batch."""

    cdef object segment
    cdef char* data
    cdef Py_ssize_t shape[1]
    cdef list free
    cdef Py_ssize_t region

    def __cinit__(self, object segment, uintptr_t address, Py_ssize_t size, list free,
                  Py_ssize_t region):
        self.segment, self.free, self.region = segment, free, region
        self.data = <char*>address
        self.shape[0] = size

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        buffer.buf = self.data
        buffer.obj = self
        buffer.len = self.shape[0]
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = NULL  # unsigned bytes
        if flags & PyBUF_FORMAT:
            buffer.format = b"B"
        buffer.ndim = 1
        buffer.shape = NULL
        if flags & PyBUF_ND:
            buffer.shape = self.shape
        buffer.strides = NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __dealloc__(self):
        self.free.append(self.region)
