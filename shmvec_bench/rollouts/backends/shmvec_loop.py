"""A hand-written ``send``/``recv`` trajectory loop over the same ``ShmVectorEnv`` as
the ``shmvec`` runner: the step-level API with nothing on top, so that the two
rows give the rollout layer's overhead.

Each env runs trajectories back to back (``autoreset_mode="Disabled"``): when one
ends, the env is reset to the next slot of the task stream with
``async_reset(seed, env_ids=[env])``. Each turn receives a batch and every further
batch that is ready already, and asks the policy for all their rows in one call. A
step that failed (an env error, a restarted worker) ends its trajectory as
``"error"``; there are no retries.
"""

from __future__ import annotations

import multiprocessing

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
        results = [self.envs.recv()]
        # Every env has a command out between turns; take the batches that are ready
        # already (each recv returns a copy) while enough envs run to fill one.
        running = self.ctx.num_envs - len(results[0][1])
        while running >= self.envs.batch_size:
            try:
                results.append(self.envs.recv(timeout=0))
            except (multiprocessing.TimeoutError, TimeoutError):
                break
            running -= len(results[-1][1])
        observations, act, resets = [], [], []
        for result in results:
            self._record(result, observations, act, resets)
        if resets:
            seeds = [0] * self.ctx.num_envs
            for env in resets:
                seeds[env] = self.slot[env][1]
            self.envs.async_reset(seed=seeds, env_ids=resets)
        if act:
            actions = self.ctx.policy(observations)
            self.envs.send(tuple(actions), np.array(act))

    def _record(self, result, observations: list, act: list, resets: list) -> None:
        """Records one received batch: the envs that await an action go to ``act`` (their
        observations to ``observations``), those whose trajectory ended to ``resets``."""
        obs, rewards, terms, truncs, infos = result
        ids = infos["env_id"]
        failed = np.zeros(len(ids), dtype=bool)
        for key in FAILURES:
            if f"_{key}" in infos:
                failed |= infos[f"_{key}"]
        t = now()
        for row, env in enumerate(ids.tolist()):
            if self.expect_reset[env]:
                self.expect_reset[env] = False
                self.started[env], self.steps[env], self.reward[env] = t, 0, 0.0
                act.append(env)
                observations.append(obs[row])
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
                act.append(env)
                observations.append(obs[row])

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
