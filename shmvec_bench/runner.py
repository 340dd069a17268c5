"""The runner: plans the cases, times each one and fills in the ratios.

Each measurement opens a backend, resets it, draws random valid actions
*before* the clock starts, lets an async backend's envs all come back (their
resets, then one step each), steps for a warm-up, then steps for ``seconds``
and reports ``steps/s = env steps per call * calls / seconds``.

Example:
    >>> m = measure("noop", "sync", num_envs=1, seconds=0.05, warmup_s=0.01)
    >>> m.steps_per_s > 0
    True
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shmvec_bench.backends import opened
from shmvec_bench.policy import PolicyWait
from shmvec_bench.registry import REGISTRY, Stepper, async_batch
from shmvec_bench.rss import tree_rss_mib
from shmvec_bench.workloads import CPU_BOUND, WAIT_S


@dataclass
class Measurement:
    """One timed run of one backend on one workload, plus ratios filled in afterwards."""

    workload: str
    backend: str
    num_envs: int
    #: Processes stepping the envs; 0 when they run in the measuring process.
    num_workers: int
    #: Batched ``step`` calls in the timed window.
    steps: int
    seconds: float
    #: Env steps per second: ``num_envs`` (an async backend: its batch) ``* steps / seconds``.
    steps_per_s: float
    #: Median wall time of one batched ``step`` call (the round trip), microseconds.
    median_step_us: float
    #: ``steps_per_s`` over ``sync``'s for the same workload, ``num_envs`` and policy.
    vs_sync: float | None = None
    #: ``steps_per_s`` over ``async``'s for the same workload, ``num_envs`` and policy.
    vs_async: float | None = None
    #: Parallel efficiency, ``steps_per_s / (cores * single-env steps_per_s)`` with
    #: the ``single`` row of the same run: for ``CPU_BOUND`` workloads only, and
    #: not on the ``single`` row itself (where it is ``1 / cores`` by construction).
    efficiency: float | None = None
    #: Why the run failed (exception type and message), or None.
    error: str | None = None
    #: Env steps per ``step`` call: ``num_envs``, or an async backend's batch.
    batch: int | None = None
    #: ``--policy-us``: the wait per batch received; 0 for no policy.
    policy_us: float = 0.0
    #: The wait per batch actually measured (a sleep overshoots), microseconds.
    policy_wait_us: float | None = None
    #: With a policy: ``steps_per_s / min(envs alone, policy alone)``, where envs
    #: alone is this backend's row without the policy and policy alone is the
    #: ``policy`` row of this batch (``batch / policy wait``).
    vs_bound: float | None = None
    #: shmvec: the share of the timed window the main process spent waiting for
    #: results, by ``ShmVectorEnv.stats()``.
    main_wait_frac: float | None = None
    #: CPU time of the measuring thread (the main process's loop) per ``step``
    #: call, less the policy stand-in's, microseconds: what the backend costs the
    #: main process per round (with ``sync``, ``single`` and ``shmvec-main`` it
    #: includes the envs the main process steps itself; spinning waits count).
    main_cpu_us_per_round: float | None = None
    #: ``main_cpu_us_per_round`` per env step returned.
    main_cpu_us_per_row: float | None = None
    #: Total VmRSS of this process and all its children at the end of the timed window, MiB.
    rss_mib: float | None = None
    #: Waiting workloads: ``steps_per_s / (num_envs / wait per step)``, their bound.
    vs_wait_bound: float | None = None


def run_steps(stepper: Stepper, seconds: float) -> tuple[int, float, list[int]]:
    """Steps until ``seconds`` have passed; returns (steps, elapsed s, per-step ns)."""
    step, actions = stepper.step, stepper.actions
    num_actions = len(actions)
    durations: list[int] = []
    clock = time.perf_counter_ns
    start = now = clock()
    deadline = start + int(seconds * 1e9)
    count = 0
    while now < deadline:
        step(actions[count % num_actions])
        after = clock()
        durations.append(after - now)
        now = after
        count += 1
    return count, (now - start) / 1e9, durations


class MeasurementTimeout(Exception):
    """A measurement ran past its deadline: the backend is probably hung."""


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raises ``MeasurementTimeout`` in the body after ``seconds`` (main thread only).

    Uses SIGALRM, whose handler runs as soon as the main thread is back in
    Python: the backends here wait with timeouts or in interruptible syscalls.
    """
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise MeasurementTimeout(f"no result after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _main_wait_s(stats: dict) -> float:
    """Seconds the main process has waited for results since the env was made."""
    return stats["main_wait_fraction"] * stats["elapsed_s"]


def measure(
    workload: str,
    backend: str,
    num_envs: int,
    *,
    seconds: float = 1.0,
    warmup_s: float = 0.25,
    num_workers: int | None = None,
    context: str | None = None,
    timeout_s: float | None = None,
    batch_size: int | None = None,
    policy_us: float = 0.0,
) -> Measurement:
    """Opens, warms up, times and closes one backend; failures become ``error`` rows."""
    workers = 0
    think = PolicyWait(policy_us) if policy_us else None
    main_wait_frac = None
    try:
        with deadline(timeout_s):
            options = {"num_workers": num_workers, "context": context, "batch_size": batch_size}
            with opened(backend, workload, num_envs, think=think, **options) as stepper:
                workers = stepper.num_workers
                num_envs = stepper.num_envs
                per_call = stepper.steps_per_call or num_envs
                if stepper.every_env_back is not None:
                    stepper.every_env_back()
                run_steps(stepper, warmup_s)
                if think is not None:
                    think.reset()
                before = stepper.stats() if stepper.stats else None
                cpu_before = time.thread_time()
                steps, elapsed, durations = run_steps(stepper, seconds)
                cpu_s = time.thread_time() - cpu_before
                if think is not None:
                    cpu_s -= think.cpu_s
                if before is not None:
                    waited = _main_wait_s(stepper.stats()) - _main_wait_s(before)
                    main_wait_frac = waited / elapsed
                rss = tree_rss_mib()
    except Exception as exc:  # a crash or hang is a result to report, not a reason to stop
        return Measurement(
            workload, backend, num_envs, workers, 0, 0.0, float("nan"), float("nan"),
            error=f"{type(exc).__name__}: {exc}".splitlines()[0], policy_us=policy_us,
        )  # fmt: skip
    per_round = cpu_s / steps * 1e6 if steps else None
    return Measurement(
        workload=workload,
        backend=backend,
        num_envs=num_envs,
        num_workers=workers,
        steps=steps,
        seconds=elapsed,
        steps_per_s=per_call * steps / elapsed,
        median_step_us=statistics.median(durations) / 1e3,
        batch=per_call,
        policy_us=policy_us,
        policy_wait_us=think.waited_s / think.calls * 1e6 if think and think.calls else None,
        main_wait_frac=main_wait_frac,
        main_cpu_us_per_round=per_round,
        main_cpu_us_per_row=None if per_round is None else per_round / per_call,
        rss_mib=rss,
    )


def add_ratios(measurements: Sequence[Measurement], cores: int) -> None:
    """Fills ``vs_sync``, ``vs_async``, ``efficiency``, ``vs_bound`` and
    ``vs_wait_bound`` from rows of the same run."""
    ok = [m for m in measurements if m.error is None]
    peers = {(m.workload, m.num_envs, m.policy_us, m.backend): m.steps_per_s for m in ok}
    single = {m.workload: m.steps_per_s for m in ok if m.backend == "single" and not m.policy_us}
    alone = {
        (m.workload, m.backend, m.num_envs, m.num_workers, m.batch): m.steps_per_s
        for m in ok
        if not m.policy_us
    }
    policy = {(m.policy_us, m.batch): m.steps_per_s for m in ok if m.backend == "policy"}
    for m in ok:
        if m.backend == "policy":
            continue
        if m.backend != "single":  # the baseline itself: no peer to compare with
            sync = peers.get((m.workload, m.num_envs, m.policy_us, "sync"))
            asyn = peers.get((m.workload, m.num_envs, m.policy_us, "async"))
            m.vs_sync = m.steps_per_s / sync if sync else None
            m.vs_async = m.steps_per_s / asyn if asyn else None
        base = single.get(m.workload)
        if base and m.workload in CPU_BOUND and m.backend != "single":
            m.efficiency = m.steps_per_s / (cores * base)
        if m.policy_us:
            envs = alone.get((m.workload, m.backend, m.num_envs, m.num_workers, m.batch))
            think = policy.get((m.policy_us, m.batch))
            if envs and think:
                m.vs_bound = m.steps_per_s / min(envs, think)
        if m.workload in WAIT_S:
            m.vs_wait_bound = m.steps_per_s * WAIT_S[m.workload] / m.num_envs


# -------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Case:
    """One measurement to make."""

    workload: str
    backend: str
    num_envs: int
    #: shmvec's worker processes (None: its default; other backends ignore it).
    num_workers: int | None = None
    #: The policy stand-in's wait per batch, microseconds (0: none).
    policy_us: float = 0.0


#: ``--quick``: (workload, num_envs) pairs, each against these backends.
QUICK_CASES = (("cartpole", 32), ("cpu100us", 8), ("noop", 1))
QUICK_BACKENDS = ("shmvec", "shmvec-main", "sync", "async", "single")


def plan_cases(
    pairs: Sequence[tuple[str, int]],
    backends: Sequence[str],
    worker_counts: Sequence[int | None] = (None,),
    policy_us: Sequence[float] = (0.0,),
    batch_size: int | None = None,
) -> list[Case]:
    """Every backend for every (workload, num_envs) and policy wait; shmvec backends
    once per worker count (capped at num_envs); ``single`` once per workload,
    without a policy. With a policy wait, also each batch's ``policy`` row (the
    policy alone) and every row without the policy (the envs alone)."""
    waits = sorted({0.0, *policy_us}) if any(policy_us) else [0.0]
    cases: list[Case] = []
    for wait in waits:
        for workload, num_envs in pairs:
            batches: dict[int, None] = {}
            for backend in backends:
                entry = REGISTRY[backend]
                if backend == "policy" or not entry.runs(workload):
                    continue
                if backend == "single":
                    if not wait and Case(workload, backend, 1) not in cases:
                        cases.append(Case(workload, backend, 1))
                    continue
                counts = [None]
                if entry.takes_workers:
                    capped = {None if w is None else min(w, num_envs) for w in worker_counts}
                    counts = sorted(capped, key=lambda w: -1 if w is None else w)
                cases += [Case(workload, backend, num_envs, w, wait) for w in counts]
                batches[async_batch(num_envs, batch_size) if entry.is_async else num_envs] = None
            for batch in batches if wait else ():
                if Case(workload, "policy", batch, None, wait) not in cases:
                    cases.append(Case(workload, "policy", batch, None, wait))
    return cases
