"""WaitingCheck: one warning when workers that step their envs one after another
mostly wait.

An env whose step blocks (a tool call, a sandbox, a sleep) makes a serial worker
as slow as the sum of its envs' waits; ``env_concurrency=`` steps them at once,
in threads (shmvec/concurrent_envs.py). shmvec does not switch by itself (a guess
misjudged CPU-bound envs on a busy machine: docs/design/heuristics.md), but says
so once, with the measured shares, as a ``WaitingEnvsWarning``.

Data flow: ``Stats.count`` calls the check when the step count reaches the
count it asked for; the check reads each worker's busy time (its shared word)
and, from /proc, the time its main thread spent on a CPU or waiting for one,
over windows of stepping that double from ``WINDOW_S``. Between checks a step
costs one integer comparison. Who may call: the main process's one thread.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from shmvec.engine.pool import WorkerPool, _cpu_seconds
from shmvec.errors import WaitingEnvsWarning

#: The first window of stepping measured: long enough that /proc's CPU times
#: (clock ticks of 10 ms when schedstat is missing) are exact to a few percent.
WINDOW_S = 1.0
#: Windows double up to this length, so that a long run is checked now and then
#: at a cost that stays negligible (~20 us a worker a check).
MAX_WINDOW_S = 64.0
#: A worker busy less than this share of the window leaves the main process or
#: the policy as the bottleneck: threads would not speed it up.
BUSY_SHARE = 0.5
#: Workers on a CPU or runnable (in the run queue: a busy machine's preemption is
#: not waiting) for less than this share of their busy time mostly wait. Envs that
#: sleep 5 ms (2-vCPU VM, 2026-11-26): busy 99%, on a CPU 1% and runnable ~20%
#: (each wake-up waits for a core); a CPU-bound env is on a CPU or runnable for all
#: of its busy time, however loaded the machine.
ON_CPU_SHARE = 0.5
#: Never check again.
NEVER = 1 << 62


class WaitingCheck:
    """Warns once if serial workers mostly wait (see the module's docstring).

    Args:
        pool: the workers (one in the main process is not measured).
        block_size: the most envs a worker owns, suggested as ``env_concurrency``.
    """

    def __init__(self, pool: WorkerPool, block_size: int) -> None:
        self.pool = pool
        self.measured = [k for k, w in enumerate(pool.workers) if w is not pool.main_worker]
        self.block_size = block_size
        self.window_s = WINDOW_S
        # (time, steps, pids, busy, on-CPU) at the window's start
        self.started: tuple[float, int, list[int], np.ndarray, np.ndarray] | None = None
        self.warned = False

    def __call__(self, steps: int) -> int:
        """Called by ``Stats.count`` at ``steps``; returns the step count at which
        to be called again."""
        if not self.measured:
            return NEVER
        now = time.monotonic()
        if self.started is None:
            self.started = (now, steps, *self._sample())
            return steps + 1
        since, steps_then, pids_then, busy_then, on_cpu_then = self.started
        elapsed = now - since
        if elapsed < self.window_s:
            return steps + max(1, steps - steps_then)  # doubling: a few calls a window
        pids, busy, on_cpu = self._sample()
        if pids != pids_then:  # a worker restarted: its clocks started again
            self.started = (now, steps, pids, busy, on_cpu)
            return steps + 1
        workers = len(self.measured)
        busy_share = float(np.sum(busy - busy_then)) / elapsed / workers
        on_cpu_share = float(np.sum(on_cpu - on_cpu_then)) / elapsed / workers
        if busy_share > BUSY_SHARE and on_cpu_share < ON_CPU_SHARE * busy_share:
            warnings.warn(
                f"shmvec: the workers were busy stepping envs {busy_share:.0%} of the time "
                f"but on a CPU (or waiting for one) only {on_cpu_share:.0%}: the envs mostly "
                "wait, and each worker steps its envs one after another. "
                f"env_concurrency={self.block_size} would step the envs of each worker at "
                "once, in threads (see the guide 'Envs that wait').",
                WaitingEnvsWarning,
                stacklevel=4,
            )
            self.warned = True
            return NEVER
        self.window_s = min(2 * self.window_s, MAX_WINDOW_S)
        self.started = (now, steps, pids, busy, on_cpu)
        return steps + 1

    def _sample(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(pids, busy s, on-CPU-or-runnable s) of the measured workers, now."""
        pids = [self.pool.workers[k].pid for k in self.measured]
        busy = self.pool.busy_ns[self.measured].astype(np.float64) / 1e9
        return pids, busy, np.array([_on_cpu_seconds(pid) for pid in pids])


def _on_cpu_seconds(pid: int) -> float:
    """Seconds the main thread of ``pid`` ran or waited in a run queue
    (/proc/pid/schedstat); its process's CPU time where schedstat is missing; 0.0
    once it is gone."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as schedstat:
            on_cpu_ns, run_queue_ns = schedstat.read().split()[:2]
        return (int(on_cpu_ns) + int(run_queue_ns)) / 1e9
    except (OSError, ValueError):
        return _cpu_seconds(pid)
