"""Restart policies: ``on_worker_death="restart"``, ``on_env_error="reset"``,
``env_timeout``. The envs a failure touched report a truncated episode; every
other env goes on exactly as SyncVectorEnv's, and no transition is lost.

No test asserts a duration: a hang is caught by pytest-timeout instead.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time

import envs as test_envs
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same
from rollout_envs import TaskEnv, obs_policy

import shmvec.engine.async_engine
import shmvec.layout
from shmvec import ShmVectorEnv, WorkerDiedError

pytestmark = pytest.mark.timeout(60)

NEXT, SAME, DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED


class FailingFactory:
    """An env_fn that raises."""

    def __call__(self):
        raise RuntimeError("factory boom")


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def kill(envs: ShmVectorEnv, index: int) -> None:
    process = envs._pool.workers[index]
    os.kill(process.pid, signal.SIGKILL)
    process.join(5)


def assert_rows_equal(got, want, rows) -> None:
    for name, a, b in zip(("obs", "rewards", "terminations", "truncations"), got, want):
        assert np.array_equal(a[rows], b[rows]), f"{name}: {a[rows]} != {b[rows]}"


# ------------------------------------------------------------- dead workers


@pytest.mark.parametrize("mode", [NEXT, SAME])
def test_restart_replaces_a_dead_worker_and_spares_the_others(mode):
    fns = test_envs.gym_fns("CartPole-v1", 6)
    envs = ShmVectorEnv(fns, num_workers=3, on_worker_death="restart", autoreset_mode=mode)
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    others = np.array([0, 1, 4, 5])
    rng = np.random.default_rng(0)
    try:
        assert_same(envs.reset(seed=3), sync.reset(seed=3))
        old_pid = envs._pool.workers[1].pid
        for t in range(120):
            if t == 40:
                kill(envs, 1)
            actions = rng.integers(0, 2, 6)
            got, want = envs.step(actions), sync.step(actions)
            assert_rows_equal(got, want, others)
            if t == 40:
                obs, rewards, terminations, truncations, infos = got
                restarted = np.array([False, False, True, True, False, False])
                assert np.array_equal(truncations, restarted | want[3])
                assert not terminations[2:4].any() and (rewards[2:4] == 0).all()
                assert np.array_equal(infos["_worker_restarted"], restarted)
                assert infos["worker_restarted"][2] and infos["worker_restarted"][3]
                # A fresh CartPole starts within +-0.05 in each coordinate.
                assert (np.abs(obs[2:4]) <= 0.05).all()
                if mode == SAME:
                    assert infos["_final_obs"][2:4].all()
                    assert np.array_equal(infos["final_obs"][2], obs[2])
                    assert infos["final_info"]["worker_restarted"][3]
            if t == 41 and mode == NEXT:
                # As after any truncation, NEXT_STEP's next step is a reset step.
                assert (got[1][2:4] == 0).all() and not got[3][2:4].any()
        new = envs._pool.workers[1]
        assert new.pid != old_pid and new.exitcode is None
        assert envs.stats()["worker_restarts"] == 1
        workers = list(envs._pool.workers)
    finally:
        envs.close()
        sync.close()
    assert all(p.exitcode is not None for p in workers)


@pytest.mark.parametrize("lent", [False, True], ids=["copied", "lent"])
def test_restart_during_reset_and_during_call(lent, monkeypatch):
    if lent:  # observations in lease regions (shmvec/engine/leases.py), small as they are
        monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)
    fns = test_envs.gym_fns("CartPole-v1", 4)
    envs = ShmVectorEnv(fns, num_workers=2, on_worker_death="restart")
    try:
        assert (envs._decoder.leases is not None) == lent
        envs.reset(seed=0)
        kill(envs, 0)
        obs, infos = envs.reset(seed=1)
        assert np.array_equal(infos["_worker_restarted"], [True, True, False, False])
        want, _ = SyncVectorEnv(fns).reset(seed=1)
        assert np.array_equal(obs[2:], want[2:])  # worker 1 reset as asked
        assert obs.shape == (4, 4) and (np.abs(obs) <= 0.05).all()

        kill(envs, 1)
        with pytest.raises(WorkerDiedError, match=r"worker 1 .*SIGKILL") as error:
            envs.get_attr("spec")
        assert "restarted" in notes(error.value)
        assert [s.id for s in envs.get_attr("spec")] == ["CartPole-v1"] * 4
        envs.step(np.zeros(4, dtype=np.int64))
        assert envs.stats()["worker_restarts"] == 2
    finally:
        envs.close()


@pytest.mark.parametrize("obs_len", [2, 2048], ids=["copied", "lent"])
def test_random_kills_lose_and_duplicate_no_transition(obs_len):
    """Kills random workers at random steps; each env's counter shows every
    transition exactly once: +1 per step, 0 after a reset or a restart. With
    2048 numbers an env (128 KiB a round), observations come in lease regions."""
    n, steps = 8, 400
    fns = test_envs.class_fns(test_envs.CountingEnv, n, episode_len=25, obs_len=obs_len)
    envs = ShmVectorEnv(fns, num_workers=4, on_worker_death="restart")
    rng = np.random.default_rng(7)
    kills = 0
    try:
        assert (envs._decoder.leases is not None) == (obs_len == 2048)
        obs, _ = envs.reset(seed=0)
        count = obs[:, 0].copy()
        assert (count == 0).all()
        ended = np.zeros(n, dtype=bool)
        transitions = np.zeros(n, dtype=np.int64)
        for _ in range(steps):
            if rng.random() < 0.05:
                kill(envs, int(rng.integers(4)))
                kills += 1
            actions = rng.integers(0, 4, n)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            restarted = infos.get("_worker_restarted", np.zeros(n, dtype=bool))
            for e in range(n):
                if restarted[e]:
                    assert obs[e, 0] == 0 and truncations[e] and rewards[e] == 0, e
                elif ended[e]:  # NEXT_STEP: the step after an end is the reset
                    assert obs[e, 0] == 0 and rewards[e] == 0, e
                else:
                    assert obs[e, 0] == count[e] + 1, (e, obs[e], count[e])
                    assert obs[e, 1] == actions[e] and rewards[e] == obs[e, 0]
            transitions += 1
            count = obs[:, 0].copy()
            ended = terminations | truncations
        assert kills >= 10
        assert envs.stats()["worker_restarts"] == kills
        assert (transitions == steps).all()
        assert envs.stats()["steps"] == n * steps
    finally:
        envs.close()


def test_a_replacement_that_cannot_start_is_an_error():
    """An env_fn that fails in the replacement: the restart is reported, not retried."""
    fns = test_envs.class_fns(test_envs.CountingEnv, 2)
    envs = ShmVectorEnv(fns, num_workers=2, on_worker_death="restart", context="fork")
    try:
        envs.reset(seed=0)
        envs.env_fns[1] = FailingFactory()  # replacements are built from env_fns
        kill(envs, 1)
        with pytest.raises(RuntimeError, match="factory boom") as error:
            envs.step(np.zeros(2, dtype=np.int64))
        assert "while restarting shmvec worker 1" in notes(error.value)
    finally:
        envs.close()


class Transitions:
    """Checks an async run of CountingEnvs result by result: each env's counter
    goes +1 per step, 0 after a reset or a restart; counts what each env got."""

    def __init__(self, n: int) -> None:
        self.last: dict[int, tuple] = {}
        self.action_sent: dict[int, int] = {}
        self.sent = np.zeros(n, dtype=np.int64)
        self.received = np.zeros(n, dtype=np.int64)
        self.restarted: set[int] = set()  # envs that delivered a worker_restarted result
        self.restarts = dict.fromkeys(range(n), 0)  # how many each delivered

    def check(self, obs, rewards, terminations, truncations, infos) -> None:
        restarted = infos.get("_worker_restarted", np.zeros(len(obs), dtype=bool))
        for row, e in enumerate(infos["env_id"].tolist()):
            self.received[e] += 1
            self.restarts[e] += int(restarted[row])
            if e not in self.last:  # its reset (by a replacement or not)
                assert obs[row, 0] == 0 and not truncations[row], (e, obs[row])
            elif restarted[row]:  # a fresh env ends the episode its worker lost
                assert obs[row, 0] == 0 and truncations[row] and rewards[row] == 0, e
                self.restarted.add(e)
            elif self.last[e][1]:  # NEXT_STEP: the step after an end is the reset
                assert obs[row, 0] == 0 and rewards[row] == 0, (e, obs[row])
            else:
                assert obs[row, 0] == self.last[e][0] + 1, (e, obs[row], self.last[e])
                assert obs[row, 1] == self.action_sent[e]
            self.last[e] = (obs[row, 0], terminations[row] or truncations[row])

    def step(self, envs: ShmVectorEnv, rng) -> np.ndarray:
        """recv(), check, send random actions back; the env ids."""
        result = envs.recv()
        self.check(*result)
        ids = result[4]["env_id"]
        actions = rng.integers(0, 4, len(ids))
        envs.send(actions, ids)
        for e, a in zip(ids.tolist(), actions.tolist()):
            self.action_sent[e], self.sent[e] = a, self.sent[e] + 1
        return ids

    def drain(self, envs: ShmVectorEnv) -> None:
        """Receives every result still due; then each env got one per action, plus
        its reset."""
        for _ in range(envs.num_envs // envs.batch_size):
            self.check(*envs.recv())
        assert np.array_equal(self.received, self.sent + 1), (self.received, self.sent)


@pytest.mark.parametrize(
    "step_in_main,obs_len",
    [(False, 2), (True, 2), (False, 2048)],
    ids=["workers", "main-too", "lent"],
)
def test_async_random_kills_lose_and_duplicate_no_transition(step_in_main, obs_len):
    """Async mode: every env's results, counted and checked against its counter,
    show each transition once, whichever worker died while it ran. With 2048
    numbers an env (64 KiB a batch), observations come in lease regions."""
    n, batch = 8, 4
    fns = test_envs.class_fns(test_envs.CountingEnv, n, episode_len=25, obs_len=obs_len)
    envs = ShmVectorEnv(
        fns, num_workers=4, batch_size=batch, on_worker_death="restart", step_in_main=step_in_main
    )
    assert (envs._decoder.leases is not None) == (obs_len == 2048)
    rng = np.random.default_rng(11)
    run, kills, t = Transitions(n), 0, 0
    try:
        envs.async_reset(seed=0)
        while True:
            alive = all(p.exitcode is None for p in envs._pool.workers)
            if t >= 300 and kills >= 10 and alive:  # deaths are noticed within 0.1 s
                break
            t += 1
            if alive and rng.random() < 0.07:  # one death here; several: below
                kill(envs, int(rng.integers(1 if step_in_main else 0, 4)))
                kills += 1
            run.step(envs, rng)
        run.drain(envs)
        assert kills >= 10
        assert envs.stats()["worker_restarts"] == kills
    finally:
        envs.close()


@pytest.mark.parametrize("lent", [False, True], ids=["copied", "lent"])
@pytest.mark.parametrize("where", ["step", "obs", "info"])
def test_async_restart_wherever_the_worker_dies(where, lent, monkeypatch):
    """The three states a dying worker can leave its last env in: no row yet,
    a claimed row never published (a hole in its slot), a published row whose
    message never came. The env still delivers exactly one result, into the
    lease region bound to its row's slot too."""
    if lent:
        monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)
    n, batch = 6, 2
    envs = ShmVectorEnv(
        [test_envs.DiesWhenTold] * n, num_workers=3, batch_size=batch, on_worker_death="restart"
    )
    assert (envs._decoder.leases is not None) == lent
    rng = np.random.default_rng(3)
    run = Transitions(n)
    try:
        envs.async_reset(seed=0)
        for t in range(60):
            if t == 20:
                envs.set_attr("die", [""] * 3 + [where] + [""] * 2)
            if t == 30:
                time.sleep(0.2)  # past LIVENESS_CHECK_S: the next recv notices
            run.step(envs, rng)  # the replacement's envs are new: they live on
        run.drain(envs)
        assert envs.stats()["worker_restarts"] == 1
        assert 3 in run.restarted  # its lost step came back as a truncation
    finally:
        envs.close()


class SlowOrTalkative(test_envs.DiesWhenTold):
    """Envs 0-1 are slow; envs 2-3 put a pickled info in every step, so that
    their rows come first and both carry a message."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.delay = 0.05 if index < 2 else 0.0

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.index >= 2 and not info:
            info = {"note": f"env {self.index}"}
        return obs, reward, terminated, truncated, info


def test_async_death_while_main_reads_the_slots_messages(monkeypatch):
    """Worker 1 dies sending env 3's message, after publishing its row, often
    while main is reading the slot's messages and has read env 2's: only env
    3's row is redone, env 2's result stands (the counters check both)."""
    # No periodic liveness check: the death is noticed while reading messages.
    monkeypatch.setattr(shmvec.engine.async_engine.AsyncEngine, "periodic_check_s", 60.0)
    envs = ShmVectorEnv(
        test_envs.indexed_fns(SlowOrTalkative, 4), num_workers=2, batch_size=2,
        on_worker_death="restart",
    )  # fmt: skip
    rng = np.random.default_rng(4)
    run = Transitions(4)
    try:
        envs.async_reset(seed=0)
        for t in range(100):  # four deaths
            if t % 25 == 10:
                envs.set_attr("die", ["", "", "", "info"])
            run.step(envs, rng)
        run.drain(envs)
        assert envs.stats()["worker_restarts"] == 4
        assert run.restarted == {2, 3}  # env 3's lost steps, env 2's next ones
    finally:
        envs.close()


def test_async_death_during_a_call_restarts_then_raises():
    n = 6
    envs = ShmVectorEnv(
        test_envs.class_fns(test_envs.CountingEnv, n), num_workers=3, batch_size=2,
        on_worker_death="restart",
    )  # fmt: skip
    rng = np.random.default_rng(2)
    run = Transitions(n)
    try:
        envs.async_reset(seed=0)
        for _ in range(10):
            run.step(envs, rng)
        kill(envs, 2)
        with pytest.raises(WorkerDiedError, match=r"worker 2 .*SIGKILL") as error:
            envs.get_attr("t")
        assert "restarted" in notes(error.value)
        assert len(envs.get_attr("t")) == n
        for _ in range(20):
            run.step(envs, rng)
        run.drain(envs)
        assert envs.stats()["worker_restarts"] == 1
    finally:
        envs.close()


# ------------------------------------------------ several workers dead at once


def kill_at_once(envs: ShmVectorEnv, indices) -> list[int]:
    """SIGKILLs workers ``indices`` in one tight loop, then waits until each is
    gone (so that none finishes a step posted after its kill): the env ids of
    their blocks."""
    processes = [envs._pool.workers[i] for i in indices]
    for process in processes:
        os.kill(process.pid, signal.SIGKILL)
    for process in processes:
        process.join(5)
    return [e for i in indices for e in envs._pool.blocks[i]]


def kill_plan(rng, num_workers: int, rounds: int) -> list[list[int]]:
    """Per round, the workers to kill at once: two of them, or every one (every
    third round, and at least once)."""
    plan = []
    for r in range(rounds):
        if r % 3 == 2:
            plan.append(list(range(num_workers)))
        else:
            plan.append(sorted(rng.choice(num_workers, 2, replace=False).tolist()))
    return plan


@pytest.mark.parametrize(
    "concurrency,obs_len",
    [(None, 2), (3, 2), (None, 2048)],
    ids=["serial", "env-threads", "lent"],
)
def test_async_workers_killed_together_are_all_restarted(concurrency, obs_len):
    """Two workers, then every worker, SIGKILLed in the same loop while every env
    has a step in flight, round after round: each env of a killed worker reports
    ``worker_restarted`` exactly once per death, no transition is lost or
    duplicated (each env's counter checks it), and recv() never raises."""
    n, workers, batch = 12, 4, 4
    fns = test_envs.class_fns(test_envs.CountingEnv, n, episode_len=25, obs_len=obs_len)
    envs = ShmVectorEnv(
        fns, num_workers=workers, batch_size=batch, on_worker_death="restart",
        env_concurrency=concurrency,
    )  # fmt: skip
    seed = 21
    rng = np.random.default_rng(seed)
    run, killed = Transitions(n), 0
    try:
        envs.async_reset(seed=0)
        for _ in range(5):
            run.step(envs, rng)
        for indices in kill_plan(rng, workers, 6):
            due = kill_at_once(envs, indices)
            killed += len(indices)
            before = {e: run.restarts[e] for e in due}
            deadline = time.monotonic() + 60
            while any(run.restarts[e] == before[e] for e in due):
                assert time.monotonic() < deadline, f"seed {seed}: {indices} not all restarted"
                run.step(envs, rng)
            assert all(run.restarts[e] == before[e] + 1 for e in due), f"seed {seed}"
            for _ in range(int(rng.integers(0, 6))):
                run.step(envs, rng)
        run.drain(envs)
        assert sum(run.restarts.values()) == 3 * (2 * 4 + 4 * 2)  # 3 envs a worker
        assert envs.stats()["worker_restarts"] == killed
        assert all(p.exitcode is None for p in envs._pool.workers)
    finally:
        envs.close()


@pytest.mark.parametrize("mode", [NEXT, SAME])
def test_sync_workers_killed_together_are_all_restarted(mode):
    """Sync mode: two workers, then every worker, SIGKILLed together before a
    step: that step reports ``worker_restarted`` (a truncation) for exactly their
    envs; every other env's transition is counted once; a kill of every worker
    before a reset gives the reset asked for."""
    n, workers = 8, 4
    fns = test_envs.class_fns(test_envs.CountingEnv, n, episode_len=25)
    envs = ShmVectorEnv(fns, num_workers=workers, on_worker_death="restart", autoreset_mode=mode)
    seed = 5
    rng = np.random.default_rng(seed)
    killed = 0
    try:
        obs, _ = envs.reset(seed=0)
        count, ended = obs[:, 0].copy(), np.zeros(n, dtype=bool)
        for indices in kill_plan(rng, workers, 9):
            due = np.zeros(n, dtype=bool)
            due[kill_at_once(envs, indices)] = True
            killed += len(indices)
            actions = rng.integers(0, 4, n)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            restarted = infos.get("_worker_restarted", np.zeros(n, dtype=bool))
            assert np.array_equal(restarted, due), f"seed {seed}: {indices}"
            assert (obs[due, 0] == 0).all() and truncations[due].all() and (rewards[due] == 0).all()
            for e in np.flatnonzero(~due):
                want = 0 if (ended[e] and mode == NEXT) else count[e] + 1
                assert obs[e, 0] == want, (seed, e, obs[e], count[e])
            count, ended = obs[:, 0].copy(), terminations | truncations
        kill_at_once(envs, range(workers))
        killed += workers
        obs, infos = envs.reset(seed=7)
        assert infos["_worker_restarted"].all() and (obs[:, 0] == 0).all()
        assert envs.stats()["worker_restarts"] == killed
    finally:
        envs.close()


def test_rollouts_survive_workers_killed_together():
    """The rollout layer over a vector env whose workers are SIGKILLed two at a
    time and all at once, trajectories in flight: the trainer sees no exception
    while it takes batches until every death is recovered; no task is handed
    over twice or lost; the lost trajectories are counted as ``worker_died`` and
    retried; every trajectory handed over (retried ones included) replays bit
    for bit."""
    from shmvec.rollouts import Rollouts, Task, replay

    n, workers = 8, 4
    env_fn = functools.partial(TaskEnv, max_len=12, wait_s=0.002)
    envs = ShmVectorEnv(
        [env_fn] * n, num_workers=workers, batch_size=2, on_worker_death="restart",
        on_env_error="reset", env_concurrency=2,
    )  # fmt: skip
    seed = 9
    rng = np.random.default_rng(seed)
    tasks = (Task(seed=s) for s in itertools.count())
    groups, killed = [], 0
    try:
        with Rollouts(envs, obs_policy, group_size=2, tasks=tasks, max_retries=20) as rollouts:
            groups += rollouts.get_batch(2)
            for indices in kill_plan(rng, workers, 6):
                kill_at_once(envs, indices)
                killed += len(indices)
                deadline = time.monotonic() + 60
                while envs.stats()["worker_restarts"] < killed:  # noticed as the loop runs
                    assert time.monotonic() < deadline, f"seed {seed}: {indices} not restarted"
                    groups += rollouts.get_batch(1)
            deadline = time.monotonic() + 60
            while not any(t.attempt for g in groups for t in g.trajectories):
                assert time.monotonic() < deadline, f"seed {seed}: no retried trajectory"
                groups += rollouts.get_batch(1)  # the retries of the lost ones come in
            stats = rollouts.stats()
        seeds = [g.task.seed for g in groups]
        assert len(seeds) == len(set(seeds)), f"seed {seed}: a task handed over twice"
        ended = stats["groups_delivered"] + sum(stats["groups_dropped"].values())
        assert ended + stats["groups_pending"] == stats["groups_submitted"]
        assert stats["dropped"].get("worker_died", 0) >= 1
        assert stats["launched"] == (
            stats["completed"] + sum(stats["dropped"].values()) + stats["in_flight"]
        )
        assert envs.stats()["worker_restarts"] == killed
        for group in groups:
            for traj in group.trajectories:
                replay(traj, env_fn)
    finally:
        envs.close()


# ------------------------------------------------------------- env_timeout


@pytest.mark.parametrize("policy", ["restart", "raise"])
def test_env_timeout_kills_a_stuck_worker(policy):
    fns = test_envs.class_fns(test_envs.CountingEnv, 4)
    envs = ShmVectorEnv(fns, num_workers=2, on_worker_death=policy, env_timeout=0.5)
    try:
        envs.reset(seed=0)
        envs.set_attr("delay", [0.0, 0.0, 0.0, 30.0])
        if policy == "raise":
            with pytest.raises(WorkerDiedError, match=r"worker 1 .*SIGKILL") as error:
                envs.step(np.zeros(4, dtype=np.int64))
            assert "stuck in env 3 for more than env_timeout=0.5 s" in notes(error.value)
            return
        obs, rewards, terminations, truncations, infos = envs.step(np.ones(4, dtype=np.int64))
        assert np.array_equal(truncations, [False, False, True, True])
        assert np.array_equal(obs[:2], [[1, 1], [1, 1]]) and (obs[2:] == 0).all()
        assert np.array_equal(infos["_worker_restarted"], [False, False, True, True])
        # The replacement's envs are new: no delay any more.
        obs = envs.step(np.ones(4, dtype=np.int64))[0]
        assert np.array_equal(obs[:, 0], [2, 2, 0, 0])
    finally:
        envs.close()


class Napping(test_envs.CountingEnv):
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_env_timeout_in_async_mode_times_a_call_from_its_start():
    """A call that takes less than env_timeout, made after the workers sat idle
    for longer than it, is not taken for stuck (its env's clock starts with it)."""
    fns = test_envs.class_fns(Napping, 4)
    envs = ShmVectorEnv(fns, num_workers=2, batch_size=2, env_timeout=1.0)
    try:
        envs.async_reset(seed=0)
        for _ in range(4):
            ids = envs.recv()[4]["env_id"]
            envs.send(np.ones(len(ids), dtype=np.int64), ids)
        time.sleep(1.5)  # every env's last step began long before env_timeout
        assert envs.call("nap", 0.2) == (0.2,) * 4  # main checks the workers meanwhile
        assert envs.stats()["worker_restarts"] == 0
    finally:
        envs.close()


@pytest.mark.parametrize("policy", ["restart", "raise"])
def test_env_timeout_in_async_mode_times_each_env(policy):
    """Env 3 hangs; the other envs keep filling batches, and env 3's worker is
    killed once env 3 has run past env_timeout."""
    fns = test_envs.class_fns(test_envs.CountingEnv, 6)
    envs = ShmVectorEnv(fns, num_workers=3, batch_size=2, on_worker_death=policy, env_timeout=0.3)
    rng = np.random.default_rng(5)
    run = Transitions(6)
    try:
        envs.async_reset(seed=0)
        envs.set_attr("delay", [0.0] * 3 + [30.0] + [0.0] * 2)
        started = time.monotonic()
        if policy == "raise":
            with pytest.raises(WorkerDiedError, match=r"worker 1 .*SIGKILL") as error:
                while time.monotonic() - started < 20:
                    run.step(envs, rng)
            assert "stuck in env 3 for more than env_timeout=0.3 s" in notes(error.value)
            return
        while 3 not in run.restarted and time.monotonic() - started < 20:
            run.step(envs, rng)
        assert 3 in run.restarted and envs.stats()["worker_restarts"] == 1
        for _ in range(20):  # the new env 3 has no delay
            run.step(envs, rng)
        run.drain(envs)
    finally:
        envs.close()


# ------------------------------------------------------------- env errors


@pytest.mark.parametrize("mode", [NEXT, SAME, DISABLED])
def test_on_env_error_reset_truncates_that_env_only(mode):
    envs = ShmVectorEnv(
        test_envs.indexed_fns(test_envs.FailingEnv, 4, fail_index=1, fail_step=3),
        num_workers=2,
        on_env_error="reset",
        autoreset_mode=mode,
    )
    try:
        envs.reset(seed=0)
        for t in (1, 2):
            obs = envs.step(np.full(4, 2))[0]
            assert (obs[:, 0] == t).all()
        obs, rewards, terminations, truncations, infos = envs.step(np.full(4, 2))
        assert np.array_equal(obs[:, 0], [3, 0, 3, 3])
        assert np.array_equal(truncations, [False, True, False, False])
        assert rewards[1] == 0 and not terminations.any()
        assert np.array_equal(infos["_env_error"], [False, True, False, False])
        assert infos["env_error"][1] == "EnvBoom: step boom in env 1 at step 3"
        if mode == SAME:
            assert infos["_final_obs"][1] and np.array_equal(infos["final_obs"][1], obs[1])
        assert envs.stats()["env_resets"] == 1
        if mode == DISABLED:
            envs.reset(options={"reset_mask": truncations})
        obs = envs.step(np.full(4, 2))[0]
        expected_env_1 = 0 if mode == NEXT else 1  # NEXT_STEP: the reset step
        assert np.array_equal(obs[:, 0], [4, expected_env_1, 4, 4])
        # Resets and calls still raise: there is nothing to truncate.
        with pytest.raises(test_envs.EnvBoom, match="reset boom"):
            envs.reset(options={"fail": True})
    finally:
        envs.close()


def test_on_env_error_reset_in_async_mode():
    envs = ShmVectorEnv(
        test_envs.indexed_fns(test_envs.FailingEnv, 4, fail_index=2, fail_step=2),
        num_workers=2,
        batch_size=2,
        on_env_error="reset",
    )
    try:
        envs.async_reset(seed=0)
        seen = {e: [] for e in range(4)}
        while len(seen[2]) < 7:  # two of its episodes fail: steps 3 and 6
            obs, rewards, terminations, truncations, infos = envs.recv()
            for row, e in enumerate(infos["env_id"].tolist()):
                error = infos["env_error"][row] if infos.get("_env_error", [0, 0])[row] else None
                seen[e].append((int(obs[row, 0]), bool(truncations[row]), error))
            envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
        assert seen[2][:3] == [
            (0, False, None),
            (1, False, None),
            (0, True, "EnvBoom: step boom in env 2 at step 2"),
        ]
        assert all(error is None for e in (0, 1, 3) for _, _, error in seen[e])
        # Env 2 fails again in each new episode (its second step): each is counted.
        errors = sum(error is not None for _, _, error in seen[2])
        assert errors >= 2 and envs.stats()["env_resets"] == errors
    finally:
        envs.close()


def assert_resets_take_their_seeds(envs: ShmVectorEnv) -> None:
    """Two rounds of resets of every (idle) env of ``envs``, each with its own seed:
    every reset observation is TaskEnv's for that seed."""
    alone = TaskEnv()
    for seed in (100, 200):
        envs.async_reset(
            seed=[seed + e for e in range(envs.num_envs)], env_ids=np.arange(envs.num_envs)
        )
        for _ in range(envs.num_envs // envs.batch_size):
            obs, _, _, _, infos = envs.recv()
            for row, e in enumerate(infos["env_id"].tolist()):
                expected, _ = alone.reset(seed=seed + e)
                assert np.array_equal(obs[row], expected), (seed, e)


def test_async_resets_after_a_restart_get_their_own_seeds():
    """A replacement gets the reset arguments of the envs whose command is a
    reset, and no earlier ones: every later reset of its envs starts from the
    seed it was given (a stepping env's old arguments would be taken by its next
    reset, and each reset after that would get the one before it)."""
    slow = functools.partial(TaskEnv, wait_s=0.05, max_len=1000)
    envs = ShmVectorEnv(
        [slow] * 4, num_workers=2, batch_size=2, on_worker_death="restart", env_concurrency=2
    )
    try:
        envs.async_reset(seed=list(range(4)))
        results = dict.fromkeys(range(4), 0)
        while min(results.values()) < 3:  # every env has reset and is stepping now
            _, _, _, _, infos = envs.recv()
            for e in infos["env_id"].tolist():
                results[e] += 1
            envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
        os.kill(envs._pool.workers[1].pid, signal.SIGKILL)  # in a 50 ms step, or about to be
        idle = [e for _ in range(2) for e in envs.recv()[4]["env_id"].tolist()]
        assert sorted(idle) == [0, 1, 2, 3]
        assert_resets_take_their_seeds(envs)
    finally:
        envs.close()


@pytest.mark.parametrize("trial", range(3))
def test_restarted_env_threads_each_read_their_own_reset(trial):
    """After a restart, the replacement's envs report their first reset from
    their own threads at once: each reads its own seed from the pipe."""
    envs = ShmVectorEnv(
        [TaskEnv] * 16, num_workers=2, batch_size=4, on_worker_death="restart",
        env_concurrency=8,
    )  # fmt: skip
    try:
        envs.async_reset(seed=list(range(16)))
        for _ in range(4):
            envs.recv()  # every env idle
        os.kill(envs._pool.workers[1].pid, signal.SIGKILL)
        envs._pool.workers[1].join(5)
        assert_resets_take_their_seeds(envs)
    finally:
        envs.close()


# ------------------------------------------------------------- arguments


def test_policy_arguments_are_checked():
    fns = test_envs.class_fns(test_envs.CountingEnv, 2)
    with pytest.raises(ValueError, match="on_worker_death must be 'raise' or 'restart'"):
        ShmVectorEnv(fns, on_worker_death="respawn")
    with pytest.raises(ValueError, match="on_env_error must be 'raise' or 'reset'"):
        ShmVectorEnv(fns, on_env_error="ignore")
    with pytest.raises(ValueError, match="env_timeout must be a positive"):
        ShmVectorEnv(fns, env_timeout=0)


# -------------------------------------------- deaths that another waiter reaps


def kill_and_reap(envs: ShmVectorEnv, indices) -> None:
    """SIGKILLs workers ``indices`` and reaps them with ``os.waitpid``, as a
    user's thread that joins them might first: multiprocessing then never
    learns their exit status, and only their pipes and sentinels tell."""
    processes = [envs._pool.workers[i] for i in indices]
    for process in processes:
        os.kill(process.pid, signal.SIGKILL)
    for process in processes:
        os.waitpid(process.pid, 0)


def recv_all(envs: ShmVectorEnv, count: int) -> dict[int, tuple]:
    """recv(partial=True) until ``count`` results came: env -> (obs, infos row)."""
    got: dict[int, tuple] = {}
    while len(got) < count:
        obs, _, _, _, infos = envs.recv(timeout=30, partial=True)
        for row, e in enumerate(infos["env_id"].tolist()):
            assert e not in got, f"env {e} delivered twice"
            got[e] = (obs[row], bool(infos.get("worker_restarted", np.zeros(8))[row]))
    return got


@pytest.mark.parametrize("killed", [[1], [0, 1]], ids=["one", "two"])
@pytest.mark.parametrize("when", ["before", "in-flight"])
def test_async_reset_reaches_the_replacement_of_a_worker_reaped_elsewhere(killed, when):
    """Workers killed and reaped by another waiter (their exit status never
    reaches multiprocessing), before an async_reset of some of their envs or
    while it is in flight: no exception reaches the caller, each env reset
    delivers exactly one result, and the replacements start the envs from the
    seeds given (the reset arguments reach them)."""
    envs = ShmVectorEnv(
        [TaskEnv] * 8, num_workers=2, batch_size=2, on_worker_death="restart",
        env_concurrency=2,
    )  # fmt: skip
    alone = TaskEnv()
    try:
        envs.async_reset(seed=list(range(8)))
        recv_all(envs, 8)  # every env idle
        ids = [1, 2, 5, 6]
        seeds = [100 + e for e in range(8)]  # by env: only those of ``ids`` are taken
        if when == "before":
            kill_and_reap(envs, killed)
            envs.async_reset(seed=seeds, env_ids=ids)
        else:
            envs.async_reset(seed=seeds, env_ids=ids)
            kill_and_reap(envs, killed)
        got = recv_all(envs, len(ids))
        assert sorted(got) == ids
        for e in ids:
            expected, _ = alone.reset(seed=seeds[e])
            obs, restarted = got[e]
            # A reset that finished before its worker died is delivered as it
            # is; one that did not is redone by the replacement with its seed.
            assert np.array_equal(obs, expected) or restarted, (e, obs, expected)
        # Resets of every env, those of the killed workers' blocks too: their
        # replacements deliver them (the results above may all predate the kills).
        assert_resets_take_their_seeds(envs)
        assert envs.stats()["worker_restarts"] == len(killed)
        for index in killed:
            assert envs._pool.workers[index].exitcode is None  # the replacement lives
    finally:
        envs.close()


def test_a_replacement_is_sent_no_reset_whose_row_stands():
    """A worker killed after publishing its envs' reset rows, before main read
    them: those rows stand, so its replacement gets no reset arguments for them;
    each later reset of those envs starts from the seed it was given (arguments
    it never took would be taken by the next reset instead)."""
    slow = functools.partial(TaskEnv, wait_s=2.0, max_len=1000)
    envs = ShmVectorEnv(
        [slow, slow, TaskEnv, TaskEnv], num_workers=2, batch_size=3,
        on_worker_death="restart", env_concurrency=2,
    )  # fmt: skip
    alone = TaskEnv()
    try:
        envs.async_reset(seed=list(range(4)))
        recv_all(envs, 4)  # every env idle
        wire = envs._async.wire
        envs.send(np.zeros(1, dtype=np.int64), [0])  # the slot's third row, in 2 s
        envs.async_reset(seed=[100 + e for e in range(4)], env_ids=[2, 3])  # worker 1's
        while sum(wire.published(s) for s in range(len(envs._pool.slots))) < 2:
            time.sleep(0.001)
        kill(envs, 1)
        # The slot waits for env 0's row: the wait notices the death and restarts.
        got = recv_all(envs, 3)
        assert envs.stats()["worker_restarts"] == 1
        for e in (2, 3):
            assert np.array_equal(got[e][0], alone.reset(seed=100 + e)[0]), e
        for trial in range(3):
            seeds = [1000 * (trial + 1) + e for e in range(4)]
            envs.async_reset(seed=seeds, env_ids=[2, 3])
            got = recv_all(envs, 2)
            for e in (2, 3):
                assert np.array_equal(got[e][0], alone.reset(seed=seeds[e])[0]), (trial, e)
    finally:
        envs.close()
