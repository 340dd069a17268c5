"""verl-agent's env workers on Ray: one Ray actor per env, stepped in lock-step.

Mirrors verl-agent ``agent_system/environments/env_package/*/envs.py`` (e.g.
``alfworld/envs.py``: ``env_num * group_n`` workers made with
``ray.remote(**resources_per_worker)``, each holding one env; ``step`` is
``ray.get([worker.step.remote(a) ...])`` over every worker) as
``agent_system/environments/env_manager.py`` drives them from
``agent_system/multi_turn_rollout/rollout_loop.py``: reset every env (the ``group_n``
envs of a group share a seed), then each turn one batched policy call on every env's
observation and a step of every env, finished ones only masked, until every episode is
done; every batch is a fresh rollout. Each actor reserves a small share of a CPU (the
config's ``resources_per_worker``: 0.1, or less where that many do not fit) and Ray
spreads them over the nodes. An env's exception reaches the trainer as one (``ray.get``
re-raises it). Each actor is a Ray worker process of its own (about 70 MiB): a run that
would need more memory than the machine has free is refused before any starts.
"""

from __future__ import annotations

import math

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.lockstep import Lockstep
from shmvec_bench.rollouts.cluster import ClusterRunner, cpu_nodes
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import make_env

#: verl-agent's ``resources_per_worker`` CPUs, at most.
WORKER_CPUS = 0.1
#: Memory one env actor takes (a Ray worker process with the env imported), MiB; a run
#: may take this share of the memory available at its start.
ACTOR_MIB = 80
MEMORY_SHARE = 0.8


class EnvWorker:
    """One env in one Ray actor (verl-agent's ``*Worker``)."""

    def __init__(self, workload: str, index: int) -> None:
        self.env = make_env(workload, index)

    def reset(self, seed: int | None) -> str:
        return self.env.reset(seed=seed)[0]

    def step(self, action: str) -> tuple:
        return self.env.step(action)[:4]


def available_mib() -> float:
    """``MemAvailable`` of ``/proc/meminfo``, MiB (infinite where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.inf


@register(
    "verl-agent-actors",
    summary="C verl-agent on Ray: lock-step, one Ray actor per env, a ray.get over all each turn",
    mirrors="agent_system/environments/env_package/*/envs.py, env_manager.py",
    requires="ray",
    lockstep=True,
)
class VerlAgentActors(ClusterRunner, Lockstep):
    ROLLOUT = {"generate_for_finished": True, "step_finished": True}

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        need, free = ctx.num_envs * ACTOR_MIB, available_mib()
        if need > MEMORY_SHARE * free:
            raise MemoryError(
                f"{ctx.num_envs} env actors need about {need / 1024:.1f} GiB, more than "
                f"{MEMORY_SHARE:.0%} of the {free / 1024:.1f} GiB available"
            )
        import ray

        self.join(lockstep=True)
        self.workers: list = []
        try:
            total = sum(c for _, c in cpu_nodes())
            # Rounded down to Ray's resource precision, so that all of them fit.
            cpus = min(WORKER_CPUS, math.floor(1e4 * total / ctx.num_envs) / 1e4)
            remote = ray.remote(num_cpus=cpus, scheduling_strategy="SPREAD")(EnvWorker)
            self.workers = [remote.remote(ctx.workload, i) for i in range(ctx.num_envs)]
            # Every actor built and answering before the first turn.
            ray.get([w.reset.remote(None) for w in self.workers])
        except BaseException:
            self.close(terminate=True)
            raise
        self.config = f"actors={ctx.num_envs} num_cpus_per_actor={cpus:g}"

    def _reset(self, seeds):
        import ray

        return ray.get([w.reset.remote(s) for w, s in zip(self.workers, seeds)])

    def _step(self, ids, actions):
        import ray

        return ray.get([self.workers[i].step.remote(a) for i, a in zip(ids, actions)])

    def get_batch(self):
        return self.timed(super().get_batch)

    def close(self, terminate: bool = False) -> None:
        """Kills the env actors, and stops the cluster if this runner started it."""
        import ray

        try:
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []
        finally:
            self.leave()
