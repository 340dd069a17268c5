"""The rollout layer over ShmVectorEnv: complete groups, each trajectory equal
to its env replayed alone, failures as outcomes with honest accounting, the
lag bound, sync and async modes, batched and per-row policies, bad input."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from rollout_envs import GatedResetEnv, GlobalRandomEnv, TaskEnv, obs_policy

import shmvec
from shmvec.rollouts import (
    AsyncPolicy,
    EndTrajectory,
    PolicyError,
    PolicyFailure,
    PolicyOutput,
    ReplayMismatch,
    Rollouts,
    RowOutput,
    Status,
    Task,
    replay,
)

pytestmark = pytest.mark.timeout(240)


def make_envs(n=8, batch_size=4, num_workers=2, env_fn=TaskEnv, **kwargs):
    return shmvec.ShmVectorEnv(
        [env_fn] * n,
        num_workers=num_workers,
        batch_size=batch_size,
        on_env_error="reset",
        on_worker_death="restart",
        **kwargs,
    )


def check_group(group, group_size, env_fn=TaskEnv):
    assert len(group.trajectories) == group_size
    assert sorted(t.index for t in group.trajectories) == sorted(
        t.index for t in group.trajectories
    )
    for traj in group.trajectories:
        assert traj.status.finished
        assert traj.task is group.task
        assert len(traj.observations) == len(traj.actions) + 1 == len(traj.rewards) + 1
        assert len(traj.versions) == len(traj.actions) == len(traj.extras)
        replay(traj, env_fn)


def test_groups_are_complete_and_every_trajectory_replays_alone():
    envs = make_envs()
    try:
        with Rollouts(envs, obs_policy, group_size=4, info_keys=["t"]) as rollouts:
            rollouts.submit([Task(seed=100 + k, options={"bonus": k}) for k in range(12)])
            groups = [g for _ in range(3) for g in rollouts.get_batch(4)]
            stats = rollouts.stats()
        assert sorted(g.task.seed for g in groups) == list(range(100, 112))
        for group in groups:
            check_group(group, 4)
            # one task per group: the same seed gives the same reset observation
            first = [t.observations[0] for t in group.trajectories]
            assert all(np.array_equal(first[0], o) for o in first)
            for traj in group.trajectories:
                assert traj.infos[-1]["t"] == traj.num_steps
                assert traj.reset_info == {}
        assert stats["groups_delivered"] == 12 and stats["launched"] == 48
        assert stats["completed"] == 48 and stats["dropped"] == {} and stats["in_flight"] == 0
    finally:
        envs.close()


def test_env_errors_are_retried_counted_and_retries_replay():
    fn = functools.partial(TaskEnv, fault_rate=0.15)
    envs = make_envs(env_fn=fn)
    try:
        # An 8-step attempt fails with probability 1 - 0.85**8 = 0.73: with 20 retries one of
        # the 60 trajectories ran out of them in about 1% of runs; with 60, about 1e-8.
        with Rollouts(envs, obs_policy, group_size=2, max_retries=60) as rollouts:
            rollouts.submit(seeds=list(range(30)))
            groups = [g for _ in range(5) for g in rollouts.get_batch(6)]
            stats = rollouts.stats()
        assert len(groups) == 30
        retried = [t for g in groups for t in g.trajectories if t.attempt > 0]
        assert retried, "with 15% of steps failing some trajectory must have been retried"
        for group in groups:
            check_group(group, 2, TaskEnv)  # the same env without faults
            for traj in group.failed:
                assert traj.status is Status.ENV_ERROR and "flaky tool call" in traj.reason
        failures = sum(len(g.failed) for g in groups)
        assert stats["dropped"] == {"env_error": failures}
        assert stats["retries"] == failures == sum(g.retries for g in groups)
        assert stats["launched"] == stats["completed"] + failures + stats["in_flight"]
    finally:
        envs.close()


def test_a_group_without_retries_is_dropped_and_counted():
    fn = functools.partial(TaskEnv, fault_rate=0.3, max_len=4)
    envs = make_envs(env_fn=fn)
    try:
        rollouts = Rollouts(envs, obs_policy, group_size=4, max_retries=0, mode="sync")
        rollouts.submit(seeds=list(range(200)))
        groups = rollouts.get_batch(3)
        stats = rollouts.stats()
        rollouts.close()
        assert len(groups) == 3 and all(not g.failed for g in groups)
        assert stats["groups_dropped"].get("env_error", 0) >= 1
        assert stats["retries"] == 0
        assert stats["groups_submitted"] == (
            stats["groups_delivered"]
            + sum(stats["groups_dropped"].values())
            + stats["groups_pending"]
        )
        assert stats["failed_share"]["delivered"] == 0.0 < stats["failed_share"]["resolved"]
    finally:
        envs.close()


def test_survivors_keep_a_group():
    fn = functools.partial(TaskEnv, fault_rate=0.3, max_len=4)
    envs = make_envs(env_fn=fn)
    try:
        with Rollouts(
            envs, obs_policy, group_size=4, max_retries=0, min_survivors=1, mode="sync"
        ) as rollouts:
            rollouts.submit(seeds=list(range(40)))
            groups = rollouts.get_batch(8)
        short = [g for g in groups if len(g.trajectories) < 4]
        assert short, "at 30% faults per step some group must have lost a trajectory"
        for group in groups:
            assert len(group.trajectories) + len(group.failed) == 4
            assert all(t.status is Status.ENV_ERROR for t in group.failed)
            for traj in group.trajectories:
                replay(traj, TaskEnv)
    finally:
        envs.close()


def test_redundancy_keeps_the_first_finished_and_cancels_the_rest():
    envs = make_envs(n=12, batch_size=3, num_workers=2, env_concurrency=6,
                     env_fn=functools.partial(TaskEnv, wait_s=0.002))  # fmt: skip
    try:
        with Rollouts(envs, obs_policy, group_size=2, redundancy=2) as rollouts:
            rollouts.submit(seeds=list(range(12)))
            groups = [g for _ in range(3) for g in rollouts.get_batch(4)]
            stats = rollouts.stats()
        for group in groups:
            check_group(group, 2)
            assert len(group.failed) == 2
            for traj in group.failed:
                assert traj.status in (Status.REDUNDANT, Status.TERMINATED)
        cancelled = stats["dropped"].get("redundant", 0)
        # a spare still queued when its group completed never launched
        assert 24 <= stats["launched"] <= 48 and stats["retries"] == 0
        assert stats["launched"] == stats["completed"] + cancelled + stats["in_flight"]
    finally:
        envs.close()


def test_a_killed_worker_costs_only_retries():
    fn = functools.partial(TaskEnv, wait_s=0.005, max_len=20)
    envs = make_envs(n=8, batch_size=2, env_fn=fn, env_concurrency=4)
    try:
        with Rollouts(envs, obs_policy, group_size=2, max_retries=5) as rollouts:
            rollouts.submit(seeds=list(range(16)))
            groups = rollouts.get_batch(2)
            os.kill(envs._pool.workers[1].pid, signal.SIGKILL)
            groups += [g for _ in range(7) for g in rollouts.get_batch(2)]
            stats = rollouts.stats()
        assert sorted(g.task.seed for g in groups) == list(range(16))
        assert stats["dropped"].get("worker_died", 0) >= 1
        for group in groups:
            check_group(group, 2)
    finally:
        envs.close()


@pytest.mark.parametrize("on_stale", ["wait", "drop", "rerun"])
def test_no_group_is_handed_over_past_max_lag(on_stale):
    fn = functools.partial(TaskEnv, wait_s=0.002, max_len=12)
    envs = make_envs(n=16, batch_size=4, env_fn=fn, env_concurrency=8)
    tasks = (Task(seed=s) for s in range(10_000))
    try:
        with Rollouts(envs, obs_policy, group_size=2, tasks=tasks, max_lag=1,
                      on_stale=on_stale, groups_per_batch=3) as rollouts:  # fmt: skip
            handed = []
            for version in range(1, 9):
                batch = rollouts.get_batch(3)
                handed += batch
                for group in batch:
                    for traj in group.trajectories:
                        assert group.version - min(traj.versions) <= 1
                    assert group.lag <= 1
                time.sleep(0.02)  # the trainer trains; the envs keep stepping
                rollouts.set_version(version)
            stats = rollouts.stats()
        assert len(handed) == 24
        assert any(g.lag == 1 for g in handed) or on_stale != "wait"
        if on_stale == "wait":
            assert "stale" not in stats["dropped"] and "stale" not in stats["groups_dropped"]
    finally:
        envs.close()


def test_sync_mode_launches_only_what_a_batch_needs():
    envs = make_envs()
    try:
        with Rollouts(envs, obs_policy, group_size=2, mode="sync") as rollouts:
            rollouts.submit(seeds=list(range(20)))
            groups = rollouts.get_batch(3)
            launched = rollouts.stats()["launched"]
            time.sleep(0.3)
            assert rollouts.stats()["launched"] == launched == 6
            assert rollouts.stats()["in_flight"] == 0
            groups += rollouts.get_batch(3)
        assert sorted(g.task.seed for g in groups) == list(range(6))
    finally:
        envs.close()


def test_per_row_async_policy_with_extras_and_a_concurrency_limit():
    calls = {"now": 0, "most": 0}

    async def policy(row):
        calls["now"] += 1
        calls["most"] = max(calls["most"], calls["now"])
        await asyncio.sleep(0.001 * (1 + row.env_id % 3))
        calls["now"] -= 1
        action = int(abs(row.observation[1] * 10)) % 3
        return RowOutput(action, extra={"env": row.env_id, "step": row.trajectory.num_steps})

    envs = make_envs(n=8, batch_size=2)
    try:
        with Rollouts(envs, AsyncPolicy(policy, concurrency=3), group_size=2) as rollouts:
            rollouts.submit(seeds=list(range(10)))
            groups = [g for _ in range(5) for g in rollouts.get_batch(2)]
        assert calls["most"] <= 3
        for group in groups:
            check_group(group, 2)
            for traj in group.trajectories:
                assert [e["step"] for e in traj.extras] == list(range(traj.num_steps))
                assert all(e["env"] == traj.env_id for e in traj.extras)
    finally:
        envs.close()


@pytest.mark.parametrize("kind", ["per-row", "batched"])
def test_a_policy_ends_or_fails_trajectories_and_the_loop_goes_on(kind):
    """``EndTrajectory`` ends a trajectory as finished, with the steps it had (handed over,
    replayed alone, its env reused): raised by a per-row policy, or in a row's place in a
    batched policy's actions. ``PolicyFailure`` fails one (per row; retried from its task)."""
    failed_once: set[tuple[int | None, int]] = set()

    def act(traj, observation):
        if traj.num_steps == 2 and traj.seed % 2 == 0:
            return EndTrajectory(f"no room left for seed {traj.seed}")
        key = (traj.seed, traj.index)
        if kind == "per-row" and traj.num_steps == 1 and traj.seed % 3 == 0:
            if key not in failed_once:
                failed_once.add(key)
                raise PolicyFailure("the server is down")
        return int(abs(observation[1] * 10)) % 3

    async def per_row(row):
        action = act(row.trajectory, row.observation)
        if isinstance(action, EndTrajectory):
            raise action
        return action

    def batched(batch):
        return [act(t, o) for t, o in zip(batch.trajectories, batch.observations)]

    policy = per_row if kind == "per-row" else batched
    env_fn = functools.partial(TaskEnv, max_len=6)
    envs = make_envs(n=6, batch_size=2, env_fn=env_fn)
    try:
        with Rollouts(envs, policy, group_size=3, info_keys=["length"]) as rollouts:
            rollouts.submit(seeds=list(range(12)))
            groups = [g for _ in range(6) for g in rollouts.get_batch(2)]
            stats = rollouts.stats()
        assert sorted(g.task.seed for g in groups) == list(range(12))
        for group in groups:
            check_group(group, 3, env_fn)
            for traj in group.trajectories:
                length = traj.reset_info["length"]
                if traj.seed % 2:
                    assert traj.status is Status.TERMINATED and traj.num_steps == length
                elif length > 2:  # its third action was never chosen
                    assert traj.status is Status.POLICY_ENDED and traj.num_steps == 2
                    assert traj.reason == f"no room left for seed {traj.seed}"
                else:
                    assert traj.status is Status.TERMINATED and traj.num_steps == length
        ended = [t for g in groups for t in g.trajectories if t.status is Status.POLICY_ENDED]
        assert ended, "no episode of an even seed was longer than 2 steps"
        retried = [t for g in groups for t in g.trajectories if t.retried_after]
        assert len(failed_once) == stats["retries"] == stats["dropped"].get("policy_error", 0)
        assert all(t.retried_after == [Status.POLICY_ERROR] for t in retried)
        assert bool(failed_once) == (kind == "per-row")
        assert stats["completed"] == 36 and stats["dropped"].keys() <= {"policy_error"}
    finally:
        envs.close()


def test_closing_lets_cancelled_calls_unwind_and_closes_their_async_generators():
    # Calls in flight at close are cancelled; their cleanup takes several turns of the
    # event loop, and one is inside an async generator (as an HTTP stream is).
    started, unwound, generators_closed = threading.Event(), [], []

    async def stream():
        try:
            while True:
                yield
                await asyncio.sleep(3600)
        finally:
            generators_closed.append(1)

    async def policy(row):
        started.set()
        try:
            async for _ in stream():
                pass
        finally:
            for _ in range(5):
                await asyncio.sleep(0)
            unwound.append(row.env_id)

    envs = make_envs(n=8, batch_size=2)
    try:
        rollouts = Rollouts(envs, AsyncPolicy(policy, concurrency=8), group_size=2)
        rollouts.submit(seeds=list(range(4)))
        assert started.wait(30)
        time.sleep(0.2)  # more rows reach the policy
        rollouts.close()
        assert unwound and len(generators_closed) == len(unwound)
    finally:
        envs.close()


def test_extras_and_versions_are_carried():
    def policy(batch):
        actions = obs_policy(batch)
        return PolicyOutput(actions, extras=[{"logprob": -1.0 * a} for a in actions])

    envs = make_envs()
    try:
        with Rollouts(envs, policy, group_size=2) as rollouts:
            rollouts.set_version(7)
            rollouts.submit(seeds=[1, 2])
            groups = rollouts.get_batch(2)
        for traj in (t for g in groups for t in g.trajectories):
            assert traj.versions == [7] * traj.num_steps
            assert [e["logprob"] for e in traj.extras] == [-1.0 * a for a in traj.actions]
    finally:
        envs.close()


def test_the_loop_receives_while_the_batched_policy_runs(tmp_path):
    """While a batched call runs, the loop goes on receiving; the next call
    takes every row that came in meanwhile, in one batch."""
    gate = tmp_path / "gate"  # env 7 resets only once the first call has begun
    calls, release = [], threading.Event()

    def policy(batch):
        calls.append(sorted(batch.env_ids.tolist()))
        if len(calls) == 1:
            gate.touch()
            assert release.wait(60), "the test never released the first call"
        return obs_policy(batch)

    fns = [TaskEnv] * 7 + [functools.partial(GatedResetEnv, str(gate))]
    envs = shmvec.ShmVectorEnv(
        fns, num_workers=2, batch_size=2, on_env_error="reset", on_worker_death="restart"
    )
    try:
        with Rollouts(envs, policy, group_size=8, max_steps=1) as rollouts:
            rollouts.submit(seeds=[5])
            deadline = time.monotonic() + 60
            while rollouts.stats()["awaiting_policy"] < 8:  # the first call's rows and the rest
                assert time.monotonic() < deadline, rollouts.stats()
                time.sleep(0.01)
            release.set()
            (group,) = rollouts.get_batch(1)
            stats = rollouts.stats()
        assert 7 not in calls[0]
        assert calls[1:] == [sorted(set(range(8)) - set(calls[0]))]
        assert stats["policy_calls"] == 2 and stats["awaiting_policy"] == 0
        check_group(group, 8, fns[0])
    finally:
        release.set()
        envs.close()


def test_tasks_with_a_tag_run_on_envs_of_that_tag():
    def short():
        return TaskEnv(max_len=2)

    envs = shmvec.make_mix({TaskEnv: 4, short: 4}, num_workers=2, batch_size=2,
                           on_env_error="reset", on_worker_death="restart")  # fmt: skip
    try:
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit([Task(seed=s, tag="short") for s in range(4)])
            rollouts.submit([Task(seed=s, tag="TaskEnv") for s in range(4)])
            groups = [g for _ in range(4) for g in rollouts.get_batch(2)]
        for group in groups:
            for traj in group.trajectories:
                assert traj.env_tag == group.task.tag == envs.env_tags[traj.env_id]
                replay(traj, short if group.task.tag == "short" else TaskEnv)
                assert traj.num_steps <= 2 or group.task.tag == "TaskEnv"
        with pytest.raises(ValueError, match="replay it with that env's env_fn"):
            replay(groups[0].trajectories[0], lambda: gym.make("CartPole-v1"))
    finally:
        envs.close()


def test_replay_names_a_global_random_generator():
    envs = make_envs(env_fn=GlobalRandomEnv, n=4, batch_size=2)
    try:
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit(seeds=[0])
            (group,) = rollouts.get_batch(1)
        with pytest.raises(ReplayMismatch, match="global random generator"):
            for traj in group.trajectories:
                replay(traj, GlobalRandomEnv)
    finally:
        envs.close()


def test_bad_input_is_a_clear_error():
    sync_envs = shmvec.ShmVectorEnv([TaskEnv] * 4, num_workers=2)
    try:
        with pytest.raises(ValueError, match="async mode"):
            Rollouts(sync_envs, obs_policy)
    finally:
        sync_envs.close()
    raising = shmvec.ShmVectorEnv([TaskEnv] * 4, num_workers=2, batch_size=2)
    try:
        with pytest.raises(ValueError, match="on_env_error='reset'"):
            Rollouts(raising, obs_policy)
    finally:
        raising.close()
    envs = make_envs()
    try:
        for kwargs, match in [
            ({"max_lag": -1}, "max_lag"),
            ({"mode": "lockstep"}, "mode"),
            ({"min_survivors": 5, "group_size": 4}, "min_survivors"),
            ({"max_lag": 1}, "groups_per_batch"),
            ({"on_stale": "cancel"}, "on_stale"),
        ]:
            with pytest.raises(ValueError, match=match):
                Rollouts(envs, obs_policy, **kwargs)
        with Rollouts(envs, obs_policy, group_size=4) as rollouts:
            with pytest.raises(ValueError, match="whole number of groups"):
                rollouts.get_batch(num_trajectories=6)
            with pytest.raises(ValueError, match="2 seeds but 3 options"):
                rollouts.submit(seeds=[1, 2], options=[{}, {}, {}])
            with pytest.raises(ValueError, match="env tag 'nope'"):
                rollouts.submit([Task(seed=1, tag="nope")])
            with pytest.raises(TypeError, match="Task"):
                rollouts.submit([3])
            rollouts.submit(seeds=[1])
            with pytest.raises(RuntimeError, match="can never be complete"):
                rollouts.get_batch(2)
    finally:
        envs.close()


@pytest.mark.parametrize("answer", ["short", "raise"])
def test_a_failing_policy_reaches_the_trainer_with_its_rows(answer):
    def policy(batch):
        if answer == "raise":
            raise ZeroDivisionError("bad weights")
        return np.zeros(len(batch) + 1, dtype=np.int64)

    envs = make_envs()
    try:
        rollouts = Rollouts(envs, policy, group_size=2)
        rollouts.submit(seeds=[0, 1])
        expected = "ZeroDivisionError" if answer == "raise" else r"actions for \d+ rows"
        with pytest.raises(PolicyError, match=expected) as info:
            rollouts.get_batch(1, timeout=60)
        assert "envs [" in str(info.value)
        rollouts.close()
    finally:
        envs.close()


def test_from_env_fns_makes_the_user_choose_concurrency():
    with pytest.raises(TypeError, match="env_concurrency"):
        Rollouts.from_env_fns([TaskEnv] * 4, obs_policy)  # type: ignore[call-arg]
    make = Rollouts.from_env_fns
    with make([TaskEnv] * 8, obs_policy, env_concurrency=1, vector_kwargs={"num_workers": 2},
              group_size=2) as rollouts:  # fmt: skip
        rollouts.submit(seeds=[5, 6])
        groups = rollouts.get_batch(2)
        envs = rollouts.envs
    assert envs.closed
    for group in groups:
        check_group(group, 2)
