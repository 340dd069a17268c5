# Included by _worker_loop.pyx: the result ring and the doorbells of async
# mode (csrc/result_ring.h), the workers' side and the main process's books.

cdef extern from "result_ring.h" namespace "shmvec":
    cdef struct RowRef:
        uint32_t slot
        uint32_t row

    cdef cppclass ResultRing:
        ResultRing(void* words, uint32_t num_slots, uint32_t batch_size) nogil
        RowRef claim() nogil
        void publish(uint32_t slot) nogil

    cdef cppclass DoorbellWords:
        pass

    cdef cppclass Doorbell:
        Doorbell(DoorbellWords* words) nogil
        void ring() nogil
        WaitStatus wait(uint32_t last, int64_t timeout_ns, uint32_t* out) nogil
        void set_spin(int64_t cap_ns, bint adaptive) nogil


cdef class EnvBook:
    """[main] Async mode's per-env books (``AsyncEngine``) in C loops: which envs
    await a command, their commands in the segment, and their workers'
    doorbells. ``idle_ids`` answers None where anything is off: the engine's
    own checks then say what.

    Args: ``awaiting`` (bool per env, viewed as uint8), ``commands`` (the
    segment's env commands), ``last_command`` (uint8 per env), ``env_worker``
    (int64 per env) and the doorbells' addresses, by worker.
    """

    cdef uint8_t[::1] awaiting, commands, last_command, seen, ringing
    cdef const int64_t[::1] env_worker
    cdef Doorbell** bells
    cdef Py_ssize_t num_workers

    def __cinit__(self, uint8_t[::1] awaiting, uint8_t[::1] commands,
                  uint8_t[::1] last_command, const int64_t[::1] env_worker, list bell_addresses):
        self.awaiting, self.commands, self.last_command = awaiting, commands, last_command
        self.env_worker = env_worker
        self.seen = _zeros(awaiting.shape[0], dtype="uint8")
        self.num_workers = len(bell_addresses)
        self.ringing = _zeros(self.num_workers, dtype="uint8")
        self.bells = <Doorbell**>PyMem_Malloc(self.num_workers * sizeof(Doorbell*))
        if self.bells == NULL:
            raise MemoryError()
        cdef Py_ssize_t w
        for w in range(self.num_workers):
            self.bells[w] = new Doorbell(<DoorbellWords*><uintptr_t>bell_addresses[w])

    def __dealloc__(self):
        cdef Py_ssize_t w
        if self.bells != NULL:
            for w in range(self.num_workers):
                del self.bells[w]
            PyMem_Free(self.bells)

    def idle_ids(self, object env_ids):
        """``env_ids`` itself if it is a 1-D contiguous int64 array of distinct
        envs that all await a command, else None."""
        cdef const int64_t[::1] ids
        if type(env_ids) is not _ndarray:
            return None
        try:
            ids = env_ids
        except (ValueError, TypeError, BufferError):
            return None
        cdef Py_ssize_t i, marked = 0, n = self.awaiting.shape[0]
        cdef int64_t e
        cdef bint ok = True
        for i in range(ids.shape[0]):
            e = ids[i]
            if e < 0 or e >= n or self.seen[e] or not self.awaiting[e]:
                ok = False
                break
            self.seen[e] = 1
            marked += 1
        for i in range(marked):
            self.seen[ids[i]] = 0
        return env_ids if ok else None

    def start(self, const int64_t[::1] ids, uint8_t command):
        """Gives each env of ``ids`` (checked) ``command``, then rings each of
        their workers' doorbells once (the command before the ring: protocol.py)."""
        cdef Py_ssize_t i, w
        cdef int64_t e
        for i in range(ids.shape[0]):
            e = ids[i]
            self.commands[e] = command
            self.last_command[e] = command
            self.awaiting[e] = 0
            self.ringing[self.env_worker[e]] = 1
        for w in range(self.num_workers):
            if self.ringing[w]:
                self.ringing[w] = 0
                self.bells[w].ring()

    def received(self, const int32_t[::1] row_env_ids):
        """A batch's env ids (a ring slot's), as int64; each env awaits a command
        again."""
        cdef Py_ssize_t i, n = row_env_ids.shape[0]
        out = _empty(n, dtype="int64")
        cdef int64_t[::1] ids = out
        for i in range(n):
            ids[i] = row_env_ids[i]
            self.awaiting[ids[i]] = 1
        return out


cdef class WorkerDoorbell:
    """A worker's side of its Doorbell at ``address`` (csrc/result_ring.h)."""

    cdef Doorbell* bell

    def __cinit__(self, uintptr_t address):
        self.bell = new Doorbell(<DoorbellWords*>address)

    def __dealloc__(self):
        del self.bell

    def set_spin(self, int64_t cap_ns, bint adaptive):
        """How ``wait`` spins before it sleeps (csrc/wait_policy.h)."""
        self.bell.set_spin(cap_ns, adaptive)

    def wait(self, uint32_t last, int64_t timeout_ns):
        """The new ring count, or None on timeout."""
        cdef uint32_t seen = 0
        cdef WaitStatus status
        with nogil:
            status = self.bell.wait(last, timeout_ns, &seen)
        if status == WaitStatus.kReady:
            return seen
        if status == WaitStatus.kTimedOut:
            return None
        raise OSError(errno, "futex wait failed in a shmvec worker")


cdef class WorkerRing:
    """A worker's side of the ResultRing at ``address`` (csrc/result_ring.h)."""

    cdef ResultRing* ring

    def __cinit__(self, uintptr_t address, uint32_t num_slots, uint32_t batch_size):
        self.ring = new ResultRing(<void*>address, num_slots, batch_size)

    def __dealloc__(self):
        del self.ring

    def claim(self):
        """(slot, row) of the next free row (a replacement worker's recovery)."""
        cdef RowRef ref
        with nogil:
            ref = self.ring.claim()
        return ref.slot, ref.row

    def publish(self, uint32_t slot):
        with nogil:
            self.ring.publish(slot)
