"""Complete groups of trajectories per second with pytest-benchmark: shmvec's rollout layer
beside the runners agent trainers use (``shmvec_bench.rollouts``).

Run with::

    python -m pytest benchmarks/test_rollouts.py --benchmark-only -q

Groups and what each answers:

- ``tool-64envs``: W3, envs whose step waits on a tool (lognormal, median 20 ms), a
  policy with a GPU decode batch's latency: do the envs' waits overlap each other and
  the policy?
- ``cpu200us-256envs``: W2, 200 us of CPU a step: does the runner use both cores, or
  does the GIL serialize the envs (the thread-per-env runners)?

A round is one ``get_batch()`` (``num_envs / 8`` complete groups of 8); runners without
a barrier per batch get one untimed batch first. ``extra_info`` (in
``--benchmark-json``) holds groups/s and the policy's idle share; for every metric
side by side (latency tails, PSS, CPU per step, faults) run ``shmvec-bench rollouts``.
No test asserts a timing target.
"""

from __future__ import annotations

import pytest

from shmvec_bench.rollouts.backends import REGISTRY
from shmvec_bench.rollouts.policies import make_policy
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import WORKLOADS

pytest.importorskip("gem")

ROUNDS = 3
GROUP = 8


def run_rollouts(benchmark, workload: str, backend: str, num_envs: int) -> None:
    policy = make_policy("latency", WORKLOADS[workload].actions)
    ctx = RunContext(workload, num_envs, GROUP, num_envs // GROUP, policy)
    runner = REGISTRY[backend].open(ctx)
    try:
        if not REGISTRY[backend].lockstep:
            runner.get_batch()
        busy0, _, _ = policy.clock.snapshot()
        benchmark.pedantic(runner.get_batch, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        busy1, _, _ = policy.clock.snapshot()
    finally:
        runner.close()
    if benchmark.stats is None:
        return
    stats = benchmark.stats.stats
    benchmark.extra_info.update(
        workload=workload,
        backend=backend,
        num_envs=num_envs,
        groups_per_s=round(ctx.groups_per_batch / stats.median, 3),
        policy_idle_share=round(1 - (busy1 - busy0) / (stats.mean * ROUNDS), 3),
    )


@pytest.mark.benchmark(group="tool-64envs")
@pytest.mark.parametrize(
    "backend", [b for b in REGISTRY if b not in ("ragen-serial", "verl-procs", "gym-async")]
)
def test_tool_64_envs(benchmark, backend):
    # The serial and process-per-env runners take minutes here: shmvec-bench rollouts has them.
    run_rollouts(benchmark, "tool", backend, 64)


@pytest.mark.benchmark(group="cpu200us-256envs")
@pytest.mark.parametrize("backend", [b for b in REGISTRY if b not in ("verl-procs", "gym-async")])
def test_cpu200us_256_envs(benchmark, backend):
    # Fewer envs leave the policy, not the envs, setting the pace. A process per env
    # means 256 processes here: shmvec-bench rollouts has those runners.
    run_rollouts(benchmark, "cpu200us", backend, 256)
