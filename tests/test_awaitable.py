"""Awaitable envs: leases, each coroutine's results equal to its env run alone and
replayable from its record, failures (env errors, deadlines, a killed worker) raised
in their own coroutine only, cancellation, one dispatcher thread, bad input."""

from __future__ import annotations

import asyncio
import contextvars
import random
import threading

import gymnasium as gym
import numpy as np
import pytest
from awaitable_envs import GuessTextEnv, WalkEnv

import shmvec
from shmvec import AwaitableEnvs, EnvDeadlineError, EnvStepError, EnvWorkerDiedError, LeaseError

pytestmark = pytest.mark.timeout(240)


def make_envs(n=8, batch_size=2, num_workers=2, env_fn=WalkEnv, **kwargs):
    return shmvec.ShmVectorEnv(
        [env_fn] * n,
        num_workers=num_workers,
        batch_size=batch_size,
        on_env_error="reset",
        on_worker_death="restart",
        **kwargs,
    )


def alone(seed, options, actions, env_fn=WalkEnv):
    """The episode ``env_fn()`` gives alone: [reset obs, (obs, reward, term, trunc)...]."""
    env = env_fn()
    obs, _ = env.reset(seed=seed, options=options)
    out = [obs]
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((obs, float(reward), terminated, truncated))
    env.close()
    return out


def same(a, b):
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


async def episode(pool, seed, rng, options=None, tag=None):
    """Leases an env, runs one episode with actions drawn from ``rng``; returns what it
    saw and the env's record."""
    async with pool.env(tag=tag) as env:
        obs, _ = await env.reset(seed=seed, options=options)
        seen, actions, done = [obs], [], False
        while not done:
            action = rng.randrange(3)
            actions.append(action)
            obs, reward, terminated, truncated, _ = await env.step(action)
            seen.append((obs, reward, terminated, truncated))
            done = terminated or truncated
        return seen, actions, env.trajectory, env.env_id


def check_alone(seed, options, seen, actions, env_fn=WalkEnv):
    ref = alone(seed, options, actions, env_fn)
    assert len(seen) == len(ref)
    assert same(seen[0], ref[0])
    for got, want in zip(seen[1:], ref[1:]):
        assert same(got[0], want[0]) and got[1:] == want[1:]


def test_a_thousand_coroutines_each_get_their_own_env_results_and_replay_alone():
    seed0 = random.randrange(2**31)
    envs = make_envs(n=32, batch_size=4)

    async def main():
        async with AwaitableEnvs(envs) as pool:
            runs = [
                episode(pool, seed0 + k, random.Random(seed0 + k), {"k": k}) for k in range(1000)
            ]
            results = await asyncio.gather(*runs)
            dispatchers = [t for t in threading.enumerate() if t.name == "shmvec-awaitable"]
            return results, len(dispatchers)

    try:
        results, dispatchers = asyncio.run(main())
    finally:
        envs.close()
    assert dispatchers == 1, "one dispatcher thread for every coroutine"
    assert len({env for *_, env in results}) == 32, f"seed {seed0}: every env served"
    for k, (seen, actions, traj, _) in enumerate(results):
        check_alone(seed0 + k, {"k": k}, seen, actions)
        assert traj.actions == actions and traj.status.value in ("terminated", "truncated")
        report = shmvec.rollouts.replay(traj, WalkEnv)
        assert report.steps == len(actions) and not report.used_global_random


def test_an_env_error_raises_in_its_coroutine_only_and_the_env_is_usable_after():
    envs = make_envs()

    async def failing():
        async with pool.env() as env:
            await env.reset(seed=7, options={"fail_at": 2})
            await env.step(0)
            with pytest.raises(EnvStepError) as caught:
                await env.step(1)
            error = caught.value
            assert error.env_id == env.env_id and error.what == "env_error"
            assert "ScriptedFault" in str(error) and f"env {env.env_id}" in str(error)
            assert env.trajectory.status.value == "env_error" and env.trajectory.actions == [0]
            with pytest.raises(gym.error.ResetNeeded):
                await env.step(0)
            return await run_on(env, 11)

    async def run_on(env, seed):
        obs, _ = await env.reset(seed=seed)
        seen, actions, done = [obs], [], False
        while not done:
            actions.append(1)
            obs, reward, terminated, truncated, _ = await env.step(1)
            seen.append((obs, reward, terminated, truncated))
            done = terminated or truncated
        return seen, actions

    async def main():
        nonlocal pool
        async with AwaitableEnvs(envs) as pool:
            others = [episode(pool, s, random.Random(s)) for s in range(40)]
            return await asyncio.gather(failing(), *others)

    pool = None
    try:
        (after, *others) = asyncio.run(main())
    finally:
        envs.close()
    check_alone(11, None, *after)
    for s, (seen, actions, _, _) in enumerate(others):
        check_alone(s, None, seen, actions)


def test_a_step_past_the_deadline_raises_in_its_coroutine_only():
    envs = make_envs(step_deadline=0.5, env_timeout=20)

    async def hanging():
        async with pool.env() as env:
            await env.reset(seed=3, options={"hang_at": 1})
            with pytest.raises(EnvDeadlineError) as caught:
                await env.step(0)
            assert caught.value.what == "deadline" and "step_deadline" in str(caught.value)
            seen, actions, _, _ = await again(env)
            return seen, actions

    async def again(env):
        obs, _ = await env.reset(seed=4)
        seen, actions = [obs], []
        while True:
            actions.append(2)
            obs, reward, terminated, truncated, _ = await env.step(2)
            seen.append((obs, reward, terminated, truncated))
            if terminated or truncated:
                return seen, actions, None, None

    async def main():
        nonlocal pool
        async with AwaitableEnvs(envs) as pool:
            others = [episode(pool, s, random.Random(s)) for s in range(20)]
            return await asyncio.gather(hanging(), *others)

    pool = None
    try:
        (after, *others) = asyncio.run(main())
    finally:
        envs.close()
    check_alone(4, None, *after)
    for s, (seen, actions, _, _) in enumerate(others):
        check_alone(s, None, seen, actions)


def test_a_killed_worker_raises_only_in_the_coroutines_of_its_envs():
    seed0 = random.randrange(2**31)
    envs = make_envs(n=8, batch_size=2, num_workers=2)  # envs 0-3 on worker 0, 4-7 on 1
    outcomes: list[tuple[int, str]] = []

    async def one(k):
        rng = random.Random(seed0 + k)
        async with pool.env() as env:
            # The first coroutine that holds env 0 kills its worker at its first step.
            die = env.env_id == 0 and not any(e == 0 for e, _ in outcomes)
            options = {"die_at": 1, "wait_s": 0.01} if die else {"wait_s": 0.01}
            outcomes.append((env.env_id, "started"))
            obs, _ = await env.reset(seed=seed0 + k, options=options)
            try:
                actions, seen = [], [obs]
                while True:
                    actions.append(rng.randrange(3))
                    obs, reward, terminated, truncated, _ = await env.step(actions[-1])
                    seen.append((obs, reward, terminated, truncated))
                    if terminated or truncated:
                        break
            except EnvWorkerDiedError as error:
                assert error.env_id == env.env_id and error.what == "worker_died"
                outcomes.append((env.env_id, "died"))
                # Usable again: the same episode, without the fault, equals the env alone.
                obs, _ = await env.reset(seed=seed0 + k)
                actions, seen = [], [obs]
                while True:
                    actions.append(rng.randrange(3))
                    obs, reward, terminated, truncated, _ = await env.step(actions[-1])
                    seen.append((obs, reward, terminated, truncated))
                    if terminated or truncated:
                        break
                return seen, actions, seed0 + k, None
            return seen, actions, seed0 + k, options

    async def main():
        nonlocal pool
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(one(k) for k in range(48)))

    pool = None
    try:
        results = asyncio.run(main())
        restarts = envs.stats()["worker_restarts"]
    finally:
        envs.close()
    died = [env for env, what in outcomes if what == "died"]
    assert 0 in died, f"seed {seed0}: the dying env's coroutine got EnvWorkerDiedError"
    assert all(env < 4 for env in died), f"seed {seed0}: only worker 0's envs failed: {died}"
    assert restarts == 1
    for seen, actions, seed, options in results:
        check_alone(seed, options, seen, actions)


def test_cancelling_a_coroutine_releases_its_env():
    envs = make_envs(n=2, batch_size=1, num_workers=1, env_concurrency=2)

    async def main():
        async with AwaitableEnvs(envs) as pool:
            leased, release = asyncio.Event(), asyncio.Event()
            first = second = None

            async def stuck():
                nonlocal first
                async with pool.env() as env:
                    first = env.env_id
                    await env.reset(seed=0, options={"wait_s": 2.0})
                    leased.set()
                    await env.step(0)  # 2 s: cancelled while it runs

            async def waiting():
                async with pool.env():
                    raise AssertionError("a cancelled waiter got an env")

            async def holder():
                nonlocal second
                async with pool.env() as env:
                    second = env.env_id
                    await release.wait()

            tasks = [asyncio.create_task(stuck()), asyncio.create_task(holder())]
            await leased.wait()
            waiter = asyncio.create_task(waiting())  # both envs leased: it waits
            for _ in range(3):
                await asyncio.sleep(0)  # the waiter queues; stuck() awaits its step
            assert not waiter.done()
            waiter.cancel()
            tasks[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
            with pytest.raises(asyncio.CancelledError):
                await waiter
            release.set()
            await tasks[1]
            # Both envs come back: the cancelled step's env once its result arrived.
            async with pool.env() as a, pool.env() as b:
                assert {a.env_id, b.env_id} == {first, second}
                obs, _ = await a.reset(seed=5)
                assert same(obs, alone(5, None, [])[0])

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        envs.close()


def test_tags_lease_only_envs_of_their_kind_and_replay_with_their_env_fn():
    def walk():
        return WalkEnv()

    def walk_b():
        return WalkEnv()

    envs = shmvec.make_mix(
        {walk: 4, walk_b: 4}, num_workers=2, batch_size=2,
        on_env_error="reset", on_worker_death="restart",
    )  # fmt: skip

    async def main():
        async with AwaitableEnvs(envs) as pool:
            with pytest.raises(ValueError, match="no env has tag 'nope'.*'walk', 'walk_b'"):
                pool.env(tag="nope")
            runs = [
                episode(pool, s, random.Random(s), tag=("walk_b" if s % 2 else "walk"))
                for s in range(30)
            ]  # noqa: E501
            return await asyncio.gather(*runs)

    try:
        results = asyncio.run(main())
    finally:
        envs.close()
    for s, (seen, actions, traj, env_id) in enumerate(results):
        assert envs.env_tags[env_id] == ("walk_b" if s % 2 else "walk")
        shmvec.rollouts.replay(traj, walk_b if s % 2 else walk)
        check_alone(s, None, seen, actions)


def test_a_waiter_for_one_tag_does_not_hold_up_leases_of_another():
    def walk():
        return WalkEnv()

    def walk_b():
        return WalkEnv()

    envs = shmvec.make_mix(
        {walk: 2, walk_b: 2}, num_workers=1, batch_size=1,
        on_env_error="reset", on_worker_death="restart",
    )  # fmt: skip

    async def main():
        async with AwaitableEnvs(envs) as pool:
            async with pool.env(tag="walk"), pool.env(tag="walk"):
                waiter = asyncio.create_task(pool.env(tag="walk").__aenter__())
                await asyncio.sleep(0.05)
                assert not waiter.done()  # both "walk" envs are leased
                async with pool.env(tag="walk_b") as env:  # a free "walk_b": at once
                    await env.reset(seed=1)
                async with pool.env() as env:  # any: only "walk_b" envs are free
                    assert env.tag == "walk_b"
            env = await waiter  # a "walk" env came back to it
            assert env.tag == "walk"

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        envs.close()


def test_text_envs_step_and_replay():
    envs = make_envs(n=4, env_fn=GuessTextEnv)

    async def guesses(pool, seed):
        async with pool.env() as env:
            obs, _ = await env.reset(seed=seed)
            for guess in "5372":
                obs, reward, terminated, truncated, _ = await env.step(f"I say {guess}")
                assert isinstance(obs, str)
                if terminated or truncated:
                    break
            return env.replay(GuessTextEnv)

    async def main():
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(guesses(pool, s) for s in range(16)))

    try:
        reports = asyncio.run(main())
    finally:
        envs.close()
    assert all(r.steps >= 1 for r in reports)


def test_misuse_gets_clear_errors():
    envs = make_envs(n=2, batch_size=1, num_workers=1)

    async def main():
        async with AwaitableEnvs(envs) as pool:
            with pytest.raises(ValueError, match="these envs have no tags"):
                pool.env(tag="a")
            async with pool.env() as env:
                with pytest.raises(gym.error.ResetNeeded, match="reset"):
                    await env.step(0)
                await env.reset(seed=1)
                with pytest.raises(ValueError, match="not in the action space"):
                    await env.step(7)
                with pytest.raises(TypeError, match="seed must be an int"):
                    await env.reset(seed="x")

                async def stranger():
                    await env.step(0)

                # A coroutine that did not lease it (created outside the block's context).
                with pytest.raises(LeaseError, match="does not hold it"):
                    await outside.run(asyncio.get_running_loop().create_task, stranger())
                # A task started inside the block holds it as its parent does.
                await asyncio.create_task(env.step(0))
                first = asyncio.create_task(env.step(1))
                await asyncio.sleep(0)
                with pytest.raises(LeaseError, match="still running"):
                    await env.step(2)
                await first
            with pytest.raises(LeaseError, match="released"):
                await env.step(0)
            return pool

    outside = contextvars.copy_context()
    try:
        pool = asyncio.run(main())
        with pytest.raises(RuntimeError, match="closed"):
            asyncio.run(pool.env().__aenter__())
    finally:
        envs.close()


def test_vector_envs_that_cannot_serve_leases_are_refused():
    sync = shmvec.ShmVectorEnv([WalkEnv] * 2, num_workers=1)
    raising = shmvec.ShmVectorEnv(
        [WalkEnv] * 2, num_workers=1, batch_size=1, on_worker_death="restart"
    )
    try:
        with pytest.raises(ValueError, match="async mode"):
            AwaitableEnvs(sync)
        with pytest.raises(ValueError, match="on_env_error='reset'"):
            AwaitableEnvs(raising)
    finally:
        sync.close()
        raising.close()


def test_one_pool_serves_one_event_loop():
    envs = make_envs(n=2, batch_size=1, num_workers=1)
    pool = AwaitableEnvs(envs)

    async def lease():
        async with pool.env() as env:
            await env.reset(seed=0)

    try:
        asyncio.run(lease())
        with pytest.raises(RuntimeError, match="one pool per event loop"):
            asyncio.run(lease())
    finally:
        pool.close()
        envs.close()


def test_from_env_fns_owns_its_vector_env():
    pool = AwaitableEnvs.from_env_fns([WalkEnv] * 4, env_concurrency=1, num_workers=1)
    assert pool.envs.batch_size == 1

    async def main():
        async with pool:
            return await episode(pool, 3, random.Random(3))

    seen, actions, _, _ = asyncio.run(main())
    check_alone(3, None, seen, actions)
    assert pool.envs.closed
