"""How long a waiter spins before it sleeps on its futex.

Each waiter learns its spin from the gaps it sees (csrc/wait_policy.h: grow
after a sleep that a longer spin would have avoided, drift down after waits
caught by the spin, drop to 0 when idle); this module only chooses each
waiter's ``Spin`` (its cap, and whether it adapts) from the core count and the
waiter's role. ``Spin.core_ns`` is the one place that turns a ``Spin`` into
the core's integer argument.

Measurements behind the caps (futex sleep/wake round trip ~55 us on an idle
2-core VM, several times that when the woken vCPU had halted; a spin round
trip ~0.5 us; the spin loop calls sched_yield() every ~3 us, so a runnable
peer on the same core gets it back quickly):

- When every process has a core of its own (or one process is over on 8+
  cores, where the wake-ups cost more than the share a spinner takes), main
  and workers spin adaptively up to ``SPIN_CAP_NS``: on a 16-core VM (16
  workers), spinning 200 us instead of 0 (main) and 50 (workers) lifted
  cpu100us x64 from 72k to 109k steps/s. From ``MANY_CORES`` cores on the cap
  is ``MANY_CORES_SPIN_CAP_NS``: on a 16-vCPU VM with pinned workers, a
  fixed 500 us spin against the 200 us adaptive cap gave 1.07-1.09x (cpu100us
  x16, x64; CartPole x64, x256, sync) and 1.14x (cpu100us x64, async),
  medians of 3 alternated runs; then the 500 us adaptive cap against the
  200 us one: cpu100us x64 1.03x sync, 1.11x async, x16 and CartPole x256
  within noise (docs/design/waiting.md).
- When processes share cores (2 workers and main on 2 cores), a spinning main
  steals time from the very worker it waits for: with CartPole-v1 x32, a
  50 us main spin cut throughput from ~150k to ~85-105k steps/s. There main
  does not spin. Workers that each have a core (main is the one over) still
  spin adaptively: in an async loop with a 200 us policy per batch (8 x
  100 us envs, batches of 4, 2 cores) a worker that finished its envs
  otherwise sleeps before the next ``send`` and needs a wake-up (cap 200 us
  against a fixed 50 us: +1.4%, medians of 6 alternated runs; CartPole x32
  the same within noise). More workers than cores keep the fixed
  ``SHARED_SPIN_NS``: a spinning worker would share its core with a working
  one (the yields give it back, at a cost).
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: The adaptive spin's cap when each spinner has a core (halt-polling's default too).
SPIN_CAP_NS = 200_000
#: Workers' fixed spin when processes share cores: ~1 futex round trip on 2 cores.
SHARED_SPIN_NS = 50_000
#: From this many cores on, one process more than cores still lets main spin.
MANY_CORES = 8
#: The adaptive spin's cap there: a round's stragglers and main's turn take longer.
MANY_CORES_SPIN_CAP_NS = 500_000


class Spin(NamedTuple):
    """How one waiter spins before it sleeps on its futex."""

    #: The longest spin, in ns (0: sleep at once).
    cap_ns: int
    #: True: the spin adapts to the gaps seen, from 0 up to ``cap_ns``;
    #: False: every wait spins ``cap_ns``.
    adaptive: bool

    def core_ns(self) -> int:
        """The ``spin_ns`` argument of the core's waits (csrc/wait_policy.h): a
        fixed spin as itself, an adaptive one as ``-cap_ns``."""
        if self.cap_ns < 0:
            raise ValueError(f"a spin's cap must be >= 0 ns, got {self.cap_ns}")
        return -self.cap_ns if self.adaptive else self.cap_ns


#: No spin: the waiter sleeps on its futex at once.
NO_SPIN = Spin(0, adaptive=False)


class SpinPolicy(NamedTuple):
    """Each waiter's spin."""

    main: Spin  # the main process waiting for the workers
    worker: Spin  # a worker waiting for the next command


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_spin(num_processes: int, cpus: int | None = None) -> SpinPolicy:
    """The adaptive policy above for ``num_processes`` worker processes on ``cpus`` cores."""
    cpus = available_cpus() if cpus is None else cpus
    over = num_processes + 1 - cpus
    if over <= 0 or (over == 1 and cpus >= MANY_CORES):
        cap = Spin(MANY_CORES_SPIN_CAP_NS if cpus >= MANY_CORES else SPIN_CAP_NS, adaptive=True)
        return SpinPolicy(main=cap, worker=cap)
    if num_processes <= cpus:  # a core per worker; main shares one
        return SpinPolicy(main=NO_SPIN, worker=Spin(SPIN_CAP_NS, adaptive=True))
    return SpinPolicy(main=NO_SPIN, worker=Spin(SHARED_SPIN_NS, adaptive=False))


def default_pinning(num_processes: int, async_mode: bool, cpus: int | None = None) -> bool:
    """Whether worker processes are each kept on one CPU by default: in sync
    mode, when there are as many as the cores or more, on ``MANY_CORES`` or more.

    Measured on a 16-vCPU VM (16 workers and main; docs/design/waiting.md):
    unpinned, the scheduler often queues a woken worker behind another on one
    CPU while main's CPU idles, so a sync round's last worker starts a whole
    block of env steps late (cpu100us: 1.65 ms of a 3.4 ms round at 256 envs,
    0.5 ms of 1.0 ms at 64); pinned, or with 15 workers (a core to spare), it
    starts within ~60 us. In async mode pinning cost 5-40% (CartPole, cpu100us):
    there a worker that wakes main yields its core to it and runs on elsewhere.
    """
    cpus = available_cpus() if cpus is None else cpus
    return not async_mode and cpus >= MANY_CORES and num_processes >= cpus


def fixed_spin(spin_ns: int) -> SpinPolicy:
    """``spin_ns=`` given by the user: every waiter spins exactly that long."""
    if spin_ns < 0:
        raise ValueError(f"spin_ns must be >= 0 (nanoseconds), got {spin_ns}")
    spin = Spin(int(spin_ns), adaptive=False)
    return SpinPolicy(main=spin, worker=spin)
