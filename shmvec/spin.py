"""How long a waiter spins before it sleeps on its futex.

Measured on the 2-core VMs this was built on: a futex sleep/wake round trip
costs ~55 us, a spin round trip ~0.5 us when each side has a core of its own.
A spin of about one futex round trip wins every wait shorter than that and
costs at most 2x on longer ones (the classic competitive bound), *if* the
spinner's core is idle. The spin loop calls sched_yield() every ~3 us
(csrc/barrier.h), so a runnable peer on the same core gets it back quickly.

- Workers wait for the main process's next command while the main process
  runs Python (the user's policy, the next ``step_async``): they spin, and
  the yield hands the core back to the main process when it needs it.
- The main process waits while the workers step their envs: it spins only
  when every worker has a core of its own besides the main's; otherwise a
  spinning main steals the time of the very worker it waits for. Measured
  with CartPole-v1, 32 envs, 2 workers on 2 cores: a 50 us main spin cut
  throughput from ~150k to ~85-105k steps/s.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: ~1 futex round trip on the machines above.
SPIN_NS = 50_000


class SpinPolicy(NamedTuple):
    main_ns: int  # the main process waiting for the workers
    worker_ns: int  # a worker waiting for the next command


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_spin(num_workers: int, cpus: int | None = None) -> SpinPolicy:
    """The policy above for ``num_workers`` workers on ``cpus`` cores."""
    cpus = available_cpus() if cpus is None else cpus
    return SpinPolicy(SPIN_NS if num_workers + 1 <= cpus else 0, SPIN_NS)
