"""The price of the Ray hop: RayVectorEnv against a local ShmVectorEnv, same envs, same run.

Run with::

    python -m pytest benchmarks/test_ray.py --benchmark-only -q

Groups (one per workload and size), each timing the same envs three ways:

- ``shmvec``: a local ShmVectorEnv, one worker per core.
- ``shmvec-ray``: a RayVectorEnv with one actor per core (each actor a
  ShmVectorEnv running its block of envs in the actor process).
- ``shmvec-ray-async``: the same, stepped with ``recv``/``send`` and
  ``batch_size = num_envs / 2`` (one actor's batch per call).

On one machine, Ray's hop is pure cost (a task submission, a reply through
the object store, the concatenation); across machines it is what buys more
cores. ``extra_info["vs_shmvec"]`` is each Ray row's steps/s over the local
row's, and the summary printed at the end lists them. Nothing here asserts a
timing target. Skipped without Ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from shmvec import ShmVectorEnv
from shmvec.spin import available_cpus
from shmvec_bench.workloads import WORKLOADS

ray = pytest.importorskip("ray")

from shmvec.ray import RayVectorEnv  # noqa: E402

#: Rounds per benchmark, after one warm-up round.
ROUNDS = 10
#: Batches of random actions drawn before timing, replayed in a cycle.
ACTION_BATCHES = 64


@dataclass
class Row:
    group: str
    backend: str
    num_envs: int
    steps_per_s: float
    extra_info: dict


@pytest.fixture(scope="module")
def rows(request) -> Iterator[list[Row]]:
    """A local Ray session for the module; prints the ratios at the end."""
    cores = available_cpus()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    results: list[Row] = []
    yield results
    ray.shutdown()
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not results:
        return
    with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
        reporter.write_line("")
        reporter.write_sep("-", f"RayVectorEnv vs a local ShmVectorEnv, same run ({cores} cores)")
        for row in results:
            ratio = row.extra_info.get("vs_shmvec")
            reporter.write_line(
                f"{row.group:<22} {row.backend:<18} {row.num_envs:>4} envs "
                f"{row.steps_per_s:>10,.0f} steps/s" + (f"  vs_shmvec={ratio}" if ratio else "")
            )


def open_env(backend: str, workload: str, num_envs: int):
    factory = WORKLOADS[workload]
    cores = available_cpus()
    if backend == "shmvec":
        return ShmVectorEnv([factory] * num_envs, num_workers=cores)
    batch_size = num_envs // cores if backend == "shmvec-ray-async" else None
    return RayVectorEnv(
        [factory] * num_envs, num_actors=cores, num_cpus_per_actor=1, batch_size=batch_size
    )


@pytest.mark.parametrize("backend", ["shmvec", "shmvec-ray", "shmvec-ray-async"])
@pytest.mark.parametrize(
    "workload,num_envs,steps",
    [("cartpole", 16, 100), ("cpu100us", 16, 20), ("largeobs", 4, 20)],
    ids=["cartpole-16envs", "cpu100us-16envs", "largeobs-4envs"],
)
def test_ray_hop(benchmark, rows, backend, workload, num_envs, steps):
    group = f"ray-{workload}-{num_envs}envs"
    benchmark.group = group
    envs = open_env(backend, workload, num_envs)
    try:
        space = envs.action_space
        space.seed(0)
        actions = [space.sample() for _ in range(ACTION_BATCHES)]
        per_call = envs.batch_size if getattr(envs, "is_async", False) else num_envs
        if per_call < num_envs:
            envs.async_reset(seed=0)
            actions = [a[:per_call] for a in actions]

            def step(batch):
                *_, infos = envs.recv()
                envs.send(batch, infos["env_id"])

        else:
            envs.reset(seed=0)
            step = envs.step

        def one_round() -> None:
            for i in range(steps):
                step(actions[i % ACTION_BATCHES])

        benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    finally:
        envs.close()
    if benchmark.stats is None:  # --benchmark-disable
        return
    steps_per_s = per_call * steps / benchmark.stats.stats.median
    benchmark.extra_info.update(
        workload=workload, backend=backend, num_envs=num_envs, steps_per_s=round(steps_per_s, 1)
    )
    local = next((r for r in rows if r.group == group and r.backend == "shmvec"), None)
    if local is not None and backend != "shmvec":
        benchmark.extra_info["vs_shmvec"] = round(steps_per_s / local.steps_per_s, 3)
    rows.append(Row(group, backend, num_envs, steps_per_s, benchmark.extra_info))
    assert np.isfinite(steps_per_s)
