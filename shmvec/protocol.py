"""The wire protocol: everything that crosses the main/worker process boundary.

Three channels, whose constants are defined here and nowhere else: the step
barrier (``(kind, arg)`` commands, csrc/barrier.h), shared words written from
numpy (env commands, per-worker lines, ring slot rows; offsets in
shmvec/layout.py) and one pipe per worker (pickled dicts, sent by a worker only
after it arrived). docs/design/protocol.md describes each word, tag and message
key and the order of writes that publishes them.
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
