"""shmvec's block-stepping Ray vector env: ``shmvec.ray.RayVectorEnv`` in async mode,
one actor per node, driven by a hand-written ``send``/``recv`` trajectory loop.

Mirrors ``shmvec/ray/vector.py`` (async mode: ``recv`` hands back whole actor batches,
``send`` and ``async_reset`` name whole blocks of idle actors) under a loop like the
``shmvec-loop`` runner's over ``ShmVectorEnv``. A block cannot reset one env while the
others step, so each block runs its envs' trajectories together: it is reset to the next
slots of the task stream, then stepped until each of its envs has ended (an env that
ended first is stepped along, its results ignored), then reset again; the blocks run
independently of each other. Each turn receives a block and every further one that is
ready already and asks the policy for all their unfinished rows in one call. Each
actor's ShmVectorEnv steps every env of its block at once for workloads that wait. A step
that failed (an env error) ends its trajectory as ``"error"``; there are no retries.
"""

from __future__ import annotations

import multiprocessing

import numpy as np

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.cluster import ClusterRunner, cpu_nodes
from shmvec_bench.rollouts.records import GroupAssembler, RunContext, TrajRecord, now
from shmvec_bench.rollouts.workloads import WORKLOADS, env_fns


@register(
    "ray-blocks",
    summary="C RayVectorEnv (async, whole actor blocks), one actor per node, a send/recv loop",
    mirrors="shmvec/ray/vector.py async_reset/send/recv",
    requires="ray",
)
class RayBlocks(ClusterRunner):
    def __init__(self, ctx: RunContext) -> None:
        from shmvec.ray import RayVectorEnv

        self.ctx = ctx
        n = ctx.num_envs
        self.assembler = GroupAssembler(ctx.stream, ctx.group_size)
        self.env_steps = 0
        self.join()
        self.envs = None
        try:
            nodes = cpu_nodes()
            cpus = min(c for _, c in nodes)
            if n % len(nodes):
                raise ValueError(f"ray-blocks needs num_envs={n} to split evenly over {nodes}")
            block = n // len(nodes)
            waits = WORKLOADS[ctx.workload].waits
            self.envs = RayVectorEnv(
                env_fns(ctx.workload, n),
                num_actors=len(nodes),
                num_cpus_per_actor=cpus,
                batch_size=block,
                vector_kwargs={
                    # As the cluster's node agents: worker processes, every env at once.
                    "num_workers": max(1, int(cpus)),
                    "env_concurrency": ctx.env_concurrency or (block if waits else None),
                    "on_env_error": "reset",
                    "context": ctx.context,
                },
            )
        except BaseException:
            self.close(terminate=True)
            raise
        self.config = f"actors={len(nodes)} envs_per_actor={block} num_cpus_per_actor={cpus:g}"
        self.block = block
        self.slot: list[tuple[int, int, int]] = [(0, 0, 0)] * n
        self.started = np.zeros(n)
        self.steps = np.zeros(n, dtype=np.int64)
        self.reward = np.zeros(n)
        self.ended = np.zeros(n, dtype=bool)
        self.obs: list = [""] * n
        self.expect_reset = [True] * len(nodes)
        for k in range(len(nodes)):
            self._start_block(k)

    def _start_block(self, k: int) -> None:
        """Resets block ``k`` to the next slots of the task stream."""
        rows = self.envs.actor_env_ids[k]
        seeds = [0] * self.ctx.num_envs
        for env in rows:
            self.slot[env] = self.assembler.take()
            seeds[env] = self.slot[env][1]
        self.ended[rows.start : rows.stop] = False
        self.expect_reset[k] = True
        self.envs.async_reset(seed=seeds, env_ids=list(rows))

    def _turn(self) -> None:
        results = [self.envs.recv()]
        running = len(self.expect_reset) - 1
        while running:  # the blocks that are ready already
            try:
                results.append(self.envs.recv(timeout=0))
            except (multiprocessing.TimeoutError, TimeoutError):
                break
            running -= 1
        step_ids = []
        for result in results:
            ids = self._record(result)
            if ids is not None:
                step_ids.append(ids)
        if not step_ids:
            return
        ids = np.concatenate(step_ids)
        asked = [env for env in ids.tolist() if not self.ended[env]]
        action_of = dict(zip(asked, self.ctx.policy([self.obs[env] for env in asked])))
        fallback = action_of[asked[0]]
        self.envs.send(tuple(action_of.get(env, fallback) for env in ids.tolist()), ids)

    def _record(self, result) -> np.ndarray | None:
        """Records one block's batch; returns its env ids if the block steps on (None when
        all its trajectories have ended and it was reset)."""
        obs, rewards, terms, truncs, infos = result
        ids = infos["env_id"]
        k = int(ids[0]) // self.block
        failed = infos.get("_env_error", np.zeros(len(ids), dtype=bool))
        t = now()
        if self.expect_reset[k]:
            self.expect_reset[k] = False
            self.started[ids], self.steps[ids], self.reward[ids] = t, 0, 0.0
            for row, env in enumerate(ids.tolist()):
                self.obs[env] = obs[row]
            return ids
        for row, env in enumerate(ids.tolist()):
            if self.ended[env]:
                continue
            self.obs[env] = obs[row]
            self.steps[env] += 1
            self.reward[env] += rewards[row]
            self.env_steps += 1
            if terms[row] or truncs[row] or failed[row]:
                status = "error" if failed[row] else "done" if terms[row] else "truncated"
                steps, total = int(self.steps[env]), float(self.reward[env])
                record = TrajRecord(*self.slot[env], self.started[env], t, steps, total, status)
                self.assembler.finish(record)
                self.ended[env] = True
        if self.ended[ids].all():
            self._start_block(k)
            return None
        return ids

    def get_batch(self):
        return self.timed(self._get_batch)

    def _get_batch(self):
        while self.assembler.ready < self.ctx.groups_per_batch:
            self._turn()
        return self.assembler.wait_groups(self.ctx.groups_per_batch)

    def env_pids(self):
        return []

    def close(self, terminate: bool = False) -> None:
        """Closes the actors, and stops the cluster if this runner started it."""
        try:
            if self.envs is not None:
                self.envs.close(terminate=terminate)
                self.envs = None
        finally:
            self.leave()
