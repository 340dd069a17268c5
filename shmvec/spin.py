"""How long a waiter spins before it sleeps on its futex.

Each waiter learns its spin from the gaps it sees (csrc/wait_policy.h); this
module only chooses each waiter's ``Spin`` (its cap, and whether it adapts)
from the core count and the waiter's role, and sets it on the object it waits
on (``Spin.apply``).

The rule: when every process has a core of its own (or only main is over, on
``MANY_CORES``+ cores), main and workers spin adaptively up to ``SPIN_CAP_NS``
(``MANY_CORES_SPIN_CAP_NS`` from ``MANY_CORES`` on); when processes share cores,
main does not spin (it would steal the worker it waits for), workers that each
have a core spin adaptively, and more workers than cores spin a fixed
``SHARED_SPIN_NS``. Under a cgroup CPU quota below the affinity, processes share
cores however many there are: a spinning main spends quota time the workers
need, even where a core is idle. The cores are the ones the process may use
(``available_cpus``). The measurements behind each cap: docs/design/heuristics.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shmvec.cpus import cpu_budget

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

    def apply(self, waiter: Any) -> None:
        """Makes ``waiter``'s waits spin so: a barrier, ring or doorbell of the
        core (its ``set_spin``, csrc/wait_policy.h), in the process that waits."""
        if self.cap_ns < 0:
            raise ValueError(f"a spin's cap must be >= 0 ns, got {self.cap_ns}")
        waiter.set_spin(self.cap_ns, self.adaptive)


#: No spin: the waiter sleeps on its futex at once.
NO_SPIN = Spin(0, adaptive=False)


class SpinPolicy(NamedTuple):
    """Each waiter's spin."""

    main: Spin  # the main process waiting for the workers
    worker: Spin  # a worker waiting for the next command


def available_cpus() -> int:
    """How many CPUs this process may use: the fewest of its affinity's CPUs, its
    cgroup CPU quota (rounded down, at least 1) and its Ray actor's CPUs
    (``shmvec.cpus.cpu_budget``)."""
    return cpu_budget().cpus


def default_spin(
    num_processes: int, cpus: int | None = None, quota_limited: bool = False
) -> SpinPolicy:
    """The adaptive policy above for ``num_processes`` worker processes on ``cpus``
    cores; ``quota_limited``: the cores are a cgroup quota's time, which every
    process shares. ``cpus=None``: this process's (``shmvec.cpus.cpu_budget``)."""
    if cpus is None:
        budget = cpu_budget()
        cpus, quota_limited = budget.cpus, quota_limited or budget.quota_limited
    over = num_processes + 1 - cpus
    if not quota_limited and (over <= 0 or (over == 1 and cpus >= MANY_CORES)):
        cap = Spin(MANY_CORES_SPIN_CAP_NS if cpus >= MANY_CORES else SPIN_CAP_NS, adaptive=True)
        return SpinPolicy(main=cap, worker=cap)
    if num_processes <= cpus:  # a core per worker; main shares one
        return SpinPolicy(main=NO_SPIN, worker=Spin(SPIN_CAP_NS, adaptive=True))
    return SpinPolicy(main=NO_SPIN, worker=Spin(SHARED_SPIN_NS, adaptive=False))


def default_pinning(num_processes: int, async_mode: bool, cpus: int | None = None) -> bool:
    """Whether worker processes are each kept on one CPU by default: in sync
    mode, when there are as many as the cores or more, on ``MANY_CORES`` or more
    (unpinned, a woken worker queues behind another while main's CPU idles; in
    async mode pinning costs 5-40%: docs/design/heuristics.md).
    """
    cpus = available_cpus() if cpus is None else cpus
    return not async_mode and cpus >= MANY_CORES and num_processes >= cpus


def fixed_spin(spin_ns: int) -> SpinPolicy:
    """``spin_ns=`` given by the user: every waiter spins exactly that long."""
    if spin_ns < 0:
        raise ValueError(f"spin_ns must be >= 0 (nanoseconds), got {spin_ns}")
    spin = Spin(int(spin_ns), adaptive=False)
    return SpinPolicy(main=spin, worker=spin)
