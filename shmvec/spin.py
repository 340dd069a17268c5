"""How long a waiter spins before it sleeps on its futex.

Measured on the 2-core VMs this was built on: a futex sleep/wake round trip
costs ~55 us, a spin round trip ~0.5 us when each side has a core of its own.
A waiter that spins on a core another process needs steals exactly the time
it is waiting for, so spinning is on only when the main process and every
worker can each have a core; then a spin of about one futex round trip wins
every wait shorter than that and costs at most 2x on longer ones (the
classic competitive bound).
"""

from __future__ import annotations

import os

#: ~1 futex round trip on the machines above.
SPIN_NS = 50_000


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_spin_ns(num_workers: int, cpus: int | None = None) -> int:
    """Spin time for both sides: SPIN_NS with a core per process, else 0."""
    cpus = available_cpus() if cpus is None else cpus
    return SPIN_NS if num_workers + 1 <= cpus else 0
