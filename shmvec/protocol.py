"""The wire protocol: everything that crosses the main/worker process boundary.

Three channels, defined here and nowhere else:

1. **The step barrier** (csrc/barrier.h). Main posts ``(kind, arg)`` with one
   of the command kinds below; every worker runs it for its block and arrives.
   ``STEP``'s arg is the ring slot, with ``BY_VALUE_BIT`` set when this round's
   actions come pickled on the pipe (tag ``"actions"``) instead of in the
   action slab, and the round's observation region above ``REGION_SHIFT``
   (0: the slot's own observation columns; ``r + 1``: lease region ``r``, see
   shmvec/layout.py). ``RESET``'s arg is the slot and region; ``CALL``,
   ``SET_ATTR`` and ``CLOSE`` take none.

2. **Shared words written from numpy** (offsets in shmvec/layout.py):

   - *Env commands* (async mode): one uint8 per env, ``ENV_IDLE``,
     ``ENV_STEP`` or ``ENV_RESET``. Main writes a command, then rings the
     owner's doorbell (csrc/result_ring.h); the worker clears it to
     ``ENV_IDLE`` *before* it publishes the env's row, since main may send
     again as soon as it sees the row.
   - *Per-worker lines*: one cache line per worker, written only by that
     worker and read by main, so no line bounces between writers. uint32
     words: ``LINE_MESSAGE`` (1: a pickled message follows this round; main
     clears it when it reads the message), ``LINE_CURRENT_ENV`` (1 + the env
     being stepped, 0 between envs: timeouts name it), ``LINE_FINISHED``
     (the last barrier generation finished: a restart round ends without the
     barrier's count), ``LINE_ENV_THREADS`` (how many of its envs it steps at
     once, shmvec/concurrent_envs.py). uint64 words: ``LINE_BUSY_NS`` (time serving
     commands, for ``stats()``), ``LINE_ENV_STARTED_NS`` (CLOCK_MONOTONIC when
     the current env began, async mode's ``env_timeout``). The worker writes
     all of them *before* it arrives at the barrier, whose release ordering
     publishes them.
   - *Ring slot rows* (shmvec/layout.py ``SlotViews``): results, numeric info
     columns (shmvec/infos.py), ``env_ids`` (async mode; ``UNWRITTEN`` until a
     worker writes the row) and a per-row message flag.

3. **The pipe** (one per worker, pickled dicts). Main to worker:
   ``(tag, payload)`` with tag ``"reset"``, ``"actions"``, ``"call"`` or
   ``"set_attr"``, sent *before* the command that reads it. Worker to main:
   a message of a round (sent only after the worker arrived, so a large one
   never blocks a round main waits for) or of an async row (with key
   ``"row"``: ``(slot, row)``). Keys: ``"infos"`` ``[(row, [info, ...])]``,
   ``"errors"`` ``[(row, exception, traceback)]``, ``"obs"`` (pickled
   observations by row), ``"info_columns"`` (``(key, column)`` pairs new this
   round), ``"results"`` (``call``), ``"ready"`` / ``"startup_error"`` /
   ``"recovered"`` (start-up).
"""

from __future__ import annotations

from gymnasium.vector.vector_env import AutoresetMode

# Command kinds posted on the step barrier.
STEP = 1
RESET = 2
CALL = 3
SET_ATTR = 4
CLOSE = 5

#: Bit of ``STEP``'s arg: this round's actions come pickled, one per env.
BY_VALUE_BIT = 1 << 31
#: ``STEP``'s and ``RESET``'s arg: the ring slot in the low bits, then the
#: observation region (0: the slot's own columns; ``r + 1``: lease region ``r``).
REGION_SHIFT = 16
SLOT_MASK = (1 << REGION_SHIFT) - 1
REGION_MASK = (BY_VALUE_BIT - 1) >> REGION_SHIFT

# Env commands of the async engine, one uint8 per env.
ENV_IDLE = 0
ENV_STEP = 1
ENV_RESET = 2

# Autoreset modes as the worker loop knows them (cdef enum in _worker_loop.pyx,
# which checks these values on import).
AUTORESET_NEXT_STEP = 0
AUTORESET_SAME_STEP = 1
AUTORESET_DISABLED = 2
AUTORESET_CODES = {
    AutoresetMode.NEXT_STEP: AUTORESET_NEXT_STEP,
    AutoresetMode.SAME_STEP: AUTORESET_SAME_STEP,
    AutoresetMode.DISABLED: AUTORESET_DISABLED,
}

# Word indices in a worker's cache line (uint32 and uint64 views of it).
LINE_MESSAGE = 0  # uint32, bytes 0..3
LINE_CURRENT_ENV = 1  # uint32, bytes 4..7
LINE_BUSY_NS = 1  # uint64, bytes 8..15
LINE_FINISHED = 4  # uint32, bytes 16..19
LINE_ENV_STARTED_NS = 3  # uint64, bytes 24..31
LINE_ENV_THREADS = 8  # uint32, bytes 32..35

#: ``env_ids`` of a ring row that no worker has written since main released it.
UNWRITTEN = -1

#: Main checks that its workers live this often while it waits: a dead worker
#: is reported within about this long.
LIVENESS_CHECK_S = 0.1
LIVENESS_CHECK_NS = int(LIVENESS_CHECK_S * 1e9)
#: How long a worker sleeps before it checks that the main process lives.
WATCHDOG_NS = 250_000_000
#: How long close() gives workers to close their envs, and SIGTERM to act.
CLOSE_GRACE_S = 5.0
