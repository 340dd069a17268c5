"""Envs that wait (shmvec/concurrent_envs.py): a worker steps several at once.

Results must not depend on which env finished first: each env's sleep varies
at random per step, so threads finish out of order, and every step is compared
with gymnasium's SyncVectorEnv.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
import os
import random
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same

from shmvec import ShmVectorEnv, WorkerDiedError, concurrent_envs
from shmvec.concurrent_envs import CHILD_CHECK_ROUNDS, CpuNeighbours, EnvThreadPool


class WaitingEnv(gym.Env):
    """A tool-call-like env: each step blocks for a random 0.3..3 ms (its own
    generator, so the timing differs between runs but the results do not);
    episodes end by termination or truncation at env-dependent steps; infos mix
    numeric columns and pickled strings."""

    def __init__(
        self, index: int = 0, max_sleep: float = 0.003, episode_len: int | None = None
    ) -> None:
        self.index = index
        self.episode_len = 3 + index % 4 if episode_len is None else episode_len
        self.max_sleep = max_sleep
        self.sleep_rng = random.Random()  # timing only: not seeded on purpose
        self.observation_space = spaces.Box(-1e6, 1e6, (3,), np.float64)
        self.action_space = spaces.Discrete(4)
        self.block = False  # set_attr("block", True): the next step never returns
        self.boom_at = -1  # set_attr("boom_at", t): the step reaching t raises
        self.boom_on_reset = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if getattr(self, "boom_on_reset", False):
            raise RuntimeError(f"sandbox of env {self.index} failed to start")
        time.sleep(self.sleep_rng.uniform(0, self.max_sleep))  # a sandbox starting
        self.t = 0
        self.offset = float(self.np_random.integers(100))
        return np.array([0.0, -1.0, self.offset]), {"start": self.index}

    def step(self, action):
        if self.block:
            time.sleep(3600)
        time.sleep(self.sleep_rng.uniform(0.1 * self.max_sleep, self.max_sleep))
        self.t += 1
        if self.t == self.boom_at:
            raise RuntimeError(f"tool call failed in env {self.index}")
        obs = np.array([self.t, float(action), self.offset + self.t])
        terminated = self.t == self.episode_len
        truncated = self.t >= 9 and self.episode_len < 9
        info = {"t": self.t, "score": float(action) / 2}
        if (self.t + int(action)) % 3 == 0:
            info["note"] = f"env {self.index} step {self.t}"
        return obs, float(action) * self.t, terminated, truncated, info


class BusyEnv(WaitingEnv):
    """The same env, but its step computes for 0.5 ms instead of waiting."""

    def step(self, action):
        deadline = time.perf_counter() + 0.0005
        while time.perf_counter() < deadline:
            pass
        self.t += 1
        return np.array([self.t, float(action), self.offset]), 1.0, False, self.t >= 50, {}


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def waiting_fns(n: int, cls=WaitingEnv, **kwargs) -> list:
    return [lambda i=i: cls(i, **kwargs) for i in range(n)]


# ------------------------------------------------------------ the mechanism


def test_pool_map_keeps_item_order_and_returns_exceptions():
    pool = EnvThreadPool(os.sched_getaffinity(0))
    pool.grow(4)

    def work(i: int) -> int:
        time.sleep(random.uniform(0, 0.003))
        if i == 5:
            raise ValueError("five")
        return i * i

    results = pool.map(work, list(range(10)))
    assert results[:5] == [0, 1, 4, 9, 16] and results[6:] == [36, 49, 64, 81]
    assert isinstance(results[5], ValueError)
    assert pool.size == 4
    assert pool.map(work, []) == []  # nothing to wait for: no hang


# ----------------------------------------------- equivalence with gymnasium


def run_both(fns, mode: AutoresetMode, steps: int, **kwargs):
    """Steps ShmVectorEnv and SyncVectorEnv with the same actions; compares every
    result. Returns the ShmVectorEnv's stats."""
    ours = ShmVectorEnv(fns, autoreset_mode=mode, **kwargs)
    theirs = SyncVectorEnv(fns, autoreset_mode=mode)
    rng = np.random.default_rng(3)
    try:
        assert_same(ours.reset(seed=7), theirs.reset(seed=7), "reset")
        ended = np.zeros(len(fns), dtype=bool)
        for t in range(steps):
            actions = rng.integers(0, 4, len(fns))
            if mode == AutoresetMode.DISABLED and ended.any():
                mask = ended
                assert_same(
                    ours.reset(options={"reset_mask": mask.copy()}),
                    theirs.reset(options={"reset_mask": mask.copy()}),
                    f"reset {t}",
                )
            got, want = ours.step(actions), theirs.step(actions)
            assert_same(got, want, f"step {t}")
            ended = got[2] | got[3]
        return ours.stats()
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_sync_mode_matches_sync_vector_env_with_threads(mode):
    stats = run_both(waiting_fns(6), mode, steps=40, num_workers=2, env_concurrency=3)
    assert stats["worker_env_threads"] == [3, 3]  # each worker steps its 3 envs at once


def test_cap_and_never():
    assert run_both(waiting_fns(6), AutoresetMode.NEXT_STEP, 12, num_workers=2,
                    env_concurrency=2)["worker_env_threads"] == [2, 2]  # fmt: skip
    assert run_both(waiting_fns(4), AutoresetMode.NEXT_STEP, 12, num_workers=2,
                    env_concurrency=1)["worker_env_threads"] == [1, 1]  # fmt: skip
    # More than a worker's block: the block.
    assert run_both(waiting_fns(4), AutoresetMode.NEXT_STEP, 4, num_workers=2,
                    env_concurrency=16)["worker_env_threads"] == [2, 2]  # fmt: skip
    # max_concurrency bounds the envs inside step over all workers: 2 workers x 2;
    # alone it starts no threads.
    envs = ShmVectorEnv(waiting_fns(8), num_workers=2, max_concurrency=4, env_concurrency=8)
    try:
        assert envs.env_concurrency == 2
    finally:
        envs.close()
    envs = ShmVectorEnv(waiting_fns(8), num_workers=2, max_concurrency=4)
    try:
        assert envs.env_concurrency is None
    finally:
        envs.close()
    with pytest.raises(ValueError, match="env_concurrency must be None or an int >= 1"):
        ShmVectorEnv(waiting_fns(2), env_concurrency=0)


@pytest.mark.parametrize("env_class", [WaitingEnv, BusyEnv])
def test_envs_step_one_after_another_by_default(env_class):
    envs = ShmVectorEnv(waiting_fns(4, env_class), num_workers=2)
    try:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(4, dtype=np.int64))
        stats = envs.stats()
        assert stats["worker_env_threads"] == [1, 1]
        assert len(stats["worker_cpu_fraction"]) == 2
    finally:
        envs.close()


class PlacedEnv(WaitingEnv):
    """Reports the CPUs its stepping thread may use; once ``spawn`` is set, its
    next step starts a child process that outlives it (a sandbox), and steps
    report the child's CPUs too."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index, max_sleep=0.002, episode_len=10_000)
        self.spawn = False
        self.child = None

    def step(self, action):
        if self.spawn and self.child is None:
            self.child = subprocess.Popen(["sleep", "60"])
        obs, reward, terminated, truncated, _ = super().step(action)
        cpus = os.sched_getaffinity(0)
        info = {"cpus": len(cpus), "first_cpu": min(cpus)}
        if self.child is not None:
            info["child_cpus"] = len(os.sched_getaffinity(self.child.pid))
        return obs, reward, terminated, truncated, info

    def close(self):
        if self.child is not None:
            self.child.kill()
            self.child.wait()


def step_in_threads(envs) -> dict:
    """One step of envs whose two workers step two envs at once; its infos."""
    assert envs.stats()["worker_env_threads"] == [2, 2]
    return envs.step(np.zeros(envs.num_envs, dtype=np.int64))[4]


def neighbours_say(monkeypatch) -> multiprocessing.sharedctypes.Synchronized:
    """A flag that stands for what every worker's ``CpuNeighbours`` reads of its CPU
    (0: other processes leave it quiet; 1: they keep it busy), checked at every
    command. Workers must fork from this process to see it."""
    crowded = multiprocessing.get_context("fork").Value("b", 0)
    monkeypatch.setattr(concurrent_envs, "CHILD_CHECK_S", 0.0)
    monkeypatch.setattr(CpuNeighbours, "share", lambda self, interval_s: float(crowded.value))
    return crowded


def step_until(envs, done, seconds: float = 30.0) -> dict:
    """Steps in threads until ``done(infos)``; the last infos."""
    deadline = time.monotonic() + seconds
    while True:
        infos = step_in_threads(envs)
        if done(infos) or time.monotonic() > deadline:
            return infos


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_env_threads_share_their_workers_cpu_while_other_processes_leave_it_quiet(monkeypatch):
    crowded = neighbours_say(monkeypatch)
    everywhere = sorted(os.sched_getaffinity(0))
    envs = ShmVectorEnv([lambda i=i: PlacedEnv(i) for i in range(4)], num_workers=2,
                        env_concurrency=2, context="fork")  # fmt: skip
    try:
        # Other processes keep the CPUs busy from the start: every CPU.
        crowded.value = 1
        envs.reset(seed=0)
        for _ in range(concurrent_envs.NEIGHBOUR_CHECKS + 2):
            assert step_in_threads(envs)["cpus"].tolist() == [len(everywhere)] * 4
        # They leave them quiet: on one after NEIGHBOUR_CHECKS quiet checks.
        crowded.value = 0
        infos = step_until(envs, lambda infos: (infos["cpus"] == 1).all())
        assert infos["cpus"].tolist() == [1, 1, 1, 1]
        # worker k (envs 2k, 2k+1): the k-th CPU the process may use
        assert infos["first_cpu"].tolist() == [everywhere[0]] * 2 + [everywhere[1]] * 2
        # Other processes keep the CPUs busy: back on every CPU, and placed again
        # once they leave them quiet.
        crowded.value = 1
        infos = step_until(envs, lambda infos: (infos["cpus"] > 1).all())
        assert infos["cpus"].tolist() == [len(everywhere)] * 4
        crowded.value = 0
        assert (step_until(envs, lambda infos: (infos["cpus"] == 1).all())["cpus"] == 1).all()
    finally:
        envs.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_worker_whose_envs_start_processes_runs_them_everywhere(monkeypatch):
    neighbours_say(monkeypatch)  # quiet CPUs
    everywhere = len(os.sched_getaffinity(0))
    envs = ShmVectorEnv([lambda i=i: PlacedEnv(i) for i in range(4)], num_workers=2,
                        env_concurrency=2, context="fork")  # fmt: skip
    try:
        envs.reset(seed=0)
        infos = step_until(envs, lambda infos: (infos["cpus"] == 1).all())
        assert infos["cpus"].tolist() == [1, 1, 1, 1]
        # Worker 0's envs start sandboxes from their placed threads: the
        # children start on the one CPU, and the next round's check frees them
        # and the threads for good. Worker 1's envs start none: its threads stay.
        envs.set_attr("spawn", [True, True, False, False])
        actions = np.zeros(4, dtype=np.int64)
        assert envs.step(actions)[4]["child_cpus"][:2].tolist() == [1, 1]
        for _ in range(concurrent_envs.NEIGHBOUR_CHECKS + 2):
            infos = envs.step(actions)[4]
            assert infos["cpus"].tolist() == [everywhere, everywhere, 1, 1]
            assert infos["child_cpus"][:2].tolist() == [everywhere, everywhere]
    finally:
        envs.close()


def busy_on(cpu: int) -> subprocess.Popen:
    """A process that computes on ``cpu`` alone until killed (a neighbour bound there)."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass"
    return subprocess.Popen([sys.executable, "-c", code])


def test_cpu_neighbours_counts_another_process_busy_on_the_cpu():
    cpu = min(os.sched_getaffinity(0))
    neighbours = CpuNeighbours(cpu)
    assert neighbours.share(60.0) is None  # the interval has not passed
    hog = busy_on(cpu)
    try:
        time.sleep(0.1)  # the hog runs
        neighbours.share(0.0)  # a new interval starts
        time.sleep(0.5)
        share = neighbours.share(0.5)
    finally:
        hog.kill()
        hog.wait()
    assert share is not None and share > concurrent_envs.NEIGHBOUR_SHARE


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pinned_workers_step_on_their_cpu_until_their_envs_start_processes(monkeypatch):
    monkeypatch.setattr(concurrent_envs, "CHILD_CHECK_S", 0.0)  # workers fork from here
    everywhere = sorted(os.sched_getaffinity(0))
    envs = ShmVectorEnv([lambda i=i: PlacedEnv(i) for i in range(4)], num_workers=2,
                        env_concurrency=1, pin_workers=True, context="fork")  # fmt: skip
    try:
        assert envs.pin_workers
        envs.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        infos = envs.step(actions)[4]
        # Serial steps, in the worker's own thread: worker k on the k-th CPU.
        assert envs.stats()["worker_env_threads"] == [1, 1]
        assert infos["cpus"].tolist() == [1, 1, 1, 1]
        assert infos["first_cpu"].tolist() == [everywhere[0]] * 2 + [everywhere[1]] * 2
        # Worker 0's envs start sandboxes: pinned with it at first, then it
        # unpins itself and them at its next check (at the latest after a run
        # of serial rounds); worker 1 stays pinned.
        envs.set_attr("spawn", [True, True, False, False])
        assert envs.step(actions)[4]["child_cpus"][:2].tolist() == [1, 1]
        for _ in range(CHILD_CHECK_ROUNDS + 2):
            infos = envs.step(actions)[4]
            if infos["cpus"][0] > 1:
                break
        assert infos["cpus"].tolist() == [len(everywhere)] * 2 + [1, 1]
        assert infos["child_cpus"][:2].tolist() == [len(everywhere)] * 2
    finally:
        envs.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_restarted_worker_is_pinned_to_the_same_cpu():
    everywhere = sorted(os.sched_getaffinity(0))
    envs = ShmVectorEnv([lambda i=i: PlacedEnv(i) for i in range(2)], num_workers=2,
                        pin_workers=True, on_worker_death="restart")  # fmt: skip
    try:
        envs.reset(seed=0)
        actions = np.zeros(2, dtype=np.int64)
        old = envs._pool.workers[1].pid
        os.kill(old, signal.SIGKILL)
        while envs._pool.workers[1].pid == old:
            envs.step(actions)
        envs.step(actions)  # the restarted env's autoreset (it reported truncated)
        infos = envs.step(actions)[4]
        assert infos["cpus"].tolist() == [1, 1]
        assert infos["first_cpu"].tolist() == everywhere[:2]
    finally:
        envs.close()


def test_unpinned_workers_may_use_every_cpu():
    everywhere = len(os.sched_getaffinity(0))
    envs = ShmVectorEnv([lambda i=i: PlacedEnv(i) for i in range(2)], num_workers=2,
                        env_concurrency=1, pin_workers=False)  # fmt: skip
    try:
        envs.reset(seed=0)
        assert envs.step(np.zeros(2, dtype=np.int64))[4]["cpus"].tolist() == [everywhere] * 2
    finally:
        envs.close()
    with pytest.raises(ValueError, match="pin_workers must be None, True or False"):
        ShmVectorEnv([lambda: PlacedEnv(0)], pin_workers="yes")


def reference_step(env, mode, ended, action):
    if mode == AutoresetMode.NEXT_STEP and ended:
        obs, info = env.reset()
        return (obs, 0.0, False, False), False
    obs, reward, terminated, truncated, info = env.step(action)
    if mode == AutoresetMode.SAME_STEP and (terminated or truncated):
        obs, _ = env.reset()
    return (obs, reward, terminated, truncated), terminated or truncated


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_async_mode_each_env_matches_stepping_it_alone(mode):
    n, batch = 8, 3
    envs = ShmVectorEnv(waiting_fns(n), num_workers=2, batch_size=batch, autoreset_mode=mode,
                        env_concurrency=4)  # fmt: skip
    alone = waiting_fns(n)
    alone = [fn() for fn in alone]
    expected, ended = {}, np.zeros(n, dtype=bool)
    for e, env in enumerate(alone):
        obs, _ = env.reset(seed=50 + e)
        expected[e] = (obs, 0.0, False, False)
    rng = np.random.default_rng(2)
    results = np.zeros(n, dtype=int)
    # Until every env has 30 results: each sent env's result arrives, in however
    # many recv()s a busy machine takes; only the wall clock bounds the loop.
    deadline = time.monotonic() + 120.0
    try:
        envs.async_reset(seed=50)
        while results.min() < 30 and time.monotonic() < deadline:
            obs, rewards, terminations, truncations, infos = envs.recv(timeout=120.0)
            ids = infos["env_id"].tolist()
            for row, e in enumerate(ids):
                want_obs, want_reward, want_terminated, want_truncated = expected[e]
                assert np.array_equal(obs[row], want_obs), f"env {e}"
                assert rewards[row] == want_reward, f"env {e}"
                assert terminations[row] == want_terminated, f"env {e}"
                assert truncations[row] == want_truncated, f"env {e}"
                if "t" in infos and infos["_t"][row]:
                    assert infos["t"][row] == obs[row][0]
                results[e] += 1
            actions = rng.integers(0, 4, len(ids))
            envs.send(actions, ids)
            for e, action in zip(ids, actions.tolist()):
                expected[e], ended[e] = reference_step(alone[e], mode, ended[e], action)
        assert envs.stats()["worker_env_threads"] == [4, 4]
    finally:
        envs.close()
    assert results.min() >= 30, f"results per env after 120 s: {results}"


# ------------------------------------------------- timeouts, restarts, errors


def started_threaded(n: int = 4, **kwargs) -> ShmVectorEnv:
    kwargs.setdefault("env_concurrency", n // 2)
    envs = ShmVectorEnv(waiting_fns(n, episode_len=1000), num_workers=2, **kwargs)
    envs.reset(seed=0)
    for _ in range(3):
        envs.step(np.ones(n, dtype=np.int64))
    assert envs.stats()["worker_env_threads"] == [n // 2, n // 2]
    return envs


@pytest.mark.parametrize("policy", ["restart", "raise"])
def test_env_timeout_catches_an_env_blocked_forever_in_a_thread(policy):
    envs = started_threaded(on_worker_death=policy, env_timeout=0.5)
    try:
        envs.set_attr("block", [False, False, False, True])
        if policy == "raise":
            with pytest.raises(WorkerDiedError, match=r"worker 1 .*SIGKILL") as error:
                envs.step(np.ones(4, dtype=np.int64))
            assert "stuck in env 3 for more than env_timeout=0.5 s" in notes(error.value)
            return
        started = time.monotonic()
        obs, _, _, truncations, infos = envs.step(np.ones(4, dtype=np.int64))
        assert time.monotonic() - started < 10
        assert np.array_equal(truncations, [False, False, True, True])
        assert np.array_equal(infos["_worker_restarted"], [False, False, True, True])
        assert np.array_equal(obs[:2, 0], [4, 4]) and (obs[2:, 0] == 0).all()
        obs = envs.step(np.ones(4, dtype=np.int64))[0]  # NEXT_STEP: the reset after the end
        assert np.array_equal(obs[:, 0], [5, 5, 0, 0])
        obs = envs.step(np.ones(4, dtype=np.int64))[0]  # the new env 3 does not block
        assert np.array_equal(obs[:, 0], [6, 6, 1, 1])
    finally:
        envs.close()


def test_env_timeout_in_async_mode_with_threads():
    envs = ShmVectorEnv(
        waiting_fns(6, episode_len=1000),
        num_workers=2,
        batch_size=2,
        on_worker_death="restart",
        env_timeout=2.0,  # far beyond any step of the others, on a busy machine too
        env_concurrency=3,
    )
    rng = np.random.default_rng(0)
    try:
        envs.async_reset(seed=0)
        for _ in range(60):  # each worker's word is written once the worker is up
            ids = envs.recv()[4]["env_id"]
            envs.send(rng.integers(0, 4, len(ids)), ids)
            if envs.stats()["worker_env_threads"] == [3, 3]:
                break
        assert envs.stats()["worker_env_threads"] == [3, 3]
        envs.set_attr("block", [False, False, False, False, True, False])
        started, restarted = time.monotonic(), set()
        while 4 not in restarted and time.monotonic() - started < 20:
            obs, _, _, truncations, infos = envs.recv()
            ids = infos["env_id"]
            flags = infos.get("_worker_restarted", np.zeros(len(ids), dtype=bool))
            restarted.update(ids[flags].tolist())
            envs.send(rng.integers(0, 4, len(ids)), ids)
        assert 4 in restarted and envs.stats()["worker_restarts"] == 1, (restarted, envs.stats())
        for _ in range(10):  # the replacement's env 4 runs again
            ids = envs.recv()[4]["env_id"]
            envs.send(rng.integers(0, 4, len(ids)), ids)
    finally:
        envs.close()


def test_an_exception_in_a_threaded_env():
    envs = started_threaded()
    try:
        envs.set_attr("boom_at", [-1, 5, -1, -1])
        envs.step(np.ones(4, dtype=np.int64))
        with pytest.raises(RuntimeError, match="tool call failed in env 1"):
            envs.step(np.ones(4, dtype=np.int64))
    finally:
        envs.close()
    envs = started_threaded(on_env_error="reset")
    try:
        envs.set_attr("boom_at", [-1, -1, 5, -1])
        envs.step(np.ones(4, dtype=np.int64))
        obs, _, _, truncations, infos = envs.step(np.ones(4, dtype=np.int64))
        assert np.array_equal(truncations, [False, False, True, False])
        assert infos["env_error"][2] == "RuntimeError: tool call failed in env 2"
        assert obs[2, 0] == 0 and obs[3, 0] == 5
    finally:
        envs.close()


def test_resets_in_threads_match_and_raise():
    envs = started_threaded()
    reference = SyncVectorEnv(waiting_fns(4, episode_len=1000))
    try:
        assert_same(envs.reset(seed=11), reference.reset(seed=11))  # threaded now
        mask = np.array([True, False, True, True])
        got = envs.reset(seed=12, options={"reset_mask": mask.copy()})
        assert_same(got, reference.reset(seed=12, options={"reset_mask": mask.copy()}))
        envs.set_attr("boom_on_reset", [False, False, True, False])
        with pytest.raises(RuntimeError, match="sandbox of env 2 failed to start"):
            envs.reset(seed=0)
    finally:
        envs.close()
        reference.close()
