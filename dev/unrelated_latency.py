"""How long a 1 ms env step takes, seen by its consumer, while another env of the same
vector env is in a 4 s call: the awaitable envs, the rollout loop with a per-row and a
batched policy. Prints p50/p99 in ms of the fast steps (each from the consumer handing
over its action to the consumer seeing the step's result).

    python dev/unrelated_latency.py [--steps 400] [--slow-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

import shmvec
from shmvec.rollouts import AsyncPolicy, Rollouts, Task


class SleepEnv(gym.Env):
    """Each step sleeps its action's seconds; episodes of 50 steps."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Box(0.0, 100.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        time.sleep(float(action[0]))
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t >= 50, False, {}


def make_envs():
    return shmvec.ShmVectorEnv(
        [SleepEnv] * 16, num_workers=2, batch_size=8, env_concurrency=8,
        on_env_error="reset", on_worker_death="restart",
    )  # fmt: skip


def awaitable(steps: int, slow_s: float) -> list[float]:
    envs = make_envs()

    async def slow(pool):
        async with pool.env() as env:
            await env.reset(seed=0)
            while not done.is_set():
                await env.step(np.array([slow_s], np.float32))

    async def fast(pool):
        async with pool.env() as env:
            await env.reset(seed=1)
            await asyncio.sleep(0.2)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                _, _, term, trunc, _ = await env.step(np.array([0.001], np.float32))
                times.append(time.perf_counter() - t)
                if term or trunc:
                    await env.reset(seed=1)
            done.set()
            return times

    async def main():
        async with shmvec.AwaitableEnvs(envs) as pool:
            _, times = await asyncio.gather(slow(pool), fast(pool))
            return times

    done = asyncio.Event()
    try:
        return asyncio.run(main())
    finally:
        envs.close(terminate=True)


def rollouts(steps: int, slow_s: float, per_row: bool) -> list[float]:
    """Each fast step's time from the policy's answer to its next row."""
    answered: dict[int, float] = {}
    times: list[float] = []

    def seen(traj) -> float:
        now = time.perf_counter()
        key = id(traj)
        if key in answered and traj.seed != 0:
            times.append(now - answered[key])
        answered[key] = time.perf_counter()
        return slow_s if traj.seed == 0 else 0.001

    async def row_policy(row):
        return np.array([seen(row.trajectory)], np.float32)

    def batch_policy(batch):
        return np.array([[seen(t)] for t in batch.trajectories], np.float32)

    policy = AsyncPolicy(row_policy) if per_row else batch_policy
    envs = make_envs()
    r = Rollouts(envs, policy, group_size=1)
    try:
        r.submit([Task(seed=0)] + [Task(seed=s) for s in range(1, 1 + steps // 50)])
        r.get_batch(steps // 50)
    finally:
        r.close()
        envs.close(terminate=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--slow-s", type=float, default=4.0)
    args = parser.parse_args()
    runs = {
        "AwaitableEnvs": lambda: awaitable(args.steps, args.slow_s),
        "rollouts, per-row policy": lambda: rollouts(args.steps, args.slow_s, True),
        "rollouts, batched policy": lambda: rollouts(args.steps, args.slow_s, False),
    }
    for name, run in runs.items():
        ms = np.array(run()) * 1e3
        print(
            f"{name:26s} {len(ms):4d} fast steps: p50 {np.percentile(ms, 50):6.1f} ms, "
            f"p99 {np.percentile(ms, 99):7.1f} ms, max {ms.max():7.1f} ms"
        )


if __name__ == "__main__":
    main()
