"""shmvec's rollout layer over a Ray cluster: ``shmvec.rollouts.Rollouts`` over
``shmvec.ray.ClusterVectorEnv``, one node agent per node.

Mirrors ``shmvec/ray/cluster.py`` under ``shmvec/rollouts/rollouts.py``, as the ``shmvec``
runner runs the layer on one machine: tasks from the benchmark's task stream, async mode,
``max_lag``, retries (``max_retries=2``). Each node's agent holds a contiguous block of
the same envs (``make_env(workload, index)``) in a ShmVectorEnv of its own, with every
env of the block stepping at once for workloads that wait; rows come back to the driver
one env at a time over each agent's channel, and the policy runs in the driver on every
row that waits. ``stats()`` adds the agents' states and the driver's CPU per 1,000 env
steps.
"""

from __future__ import annotations

import math
from collections import Counter

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.shmvec_common import (
    ENV_TIMEOUT_S,
    HANG_TIMEOUT_S,
    async_batch,
)
from shmvec_bench.rollouts.backends.shmvec_layer import ShmvecLayer, layer_policy, open_rollouts
from shmvec_bench.rollouts.cluster import ClusterRunner, cpu_nodes
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import WORKLOADS, env_fns


@register(
    "shmvec-cluster",
    summary="C shmvec.rollouts.Rollouts (async) over ClusterVectorEnv, one agent per node",
    mirrors="shmvec/ray/cluster.py under shmvec/rollouts/rollouts.py",
    requires="ray",
)
class ShmvecCluster(ClusterRunner, ShmvecLayer):
    def __init__(self, ctx: RunContext) -> None:
        from shmvec.ray import ClusterVectorEnv

        self.ctx = ctx
        self.batcher = None
        self.token_lags: Counter[int] = Counter()
        self.join()
        self.envs = None
        try:
            nodes = cpu_nodes()
            cpus = min(c for _, c in nodes)
            spec = WORKLOADS[ctx.workload]
            per_agent = math.ceil(ctx.num_envs / len(nodes))
            # Envs that wait on tools: every env of an agent's block at once.
            concurrency = ctx.env_concurrency or (per_agent if spec.waits else None)
            hangs = {"step_deadline": HANG_TIMEOUT_S, "env_timeout": ENV_TIMEOUT_S}
            self.envs = ClusterVectorEnv(
                env_fns(ctx.workload, ctx.num_envs),
                num_agents=len(nodes),
                num_cpus_per_agent=cpus,
                batch_size=async_batch(ctx),
                env_concurrency=concurrency,
                vector_kwargs={"context": ctx.context, **(hangs if spec.hang_p else {})},
            )
            policy, self.batcher = layer_policy(ctx)
            self.rollouts = open_rollouts(self.envs, policy, ctx)
        except BaseException:
            self._release(terminate=True)
            raise
        self.config = (
            f"agents={len(nodes)} num_cpus_per_agent={cpus:g} batch_size={self.envs.batch_size} "
            f"env_concurrency={concurrency} max_lag={ctx.max_lag} policy={ctx.policy_mode}"
        )

    def get_batch(self):
        return self.timed(super().get_batch)

    def env_pids(self):
        return []

    def stats(self):
        stats = self.rollouts.stats()
        env_stats = self.envs.stats()
        stats["agent_states"] = env_stats["agent_states"]
        stats["lost_agents"] = env_stats["lost_agents"]
        return {**stats, **ClusterRunner.stats(self)}

    def close(self, terminate: bool = False) -> None:
        try:
            self.rollouts.close()
        finally:
            self._release(terminate)

    def _release(self, terminate: bool) -> None:
        """Closes the envs and the batcher, and stops the cluster if this runner started it."""
        try:
            if self.envs is not None:
                self.envs.close(terminate=terminate)
            if self.batcher is not None:
                self.batcher.close()
        finally:
            self.leave()
