"""Stress: many envs on few workers, long runs, and no growth in memory or fds.

Sized for CI's 2 cores: the whole file runs in well under a minute there.
Each check counts transitions per env on both sides (what the main process
received and what the env itself executed), so a lost or duplicated
transition shows up as a mismatch, not as a statistic.
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest
from envs import CountingEnv
from gymnasium import spaces
from helpers import assert_same, dev_shm_files

import shmvec

pytestmark = pytest.mark.timeout(180)


class CallCounter(gym.Wrapper):
    """Appends to the observation how many results this env produced so far
    (reset and step calls, autoresets included), and counts its steps."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        low = np.append(env.observation_space.low, 0).astype(np.float32)
        high = np.append(env.observation_space.high, np.inf).astype(np.float32)
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        self.calls = 0
        self.steps = 0

    def _obs(self, obs):
        self.calls += 1
        return np.append(obs, np.float32(self.calls)).astype(np.float32)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._obs(obs), info

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._obs(obs), reward, terminated, truncated, info


def counted_cartpole() -> gym.Env:
    return CallCounter(gym.make("CartPole-v1"))


class StepCountingEnv(CountingEnv):
    """CountingEnv that also counts every step it executes, over all episodes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.total_steps = 0
        self.episodes = 0

    def step(self, action):
        self.total_steps += 1
        result = super().step(action)
        self.episodes += bool(result[2] or result[3])
        return result


def test_1024_envs_on_2_workers_equal_sync_vector_env():
    num_envs, steps = 1024, 200
    fns = [lambda: gym.make("CartPole-v1")] * num_envs
    rng = np.random.default_rng(7)
    envs = shmvec.ShmVectorEnv(fns, num_workers=2)
    ref = gym.vector.SyncVectorEnv(fns)
    try:
        assert_same(envs.reset(seed=123), ref.reset(seed=123))
        episodes = 0
        for _ in range(steps):
            actions = rng.integers(0, 2, num_envs)
            got, want = envs.step(actions), ref.step(actions)
            assert_same(got, want)
            episodes += int(np.count_nonzero(want[2] | want[3]))
        # Random CartPole episodes last ~20 steps: autoreset ran thousands of times.
        assert episodes > num_envs
        assert envs.stats()["steps"] == num_envs * steps
    finally:
        envs.close()
        ref.close()


def test_1024_envs_async_lose_and_duplicate_no_transition():
    num_envs, batch, rounds = 1024, 256, 400
    envs = shmvec.ShmVectorEnv([counted_cartpole] * num_envs, num_workers=2, batch_size=batch)
    rng = np.random.default_rng(11)
    received = np.zeros(num_envs, np.int64)  # results, the reset's included
    sent = np.zeros(num_envs, np.int64)  # actions
    try:
        envs.async_reset(seed=5)

        def recv() -> np.ndarray:
            obs, _reward, _terminated, _truncated, infos = envs.recv()
            ids = np.asarray(infos["env_id"])
            assert ids.shape == (batch,) and np.unique(ids).size == batch, "an env twice"
            received[ids] += 1
            # The env's own count of results it produced: the n-th one received
            # is the n-th one it made (a lost one skips, a repeated one stalls).
            np.testing.assert_array_equal(obs[:, -1], received[ids])
            return ids

        for _ in range(rounds):
            ids = recv()
            sent[ids] += 1
            envs.send(rng.integers(0, 2, batch), ids)
        # Drain: 1024 = 4 * 256 envs in flight, so four recvs return them all.
        for _ in range(num_envs // batch):
            recv()
        np.testing.assert_array_equal(received, sent + 1)
        # Each env executed exactly the actions it was sent (autoresets are
        # resets, not steps, so steps <= sent; calls counts both).
        calls = np.array(envs.get_attr("calls"))
        np.testing.assert_array_equal(calls, sent + 1)
        assert int(sent.sum()) == rounds * batch
        assert int(np.count_nonzero(received)) == num_envs  # every env ran
        assert envs.stats()["steps"] == int(received.sum())  # rows returned, resets included
    finally:
        envs.close()


def test_a_million_steps_count_every_step_and_episode():
    num_envs, steps, episode_len = 32, 31_250, 97  # 10**6 env steps
    fns = [functools.partial(StepCountingEnv, episode_len=episode_len)] * num_envs
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, autoreset_mode="SameStep")
    actions = np.zeros(num_envs, np.int64)
    dones = np.zeros(num_envs, np.int64)
    try:
        envs.reset(seed=0)
        for _ in range(steps):
            obs, _reward, terminated, truncated, _infos = envs.step(actions)
            dones += terminated | truncated
        assert num_envs * steps == 10**6
        stats = envs.stats()
        assert stats["steps"] == 10**6
        # SameStep: every vector step is one env.step, and an episode ends
        # every episode_len of them.
        np.testing.assert_array_equal(envs.get_attr("total_steps"), [steps] * num_envs)
        np.testing.assert_array_equal(envs.get_attr("episodes"), dones)
        np.testing.assert_array_equal(dones, steps // episode_len)
        assert stats["episodes"] == int(dones.sum())
        np.testing.assert_array_equal(obs[:, 0], steps % episode_len)  # t since reset
    finally:
        envs.close()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _usage(pids: list[int]) -> dict[int, tuple[int, int]]:
    return {pid: (_rss_kb(pid), _fds(pid)) for pid in pids}


#: RSS may grow this much (kB) between the warm-up and the end. Not zero: the
#: allocators may touch new pages for objects that are freed again (pymalloc
#: arenas are 1 MiB, numpy's buffers come from malloc). Measured on the 2-core
#: VM: 0 kB in every process, 3 runs out of 3. Leaks it still catches: with 4
#: envs the 10**5 env steps are 25,000 vector steps, so one object of 84 bytes
#: or more kept per vector step (a 4-element array: ~140 bytes) crosses 2 MB.
RSS_SLACK_KB = 2048


def test_rss_fds_and_dev_shm_flat_over_1e5_steps():
    # Few envs, many vector steps: a leak per step (not per env) shows too.
    num_envs, warmup, steps = 4, 2000, 25_000  # 25,000 * 4 = 10**5 env steps
    shm_before = dev_shm_files()
    fns = [functools.partial(StepCountingEnv, episode_len=50)] * num_envs
    envs = shmvec.ShmVectorEnv(fns, num_workers=2)
    rng = np.random.default_rng(3)
    try:
        pids = [os.getpid()] + [p.pid for p in envs._pool.workers]
        assert len(pids) == 3
        envs.reset(seed=1)

        def run(n: int) -> None:
            for _ in range(n):
                envs.step(rng.integers(0, 4, num_envs))

        run(warmup)  # caches, lazily built schemas, pages of the first batches
        before = _usage(pids)
        run(steps)
        after = _usage(pids)
        print(f"\n(RSS kB, fds) after warm-up {before}, after 10**5 steps {after}")
        for pid in pids:
            (rss0, fds0), (rss1, fds1) = before[pid], after[pid]
            who = "main" if pid == os.getpid() else f"worker {pid}"
            # fds: exactly flat, nothing is opened per step.
            assert fds1 == fds0, f"{who}: {fds0} -> {fds1} open fds"
            assert rss1 - rss0 <= RSS_SLACK_KB, f"{who}: RSS {rss0} -> {rss1} kB"
        assert envs.stats()["steps"] == num_envs * (warmup + steps)
        # The segment is a memfd, never a file: nothing appears in /dev/shm (files of
        # other processes on the machine, an inference server of other tests, may go).
        assert not dev_shm_files() - shm_before
    finally:
        envs.close()
    assert not dev_shm_files() - shm_before
