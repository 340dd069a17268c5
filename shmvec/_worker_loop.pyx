# cython: language_level=3, boundscheck=False, wraparound=False
"""The worker's hot path: wait for a command, step a block of envs, arrive.
Included: _ring.pxi (async mode's ring and doorbells), _main_side.pxi (the
main process's loops over the same columns, such as ``count_ended``).

Compiled with Cython and linked against the C++ core (csrc/barrier.h), so
the barrier calls go straight to C++ with the GIL released, and rewards and
done flags are written through typed pointers. Gymnasium semantics (autoreset
modes, what goes into infos) are the same as in ``SyncVectorEnv.step``.
"""

cimport cython
from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from cpython.buffer cimport (
    PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer,
)
from libc.string cimport memcpy, memset
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from posix.time cimport CLOCK_MONOTONIC, ITIMER_REAL, clock_gettime, itimerval, setitimer, timespec

from traceback import format_exc as _format_exc

from numpy import empty as _empty, ndarray as _ndarray, shape as _shape, zeros as _zeros

from shmvec import protocol
from shmvec.errors import StepDeadlineExceeded
from shmvec.infos import CELL_KINDS as _CELL_KINDS, CODES as _CODES, INFO_COLUMNS
from shmvec.protocol import (
    BY_VALUE_BIT, ENV_IDLE, ENV_RESET, REGION_MASK, REGION_SHIFT, SLOT_MASK, STEP,
)

cdef extern from "barrier.h" namespace "shmvec":
    cdef cppclass BarrierWords:
        pass

    enum class WaitStatus:
        kReady
        kTimedOut
        kError

    cdef struct Command:
        uint32_t generation
        uint32_t kind
        uint32_t arg

    cdef cppclass StepBarrier:
        StepBarrier(BarrierWords* words, uint32_t num_workers) nogil
        WaitStatus wait_command(uint32_t last_generation, int64_t timeout_ns,
                                Command* out) nogil
        void set_spin(int64_t cap_ns, bint adaptive) nogil
        void arrive(bint message) nogil
        uint32_t generation() nogil

# Autoreset modes (shmvec.protocol.AUTORESET_CODES), as C constants for the hot loop.
cdef enum:
    NEXT_STEP = 0
    SAME_STEP = 1
    DISABLED = 2

if (NEXT_STEP, SAME_STEP, DISABLED) != (
    protocol.AUTORESET_NEXT_STEP, protocol.AUTORESET_SAME_STEP, protocol.AUTORESET_DISABLED
):
    raise ImportError("shmvec._worker_loop was built for other autoreset codes: rebuild it")


cdef class WorkerBarrier:
    """A worker's side of the StepBarrier whose words start at ``address``.

    The caller keeps the segment mapped for as long as this object lives.
    """

    cdef StepBarrier* barrier

    def __cinit__(self, uintptr_t address, uint32_t num_workers):
        self.barrier = new StepBarrier(<BarrierWords*>address, num_workers)

    def __dealloc__(self):
        del self.barrier

    def set_spin(self, int64_t cap_ns, bint adaptive):
        """How ``wait_command`` spins before it sleeps (csrc/wait_policy.h)."""
        self.barrier.set_spin(cap_ns, adaptive)

    def wait_command(self, uint32_t last_generation, int64_t timeout_ns):
        """(generation, kind, arg) of the next command, or None on timeout."""
        cdef Command command
        cdef WaitStatus status
        with nogil:
            status = self.barrier.wait_command(last_generation, timeout_ns, &command)
        if status == WaitStatus.kReady:
            return (command.generation, command.kind, command.arg)
        if status == WaitStatus.kTimedOut:
            return None
        raise OSError(errno, "futex wait failed in a shmvec worker")

    def arrive(self, bint message=False):
        """Ends this worker's round; ``message``: a pickled message follows."""
        with nogil:
            self.barrier.arrive(message)

    def generation_now(self):
        """The current generation, without waiting."""
        return self.barrier.generation()


cdef class InfoColumns:
    """A worker's writer of numeric scalar infos into a slot (see shmvec/infos.py).

    ``schema`` maps each key this worker has seen to its column; it is shared
    by every slot of the worker.
    """

    cdef dict schema
    cdef uint8_t[:, ::1] codes
    cdef double[:, ::1] cells_f
    cdef int64_t[:, ::1] cells_i
    cdef uint64_t[:, ::1] cells_u

    def __cinit__(self, dict schema, object codes, object cells):
        self.schema = schema
        self.codes = codes
        self.cells_f = cells.view("float64")
        self.cells_i = cells.view("int64")
        self.cells_u = cells

    cdef inline void clear(self, Py_ssize_t row):
        """Marks every column of ``row`` empty, known to this worker or not: in
        async mode a ring row was last written by any worker, with its own
        columns, which the main process would read as this row's once this
        worker announces a column of the same number."""
        memset(&self.codes[row, 0], 0, INFO_COLUMNS)

    cdef bint write(self, dict info, Py_ssize_t row, list announced) except -1:
        """Stores ``info`` in the columns of ``row``; False if it must be pickled."""
        cdef int code
        cdef Py_ssize_t col
        cdef Py_ssize_t new_keys = 0
        for key, value in info.items():
            code = _CODES.get(type(value), 0)
            if code == 0:
                return False
            if code == 1 and not (-0x8000000000000000 <= value <= 0x7FFFFFFFFFFFFFFF):
                return False
            if key not in self.schema:
                new_keys += 1
        if len(self.schema) + new_keys > INFO_COLUMNS:
            return False
        for key, value in info.items():
            known = self.schema.get(key)
            if known is None:
                col = len(self.schema)
                self.schema[key] = col
                announced.append((key, col))
            else:
                col = known
            code = _CODES[type(value)]
            self.codes[row, col] = code
            kind = _CELL_KINDS[code]
            if kind == "f":
                self.cells_f[row, col] = value
            elif kind == "u":
                self.cells_u[row, col] = value
            else:
                self.cells_i[row, col] = value
        return True


cdef class SlotColumns:
    """One ring slot's columns, as typed views taken once: taking a numpy
    array's buffer costs ~0.1 us, at every call that takes it as a typed
    argument (five a round were a sixth of a no-op env's round trip)."""

    cdef readonly object obs  # the observation codec's columns
    cdef double[::1] rewards
    cdef uint8_t[::1] terminations
    cdef uint8_t[::1] truncations
    cdef int32_t[::1] env_ids
    cdef uint8_t[::1] messages
    # Async mode with lease regions: this slot's word of the segment's
    # slot-regions table, and the regions' observation columns.
    cdef Py_ssize_t index
    cdef uint32_t[::1] regions_table
    cdef list regions

    def __cinit__(self, object views, Py_ssize_t index=0, uint32_t[::1] regions_table=None,
                  list regions=None):
        self.obs = views.obs
        self.rewards = views.rewards
        self.terminations = views.terminations
        self.truncations = views.truncations
        self.env_ids = views.env_ids
        self.messages = views.messages
        self.index, self.regions_table, self.regions = index, regions_table, regions

    cpdef object obs_columns(self):
        """[worker, async mode] Where a row claimed in this slot writes its
        observation: the lease region main bound to the slot, or its own columns."""
        cdef uint32_t region
        if self.regions:
            region = self.regions_table[self.index]
            if region:
                return self.regions[region - 1]
        return self.obs


@cython.final
cdef class Stepper:
    """Steps one env under an autoreset mode and writes its results into a row.

    Shared by the sync block loop (``Block.step_block``) and the async one
    (``Block.step_pending``). Action rows are env ids; result rows are env ids in
    sync mode and claimed ring rows in async mode.
    """

    cdef object action_codec, obs_codec, action_column, obs_column, obs_shape, obs_dtype
    cdef Py_ssize_t obs_nbytes
    cdef bint direct_action, copy_action, direct_obs, spilling_actions
    cdef public bint actions_by_value  # this round's actions: a list of per-env values
    # env id -> the spilled values of its action (text longer than its inline
    # bytes), which main sent on the pipe: the worker's, under its pipe's lock.
    cdef public object take_spill
    cdef int mode

    def __cinit__(self, object action_codec, object obs_codec, int mode):
        self.action_codec = action_codec
        self.obs_codec = obs_codec
        self.mode = mode
        # The common case, one array column each way, skips the codec calls.
        self.direct_action = type(action_codec).__name__ == "ArrayCodec"
        self.copy_action = self.direct_action and len(action_codec.spec.shape) > 0
        self.direct_obs = type(obs_codec).__name__ == "ArrayCodec"
        self.spilling_actions = action_codec.can_spill
        self.take_spill = None
        self.obs_shape = obs_codec.spec.shape if self.direct_obs else None
        if self.direct_obs:
            self.obs_dtype = obs_codec.spec.dtype
            self.obs_nbytes = obs_codec.spec.dtype.itemsize
            for n in self.obs_shape:
                self.obs_nbytes *= n

    cdef object read_action(self, list action_views, Py_ssize_t env_id):
        cdef object action
        if self.actions_by_value:
            return action_views[env_id]
        if self.direct_action:
            action = action_views[0][env_id]
            return action.copy() if self.copy_action else action
        if self.spilling_actions and self.action_codec.spilled(action_views, env_id):
            return self.action_codec.read(action_views, env_id, self.take_spill(env_id))
        return self.action_codec.read(action_views, env_id)

    cpdef skip_action(self, list action_views, Py_ssize_t env_id):
        """Env ``env_id`` does not take its action this time (an autoreset, a
        restart): takes its spilled values off the pipe all the same, so that
        they never stand in for a later action's."""
        if (self.spilling_actions and not self.actions_by_value
                and self.action_codec.spilled(action_views, env_id)):
            self.take_spill(env_id)

    cdef tuple step_one(self, object env, list action_views, Py_ssize_t env_id,
                        bint reset_first):
        """Reads env ``env_id``'s action and ``advance``s it."""
        if self.mode == NEXT_STEP and reset_first:
            self.skip_action(action_views, env_id)
            action = None
        else:
            action = self.read_action(action_views, env_id)
        return self.advance(env, action, reset_first)

    cdef tuple advance(self, object env, object action, bint reset_first):
        """(obs, reward, terminated, truncated, infos to merge or None)."""
        cdef object obs, reward, terminated, truncated, info, final_obs, final_info
        if self.mode == NEXT_STEP and reset_first:
            obs, info = env.reset()
            return obs, 0.0, False, False, ([info] if info else None)
        obs, reward, terminated, truncated, info = env.step(action)
        if self.mode == SAME_STEP and (terminated or truncated):
            final_obs, final_info = obs, info
            obs, info = env.reset()
            merged = [{"final_obs": final_obs, "final_info": final_info}]
            if info:
                merged.append(info)
            return obs, reward, terminated, truncated, merged
        return obs, reward, terminated, truncated, ([info] if info else None)

    cpdef write(self, object obs_views, SlotColumns slot, Py_ssize_t row, tuple result):
        """Stores ``result`` (from ``advance``) at ``row`` of ring slot ``slot``;
        ``obs_views``: where its observation goes (the slot's columns, a lease
        region's, or the dict of a pickled space). Returns the observation's
        spilled text values, for the row's message (None: nothing spilled)."""
        obs, reward, terminated, truncated = result[0], result[1], result[2], result[3]
        spill = None
        if self.direct_obs:
            if (obs.shape if type(obs) is _ndarray else _shape(obs)) != self.obs_shape:
                self.obs_codec.write(obs_views, row, obs)  # raises, naming the field
            if not (type(obs) is _ndarray and obs.dtype is self.obs_dtype
                    and _copy_row(obs_views[0], row, obs, self.obs_nbytes)):
                obs_views[0][row] = obs  # numpy casts, or copies a strided array
        else:
            spill = self.obs_codec.write(obs_views, row, obs)
        slot.rewards[row] = reward
        slot.terminations[row] = 1 if terminated else 0
        slot.truncations[row] = 1 if truncated else 0
        return spill


cdef object pickled_infos(tuple result, InfoColumns columns, Py_ssize_t row, list announced):
    """The infos of ``result`` that must be pickled (None when there are none, or
    when they went into ``columns`` at ``row``; new columns go to ``announced``)."""
    merged = result[4]
    if merged is None or (len(merged) == 1 and columns.write(merged[0], row, announced)):
        return None
    return merged


def reset_result(object env, object seed, object options, dict extra=None):
    """``env.reset(seed=, options=)`` as a result (``Stepper.advance``'s shape); ``extra``
    is merged into the info (and the info is kept even when empty)."""
    obs, info = env.reset(seed=seed, options=options)
    if extra is not None:
        return obs, 0.0, False, False, [{**info, **extra}]
    return obs, 0.0, False, False, ([info] if info else None)


cdef bint _copy_row(object column, Py_ssize_t row, object value, Py_ssize_t nbytes) except -1:
    """memcpy of ``value`` into row ``row`` of ``column`` (C-contiguous, ``nbytes``
    a row) when ``value`` is contiguous too; False if it is not. A numpy
    ``column[row] = value`` costs several times more for a small row."""
    cdef Py_buffer src, dst
    try:
        PyObject_GetBuffer(value, &src, PyBUF_SIMPLE)
    except (BufferError, ValueError):  # not C-contiguous (numpy raises ValueError)
        return False
    try:
        if src.len != nbytes:
            return False
        PyObject_GetBuffer(column, &dst, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if (row + 1) * nbytes > dst.len:
                return False
            memcpy(<char*>dst.buf + row * nbytes, src.buf, nbytes)
        finally:
            PyBuffer_Release(&dst)
    finally:
        PyBuffer_Release(&src)
    return True


cdef uint64_t _now_ns() noexcept nogil:
    """CLOCK_MONOTONIC in ns (``time.perf_counter_ns`` on Linux)."""
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <uint64_t>now.tv_sec * 1000000000 + <uint64_t>now.tv_nsec


# step_deadline in a worker that steps serially (shmvec.worker.Worker): a one-shot
# ITIMER_REAL is armed around each env call, and the SIGALRM handler raises
# StepDeadlineExceeded inside the env, but only while armed: a signal that fires
# just as the env returns finds the flag cleared and does nothing.
cdef itimerval _deadline_timer  # it_value: the deadline; zero: no deadline
cdef itimerval _no_timer  # all zero: disarms
cdef bint _deadline_armed = False
cdef double _deadline_s = 0.0


def set_step_deadline(double seconds):
    """The deadline the serial loops arm (0: none); the caller installs
    ``on_step_deadline`` as the SIGALRM handler of the thread that steps."""
    global _deadline_s
    cdef int64_t us = <int64_t>(seconds * 1e6)
    if seconds > 0 and us < 1:
        us = 1  # a zero it_value would disarm
    _deadline_s = seconds if seconds > 0 else 0.0
    _deadline_timer.it_value.tv_sec = us // 1000000
    _deadline_timer.it_value.tv_usec = us % 1000000


def on_step_deadline(signum, frame):
    """SIGALRM handler: raises ``StepDeadlineExceeded`` in the env being stepped."""
    global _deadline_armed
    if _deadline_armed:
        _deadline_armed = False
        raise StepDeadlineExceeded(_deadline_s)


cdef inline void _arm_deadline() noexcept:
    global _deadline_armed
    _deadline_armed = True
    setitimer(ITIMER_REAL, &_deadline_timer, NULL)


cdef inline void _disarm_deadline() noexcept:
    global _deadline_armed
    setitimer(ITIMER_REAL, &_no_timer, NULL)  # first: then no signal can follow
    _deadline_armed = False


def arm_step_deadline():
    """Arms the deadline around an env call made from Python (a sync reset)."""
    if _deadline_s > 0:
        _arm_deadline()


def disarm_step_deadline():
    if _deadline_s > 0:
        _disarm_deadline()


include "_ring.pxi"
include "_main_side.pxi"


@cython.final
cdef class Block:
    """One worker's envs and everything of the segment its loops write: the one
    object that crosses into these loops and into the threads of
    shmvec/concurrent_envs.py.

    Data flow: a sync round steps every env into its row ``first_row + i`` of
    a ring slot (``step_block``; ``serve_rounds`` runs plain step rounds with
    no Python frame a round) and ends in ``finish_round``; async mode runs
    each env that has a command into a ring row it claims (``step_pending``).
    Which thread may call: the worker's own; a ``part`` (one env alone, with
    its own words): the one thread that runs that env.

    Built with the envs and the barrier; the worker sets the rest (see
    shmvec/worker.py): the segment's views (``action_views``; per ring slot
    ``slots`` and ``info_columns``; the lease ``regions``), per env
    ``autoreset``, this worker's words (protocol.LINE_*: ``flag``,
    ``current_env``, ``finished``, ``busy_ns``, ``env_started``), in async mode
    ``ring``, the block's env ``commands`` and ``restarted`` (report
    ``restart(i, command)`` for the next command), and the callbacks:
    ``on_error(i, exc)`` (the result to report instead of raising), ``send``,
    ``build_message(infos, errors, obs_views, announced)`` (empty: nothing to
    send), ``take_reset_args(env_id)``; ``i`` counts from the worker's first
    env. ``row_lock``: held from a row's claim to its message's send when
    threads run parts (main reads a worker's row messages in claim order).
    """

    cdef readonly Stepper stepper
    cdef readonly list envs
    cdef readonly Py_ssize_t first_row  # the env id of envs[0]
    cdef readonly Py_ssize_t first_index  # envs[0]'s index in the worker's block
    cdef readonly WorkerBarrier barrier
    cdef public uint32_t generation  # the last barrier command's
    cdef public list action_views, slots, regions, info_columns
    cdef public uint8_t[::1] autoreset
    cdef public uint32_t[::1] flag, current_env, finished
    cdef public uint64_t[::1] busy_ns, env_started
    cdef public WorkerRing ring
    cdef public uint8_t[::1] commands, restarted
    cdef public object on_error, send, build_message, take_reset_args, restart, row_lock
    # step_deadline: ``deadline`` arms it around each env call (the serial loop
    # of a worker process; never a part: signals reach only the main thread), and
    # ``on_deadline(i)`` gives the result to report instead. A part that threads
    # run is ``abandoned`` by the worker once past the deadline: it then discards
    # its result. ``in_env``: a part's env is inside a command (cleared, under
    # ``row_lock``, when its row is published).
    cdef public bint deadline, abandoned, in_env
    cdef public object on_deadline

    def __cinit__(self, Stepper stepper, list envs, Py_ssize_t first_row, WorkerBarrier barrier):
        self.stepper, self.envs, self.first_row, self.barrier = stepper, envs, first_row, barrier
        self.env_started = self.commands = self.restarted = None  # async mode's

    def part(self, Py_ssize_t i, uint32_t[::1] current_env, uint64_t[::1] env_started=None):
        """Env ``i`` of the block alone, publishing in ``current_env`` and
        ``env_started`` (a thread's scratch words, or the worker's)."""
        cdef Block part = Block(self.stepper, self.envs[i:i + 1], self.first_row + i, self.barrier)
        part.first_index = self.first_index + i
        part.generation = self.generation
        part.action_views, part.slots = self.action_views, self.slots
        part.regions, part.info_columns = self.regions, self.info_columns
        part.autoreset = self.autoreset[i : i + 1]
        part.flag, part.finished, part.busy_ns = self.flag, self.finished, self.busy_ns
        part.current_env, part.env_started = current_env, env_started
        part.ring = self.ring
        if self.commands is not None:
            part.commands = self.commands[i : i + 1]
        if self.restarted is not None:
            part.restarted = self.restarted[i : i + 1]
        part.on_error, part.send, part.build_message = self.on_error, self.send, self.build_message
        part.on_deadline = self.on_deadline
        part.take_reset_args, part.restart = self.take_reset_args, self.restart
        part.row_lock = self.row_lock
        return part

    cdef tuple reported(self, Py_ssize_t i, object exc):
        """What env ``i`` reports after raising ``exc``: ``on_error``'s result,
        or ``exc`` raised again."""
        if self.on_error is None:
            raise exc
        return self.on_error(self.first_index + i, exc)

    cpdef tuple step_block(self, list action_views, object obs_views, Py_ssize_t slot):
        """Sync mode: steps every env and writes its results at its row of ring
        slot ``slot``.

        ``action_views`` are the action slab's columns, or, this round's actions
        by value, a list of per-env actions. ``obs_views`` are where the
        observations go: the slot's columns, a lease region's, or a dict that
        collects pickled observations.

        Returns ``(infos, errors, announced, spills)``: ``infos`` is a list of
        ``(row, [info, ...])`` for envs with something to pickle, in row order,
        each list merged in order with ``VectorEnv._add_info``; numeric scalar
        infos go to the slot's info columns instead, and ``announced`` lists the
        ``(key, column)`` pairs new this round. ``errors`` is a list of ``(row,
        exception, traceback_text)``. An env that raised keeps its previous
        results, unless ``on_error`` gives a result to report instead.
        ``spills`` lists ``(row, {path: text})`` for observations whose text
        spilled (shmvec/layout.py, ``Utf8TextCodec``).
        """
        cdef Py_ssize_t i, row
        cdef list infos = []
        cdef list errors = []
        cdef list announced = []
        cdef list spills = []
        cdef tuple result
        cdef SlotColumns columns = self.slots[slot]
        cdef InfoColumns info_columns = self.info_columns[slot]
        cdef Stepper stepper = self.stepper
        for i in range(len(self.envs)):
            row = self.first_row + i
            self.current_env[0] = row + 1
            info_columns.clear(row)
            try:
                try:
                    if self.deadline:
                        _arm_deadline()
                    try:
                        result = stepper.step_one(self.envs[i], action_views, row,
                                                  self.autoreset[i])
                    finally:
                        if self.deadline:
                            _disarm_deadline()
                    spill = stepper.write(obs_views, columns, row, result)
                except StepDeadlineExceeded:
                    result = self.on_deadline(self.first_index + i)
                    spill = stepper.write(obs_views, columns, row, result)
                except Exception as exc:  # noqa: BLE001 - a failed write resets too
                    result = self.reported(i, exc)
                    spill = stepper.write(obs_views, columns, row, result)
                if spill is not None:
                    spills.append((row, spill))
                self.autoreset[i] = 1 if (result[2] or result[3]) else 0
                merged = pickled_infos(result, info_columns, row, announced)
                if merged is not None:
                    infos.append((row, merged))
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                errors.append((row, exc, _format_exc()))
        self.current_env[0] = 0
        return infos, errors, announced, spills

    cpdef finish_round(self, object message, uint64_t started):
        """Ends this worker's part of the sync round begun at ``started``
        (CLOCK_MONOTONIC ns, ``time.perf_counter_ns``): publishes its words,
        arrives, and only then sends ``message`` (if any), so that a large
        message never blocks a worker the main process still waits for."""
        cdef bint has_message = bool(message)
        if has_message:
            self.flag[0] = 1
        self.current_env[0] = 0
        # Every write to this worker's line before arrive(): the main process
        # reads it right after, and a later write would pull the line back.
        self.busy_ns[0] += _now_ns() - started
        self.finished[0] = self.generation
        with nogil:
            self.barrier.barrier.arrive(has_message)
        if has_message:
            self.send(message)

    cdef inline void _enter(self, Py_ssize_t row):
        # env_started first: main reads current_env, then env_started (env_timeout).
        if self.env_started is not None:
            self.env_started[0] = _now_ns()
        self.current_env[0] = row + 1

    def enter_env(self, Py_ssize_t row):
        """This worker is in env ``row`` from now on (async mode: since now)."""
        self._enter(row)

    def serve_rounds(self, int64_t timeout_ns, Py_ssize_t max_rounds):
        """Sync mode: waits for commands after ``generation`` and runs them while
        they are plain STEP rounds (actions in the slab, observations in
        columns), at most ``max_rounds``, with no Python frame a round.
        Returns ``(rounds run, command)``: ``command`` is the first other
        command, as ``WorkerBarrier.wait_command`` returns it, or None (a wait
        timed out, or ``max_rounds`` ran)."""
        cdef Command command
        cdef WaitStatus status
        cdef Py_ssize_t rounds = 0
        cdef uint32_t index, region
        cdef uint64_t started
        cdef object obs
        cdef list infos, errors, announced, spills
        while rounds < max_rounds:
            with nogil:
                status = self.barrier.barrier.wait_command(self.generation, timeout_ns, &command)
            if status == WaitStatus.kTimedOut:
                break
            if status != WaitStatus.kReady:
                raise OSError(errno, "futex wait failed in a shmvec worker")
            if command.kind != STEP or command.arg & BY_VALUE_BIT:
                return rounds, (command.generation, command.kind, command.arg)
            started = _now_ns()
            self.generation = command.generation
            index = command.arg & SLOT_MASK
            region = (command.arg >> REGION_SHIFT) & REGION_MASK
            obs = self.regions[region - 1] if region else (<SlotColumns>self.slots[index]).obs
            self.stepper.actions_by_value = False
            infos, errors, announced, spills = self.step_block(self.action_views, obs, index)
            message = None
            if infos or errors or announced or spills:
                message = self.build_message(infos, errors, obs, announced, spills)
            self.finish_round(message, started)
            rounds += 1
        return rounds, None

    cpdef step_pending(self):
        """Async mode: runs every env of the block that has a command, in env order.

        For each: clears its command, resets or steps it, claims the next ring
        row, writes the results and its env id there, and publishes the row.
        Infos that are not columns, errors and pickled observations go to
        ``send`` *after* the publish, with the row; a row whose info opened new
        info columns carries ``info_columns``, so the main process learns them
        before it decodes that row. A failed reset is an error; a failed step
        is ``on_error``'s. After a restart, an env whose ``restarted`` flag is
        set reports ``restart(i, command)`` for its first command instead.

        ``current_env[0]`` is set before an env's command is cleared, and back
        to 0 only when the block is done, so that the main process can tell a
        worker with nothing left to do (its envs' commands clear,
        ``current_env`` 0). ``env_started[0]`` gets the time each env begins.
        """
        cdef Py_ssize_t i, env_id
        cdef uint8_t command
        cdef tuple result
        cdef Stepper stepper = self.stepper
        for i in range(len(self.envs)):
            command = self.commands[i]
            if command == ENV_IDLE:
                continue
            env_id = self.first_row + i
            self._enter(env_id)
            self.in_env = True
            self.commands[i] = ENV_IDLE  # before the publish: main may send again right after
            error = None
            result = None  # an error's row carries none
            try:
                if self.restarted is not None and self.restarted[i]:
                    self.restarted[i] = 0
                    if command != ENV_RESET:
                        stepper.skip_action(self.action_views, env_id)
                    result = self.restart(self.first_index + i, command)
                else:
                    result = self.command_result(i, env_id, command)
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                error = (env_id, exc, _format_exc())
            if self.row_lock is not None:  # released after the send
                self.row_lock.acquire()
            try:
                if self.abandoned:
                    return  # past the deadline: the worker reported this env already
                self.in_env = False
                if error is None:
                    self.autoreset[i] = 1 if (result[2] or result[3]) else 0
                self.publish_row(env_id, result, error)
            finally:
                if self.row_lock is not None:
                    self.row_lock.release()
        self.current_env[0] = 0

    cdef tuple command_result(self, Py_ssize_t i, Py_ssize_t env_id, uint8_t command):
        """Async mode: env ``i``'s reset or step, under the deadline if armed. A
        failed reset raises; a failed step is ``on_error``'s."""
        cdef bint resetting = command == ENV_RESET
        cdef tuple args = self.take_reset_args(env_id) if resetting else None
        if self.deadline:
            _arm_deadline()
        try:
            if resetting:
                result = reset_result(self.envs[i], *args)
            else:
                result = self.stepper.step_one(self.envs[i], self.action_views, env_id,
                                               self.autoreset[i])
        except StepDeadlineExceeded:
            if self.deadline:
                _disarm_deadline()
            return self.on_deadline(self.first_index + i)
        except Exception as exc:  # noqa: BLE001
            if self.deadline:
                _disarm_deadline()
            if resetting:
                raise
            return self.reported(i, exc)
        if self.deadline:
            _disarm_deadline()
        return result

    def report(self, tuple result, object error=None):
        """A part (env ``first_row`` alone): publishes ``result`` (or ``error``,
        ``(env_id, exception, traceback_text)``) as its env's row, as
        ``step_pending`` does after a command; threads use it for the result
        of an env replaced after its deadline."""
        if self.row_lock is not None:
            self.row_lock.acquire()
        try:
            self.in_env = False
            if error is None:
                self.autoreset[0] = 1 if (result[2] or result[3]) else 0
            self.publish_row(self.first_row, result, error)
        finally:
            if self.row_lock is not None:
                self.row_lock.release()

    cdef publish_row(self, Py_ssize_t env_id, tuple result, object error):
        """Claims a ring row, writes ``result`` (or nothing, for an ``error``)
        and the env id there, publishes it, then sends its message if any."""
        cdef RowRef ref
        cdef list announced = []
        cdef Stepper stepper = self.stepper
        with nogil:
            ref = self.ring.ring.claim()
        cdef SlotColumns slot = self.slots[ref.slot]
        cdef InfoColumns columns = self.info_columns[ref.slot]
        columns.clear(ref.row)
        message = None
        if error is None:
            obs_target = {} if stepper.obs_codec.pickled else slot.obs_columns()
            try:
                spill = stepper.write(obs_target, slot, ref.row, result)
                merged = pickled_infos(result, columns, ref.row, announced)
                if merged is not None:
                    message = {"infos": [(ref.row, merged)]}
                if spill is not None:
                    message = message or {}
                    message["spills"] = [(ref.row, spill)]
                if stepper.obs_codec.pickled:
                    message = message or {}
                    message["obs"] = obs_target
                if announced:
                    message = message or {}
                    message["info_columns"] = announced
            except Exception as exc:  # noqa: BLE001
                error = (env_id, exc, _format_exc())
        if error is not None:
            message = {"errors": [error]}
        slot.env_ids[ref.row] = env_id
        slot.messages[ref.row] = 0 if message is None else 1
        with nogil:
            self.ring.ring.publish(ref.slot)
        if message is not None:
            message["row"] = (ref.slot, ref.row)
            self.send(message)
