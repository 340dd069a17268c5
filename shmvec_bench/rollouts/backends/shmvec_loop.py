"""A hand-written ``send``/``recv`` trajectory loop over the same ``ShmVectorEnv`` as
the ``shmvec`` runner: the step-level API with nothing on top, so that the two
rows give the rollout layer's overhead.

Each env runs trajectories back to back (``autoreset_mode="Disabled"``): when one
ends, the env is reset to the next slot of the task stream with
``async_reset(seed, env_ids=[env])``. Every ``recv`` batch goes to the policy at
once. A step that failed (an env error, a restarted worker) ends its trajectory
as ``"error"``; there are no retries.
"""

from __future__ import annotations

import numpy as np

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.shmvec_common import describe, open_envs, worker_pids
from shmvec_bench.rollouts.records import GroupAssembler, RunContext, TrajRecord, now

FAILURES = ("env_error", "worker_restarted")


@register(
    "shmvec-loop",
    summary="S0 a hand-written send/recv loop over the same ShmVectorEnv (no layer)",
    mirrors="shmvec/vector_env.py async_reset/send/recv",
)
class ShmvecLoop:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.envs = open_envs(ctx, autoreset_mode="Disabled")
        n = ctx.num_envs
        self.assembler = GroupAssembler(ctx.stream, ctx.group_size)
        self.slot = [self.assembler.take() for _ in range(n)]
        self.started = np.zeros(n)
        self.steps = np.zeros(n, dtype=np.int64)
        self.reward = np.zeros(n)
        self.expect_reset = np.ones(n, dtype=bool)
        self.env_steps = 0
        self.config = describe(self.envs)
        self.envs.async_reset(seed=[s for _, s, _ in self.slot])

    def _turn(self) -> None:
        obs, rewards, terms, truncs, infos = self.envs.recv()
        ids = infos["env_id"]
        failed = np.zeros(len(ids), dtype=bool)
        for key in FAILURES:
            if f"_{key}" in infos:
                failed |= infos[f"_{key}"]
        act, resets = [], []
        t = now()
        for row, env in enumerate(ids.tolist()):
            if self.expect_reset[env]:
                self.expect_reset[env] = False
                self.started[env], self.steps[env], self.reward[env] = t, 0, 0.0
                act.append(row)
                continue
            self.steps[env] += 1
            self.reward[env] += rewards[row]
            self.env_steps += 1
            if terms[row] or truncs[row] or failed[row]:
                task, seed, member = self.slot[env]
                status = "error" if failed[row] else "done" if terms[row] else "truncated"
                self.assembler.finish(
                    TrajRecord(
                        task,
                        seed,
                        member,
                        self.started[env],
                        t,
                        int(self.steps[env]),
                        float(self.reward[env]),
                        status,
                    )  # fmt: skip
                )
                self.slot[env] = self.assembler.take()
                self.expect_reset[env] = True
                resets.append(env)
            else:
                act.append(row)
        if resets:
            seeds = [0] * self.ctx.num_envs
            for env in resets:
                seeds[env] = self.slot[env][1]
            self.envs.async_reset(seed=seeds, env_ids=resets)
        if act:
            actions = self.ctx.policy([obs[r] for r in act])
            self.envs.send(tuple(actions), ids[act])

    def get_batch(self):
        while self.assembler.ready < self.ctx.groups_per_batch:
            self._turn()
        return self.assembler.wait_groups(self.ctx.groups_per_batch)

    def env_pids(self):
        return worker_pids(self.envs)

    def stats(self):
        stats = self.envs.stats()
        return {k: stats.get(k) for k in ("worker_restarts", "env_resets")}

    def close(self, terminate: bool = False) -> None:
        self.envs.close(terminate=terminate)
