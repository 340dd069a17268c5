"""The policy stand-in: the main process waits ``policy_us`` per batch it receives.

In a PPO-style loop the main process hands each batch of observations to the
policy and waits for its actions: on a GPU, tens to hundreds of microseconds
during which it uses (almost) no CPU. ``PolicyWait`` reproduces that wait so
that a run shows whether a backend keeps the envs stepping meanwhile.

Example:
    >>> wait = PolicyWait(200)
    >>> wait()
    >>> wait.calls, wait.waited_s >= 200e-6
    (1, True)
"""

from __future__ import annotations

import time

#: How much of the wait is left to the final spin, seconds. ``time.sleep`` on
#: this project's VMs overshoots by ~75 us (median over 200 sleeps of 50-500 us;
#: p90 ~80 us: the kernel's 50 us default timer slack plus the wake-up), so we
#: sleep for all but 100 us and spin the rest.
SPIN_MARGIN_S = 100e-6


class PolicyWait:
    """Callable: waits ``policy_us`` microseconds, counting calls and time waited.

    It sleeps for most of the wait and spins only the last ``SPIN_MARGIN_S``.
    A thread blocked on a GPU (``cudaStreamSynchronize`` with blocking sync, a
    ``torch.cuda.Event.synchronize``) sleeps in the driver and frees its core;
    a pure spin would instead hold a core that the env workers need (on 2 cores,
    half of them), and the figure would measure CPU contention rather than how
    well a backend overlaps the envs with the policy. The short spin keeps the
    wait accurate to a few microseconds, which a sleep alone is not (see above).
    """

    def __init__(self, policy_us: float) -> None:
        if policy_us < 0:
            raise ValueError(f"policy_us must be >= 0, got {policy_us}")
        self.policy_s = policy_us / 1e6
        self.calls = 0
        self.waited_s = 0.0
        #: CPU time the waits used (their final spins), for the main process's account.
        self.cpu_s = 0.0

    def __call__(self) -> None:
        cpu_start = time.thread_time()
        start = time.perf_counter()
        end = start + self.policy_s
        if self.policy_s > SPIN_MARGIN_S:
            time.sleep(self.policy_s - SPIN_MARGIN_S)
        now = time.perf_counter()
        while now < end:
            now = time.perf_counter()
        self.calls += 1
        self.waited_s += now - start
        self.cpu_s += time.thread_time() - cpu_start

    def reset(self) -> None:
        """Forgets the calls so far (after a warm-up)."""
        self.calls = 0
        self.waited_s = 0.0
        self.cpu_s = 0.0
