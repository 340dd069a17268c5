"""No result waits for an unrelated env: a fast env's steps beside one in a long call
(seconds, hung past a deadline, killed) reach their consumer at the pace of the fast
env alone, in the awaitable envs and in the rollout loop with either kind of policy.

The slow calls last seconds and the fast steps milliseconds; each bound below is a
fraction of the slow call, so that a loaded machine cannot fail it and a fast result
that waited for the slow env must."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import shmvec
from shmvec.errors import EnvDeadlineError, EnvWorkerDiedError
from shmvec.rollouts import AsyncPolicy, Rollouts, Task

#: The slow env's call; every fast step must come back in well under a quarter of it.
SLOW_S = 4.0
FAST_S = 0.001


class SleepEnv(gym.Env):
    """Each step sleeps its action's seconds; an action < 0 kills the worker."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Box(-1.0, 100.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.sleep_s = float((options or {}).get("sleep", FAST_S))
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        seconds = float(action[0])
        if seconds < 0:
            os._exit(3)
        time.sleep(seconds)
        self.t += 1
        return np.zeros(2, np.float32), 1.0, self.t >= 5, False, {}


def sleep_envs(**kwargs) -> shmvec.ShmVectorEnv:
    options = dict(num_workers=2, batch_size=8, env_concurrency=8)
    options.update(kwargs)
    return shmvec.ShmVectorEnv(
        [SleepEnv] * 16, on_env_error="reset", on_worker_death="restart", **options
    )


def seconds(value: float) -> np.ndarray:
    return np.array([value], np.float32)


async def fast_steps(
    pool: shmvec.AwaitableEnvs, n: int, after_s: float, skip: int = 0
) -> list[float]:
    """Each step's time, of ``n`` 1 ms steps that start ``after_s`` into the run, on the
    env leased after ``skip`` others (held unused)."""
    async with contextlib.AsyncExitStack() as held:
        for _ in range(skip):
            await held.enter_async_context(pool.env())
        env = await held.enter_async_context(pool.env())
        await env.reset(seed=1)
        await asyncio.sleep(after_s)
        times = []
        for _ in range(n):
            started = time.perf_counter()
            _, _, terminated, truncated, _ = await env.step(seconds(FAST_S))
            times.append(time.perf_counter() - started)
            if terminated or truncated:
                await env.reset(seed=1)
        return times


async def slow_step(pool: shmvec.AwaitableEnvs, action: float) -> BaseException | float:
    async with pool.env() as env:
        await env.reset(seed=0)
        started = time.perf_counter()
        try:
            await env.step(seconds(action))
        except (EnvDeadlineError, EnvWorkerDiedError) as failure:
            return failure
        return time.perf_counter() - started


@pytest.mark.parametrize(
    ("slow_action", "options", "outcome"),
    [
        (SLOW_S, {}, float),
        (60.0, {"step_deadline": SLOW_S}, EnvDeadlineError),
    ],
    ids=["slow-call", "hung-past-deadline"],
)
def test_a_fast_coroutines_steps_do_not_wait_for_a_slow_env(slow_action, options, outcome):
    envs = sleep_envs(**options)

    async def main():
        async with shmvec.AwaitableEnvs(envs) as pool:
            return await asyncio.gather(
                slow_step(pool, slow_action), fast_steps(pool, 40, after_s=0.2)
            )

    try:
        slow, fast = asyncio.run(main())
    finally:
        envs.close(terminate=True)
    assert isinstance(slow, outcome), slow
    # Before each fast result could wait in a slot until the slow call ended: its first
    # step took the rest of the slow call.
    assert max(fast) < SLOW_S / 4, np.round(fast, 3)
    assert sum(fast) < SLOW_S / 2, np.round(fast, 3)


def test_a_fast_coroutine_keeps_stepping_while_another_envs_worker_is_killed():
    envs = sleep_envs()

    async def main():
        async with shmvec.AwaitableEnvs(envs) as pool:
            # The killed env is leased first (env 0, worker 0); the fast one is env 8,
            # of worker 1.
            return await asyncio.gather(slow_step(pool, -1.0), fast_steps(pool, 40, 0.2, skip=7))

    try:
        killed, fast = asyncio.run(main())
    finally:
        envs.close(terminate=True)
    assert isinstance(killed, EnvWorkerDiedError), killed
    assert len(fast) == 40
    assert sum(fast) < SLOW_S / 2, np.round(fast, 3)


def fast_and_slow_tasks(n_fast: int) -> list[Task]:
    return [Task(seed=0, options={"sleep": SLOW_S})] + [
        Task(seed=s, options={"sleep": FAST_S}) for s in range(1, n_fast + 1)
    ]


def slept_action(traj) -> np.ndarray:
    return seconds(traj.task.options["sleep"])


def run_beside_a_slow_env(policy) -> tuple[list, float]:
    """The fast trajectories handed over while the slow one's first step runs, and
    how long they took."""
    envs = sleep_envs()
    rollouts = Rollouts(envs, policy, group_size=1)
    try:
        rollouts.submit(fast_and_slow_tasks(6))
        started = time.perf_counter()
        groups = rollouts.get_batch(6)
        took = time.perf_counter() - started
    finally:
        rollouts.close()
        envs.close(terminate=True)
    return [g.trajectories[0] for g in groups], took


def test_the_rollout_loop_hands_over_fast_trajectories_beside_a_slow_env_per_row_policy():
    async def act(row):
        return slept_action(row.trajectory)

    trajs, took = run_beside_a_slow_env(AsyncPolicy(act))
    assert sorted(t.seed for t in trajs) == [1, 2, 3, 4, 5, 6]
    assert took < SLOW_S / 2, took
    for traj in trajs:
        assert traj.env_s / (traj.num_steps + 1) < SLOW_S / 8, (traj.seed, traj.env_s)


def test_the_rollout_loop_hands_over_fast_trajectories_beside_a_slow_env_batched_policy():
    def act(batch):
        return np.stack([slept_action(traj) for traj in batch.trajectories])

    trajs, took = run_beside_a_slow_env(act)
    assert sorted(t.seed for t in trajs) == [1, 2, 3, 4, 5, 6]
    assert took < SLOW_S / 2, took
    for traj in trajs:
        assert traj.env_s / (traj.num_steps + 1) < SLOW_S / 8, (traj.seed, traj.env_s)
