"""SkyRL's (and rLLM's) generator: one asyncio coroutine per trajectory, env calls
in a ``ThreadPoolExecutor(32)``, the batch gathered whole.

Mirrors NovaSky-AI/SkyRL ``skyrl/train/generators/skyrl_gym_generator.py``
(``agent_loop`` per trajectory; env ``init``/``step`` through ``run_in_executor`` on
a pool of ``max_env_workers=32``; ``generate`` gathers every trajectory of the
batch) and rllm-org/rllm ``rllm/engine/agent_workflow_engine.py`` (asyncio tasks,
sync env calls in a thread pool). A trajectory makes its own env, as SkyRL's
agent loop does. Inference requests from all coroutines are batched whenever the
engine is free (the engine's continuous batching), the engine running in a
thread of its own. The first exception aborts the whole batch (``tqdm.gather``, as
SkyRL's generator does). With ``--policy server`` each coroutine awaits its own request per
turn on one ``openai.AsyncOpenAI`` client a batch (rLLM's and SkyRL's remote-engine clients).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.records import GroupRecord, RunContext, TrajRecord, now
from shmvec_bench.rollouts.server import ServerRun
from shmvec_bench.rollouts.workloads import RELEASE_HANGS, make_env

#: SkyRL's default ``max_env_workers``.
MAX_ENV_WORKERS = 32


class AsyncBatcher:
    """Batches ``await generate(obs)`` calls; the policy runs in one engine thread."""

    def __init__(self, policy, engine: ThreadPoolExecutor) -> None:
        self.policy, self.engine = policy, engine
        self.pending: list[tuple[str, asyncio.Future]] = []
        self.wake = asyncio.Event()

    async def generate(self, observation: str) -> str:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((observation, future))
        self.wake.set()
        return await future

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, []
            if not batch:
                continue
            actions = await loop.run_in_executor(
                self.engine, self.policy, [obs for obs, _ in batch]
            )
            for (_, future), action in zip(batch, actions):
                if not future.done():
                    future.set_result(action)


@register(
    "skyrl-asyncio",
    summary="B4 SkyRL/rLLM: asyncio per trajectory, env calls in ThreadPoolExecutor(32)",
    mirrors="skyrl/train/generators/skyrl_gym_generator.py, rllm agent_workflow_engine.py",
    lockstep=True,
)
class SkyrlAsyncio:
    def __init__(self, ctx: RunContext) -> None:
        RELEASE_HANGS.clear()
        self.ctx = ctx
        self.pool = ThreadPoolExecutor(MAX_ENV_WORKERS, thread_name_prefix="env")
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.env_steps = 0

    async def _agent_loop(self, generator, index, task, seed, member) -> TrajRecord:
        loop = asyncio.get_running_loop()
        started = now()
        env = await loop.run_in_executor(self.pool, make_env, self.ctx.workload, index)
        obs, _ = await loop.run_in_executor(self.pool, lambda: env.reset(seed=seed))
        generate = generator()
        steps, total = 0, 0.0
        while True:
            action = await generate(obs)
            obs, reward, terminated, truncated, _ = await loop.run_in_executor(
                self.pool, env.step, action
            )
            steps += 1
            total += reward
            self.env_steps += 1
            if terminated or truncated:
                break
        status = "done" if terminated else "truncated"
        return TrajRecord(task, seed, member, started, now(), steps, total, status)

    async def _generate(self) -> list[GroupRecord]:
        g = self.ctx.group_size
        tasks = [self.ctx.stream.take() for _ in range(self.ctx.groups_per_batch)]
        server_run = self.ctx.policy
        if isinstance(server_run, ServerRun):
            client = server_run.async_client(self.ctx.num_envs)

            def generator():
                return functools.partial(server_run.conversation().aask, client)

            finish = client.close
        else:
            batcher = AsyncBatcher(server_run, self.engine)
            batching = asyncio.create_task(batcher.serve())

            def generator():
                return batcher.generate

            async def finish():
                batching.cancel()

        try:
            trajectories = await asyncio.gather(
                *(
                    self._agent_loop(generator, k * g + m, task, seed, m)
                    for k, (task, seed) in enumerate(tasks)
                    for m in range(g)
                )
            )
        finally:
            await finish()
        return [
            GroupRecord(task, seed, list(trajectories[k * g : (k + 1) * g]))
            for k, (task, seed) in enumerate(tasks)
        ]

    def get_batch(self):
        return asyncio.run(self._generate())

    def env_pids(self):
        return []

    def stats(self):
        return None

    def close(self, terminate: bool = False) -> None:
        RELEASE_HANGS.set()
        self.pool.shutdown(wait=not terminate, cancel_futures=True)
        self.engine.shutdown(wait=not terminate, cancel_futures=True)
