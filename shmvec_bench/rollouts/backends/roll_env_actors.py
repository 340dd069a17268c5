"""ROLL's env workers on Ray: actors of 16 envs, a thread per env running whole
trajectories, and one queue actor that collects them into groups.

Mirrors alibaba/ROLL ``roll/pipeline/agentic/environment_worker.py`` (an
``EnvironmentWorker`` Ray actor holding ``max_env_num_per_worker`` envs, "process +
threads": one thread per env; the docs' 16 envs a worker; CPU-only workers of 0.01 CPU
placed round-robin over the nodes, ``rank % num_nodes``),
``roll/pipeline/agentic/env_manager/traj_env_manager.py`` (``run_rollout_loop``: ask
for the next episode, reset, then generate and ``env.step`` until done, then
``ray.get(output_queue.put.remote(...))`` once per trajectory) and
``roll/distributed/scheduler/rollout_scheduler.py`` (``GroupQueueManager``: one actor on
the driver's node that hands out episodes and keeps the groups until they are complete;
the driver's ``get_batch`` is one call to it, which returns complete groups as they
complete, while the env threads keep running: ROLL's async mode).

Simplified: the policy is one Ray actor on the driver's node that batches the pending
requests as ``policies.Batcher`` does (each env thread waits on
``ray.get(policy.ask.remote(obs))``), where ROLL routes each request through its
``RequestScheduler`` actor to the inference workers; its busy time is added to the
run's policy clock after each batch. ``env_steps`` counts the steps of the trajectories
that reached the queue. ``GlobalLimiter``, ``group_size_redundancy`` and the
expiry of stale groups are left out. An env's exception ends the rollout.
"""

from __future__ import annotations

import asyncio
import math
import threading

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.cluster import ClusterRunner, cpu_nodes
from shmvec_bench.rollouts.policies import Batcher, make_policy
from shmvec_bench.rollouts.records import (
    GroupAssembler,
    RunContext,
    TaskStream,
    TrajRecord,
    now,
)
from shmvec_bench.rollouts.server import ServerRun
from shmvec_bench.rollouts.workloads import WORKLOADS, make_env

#: Envs per env actor (ROLL's ``max_env_num_per_worker`` in its docs) and its CPUs.
ENVS_PER_ACTOR = 16
ACTOR_CPUS = 0.01


class GroupQueue:
    """ROLL's ``GroupQueueManager``: episodes out, trajectories in, complete groups out."""

    def __init__(self, base_seed: int, group_size: int) -> None:
        self.assembler = GroupAssembler(TaskStream(base_seed), group_size)
        self.env_steps = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int, int]:
        """The next (task, seed, member) an env runs."""
        return self.assembler.take()

    def put(self, traj: TrajRecord) -> None:
        with self._lock:
            self.env_steps += traj.steps
        self.assembler.finish(traj)

    def fail(self, error: str) -> None:
        self.assembler.fail(RuntimeError(error))

    def get_batch(self, n: int) -> tuple[list, int, int]:
        """``n`` complete groups (waiting as needed), the tasks launched and the env steps."""
        groups = self.assembler.wait_groups(n)
        with self._lock:
            return groups, self.assembler.stream.launched, self.env_steps


class PolicyServer:
    """The run's policy behind a ``Batcher``: each ``ask`` waits for its row's action."""

    def __init__(self, name: str, actions: tuple[str, ...], seed: int) -> None:
        self.policy = make_policy(name, actions, seed)
        self.batcher = Batcher(self.policy)

    async def ask(self, observation: str) -> str:
        return await asyncio.wrap_future(self.batcher.submit(observation))

    async def busy(self) -> tuple[float, int]:
        busy_s, _, rows = self.policy.clock.snapshot()
        return busy_s, rows


class EnvActor:
    """ROLL's ``EnvironmentWorker``: a thread per env, each running whole trajectories."""

    def __init__(self, workload: str, indices: list[int], queue, policy) -> None:
        self.workload, self.queue, self.policy = workload, queue, policy
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"env-{i}", daemon=True)
            for i in indices
        ]

    def start(self) -> int:
        for thread in self.threads:
            thread.start()
        return len(self.threads)

    def _loop(self, index: int) -> None:
        import ray

        try:
            env = make_env(self.workload, index)
            while True:
                task, seed, member = ray.get(self.queue.take.remote())
                started = now()
                obs, _ = env.reset(seed=seed)
                steps, total = 0, 0.0
                while True:
                    action = ray.get(self.policy.ask.remote(obs))
                    obs, reward, terminated, truncated, _ = env.step(action)
                    steps += 1
                    total += reward
                    if terminated or truncated:
                        break
                status = "done" if terminated else "truncated"
                traj = TrajRecord(task, seed, member, started, now(), steps, total, status)
                ray.get(self.queue.put.remote(traj))
        except BaseException as exc:
            self.queue.fail.remote(f"env {index}: {type(exc).__name__}: {exc}")


@register(
    "roll-env-actors",
    summary="C ROLL on Ray: actors of 16 envs, a thread per env, a queue actor for groups",
    mirrors="roll/pipeline/agentic/environment_worker.py, traj_env_manager.py, "
    "rollout_scheduler.py",
    requires="ray",
)
class RollEnvActors(ClusterRunner):
    def __init__(self, ctx: RunContext) -> None:
        if isinstance(ctx.policy, ServerRun):
            raise ValueError("roll-env-actors runs the latency and gru policies")
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ctx = ctx
        self.env_steps = 0
        self.join()
        self.actors: list = []
        self.queue = self.policy = None
        try:
            nodes = [node for node, _ in cpu_nodes()]
            # The queue and the policy on the driver's node, reserving no CPU.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
            self.queue = (
                ray.remote(GroupQueue)
                .options(num_cpus=0, max_concurrency=16, scheduling_strategy=here)
                .remote(ctx.stream.base_seed, ctx.group_size)
            )
            self.policy = (
                ray.remote(PolicyServer)
                .options(num_cpus=0, max_concurrency=ctx.num_envs + 16, scheduling_strategy=here)
                .remote(ctx.policy.name, WORKLOADS[ctx.workload].actions, ctx.seed)
            )
            env_actor = ray.remote(EnvActor)
            for rank in range(math.ceil(ctx.num_envs / ENVS_PER_ACTOR)):
                indices = list(
                    range(rank * ENVS_PER_ACTOR, min(ctx.num_envs, (rank + 1) * ENVS_PER_ACTOR))
                )
                place = NodeAffinitySchedulingStrategy(nodes[rank % len(nodes)], False)
                self.actors.append(
                    env_actor.options(num_cpus=ACTOR_CPUS, scheduling_strategy=place).remote(
                        ctx.workload, indices, self.queue, self.policy
                    )
                )
            ray.get([actor.start.remote() for actor in self.actors])
        except BaseException:
            self.close(terminate=True)
            raise
        self._busy = (0.0, 0)
        self.config = f"env_actors={len(self.actors)} envs_per_actor={ENVS_PER_ACTOR}"

    def get_batch(self):
        import ray

        def take():
            groups, launched, self.env_steps = ray.get(
                self.queue.get_batch.remote(self.ctx.groups_per_batch)
            )
            return groups, launched

        groups, launched = self.timed(take)
        # The tasks the queue launched, in the run's task stream too (same seeds, in order).
        while self.ctx.stream.launched < launched:
            self.ctx.stream.take()
        busy_s, rows = ray.get(self.policy.busy.remote())
        self.ctx.policy.clock.add(busy_s - self._busy[0], rows - self._busy[1])
        self._busy = (busy_s, rows)
        return groups

    def env_pids(self):
        return []

    def close(self, terminate: bool = False) -> None:
        """Kills the env actors, the queue and the policy, and stops the cluster if this
        runner started it."""
        import ray

        try:
            for actor in [*self.actors, self.queue, self.policy]:
                if actor is not None:
                    ray.kill(actor)
            self.actors, self.queue, self.policy = [], None, None
        finally:
            self.leave()
