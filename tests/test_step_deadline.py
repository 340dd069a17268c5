"""step_deadline: one env's step that runs past it ends as a truncated result with
``infos["step_deadline"]``, from a new env, while the other envs of the same
worker keep their state and in-flight steps (shmvec/worker.py, shmvec/concurrent_envs.py).

Timing is asserted only with generous margins: the deadline is 0.5 s, the stuck
env's result may come 10 s later on a busy machine and still pass.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from envs import StuckEnv
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import dev_shm_files, pid_alive

from shmvec import ShmVectorEnv

DEADLINE = 0.5
MARGIN_S = 10.0  # a busy machine may take long to schedule the worker; never a hang


def stuck_fns(num_envs: int, stuck_env: int, hang: str, marker) -> list:
    return [
        lambda i=i: StuckEnv(i, 3 if i == stuck_env else -1, hang, marker) for i in range(num_envs)
    ]


def replay(index: int, seed: int, actions: list[int]) -> list[tuple]:
    """Env ``index`` alone (gymnasium's SyncVectorEnv, NEXT_STEP autoreset) with
    the same seed and actions: its (obs, reward, terminated, truncated) per step."""
    env = SyncVectorEnv([lambda: StuckEnv(index)], autoreset_mode=AutoresetMode.NEXT_STEP)
    env.reset(seed=seed)
    results = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(np.array([action]))
        results.append((obs[0].tolist(), reward[0], terminated[0], truncated[0]))
    env.close()
    return results


@pytest.mark.parametrize("env_concurrency", [None, 2])
@pytest.mark.parametrize("hang", ["sleep", "busy"])
def test_async_stuck_env_is_truncated_and_the_others_go_on(tmp_path, env_concurrency, hang):
    num_envs, stuck, seed, steps = 4, 1, 11, 24
    shm_before = dev_shm_files()
    envs = ShmVectorEnv(
        stuck_fns(num_envs, stuck, hang, str(tmp_path / "stuck")),
        num_workers=2,
        batch_size=2,
        step_deadline=DEADLINE,
        env_concurrency=env_concurrency,
    )
    pids = [p.pid for p in envs._pool.workers]
    rng = np.random.default_rng(0)
    actions: dict[int, list[int]] = {i: [] for i in range(num_envs)}
    results: dict[int, list[tuple]] = {i: [] for i in range(num_envs)}
    deadline_rows = []
    sent_at: dict[int, float] = {}
    try:
        envs.async_reset(seed=seed)
        started = time.monotonic()
        while min(len(results[i]) for i in range(num_envs)) < steps:
            assert time.monotonic() - started < 60 + MARGIN_S, "no progress"
            obs, rewards, terminations, truncations, infos = envs.recv()
            for row, env_id in enumerate(infos["env_id"].tolist()):
                if env_id in sent_at:  # a step's result (not the reset's)
                    results[env_id].append(
                        (obs[row].tolist(), rewards[row], terminations[row], truncations[row])
                    )
                    if "step_deadline" in infos and infos["_step_deadline"][row]:
                        deadline_rows.append((env_id, time.monotonic() - sent_at[env_id], row))
                        assert infos["step_deadline"][row] == DEADLINE
                        assert truncations[row] and not terminations[row]
            env_ids = infos["env_id"]
            sent = rng.integers(0, 4, len(env_ids))
            for env_id, action in zip(env_ids.tolist(), sent.tolist()):
                actions[env_id].append(action)
                sent_at[env_id] = time.monotonic()
            envs.send(sent, env_ids)
        stats = envs.stats()
    finally:
        envs.close()
    assert [env_id for env_id, _, _ in deadline_rows] == [stuck]
    assert deadline_rows[0][1] < DEADLINE + MARGIN_S
    assert stats["worker_restarts"] == 0
    assert stats["env_deadlines"] == [1, 0]
    for i in range(num_envs):
        expected = replay(i, seed + i, actions[i][: len(results[i])])
        if i != stuck:
            assert results[i] == expected, f"env {i}"
    # The stuck env: its steps before the deadline are its own; at the deadline a
    # new env's reset observation stands in, and the next step resets it (NEXT_STEP).
    assert StuckEnv(stuck).episode_len > 3  # it sticks before its episode ends
    assert results[stuck][:2] == replay(stuck, seed + stuck, actions[stuck][:2])
    obs, reward, terminated, truncated = results[stuck][2]
    assert obs[:2] == [stuck, 0.0] and reward == 0.0 and truncated and not terminated
    assert results[stuck][3][0][:2] == [stuck, 0.0]  # the autoreset step
    assert results[stuck][4][0][:2] == [stuck, 1.0]  # and its new episode goes on
    assert not any(pid_alive(pid) for pid in pids)
    assert dev_shm_files() <= shm_before


def test_a_c_loop_is_left_to_env_timeout(tmp_path):
    """What the deadline cannot end: C code that never returns to the interpreter.
    env_timeout kills the worker and on_worker_death="restart" brings it back."""
    envs = ShmVectorEnv(
        stuck_fns(4, 1, "c", str(tmp_path / "stuck")),
        num_workers=2,
        batch_size=2,
        step_deadline=DEADLINE,
        env_timeout=3.0,
        on_worker_death="restart",
    )
    try:
        envs.async_reset(seed=0)
        started, restarted = time.monotonic(), set()
        while 1 not in restarted:
            assert time.monotonic() - started < 60, "the stuck worker was not restarted"
            infos = envs.recv()[4]
            assert "step_deadline" not in infos
            if "worker_restarted" in infos:
                restarted.update(infos["env_id"][infos["_worker_restarted"]].tolist())
            envs.send(np.ones(2, np.int64), infos["env_id"])
        stats = envs.stats()
        assert stats["worker_restarts"] == 1 and stats["env_deadlines"] == [0, 0]
    finally:
        envs.close()


def test_async_reset_past_the_deadline(tmp_path):
    """A reset that hangs: the env is replaced and its (plain) reset reported as
    truncated with the info; the caller resets it again."""

    class StuckReset(StuckEnv):
        def reset(self, *, seed=None, options=None):
            if options and options.get("hang") and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                time.sleep(3600)
            return super().reset(seed=seed, options=options)

    marker = str(tmp_path / "stuck")
    fns = [lambda i=i: StuckReset(i, marker=marker) for i in range(4)]
    envs = ShmVectorEnv(fns, num_workers=2, batch_size=2, step_deadline=DEADLINE)
    try:
        envs.async_reset(seed=0, options={"hang": False})
        first = envs.recv()[4]["env_id"]
        envs.recv()
        # One env hangs, whichever worker runs each (the marker alone would race
        # between two workers' processes).
        hanging = int(first[0])
        options = [{"hang": e == hanging} for e in range(4)]
        envs.async_reset(seed=1, env_ids=first, options=options)
        obs, _, terminations, truncations, infos = envs.recv(timeout=DEADLINE + MARGIN_S)
        hung = infos["_step_deadline"]
        assert hung.sum() == 1 and truncations[hung].all() and not terminations.any()
        assert set(infos["env_id"].tolist()) == set(first.tolist())
        assert infos["env_id"][hung].tolist() == [hanging]
        envs.async_reset(seed=2, env_ids=infos["env_id"][hung])
        envs.send(np.zeros(1, np.int64), infos["env_id"][~hung])
        _, _, _, _, infos = envs.recv(timeout=MARGIN_S)
        assert "step_deadline" not in infos
        assert envs.stats()["worker_restarts"] == 0
    finally:
        envs.close()


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_sync_mode_stuck_env(tmp_path, mode):
    """Sync mode, serial workers: the stuck env's row is truncated with the info
    (SAME_STEP: final_obs and final_info are the new env's), every other env
    equals SyncVectorEnv's."""
    num_envs, stuck = 4, 2
    fns = stuck_fns(num_envs, stuck, "sleep", str(tmp_path / "stuck"))
    ours = ShmVectorEnv(fns, num_workers=2, autoreset_mode=mode, step_deadline=DEADLINE)
    theirs = SyncVectorEnv(stuck_fns(num_envs, -1, "sleep", None), autoreset_mode=mode)
    try:
        ours.reset(seed=5)
        theirs.reset(seed=5)
        rng = np.random.default_rng(1)
        for t in range(1, 12):
            actions = rng.integers(0, 4, num_envs)
            obs, rewards, terminations, truncations, infos = ours.step(actions)
            want = theirs.step(actions)
            others = np.arange(num_envs) != stuck
            if t == 3:
                assert infos["_step_deadline"].tolist() == [False, False, True, False]
                assert infos["step_deadline"][stuck] == DEADLINE
                assert truncations[stuck] and obs[stuck][1] == 0.0
                if mode == AutoresetMode.SAME_STEP:
                    assert infos["final_obs"][stuck][1] == 0.0
                    assert infos["final_info"]["step_deadline"][stuck] == DEADLINE
            else:
                assert "step_deadline" not in infos
            if t < 3:
                others = np.ones(num_envs, bool)
            np.testing.assert_array_equal(obs[others], want[0][others])
            np.testing.assert_array_equal(rewards[others], want[1][others])
            np.testing.assert_array_equal(terminations[others], want[2][others])
            np.testing.assert_array_equal(truncations[others], want[3][others])
        stats = ours.stats()
        assert stats["worker_restarts"] == 0 and stats["env_deadlines"] == [0, 1]
    finally:
        ours.close()
        theirs.close()


def test_sync_reset_past_the_deadline(tmp_path):
    marker = str(tmp_path / "stuck")

    class StuckReset(StuckEnv):
        def reset(self, *, seed=None, options=None):
            if seed == 3 and not os.path.exists(self.marker):  # env 1 of reset(seed=2)
                open(self.marker, "w").close()
                time.sleep(3600)
            return super().reset(seed=seed, options=options)

    fns = [lambda i=i: StuckReset(i, marker=marker) for i in range(2)]
    envs = ShmVectorEnv(fns, num_workers=2, step_deadline=DEADLINE)
    try:
        obs, infos = envs.reset(seed=2)
        assert infos["_step_deadline"].tolist() == [False, True]
        assert obs[1][:2].tolist() == [1.0, 0.0]
        assert envs.stats()["worker_restarts"] == 0
    finally:
        envs.close()


def test_without_deadline_nothing_changes():
    envs = ShmVectorEnv(stuck_fns(4, -1, "sleep", None), num_workers=2, batch_size=2)
    try:
        envs.async_reset(seed=0)
        for _ in range(10):
            infos = envs.recv()[4]
            assert "step_deadline" not in infos
            envs.send(np.ones(2, np.int64), infos["env_id"])
        assert envs.stats()["env_deadlines"] == [0, 0]
    finally:
        envs.close()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1", True, [1]])
def test_bad_step_deadline(value):
    with pytest.raises(ValueError, match="step_deadline"):
        ShmVectorEnv(stuck_fns(2, -1, "sleep", None), num_workers=1, step_deadline=value)


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 0},
        {"num_workers": 2, "step_in_main": True},
        {"num_workers": 2, "env_concurrency": 2},  # sync mode with threads
    ],
)
def test_step_deadline_where_it_cannot_be_kept(options):
    with pytest.raises(ValueError, match="step_deadline"):
        ShmVectorEnv(stuck_fns(4, -1, "sleep", None), step_deadline=1.0, **options)
