"""shmvec's rollout layer: ``shmvec.rollouts.Rollouts`` over ``ShmVectorEnv`` in async mode.

Tasks flow in from the benchmark's task stream (``Rollouts(..., tasks=...)``);
``get_batch(n)`` hands over complete groups while the envs keep stepping
(``mode="async"``), each within ``max_lag`` policy versions (the benchmark's trainer
sets the next version after every batch, as after an update); failed trajectories
are retried (``max_retries=2``) and the rest accounted for in ``stats()``.
Straggling tasks carry the label ``"straggler"`` so that
``stats()["label_share"]`` compares their share of delivered groups with their
share of launched ones. With ``--policy server`` the layer's policy is ``ServerPolicy``
(``interrupt`` on or off), and ``token_lags`` counts the completion tokens of the groups
handed over by how many versions older than the hand-over's they are.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from shmvec.rollouts import AsyncPolicy, Rollouts, Status, Task
from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.shmvec_common import describe, open_envs, worker_pids
from shmvec_bench.rollouts.policies import Batcher
from shmvec_bench.rollouts.records import GroupRecord, RunContext, TrajRecord
from shmvec_bench.rollouts.server import ServerRun
from shmvec_bench.rollouts.workloads import is_straggler

#: The layer's finished statuses, as the benchmark's records name them.
STATUS = {
    Status.TERMINATED.value: "done",
    Status.TRUNCATED.value: "truncated",
    Status.MAX_STEPS.value: "truncated",
    Status.POLICY_ENDED.value: "truncated",
}


def task_source(ctx: RunContext):
    while True:
        _, seed = ctx.stream.take()
        yield Task(seed=seed, label="straggler" if is_straggler(seed) else "regular")


def layer_policy(ctx: RunContext) -> tuple[Any, Batcher | None]:
    """The layer's policy for ``ctx.policy_mode``, and the ``Batcher`` behind it in
    ``"rows"`` mode (an ``AsyncPolicy`` per row, as an inference server batches)."""
    policy = ctx.policy
    if isinstance(policy, ServerRun):
        return policy.layer_policy(ctx.num_envs, ctx.interrupt), None
    if ctx.policy_mode == "rows":
        batcher = Batcher(policy)

        async def ask(row):
            return await asyncio.wrap_future(batcher.submit(row.observation))

        return AsyncPolicy(ask, concurrency=ctx.num_envs), batcher
    if ctx.policy_mode == "batched":
        return (lambda batch: list(policy(list(batch.observations)))), None
    raise ValueError(f"policy_mode must be 'batched' or 'rows', got {ctx.policy_mode!r}")


def open_rollouts(envs: Any, policy: Any, ctx: RunContext) -> Rollouts:
    """The layer as both shmvec rollout runners use it: tasks from the stream, async mode,
    ``max_lag``, two retries."""
    return Rollouts(
        envs,
        policy,
        group_size=ctx.group_size,
        tasks=task_source(ctx),
        mode="async",
        groups_per_batch=ctx.groups_per_batch,
        max_lag=ctx.max_lag,
        max_retries=2,
    )


@register(
    "shmvec",
    summary="S shmvec.rollouts.Rollouts (async) over ShmVectorEnv(env_concurrency=...)",
    mirrors="shmvec/rollouts/rollouts.py",
)
class ShmvecLayer:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.envs = open_envs(ctx)
        self.token_lags: Counter[int] = Counter()
        self.batcher: Batcher | None = None
        try:
            policy, self.batcher = layer_policy(ctx)
            self.rollouts = open_rollouts(self.envs, policy, ctx)
        except BaseException:
            self.envs.close(terminate=True)
            if self.batcher is not None:
                self.batcher.close()
            raise
        mode = ctx.policy_mode
        if isinstance(ctx.policy, ServerRun):
            mode = f"server interrupt={'on' if ctx.interrupt else 'off'}"
        self.config = describe(self.envs) + f" max_lag={ctx.max_lag} policy={mode}"

    @property
    def env_steps(self) -> int:
        return self.rollouts.steps

    def get_batch(self):
        groups = self.rollouts.get_batch(self.ctx.groups_per_batch)
        version = self.rollouts.version
        # The trainer's update after each batch: later actions carry the next version.
        self.rollouts.set_version(version + 1)
        for turn in (e for g in groups for t in g.trajectories for e in t.extras):
            self.token_lags.update(version - v for v in getattr(turn, "versions", ()))
        base = self.ctx.stream.base_seed
        return [
            GroupRecord(
                g.task.seed - base,
                g.task.seed,
                [
                    TrajRecord(
                        g.task.seed - base,
                        g.task.seed,
                        t.index,
                        t.started_s,
                        t.ended_s,
                        t.num_steps,
                        t.total_reward,
                        STATUS.get(t.status.value, t.status.value),
                    )  # fmt: skip
                    for t in g.trajectories
                ],
            )
            for g in groups
        ]

    def env_pids(self):
        return worker_pids(self.envs)

    def stats(self):
        stats = self.rollouts.stats()
        env_stats = self.envs.stats()
        stats["worker_restarts"] = env_stats.get("worker_restarts")
        stats["env_resets"] = env_stats.get("env_resets")
        return stats

    def close(self, terminate: bool = False) -> None:
        try:
            self.rollouts.close()
        finally:
            self.envs.close(terminate=terminate)
            if self.batcher is not None:
                self.batcher.close()
