"""The lag bound and staleness over real envs: a trainer that resumes at version
1000 or bumps the version twice per batch keeps every group within max_lag;
stale trajectories of complete groups are rerun ("rerun") or dropped through the
group policy and counted ("drop"); and a random schedule of every trainer
operation, env errors, steps past the deadline and killed workers keeps every
promise, in both modes and under all three on_stale policies."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from rollout_envs import TaskEnv, obs_policy

import shmvec
from shmvec.rollouts import Rollouts, Status, Task, replay
from shmvec.rollouts.book import Book
from shmvec.rollouts.groups import GroupPolicy
from shmvec.rollouts.lag import LagRule

pytestmark = pytest.mark.timeout(240)


def cartpole():
    return gym.make("CartPole-v1")


def cartpole_policy(batch):
    return (batch.observations[:, 2] > 0).astype(np.int64)


def cartpole_envs():
    return shmvec.ShmVectorEnv(
        [cartpole] * 8,
        num_workers=2,
        batch_size=4,
        on_env_error="reset",
        on_worker_death="restart",
    )


def ledger_holds(stats):
    attempts = stats["completed"] + sum(stats["dropped"].values()) + stats["in_flight"]
    groups = (
        stats["groups_delivered"] + sum(stats["groups_dropped"].values()) + stats["groups_pending"]
    )
    return stats["launched"] == attempts and stats["groups_submitted"] == groups


def test_a_trainer_resumed_at_version_1000_keeps_the_bound():
    envs = cartpole_envs()
    try:
        with Rollouts(envs, cartpole_policy, group_size=2, max_lag=1,
                      groups_per_batch=2) as rollouts:  # fmt: skip
            rollouts.set_version(1000)
            rollouts.submit(seeds=list(range(40)))
            lags = []
            for _ in range(10):
                lags += [g.lag for g in rollouts.get_batch(2)]
                rollouts.set_version(rollouts.version + 1)
            stats = rollouts.stats()
        assert max(lags) <= 1, lags
        assert 1 in lags  # the admission used the bound, not more
        assert "stale" not in stats["dropped"]  # +1 per batch: nothing had to run again
        assert ledger_holds(stats)
    finally:
        envs.close()


@pytest.mark.parametrize("bumps", [2, 3])
def test_several_version_bumps_per_batch_keep_the_bound(bumps):
    envs = cartpole_envs()
    try:
        with Rollouts(envs, cartpole_policy, group_size=2, max_lag=1,
                      groups_per_batch=2) as rollouts:  # fmt: skip
            rollouts.submit(seeds=list(range(60)))
            groups = []
            for _ in range(10):
                groups += rollouts.get_batch(2)
                for _ in range(bumps):  # one update per minibatch
                    rollouts.set_version(rollouts.version + 1)
            stats = rollouts.stats()
        assert max(g.lag for g in groups) <= 1
        seeds = [g.task.seed for g in groups]
        assert len(seeds) == len(set(seeds))
        # before the rule has seen the rise per batch, a group may fall behind: it ran again
        assert stats["dropped"].get("stale", 0) <= stats["retries"]
        assert ledger_holds(stats)
    finally:
        envs.close()


def complete_three_groups(on_stale):
    envs = cartpole_envs()
    rollouts = Rollouts(envs, cartpole_policy, group_size=2, max_lag=0, on_stale=on_stale)
    rollouts.submit(seeds=[1, 2, 3])
    deadline = time.monotonic() + 60
    while rollouts.stats()["completed"] < 6:
        assert time.monotonic() < deadline, rollouts.stats()
        time.sleep(0.01)
    return envs, rollouts


def test_rerun_reruns_the_stale_trajectories_of_complete_groups():
    envs, rollouts = complete_three_groups("rerun")
    try:
        (first,) = rollouts.get_batch(1)
        rollouts.set_version(1)
        rest = rollouts.get_batch(2, timeout=60)
        stats = rollouts.stats()
        assert sorted(g.task.seed for g in [first, *rest]) == [1, 2, 3]
        for group in rest:
            assert group.lag == 0 and len(group.trajectories) == 2
            for traj in group.trajectories:
                assert traj.attempt == 1 and traj.retried_after == [Status.STALE]
                assert traj.versions == [1] * traj.num_steps
                replay(traj, cartpole)
            assert [t.status for t in group.failed] == [Status.STALE] * 2
        assert stats["dropped"] == {"stale": 4} and stats["retries"] == 4
        assert stats["completed"] == 6 and ledger_holds(stats)
    finally:
        rollouts.close()
        envs.close()


def test_drop_counts_every_stale_trajectory_of_complete_groups():
    envs, rollouts = complete_three_groups("drop")
    try:
        rollouts.get_batch(1)
        rollouts.set_version(1)
        with pytest.raises(RuntimeError, match="can never be complete"):
            rollouts.get_batch(2, timeout=60)
        stats = rollouts.stats()
        assert stats["dropped"] == {"stale": 4} and stats["groups_dropped"] == {"stale": 2}
        assert stats["completed"] == 2 and stats["retries"] == 0 and ledger_holds(stats)
    finally:
        rollouts.close()
        envs.close()


def run_group(on_stale, min_survivors):
    """One group of two in a Book: the first finishes at version 0, the second
    at version 1; then the version moves to 2 with max_lag=1."""
    policy = GroupPolicy(2, max_retries=1, min_survivors=min_survivors)
    book = Book(policy, LagRule(max_lag=1, on_stale=on_stale), [None, None])
    book.tasks.append(Task(seed=7))
    starts = book.launch(0.0)
    for version, (env, traj) in enumerate(starts):
        book.set_version(version, 0.0)
        assert book.returned(env) is traj
        book.reset_done(traj, 0.0, {})
        assert book.answered(traj, 1, None, version, 0.0)
        assert book.returned(env) is traj
        assert not book.step_done(traj, 0.0, 1.0, True, False, {}, 0.0)
    assert book.can_hand_over(1, 0.0)
    book.set_version(2, 0.0)
    return book, starts


def test_drop_applies_min_survivors_to_a_complete_group_that_fell_behind():
    book, (old, new) = run_group("drop", min_survivors=1)
    (group,) = book.hand_over(1, 0.0)
    assert group.trajectories == [new[1]] and group.failed == [old[1]]
    assert old[1].status is Status.STALE and group.lag == 1
    assert book.ledger.completed == 1 and book.ledger.dropped == {"stale": 1}

    book, _ = run_group("drop", min_survivors=None)
    assert not book.groups and book.ledger.groups_dropped == {"stale": 1}


def test_rerun_reopens_a_complete_group_that_fell_behind():
    book, (old, new) = run_group("rerun", min_survivors=None)
    assert not book.can_hand_over(1, 0.0)
    ((env, again),) = book.launch(0.0)
    assert again.attempt == 1 and again.index == old[1].index
    assert again.retried_after == [Status.STALE] and book.ledger.retries == 1
    book.check()


# ------------------------------------------------------------ random schedules

SCHEDULE_OPS = int(os.environ.get("SHMVEC_SCHEDULE_OPS", "30"))
#: SIGKILL workers too, one or two at once (SHMVEC_SCHEDULE_KILLS=1): by hand, since each kill
#: costs a restart; test_restart.py kills workers deterministically in every run.
SCHEDULE_KILLS = os.environ.get("SHMVEC_SCHEDULE_KILLS", "0") == "1"


def kill_a_worker(envs, rng) -> int:
    """SIGKILLs one worker, or sometimes two at once, whenever the schedule
    says so (a restart may still be under way: any number of deaths are
    recovered), and reaps them here, in the trainer's thread, while the rollout
    loop's thread may be waiting on them too. Returns how many it killed."""
    workers = list(envs._pool.workers)
    chosen = rng.sample(workers, rng.choice([1, 1, 2]))
    for process in chosen:
        with contextlib.suppress(ProcessLookupError):  # it died, and the loop reaped it
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGKILL)
    for process in chosen:
        process.join(5)
    return len(chosen)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("on_stale", ["wait", "drop", "rerun"])
def test_a_random_schedule_keeps_every_promise(on_stale, mode):
    seed = int(os.environ.get("SHMVEC_SCHEDULE_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    max_lag = rng.choice([0, 1, 2])
    gpb = rng.randint(1, 3)
    fn = functools.partial(TaskEnv, max_len=6, fault_rate=0.03, hang_rate=0.01, hang_s=30.0)
    envs = shmvec.ShmVectorEnv([fn] * 8, num_workers=2, batch_size=2, env_concurrency=4,
                               step_deadline=0.3, on_env_error="reset",
                               on_worker_death="restart")  # fmt: skip
    rollouts = Rollouts(
        envs, obs_policy, group_size=rng.randint(1, 3), mode=mode, max_lag=max_lag,
        on_stale=on_stale, groups_per_batch=gpb, max_retries=rng.choice([1, 3]),
        min_survivors=rng.choice([None, 1]), redundancy=rng.choice([0, 1]),
    )  # fmt: skip
    submitted, delivered, ops, kills = 0, [], [], 0
    try:
        for _ in range(SCHEDULE_OPS):
            choices = ["submit", "get_batch", "get_batch", "version", "pause"]
            op = rng.choice([*choices, "kill"] if SCHEDULE_KILLS else choices)
            ops.append(op)
            if op == "submit":
                k = rng.choice([1, 3, 8])
                rollouts.submit(seeds=list(range(submitted, submitted + k)))
                submitted += k
            elif op == "get_batch":
                n = rng.choice([gpb, gpb, 1, gpb + 1])
                try:
                    batch = rollouts.get_batch(n, timeout=60)
                except RuntimeError as error:
                    assert "can never be complete" in str(error)
                    batch = []
                assert len(batch) in (0, n)
                delivered += batch
                for group in batch:
                    assert group.lag <= max_lag and group.version == rollouts.version
                    assert 1 <= len(group.trajectories) <= rollouts.group_size
            elif op == "version":
                rollouts.set_version(rollouts.version + rng.choice([0, 1, 1, 2, 5, 1000]))
            elif op == "kill":
                kills += kill_a_worker(envs, rng)
            else:
                time.sleep(rng.random() * 0.05)
            stats = rollouts.stats()
            assert ledger_holds(stats), stats
            seeds = [g.task.seed for g in delivered]
            assert len(seeds) == len(set(seeds)), "a task handed over twice"
        # drain: every task ends delivered or dropped
        while True:
            stats = rollouts.stats()
            if not stats["groups_pending"] and stats["groups_submitted"] == submitted:
                break
            try:
                delivered += rollouts.get_batch(1, timeout=60)
            except RuntimeError as error:
                assert "can never be complete" in str(error)
                break
        stats = rollouts.stats()
        seeds = [g.task.seed for g in delivered]
        assert len(seeds) == len(set(seeds))
        dropped = sum(stats["groups_dropped"].values())
        assert stats["groups_submitted"] == submitted == len(seeds) + dropped, stats
        assert stats["groups_pending"] == 0 and ledger_holds(stats)
        for group in delivered[:10]:
            for traj in group.trajectories:
                replay(traj, functools.partial(TaskEnv, max_len=6))
    except BaseException as error:
        error.add_note(
            f"schedule seed {seed} (SHMVEC_SCHEDULE_SEED={seed}): ops {ops}, kills {kills}"
        )
        raise
    finally:
        rollouts.close()
        envs.close()


def test_envs_that_leave_the_pool_take_no_task_and_take_tasks_again_when_back():
    """``Book.set_lost`` (a cluster's ``lost_env_ids``): a lost env's running attempt goes
    on, no attempt starts on it, and once it is back and idle it takes work again."""
    book = Book(GroupPolicy(1), LagRule(max_lag=None), [None, None, None])
    book.tasks.extend(Task(seed=s) for s in range(3))
    running = dict(book.launch(0.0))
    assert sorted(running) == [0, 1, 2]
    book.set_lost(frozenset({1, 2}))
    book.tasks.extend(Task(seed=s) for s in range(3, 6))
    for env in (0, 1):  # both finish; env 1 is lost, so only env 0 is free again
        assert book.returned(env) is running[env]
        book.reset_done(running[env], 0.0, {})
        assert book.answered(running[env], 1, None, 0, 0.0)
        assert book.returned(env) is running[env]
        book.step_done(running[env], 0.0, 1.0, True, False, {}, 0.0)
    assert [env for env, _ in book.launch(0.0)] == [0]
    book.set_lost(frozenset({2}))  # env 1 is back (idle); env 2 still runs its attempt
    assert [env for env, _ in book.launch(0.0)] == [1]
    book.check()
