"""Infos as the env returned them, types included: through ``await env.step``, the
trajectories of awaitable envs and of rollouts, and ``ShmVectorEnv.row_infos()``,
while the vector env's own batched infos stay gymnasium's.

The envs draw random nested infos (seeded by their reset seed) of every kind a
gymnasium env returns: Python ints, floats, bools, strings, None, lists, nested
dicts, numpy arrays and numpy scalars, some steps only numeric scalars (the info
columns), the types of one key varying from env to env and step to step.
"""

from __future__ import annotations

import asyncio
import json
import random

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from helpers import assert_same

import shmvec
from shmvec import AwaitableEnvs
from shmvec.batching import batch_infos
from shmvec.rollouts import Rollouts, Task
from shmvec.row_infos import RowInfos, infos_by_row

pytestmark = pytest.mark.timeout(240)

#: The numeric scalar types an info may hold; ``_add_info`` casts a batch's values
#: into the first env's type, so rows of one key may hold any of them.
NUMERIC = (
    int, float, bool,
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
)  # fmt: skip


def random_number(rng: np.random.Generator, python_only: bool):
    kind = NUMERIC[int(rng.integers(3 if python_only else len(NUMERIC)))]
    if kind is bool:
        return bool(rng.integers(2))
    # In 0..100 (every integer type holds it) and a half for floats (float16 too).
    value = int(rng.integers(101))
    return kind(value + 0.5) if kind in (float, np.float16, np.float32, np.float64) else kind(value)


def random_value(rng: np.random.Generator, kind: str, python_only: bool, depth: int):
    if kind == "num":
        return random_number(rng, python_only)
    if kind == "str":
        return "".join(rng.choice(list("abc é✓"), int(rng.integers(0, 6))))
    if kind == "none":
        return None
    if kind == "list":
        return [int(rng.integers(9)) if rng.integers(2) else "x" for _ in range(rng.integers(4))]
    if kind == "npbool":
        return np.bool_(rng.integers(2)) if not python_only else bool(rng.integers(2))
    if kind == "arr":  # one shape per key, the dtype of each env's own choosing
        dtype = (np.float32, np.float64, np.int64)[int(rng.integers(3))]
        return (rng.integers(0, 50, 3) + 0.5).astype(dtype) if not python_only else [1.5, 2.0, 3.0]
    assert kind == "dict"
    return random_info(rng, python_only, depth + 1)


KINDS = ("num", "str", "none", "list", "npbool", "arr", "dict")


def random_info(rng: np.random.Generator, python_only: bool, depth: int = 0) -> dict:
    """A random subset of keys ``{kind}{j}`` (a key's kind is fixed, as gymnasium's
    batching needs), nested dicts at most two deep."""
    kinds = KINDS if depth < 2 else KINDS[:-1]
    return {
        f"{kind}{j}": random_value(rng, kind, python_only, depth)
        for kind in kinds
        for j in range(2)
        if rng.random() < 0.4
    }


class RandomInfoEnv(gym.Env):
    """Episodes of 1..6 steps; each reset and step reports a random info drawn
    from the env's own ``np_random``: a third only numeric scalars of all types, a
    third only Python values (JSON-able), a third anything."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1e6, 1e6, (2,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.length = self.t = 0

    def _info(self) -> dict:
        rng = self.np_random
        which = int(rng.integers(3))
        if which == 0:
            return {f"col{j}": random_number(rng, False) for j in range(3) if rng.random() < 0.8}
        return random_info(rng, python_only=which == 1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.length, self.t = int(self.np_random.integers(1, 7)), 0
        return self.np_random.normal(size=2), self._info()

    def step(self, action):
        self.t += 1
        obs = self.np_random.normal(size=2) + int(action)
        reward = float(self.np_random.normal())
        return obs, reward, self.t >= self.length, False, self._info()


def alone(seed: int, actions: list) -> tuple[dict, list]:
    """The reset info and per-step ``(obs, reward, terminated, truncated, info)`` of
    ``RandomInfoEnv`` stepped alone."""
    env = RandomInfoEnv()
    _, reset_info = env.reset(seed=seed)
    return reset_info, [env.step(a) for a in actions]


def check_json(got: dict, want: dict) -> bool:
    """Where the env's info is JSON-able (then True), so is the one handed on, to
    the same text."""
    try:
        text = json.dumps(want, sort_keys=True)
    except TypeError:
        return False
    assert json.dumps(got, sort_keys=True) == text
    return True


def make_envs(n: int = 6, batch_size: int = 2, **kwargs) -> shmvec.ShmVectorEnv:
    return shmvec.ShmVectorEnv(
        [RandomInfoEnv] * n,
        num_workers=2,
        batch_size=batch_size,
        on_env_error="reset",
        on_worker_death="restart",
        **kwargs,
    )


@pytest.mark.parametrize("seed0", [0, 1])
def test_awaited_infos_and_trajectories_are_the_envs_own(seed0):
    envs = make_envs()

    async def episode(pool, seed: int):
        rng = random.Random(seed)
        async with pool.env() as env:
            _, reset_info = await env.reset(seed=seed)
            steps, actions, done = [], [], False
            while not done:
                actions.append(rng.randrange(3))
                steps.append(await env.step(actions[-1]))
                done = steps[-1][2] or steps[-1][3]
            return reset_info, steps, actions, env.trajectory

    async def main():
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(episode(pool, 1000 * seed0 + k) for k in range(24)))

    try:
        runs = asyncio.run(main())
    finally:
        envs.close()
    jsonable = 0
    for k, (reset_info, steps, actions, traj) in enumerate(runs):
        want_reset, want_steps = alone(1000 * seed0 + k, actions)
        assert_same(reset_info, want_reset, "reset info")
        assert_same(traj.reset_info, want_reset, "trajectory reset info")
        for t, (got, want) in enumerate(zip(steps, want_steps)):
            assert_same(got[0], want[0], f"step {t} obs")
            assert_same(got[1:4], want[1:4], f"step {t} reward, terminated, truncated")
            assert_same(got[4], want[4], f"step {t} info")
            assert_same(traj.infos[t], want[4], f"trajectory step {t} info")
            jsonable += check_json(got[4], want[4]) and bool(got[4])
    assert jsonable  # the JSON-able case was met


def test_rollout_trajectories_keep_the_envs_own_info_values():
    envs = make_envs(n=8, batch_size=2)
    keys = [f"{kind}{j}" for kind in KINDS for j in range(2)] + ["col0", "col1", "col2"]

    def policy(batch):
        return (np.abs(batch.observations[:, 0] * 10).astype(np.int64)) % 3

    try:
        with Rollouts(envs, policy, group_size=2, info_keys=keys) as rollouts:
            rollouts.submit([Task(seed=50 + k) for k in range(8)])
            groups = [g for _ in range(2) for g in rollouts.get_batch(4)]
    finally:
        envs.close()
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 16
    for traj in trajectories:
        want_reset, want_steps = alone(traj.task.seed, list(traj.actions))
        assert_same(traj.reset_info, want_reset, "reset info")
        assert len(traj.infos) == len(want_steps)
        for t, (got, want) in enumerate(zip(traj.infos, want_steps)):
            assert_same(got, {k: want[4][k] for k in keys if k in want[4]}, f"step {t} info")


@pytest.mark.parametrize("batch_size", [4, 2])
def test_row_infos_are_each_envs_own_and_the_batch_stays_gymnasiums(batch_size):
    n, seed = 4, 7
    envs = make_envs(n=n, batch_size=batch_size)
    sync = gym.vector.SyncVectorEnv([RandomInfoEnv] * n)
    refs = [RandomInfoEnv() for _ in range(n)]
    ended = [False] * n

    def reference(env: int, action: int) -> dict:
        """What env ``env`` reports for ``action``, autoreset (NEXT_STEP) included."""
        if ended[env]:
            ended[env] = False
            return refs[env].reset()[1]
        _, _, terminated, truncated, info = refs[env].step(action)
        ended[env] = terminated or truncated
        return info

    try:
        envs.async_reset(seed=seed)
        *_, infos = envs.recv()
        if batch_size == n:
            assert_same({k: v for k, v in infos.items() if k != "env_id"}, sync.reset(seed=seed)[1])
        wants = {e: refs[e].reset(seed=seed + e)[1] for e in range(n)}
        for t in range(20):
            env_ids = infos["env_id"].tolist()
            rows = envs.row_infos()
            assert rows.batched is infos and infos_by_row(envs, infos) is rows
            for i, env in enumerate(env_ids):
                assert_same(rows.info(i), wants[env], f"round {t} row {i} (env {env})")
            actions = np.array([(t + e) % 3 for e in env_ids])
            if batch_size == n:
                _, _, _, _, infos = envs.step(actions)
                assert_same(infos, sync.step(actions)[4], f"batched step {t} infos")
                infos["env_id"] = np.arange(n)
            else:
                envs.send(actions, env_ids)
                *_, infos = envs.recv()
            for env, action in zip(env_ids, actions.tolist()):
                wants[env] = reference(env, action)
    finally:
        envs.close()
        sync.close()


def test_unbatched_fallback_and_row_infos_of_dicts_and_columns():
    items = [(0, [{"a": 1, "d": {"x": 1.5}}]), (1, [{"a": np.int64(2)}, {"d": {"y": None}}])]
    infos = batch_infos(items, 2)
    rows = RowInfos(infos, items)
    assert_same(rows.info(0), {"a": 1, "d": {"x": 1.5}})
    assert_same(rows.info(1), {"a": np.int64(2), "d": {"y": None}})
    assert_same(rows.info(1, skip=frozenset({"d"})), {"a": np.int64(2)})
    assert_same(rows.info(0, only=["d", "zz"]), {"d": {"x": 1.5}})
    # A vector env that keeps no rows: gymnasium's batch cut into rows.
    fallback = infos_by_row(object(), infos)
    assert_same(fallback.info(0), {"a": np.int64(1), "d": {"x": np.float64(1.5)}})
    assert_same(fallback.info(1, only=["a"]), {"a": np.int64(2)})
