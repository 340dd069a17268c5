# cython: language_level=3, boundscheck=False, wraparound=False
"""The worker's hot path: wait for a command, step a block of envs, arrive.

Compiled with Cython and linked against the C++ core (csrc/barrier.h), so
the barrier calls go straight to C++ with the GIL released, and rewards and
done flags are written through typed pointers. Gymnasium semantics (autoreset
modes, what goes into infos) are the same as in ``SyncVectorEnv.step``.
"""

from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memset

from numpy import ndarray as _ndarray

from shmvec.infos import CELL_KINDS as _CELL_KINDS
from shmvec.infos import CODES as _CODES
from shmvec.infos import INFO_COLUMNS

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
        WaitStatus wait_command(uint32_t last_generation, int64_t spin_ns,
                                int64_t timeout_ns, Command* out) nogil
        void arrive() nogil

# Autoreset modes, as ints (shmvec.worker maps gymnasium's enum onto them).
NEXT_STEP = 0
SAME_STEP = 1
DISABLED = 2


cdef class WorkerBarrier:
    """A worker's side of the StepBarrier whose words start at ``address``.

    The caller keeps the segment mapped for as long as this object lives.
    """

    cdef StepBarrier* barrier

    def __cinit__(self, uintptr_t address, uint32_t num_workers):
        self.barrier = new StepBarrier(<BarrierWords*>address, num_workers)

    def __dealloc__(self):
        del self.barrier

    def wait_command(self, uint32_t last_generation, int64_t spin_ns, int64_t timeout_ns):
        """(generation, kind, arg) of the next command, or None on timeout."""
        cdef Command command
        cdef WaitStatus status
        with nogil:
            status = self.barrier.wait_command(last_generation, spin_ns, timeout_ns, &command)
        if status == WaitStatus.kReady:
            return (command.generation, command.kind, command.arg)
        if status == WaitStatus.kTimedOut:
            return None
        raise OSError(errno, "futex wait failed in a shmvec worker")

    def arrive(self):
        with nogil:
            self.barrier.arrive()


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
        if self.schema:
            memset(&self.codes[row, 0], 0, INFO_COLUMNS)

    cdef bint write(self, dict info, Py_ssize_t row, list announced) except -1:
        """Stores ``info`` in the columns of ``row``; False if it must be pickled."""
        cdef int code
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
            col = self.schema.get(key)
            if col is None:
                col = len(self.schema)
                self.schema[key] = col
                announced.append((key, col))
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


def step_envs(
    list envs,
    Py_ssize_t first_row,
    object action_codec,
    list action_views,
    object obs_codec,
    list obs_views,
    double[::1] rewards,
    uint8_t[::1] terminations,
    uint8_t[::1] truncations,
    uint8_t[::1] autoreset,
    InfoColumns info_columns,
    int mode,
):
    """Steps ``envs`` (rows ``first_row ...``) and writes their results.

    ``action_views`` are the action slab's columns, or, for a pickled action
    space, the list of this block's actions. ``obs_views`` are the ring slot's
    observation columns, or a dict that collects pickled observations.
    ``autoreset`` holds, per env of the block, whether its previous step ended
    an episode (NEXT_STEP mode resets it now instead of stepping).

    Returns ``(infos, errors, announced)``: ``infos`` is a list of ``(row,
    [info, ...])`` for envs with something to pickle, in row order, each list
    merged in order with ``VectorEnv._add_info``; numeric scalar infos go to
    ``info_columns`` instead, and ``announced`` lists the ``(key, column)``
    pairs new this round. ``errors`` is a list of ``(row, exception,
    traceback_text)``. An env that raised keeps its previous results.
    """
    cdef Py_ssize_t i, row
    cdef Py_ssize_t n = len(envs)
    cdef bint ended
    cdef object env, action, obs, reward, terminated, truncated, info
    cdef object final_obs, final_info
    cdef list infos = []
    cdef list errors = []
    cdef list announced = []
    # The common case, one array column each way, skips the codec calls.
    cdef bint direct_action = not action_codec.pickled and len(action_views) == 1 \
        and type(action_codec).__name__ == "ArrayCodec"
    cdef bint direct_obs = not obs_codec.pickled and len(obs_views) == 1 \
        and type(obs_codec).__name__ == "ArrayCodec"
    cdef object action_column = action_views[0] if direct_action else None
    cdef object obs_column = obs_views[0] if direct_obs else None
    cdef object obs_shape = obs_codec.spec.shape if direct_obs else None
    cdef bint copy_action = direct_action and len(action_codec.spec.shape) > 0

    for i in range(n):
        row = first_row + i
        env = envs[i]
        info_columns.clear(row)
        try:
            if mode == NEXT_STEP and autoreset[i]:
                obs, info = env.reset()
                reward = 0.0
                terminated = False
                truncated = False
                merged = [info] if info else None
            else:
                if direct_action:
                    action = action_column[row]
                    if copy_action:
                        action = action.copy()
                else:
                    action = action_codec.read(action_views, row)
                obs, reward, terminated, truncated, info = env.step(action)
                ended = bool(terminated) or bool(truncated)
                if mode == SAME_STEP and ended:
                    final_obs, final_info = obs, info
                    obs, info = env.reset()
                    merged = [{"final_obs": final_obs, "final_info": final_info}]
                    if info:
                        merged.append(info)
                else:
                    merged = [info] if info else None
            if direct_obs:
                if type(obs) is _ndarray and obs.shape != obs_shape:
                    obs_codec.write(obs_views, row, obs)  # raises, naming the field
                obs_column[row] = obs
            else:
                obs_codec.write(obs_views, row, obs)
            rewards[row] = reward
            ended = bool(terminated) or bool(truncated)
            terminations[row] = 1 if terminated else 0
            truncations[row] = 1 if truncated else 0
            autoreset[i] = ended
            if merged is not None and not (
                len(merged) == 1 and info_columns.write(merged[0], row, announced)
            ):
                infos.append((row, merged))
        except Exception as exc:  # noqa: BLE001 - re-raised in the main process
            errors.append((row, exc, _format_exc()))
    return infos, errors, announced


def _format_exc():
    import traceback

    return traceback.format_exc()
