"""shmvec.sb3.ShmSB3VecEnv against Stable-Baselines3's own DummyVecEnv."""

from __future__ import annotations

import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("stable_baselines3")

from gymnasium.vector import AutoresetMode  # noqa: E402
from gymnasium.wrappers import TimeLimit  # noqa: E402
from gymnasium.wrappers.vector import RecordEpisodeStatistics  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv  # noqa: E402

import shmvec  # noqa: E402
from shmvec.sb3 import ShmSB3VecEnv, sb3_env_fns, unbatch_infos  # noqa: E402

NUM_ENVS = 4


# ------------------------------------------------------------------ helpers


class InfoDictEnv(gym.Env):
    """Dict observations, infos of several kinds, a counter method and options."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, length: int = 5) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-100.0, 100.0, (2,), np.float32),
                "count": gym.spaces.Discrete(1000),
            }
        )
        self.action_space = gym.spaces.Discrete(3)
        self.length = length
        self.t = 0
        self.pos = np.zeros(2, np.float32)
        self.bumps = 0

    def bump(self, by: int = 1) -> int:
        self.bumps += by
        return self.bumps

    def _obs(self) -> dict:
        return {"pos": self.pos.copy(), "count": self.t}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        start = 0.0 if not options else float(options.get("start", 0.0))
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32) + np.float32(start)
        return self._obs(), {"reset_pos": float(self.pos[0]), "label": "reset"}

    def step(self, action):
        self.t += 1
        self.pos += np.float32(int(action) - 1)
        terminated = bool(abs(self.pos[0]) > 3)
        truncated = self.t >= self.length
        info: dict[str, Any] = {"t": self.t}
        if self.t % 2 == 0:
            info["even"] = True
            info["tag"] = f"step{self.t}"  # pickled, not a numeric column
        return self._obs(), float(self.pos.sum()), terminated, truncated, info


def cartpole(max_episode_steps: int = 25):
    def make() -> gym.Env:
        return gym.make("CartPole-v1", max_episode_steps=max_episode_steps)

    return make


def info_env(length: int):
    def make() -> gym.Env:
        return InfoDictEnv(length)

    return make


def assert_value_equal(a: Any, b: Any, where: str) -> None:
    """Values equal up to numpy scalar vs Python scalar (gymnasium batches infos)."""
    if isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict), where
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_value_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a!r} vs {b!r}"
        assert np.array_equal(a, b), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_infos(ours: list, theirs: list, where: str) -> None:
    assert isinstance(ours, list) and len(ours) == len(theirs), where
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_value_equal(a, b, f"{where} env {i}")


def run_lockstep(
    shm: VecEnv, dummy: VecEnv, steps: int, seed: int, n_actions: int
) -> tuple[int, int]:
    """Steps both with the same actions; returns (episodes ended, of which truncated)."""
    assert shm.seed(seed) == dummy.seed(seed)
    assert_value_equal(shm.reset(), dummy.reset(), "reset obs")
    assert_same_infos(shm.reset_infos, dummy.reset_infos, "reset_infos")
    rng = np.random.default_rng(seed)
    episodes = truncated = 0
    for t in range(steps):
        actions = rng.integers(0, n_actions, size=shm.num_envs)
        obs, rewards, dones, infos = shm.step(actions)
        d_obs, d_rewards, d_dones, d_infos = dummy.step(actions)
        assert_value_equal(obs, d_obs, f"step {t} obs")
        np.testing.assert_array_equal(rewards, d_rewards.astype(rewards.dtype), f"step {t}")
        assert dones.dtype == np.bool_
        np.testing.assert_array_equal(dones, d_dones, f"step {t} dones")
        assert_same_infos(infos, d_infos, f"step {t} infos")
        assert_same_infos(shm.reset_infos, dummy.reset_infos, f"step {t} reset_infos")
        episodes += int(dones.sum())
        truncated += sum(info["TimeLimit.truncated"] for info in infos)
    return episodes, truncated


@pytest.fixture
def cartpoles():
    shm = ShmSB3VecEnv([cartpole()] * NUM_ENVS, num_workers=2)
    dummy = DummyVecEnv([cartpole()] * NUM_ENVS)
    yield shm, dummy
    shm.close()
    dummy.close()


# ------------------------------------------------------------------ stepping


def test_is_a_vec_env(cartpoles):
    shm, dummy = cartpoles
    assert isinstance(shm, VecEnv)
    assert shm.num_envs == NUM_ENVS
    assert shm.observation_space == dummy.observation_space
    assert shm.action_space == dummy.action_space
    assert shm.render_mode is None
    assert shm.shm_env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP


def test_cartpole_matches_dummy_vec_env_step_by_step(cartpoles):
    shm, dummy = cartpoles
    # max_episode_steps=25: both terminations and time-limit truncations happen.
    episodes, truncated = run_lockstep(shm, dummy, steps=300, seed=7, n_actions=2)
    assert episodes > 10 and 0 < truncated < episodes


def test_terminal_observation_and_time_limit_flags(cartpoles):
    shm, dummy = cartpoles
    shm.seed(1)
    obs = shm.reset()
    saw_termination = False
    for _ in range(200):
        previous = obs
        obs, _, dones, infos = shm.step(np.ones(NUM_ENVS, dtype=np.int64))  # always right
        for i, info in enumerate(infos):
            assert isinstance(info["TimeLimit.truncated"], bool)
            if dones[i]:
                terminal = info["terminal_observation"]
                assert terminal.shape == (4,) and terminal.dtype == np.float32
                assert not np.array_equal(terminal, obs[i])  # obs[i] starts a new episode
                assert np.all(np.abs(obs[i]) <= 0.05)  # CartPole's reset range
                assert not np.array_equal(terminal, previous[i])
                saw_termination |= not info["TimeLimit.truncated"]
            else:
                assert "terminal_observation" not in info
                assert info["TimeLimit.truncated"] is False
    assert saw_termination  # pushing right always topples the pole within 25 steps


def test_dict_observations_and_infos_match_dummy_vec_env():
    fns = [info_env(length) for length in (3, 4, 5, 6)]
    shm = ShmSB3VecEnv(fns, num_workers=2)
    dummy = DummyVecEnv(fns)
    try:
        obs = shm.reset()
        assert isinstance(obs, dict) and set(obs) == {"pos", "count"}
        episodes, truncated = run_lockstep(shm, dummy, steps=40, seed=3, n_actions=3)
        assert episodes > 5 and 0 < truncated < episodes
    finally:
        shm.close()
        dummy.close()


def test_seed_is_used_once_at_next_reset(cartpoles):
    shm, _ = cartpoles
    assert shm.seed(123) == [123, 124, 125, 126]
    first = shm.reset()
    assert shm._seeds == [None] * NUM_ENVS
    shm.seed(123)
    np.testing.assert_array_equal(shm.reset(), first)
    unseeded = shm.reset()  # seeds were consumed: the envs continue their RNG streams
    assert not np.array_equal(unseeded, first)
    seeds = shm.seed()  # None: a random base seed, distinct per env
    assert len(set(seeds)) == NUM_ENVS


def test_set_options_are_passed_to_the_next_reset():
    fns = [info_env(5)] * NUM_ENVS
    shm = ShmSB3VecEnv(fns, num_workers=2)
    dummy = DummyVecEnv(fns)
    try:
        for venv in (shm, dummy):
            venv.seed(0)
            venv.set_options([{"start": 10.0}, {}, {"start": -10.0}, {}])
        assert_value_equal(shm.reset(), dummy.reset(), "obs")
        assert_same_infos(shm.reset_infos, dummy.reset_infos, "reset_infos")
        assert shm.reset_infos[0]["reset_pos"] > 8 and shm.reset_infos[2]["reset_pos"] < -8
        assert abs(shm.reset_infos[1]["reset_pos"]) <= 1
        assert shm._options == [{}] * NUM_ENVS
    finally:
        shm.close()
        dummy.close()


# ------------------------------------------------- attributes, methods, wrappers


@pytest.fixture(params=["env_fns", "prebuilt"])
def info_envs(request):
    """The adapter built from env_fns, and over a ShmVectorEnv built elsewhere."""
    fns = [info_env(5)] * NUM_ENVS
    if request.param == "env_fns":
        shm = ShmSB3VecEnv(fns, num_workers=2)
    else:
        vec = shmvec.ShmVectorEnv(fns, num_workers=2, autoreset_mode=AutoresetMode.SAME_STEP)
        shm = ShmSB3VecEnv(vec)
    dummy = DummyVecEnv(fns)
    shm.reset()
    dummy.reset()
    yield request.param, shm, dummy
    shm.close()
    dummy.close()


def test_get_attr_with_indices(info_envs):
    _, shm, dummy = info_envs
    assert shm.get_attr("length") == dummy.get_attr("length") == [5] * NUM_ENVS
    assert shm.get_attr("length", indices=[1, 3]) == [5, 5]
    assert shm.get_attr("length", indices=2) == [5]
    assert shm.get_attr("render_mode", indices=range(2)) == [None, None]
    spec = shm.get_attr("observation_space", 0)[0]
    assert spec == dummy.get_attr("observation_space", 0)[0]
    # Methods are returned, not called (SB3's get_attr is getattr); a bound method of
    # an env comes back as a pickled copy.
    method = shm.get_attr("bump", indices=[0])[0]
    assert callable(method)
    with pytest.raises(AttributeError):
        shm.get_attr("no_such_attribute")
    assert shm.has_attr("length") and not shm.has_attr("no_such_attribute")


def test_set_attr_with_indices(info_envs):
    _, shm, dummy = info_envs
    for venv in (shm, dummy):
        venv.set_attr("length", 2, indices=[1, 2])
        venv.set_attr("length", 9, indices=3)
    assert shm.get_attr("length") == dummy.get_attr("length") == [5, 2, 2, 9]
    for venv in (shm, dummy):
        venv.set_attr("length", [1, 2])  # a list value is one value, not one per env
    assert shm.get_attr("length") == [[1, 2]] * NUM_ENVS
    for venv in (shm, dummy):
        venv.set_attr("length", 3)
    # The new length is used by the envs themselves: all truncate after 3 steps.
    for _ in range(3):
        _, _, dones, infos = shm.step(np.ones(NUM_ENVS, dtype=np.int64))
    assert dones.all() and all(info["TimeLimit.truncated"] for info in infos)


def test_env_method_with_indices(info_envs):
    kind, shm, dummy = info_envs
    assert shm.env_method("bump") == dummy.env_method("bump") == [1] * NUM_ENVS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all envs: never a warning
        assert shm.env_method("get_wrapper_attr", "length") == [5] * NUM_ENVS
    if kind == "env_fns":
        # Only the envs named by indices run the method, as in DummyVecEnv.
        assert shm.env_method("bump", 5, indices=[2]) == dummy.env_method("bump", 5, indices=[2])
        assert shm.env_method("bump", by=10, indices=[0, 3]) == [11, 11]
        dummy.env_method("bump", by=10, indices=[0, 3])
        assert shm.get_attr("bumps") == dummy.get_attr("bumps") == [11, 1, 6, 11]
    else:
        # Built elsewhere: the method runs in every env, the requested results come back.
        with pytest.warns(RuntimeWarning, match="runs in every env"):
            assert shm.env_method("bump", 5, indices=[2]) == [6]
        assert shm.get_attr("bumps") == [6] * NUM_ENVS


def test_env_method_runs_only_in_the_named_envs():
    shm = ShmSB3VecEnv([cartpole(500)] * NUM_ENVS, num_workers=2)
    try:
        shm.seed(0)
        shm.reset()
        for _ in range(5):
            shm.step(np.zeros(NUM_ENVS, dtype=np.int64))
        shm.env_method("reset", indices=[2])  # side effects in env 2 only
        steps = shm.get_attr("_elapsed_steps")
        assert steps == [5, 5, 0, 5]
    finally:
        shm.close()


class MyMonitor(Monitor):
    """A subclass: env_is_wrapped(Monitor) is an isinstance check."""


def test_env_is_wrapped():
    def monitored() -> gym.Env:
        return Monitor(gym.make("CartPole-v1"))

    def my_monitored() -> gym.Env:
        return MyMonitor(gym.make("CartPole-v1"))

    fns = [monitored, my_monitored, cartpole(), monitored]
    for venv in (
        ShmSB3VecEnv(fns, num_workers=2),
        ShmSB3VecEnv(
            shmvec.ShmVectorEnv(fns, num_workers=2, autoreset_mode=AutoresetMode.SAME_STEP)
        ),
        DummyVecEnv(fns),
    ):
        try:
            assert venv.env_is_wrapped(Monitor) == [True, True, False, True]
            assert venv.env_is_wrapped(MyMonitor) == [False, True, False, False]
            assert venv.env_is_wrapped(TimeLimit, indices=[2, 3]) == [True, True]
            assert venv.env_is_wrapped(gym.wrappers.ClipAction) == [False] * 4
        finally:
            venv.close()


def test_prebuilt_vector_env_must_autoreset_in_the_same_step():
    vec = shmvec.ShmVectorEnv([cartpole()] * 2, num_workers=1)  # NEXT_STEP
    try:
        with pytest.raises(ValueError, match="SAME_STEP"):
            ShmSB3VecEnv(vec)
        with pytest.raises(TypeError, match="num_workers"):
            ShmSB3VecEnv(vec, num_workers=2)
    finally:
        vec.close()
    with pytest.raises(ValueError, match="SAME_STEP"):
        ShmSB3VecEnv([cartpole()] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)


def test_over_a_gymnasium_vector_wrapper():
    vec = RecordEpisodeStatistics(
        shmvec.ShmVectorEnv(
            [cartpole()] * NUM_ENVS, num_workers=2, autoreset_mode=AutoresetMode.SAME_STEP
        )
    )
    shm = ShmSB3VecEnv(vec)
    dummy = DummyVecEnv([lambda: gym.wrappers.RecordEpisodeStatistics(cartpole()())] * NUM_ENVS)
    try:
        assert shm.get_attr("spec", 0)[0].id == "CartPole-v1"  # call() reaches the sub-envs
        shm.seed(5)
        dummy.seed(5)
        shm.reset()
        dummy.reset()
        rng = np.random.default_rng(0)
        ended = 0
        for _ in range(100):
            actions = rng.integers(0, 2, NUM_ENVS)
            obs, rewards, dones, infos = shm.step(actions)
            d_obs, _, d_dones, d_infos = dummy.step(actions)
            np.testing.assert_array_equal(obs, d_obs)
            np.testing.assert_array_equal(dones, d_dones)
            for i in np.flatnonzero(dones):
                # In SAME_STEP infos, a done env's top-level keys are its reset's info, so
                # what a vector wrapper adds there on that step goes to reset_infos.
                ours, theirs = shm.reset_infos[i]["episode"], d_infos[i]["episode"]
                assert ours["r"] == theirs["r"] and ours["l"] == theirs["l"]
                assert "episode" not in infos[i] and "terminal_observation" in infos[i]
                ended += 1
            for i in np.flatnonzero(~dones):
                assert "episode" not in infos[i]
        assert ended > 5
    finally:
        shm.close()
        dummy.close()


def test_render_and_get_images():
    pytest.importorskip("pygame")

    def make() -> gym.Env:
        return gym.make("CartPole-v1", render_mode="rgb_array")

    shm = ShmSB3VecEnv([make] * NUM_ENVS, num_workers=2)
    try:
        assert shm.render_mode == "rgb_array"
        shm.seed(0)
        shm.reset()
        images = shm.get_images()
        assert len(images) == NUM_ENVS
        assert all(image.shape == (400, 600, 3) and image.dtype == np.uint8 for image in images)
        tiled = shm.render()
        assert tiled.shape == (800, 1200, 3)
    finally:
        shm.close()


def test_get_images_without_rgb_array_warns(cartpoles):
    shm, _ = cartpoles
    with pytest.warns(UserWarning, match="rgb_array"):
        assert shm.get_images() == [None] * NUM_ENVS


def test_close_twice(cartpoles):
    shm, _ = cartpoles
    shm.close()
    shm.close()
    assert shm.shm_env.closed


def test_unbatch_infos():
    infos = {
        "a": np.array([1, 2, 3]),
        "_a": np.array([True, False, True]),
        "episode": {"r": np.array([0.0, 5.0, 0.0]), "_r": np.array([False, True, False])},
        "_episode": np.array([False, True, False]),
        "unmasked": ["x", "y", "z"],
    }
    assert unbatch_infos(infos, 3) == [
        {"a": 1, "unmasked": "x"},
        {"episode": {"r": 5.0}, "unmasked": "y"},
        {"a": 3, "unmasked": "z"},
    ]
    assert unbatch_infos({}, 2) == [{}, {}]


# ------------------------------------------------------------------ training


def test_make_vec_env_with_shm_vec_env_cls():
    venv = make_vec_env(
        "CartPole-v1",
        n_envs=NUM_ENVS,
        seed=0,
        vec_env_cls=ShmSB3VecEnv,
        vec_env_kwargs={"num_workers": 2},
    )
    try:
        assert isinstance(venv, ShmSB3VecEnv)
        assert venv.env_is_wrapped(Monitor) == [True] * NUM_ENVS
        venv.reset()
        episodes = []
        for _ in range(100):
            _, _, dones, infos = venv.step(np.zeros(NUM_ENVS, dtype=np.int64))
            episodes += [info["episode"] for info, done in zip(infos, dones) if done]
        assert episodes and all(ep["l"] == ep["r"] for ep in episodes)
    finally:
        venv.close()


def test_ppo_learns_without_errors():
    venv = ShmSB3VecEnv([cartpole(500)] * NUM_ENVS, num_workers=2)
    try:
        model = PPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, n_epochs=2)
        model.learn(256)
        assert model.num_timesteps == 256
        actions, _ = model.predict(venv.reset(), deterministic=True)
        assert actions.shape == (NUM_ENVS,)
    finally:
        venv.close()


def test_sb3_env_fns_make_prebuilt_envs_exact():
    vec = shmvec.ShmVectorEnv(
        sb3_env_fns([info_env(5)] * NUM_ENVS),
        num_workers=2,
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    shm = ShmSB3VecEnv(vec)
    try:
        shm.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert shm.env_method("bump", indices=[1]) == [1]
        assert shm.get_attr("bumps") == [0, 1, 0, 0]
    finally:
        shm.close()


# ===================================================================================
# SB3's own VecEnv scenarios (tests/test_vec_*.py of stable-baselines3), run against
# DummyVecEnv and the adapter (and SubprocVecEnv where cheap) side by side: each
# scenario logs every result it sees (observations, rewards, dones, infos, attributes,
# renders, the kind of every error), and the logs must agree value for value.
# ===================================================================================

import copy  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
from collections.abc import Mapping  # noqa: E402

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stable_baselines3.common.monitor import get_monitor_files, load_results  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    SubprocVecEnv,
    VecCheckNan,
    VecExtractDictObs,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
    VecVideoRecorder,
    sync_envs_normalization,
)

from shmvec.sb3 import ActionCountError, batch_actions  # noqa: E402

N_ENVS = 3  # as SB3's tests
UNIT_BOX = spaces.Box(0.0, 1.0, (2,), np.float32)

SPACES = {
    "discrete": spaces.Discrete(2),
    "multidiscrete": spaces.MultiDiscrete([2, 3]),
    "multibinary": spaces.MultiBinary(3),
    "continuous": UNIT_BOX,
}


class SpaceEnv(gym.Env):
    """SB3's ``CustomGymEnv`` with per-env randomness, so that processes compare.

    Observations are samples of its own copy of ``space`` (seeded at reset), the
    reward is random plus a checksum of the action (so the action is seen), an
    episode lasts ``ep_length`` steps; it remembers its reset options.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}

    def __init__(self, space: spaces.Space, render_mode: str | None = "rgb_array", ep_length=4):
        self.observation_space = copy.deepcopy(space)
        self.action_space = copy.deepcopy(space)
        self.render_mode = render_mode
        self.ep_length = ep_length
        self.current_step = 0
        self.current_options: dict | None = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        self.current_step = 0
        self.current_options = options
        self.state = self.observation_space.sample()
        return self.state, {}

    def step(self, action):
        flat = spaces.flatten(self.action_space, action).astype(np.float64)
        checksum = float(flat @ np.arange(1, flat.size + 1))
        reward = float(self.np_random.random()) + checksum
        self.state = self.observation_space.sample()
        self.current_step += 1
        truncated = self.current_step >= self.ep_length
        return self.state, reward, False, truncated, {"step": self.current_step}

    def render(self):
        if self.render_mode == "rgb_array":
            return np.full((4, 4, 3), self.current_step, dtype=np.uint8)
        return None

    @staticmethod
    def custom_method(dim_0: int = 1, dim_1: int = 1) -> np.ndarray:
        return np.ones((dim_0, dim_1))


class StepEnv(gym.Env):
    """SB3's: the observation is the previous step count; truncates at ``max_steps``."""

    def __init__(self, max_steps: int) -> None:
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(np.array([0]), np.array([999]), dtype=int)
        self.max_steps = max_steps
        self.current_step = 0

    def reset(self, *, seed=None, options=None):
        self.current_step = 0
        return np.array([0]), {}

    def step(self, action):
        previous = self.current_step
        self.current_step += 1
        return np.array([previous]), 0.0, False, self.current_step >= self.max_steps, {}


class RewardEnv(gym.Env):
    """SB3's ``DummyRewardEnv`` (test_vec_normalize.py): a fixed reward cycle."""

    def __init__(self, return_reward_idx: int = 0) -> None:
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.returned_rewards = [0, 1, 3, 4]
        self.return_reward_idx = return_reward_idx
        self.t = return_reward_idx

    def step(self, action):
        self.t += 1
        value = self.returned_rewards[(self.t + self.return_reward_idx) % 4]
        return np.array([value]), value, False, self.t == 4, {}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.returned_rewards[self.return_reward_idx]]), {}


class GoalEnv(gym.Env):
    """SB3's ``DummyDictEnv`` with the env's own RNG for its terminations."""

    def __init__(self, mixed: bool = False) -> None:
        box = spaces.Box(-20.0, 20.0, (4,), np.float32)
        keys = (
            ("obs1", "obs2", "obs3") if mixed else ("observation", "achieved_goal", "desired_goal")
        )
        self.observation_space = spaces.Dict(
            {key: spaces.Discrete(1) if mixed and key == "obs2" else box for key in keys}
        )
        self.action_space = spaces.Box(-1, 1, (3,), np.float32)
        self.mixed = mixed

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        obs = self.observation_space.sample()
        reward = 0.0 if self.mixed else -float(np.any(obs["achieved_goal"] != obs["desired_goal"]))
        return obs, reward, bool(self.np_random.random() > 0.8), False, {}


class NanAndInfEnv(gym.Env):
    """SB3's (test_vec_check_nan.py), with gymnasium's reset signature."""

    def __init__(self) -> None:
        self.action_space = spaces.Box(-np.inf, np.inf, (1,), np.float64)
        self.observation_space = spaces.Box(-np.inf, np.inf, (1,), np.float64)

    def step(self, action):
        if np.all(np.array(action) > 0):
            obs = float("nan")
        elif np.all(np.array(action) < 0):
            obs = float("inf")
        else:
            obs = 0.0
        return [obs], 0.0, False, False, {}

    def reset(self, *, seed=None, options=None):
        return [0.0], {}


def space_env(space: spaces.Space, **kwargs):
    return functools.partial(SpaceEnv, space, **kwargs)


def monitored(make):
    return lambda: Monitor(make())


def pendulum(render_mode: str | None = None):
    return lambda: Monitor(gym.make("Pendulum-v1", render_mode=render_mode))


# ------------------------------------------------------------- the comparison


class Raised:
    """A logged exception: its class (the kind of error is what must agree)."""

    def __init__(self, error: BaseException) -> None:
        self.kind = type(error)
        self.message = str(error)

    def __repr__(self) -> str:
        return f"Raised({self.kind.__name__}: {self.message})"


class Log(list):
    """The results a scenario saw, as ``(label, value)`` pairs."""

    def add(self, label: str, value: Any) -> Any:
        self.append((label, value))
        return value

    def call(self, label: str, fn, *args: Any, **kwargs: Any) -> Any:
        """Logs ``fn(*args, **kwargs)``, or the exception it raised."""
        try:
            return self.add(label, fn(*args, **kwargs))
        except Exception as error:  # the kind of error is compared
            self.add(label, Raised(error))
            return None

    def step(self, venv: VecEnv, actions: Any, label: str = "step") -> tuple:
        """Logs one step's obs, rewards, dones, infos and reset_infos."""
        obs, rewards, dones, infos = venv.step(actions)
        self.add(f"{label} obs", obs)
        self.add(f"{label} rewards", rewards)
        self.add(f"{label} dones", dones)
        self.add(f"{label} infos", [scrub(info) for info in infos])
        self.add(f"{label} reset_infos", [scrub(info) for info in venv.unwrapped.reset_infos])
        return obs, rewards, dones, infos


def scrub(info: dict) -> dict:
    """An info without the wall-clock times of Monitor/VecMonitor's ``episode``."""
    info = dict(info)
    if isinstance(info.get("episode"), dict):
        info["episode"] = {k: v for k, v in info["episode"].items() if k != "t"}
    return info


def make_vec(kind: str, env_fns: list) -> VecEnv:
    if kind == "dummy":
        return DummyVecEnv(env_fns)
    if kind == "subproc":
        return SubprocVecEnv(env_fns, start_method="fork")  # forkserver: ~10 s a test
    return ShmSB3VecEnv(env_fns, num_workers=min(2, len(env_fns)))


def vec_env_cls(kind: str) -> tuple[type, dict]:
    """``make_vec_env``'s ``vec_env_cls`` and ``vec_env_kwargs`` of a kind."""
    return {
        "dummy": (DummyVecEnv, {}),
        "subproc": (SubprocVecEnv, {"start_method": "fork"}),
        "shm": (ShmSB3VecEnv, {"num_workers": 1}),
    }[kind]


def run_scenario(kind: str, env_fns: list, scenario, wrap=None) -> Log:
    venv = make_vec(kind, env_fns)
    if wrap is not None:
        venv = wrap(venv)
    log = Log()
    try:
        scenario(venv, log)
    finally:
        venv.close()
    return log


def assert_same_log(ours: Log, theirs: Log, exact: bool = True) -> None:
    labels = [label for label, _ in theirs]
    assert [label for label, _ in ours] == labels, "the scenario took another path"
    for (label, a), (_, b) in zip(ours, theirs):
        assert_same_result(a, b, label, exact)


def assert_same_result(ours: Any, theirs: Any, where: str, exact: bool = True) -> None:
    """``ours`` is ``theirs``: arrays in dtype, shape and bits; containers element by
    element; errors in kind (ours may be a subclass). Scalars may differ as numpy vs
    Python scalar of the same kind and value (gymnasium batches infos into arrays).
    With ``exact=False`` (SubprocVecEnv: float64 rewards, tuples of infos), arrays are
    compared after a cast to the reference's dtype, floats to 1e-6 (float64 rewards
    normalized by VecNormalize round otherwise), and lists and tuples alike."""
    if isinstance(theirs, Raised):
        assert isinstance(ours, Raised), f"{where}: {ours!r} where DummyVecEnv raised {theirs!r}"
        assert issubclass(ours.kind, theirs.kind), f"{where}: {ours!r} vs {theirs!r}"
        return
    assert not isinstance(ours, Raised), f"{where}: {ours!r} where DummyVecEnv gave {theirs!r}"
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), f"{where}: {type(ours).__name__} vs ndarray"
        if not exact:
            ours = ours.astype(theirs.dtype)
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} vs {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {ours.shape} vs {theirs.shape}"
        nan = theirs.dtype.kind in "fc"
        if exact or not nan:
            same = np.array_equal(ours, theirs, equal_nan=nan)
        else:  # SubprocVecEnv's float64 rewards round otherwise through VecNormalize
            same = np.allclose(ours, theirs, rtol=1e-6, atol=0, equal_nan=True)
        assert same, f"{where}:\n{ours}\nvs\n{theirs}"
    elif isinstance(theirs, Mapping):
        assert isinstance(ours, Mapping), f"{where}: {type(ours).__name__} vs a dict"
        assert set(ours) == set(theirs), f"{where}: keys {sorted(ours)} vs {sorted(theirs)}"
        for key in theirs:
            assert_same_result(ours[key], theirs[key], f"{where}[{key!r}]", exact)
    elif isinstance(theirs, (list, tuple)):
        kinds = (list, tuple) if not exact else type(theirs)
        assert isinstance(ours, kinds), f"{where}: {type(ours).__name__} vs {type(theirs)}"
        assert len(ours) == len(theirs), f"{where}: length {len(ours)} vs {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_result(a, b, f"{where}[{i}]", exact)
    elif isinstance(ours, np.generic) != isinstance(theirs, np.generic):
        kind_a, kind_b = np.asarray(ours).dtype.kind, np.asarray(theirs).dtype.kind
        assert kind_a == kind_b and ours == theirs, f"{where}: {ours!r} vs {theirs!r}"
    else:
        assert type(ours) is type(theirs), f"{where}: {ours!r} vs {theirs!r}"
        assert ours == theirs or (ours != ours and theirs != theirs), (
            f"{where}: {ours!r} vs {theirs!r}"
        )


def compare(kind: str, env_fns: list, scenario, wrap=None) -> Log:
    """Runs ``scenario`` on DummyVecEnv and on ``kind``; asserts the logs agree."""
    theirs = run_scenario("dummy", env_fns, scenario, wrap)
    ours = run_scenario(kind, env_fns, scenario, wrap)
    assert len(theirs) > 0
    assert_same_log(ours, theirs, exact=kind != "subproc")
    return theirs


KINDS = ["shm", "subproc"]
WRAPPERS = {
    "none": None,
    "VecNormalize": VecNormalize,
    "VecFrameStack": functools.partial(VecFrameStack, n_stack=2),
}


# ------------------------------------------------------- test_vec_envs.py's


INDEX_FORMS = [None, 1, -1, -N_ENVS, [2, -1, 0], range(1, 3), range(-2, 0), [1, 1], (0, 2)]
BAD_INDICES = [N_ENVS, -N_ENVS - 1, [0, N_ENVS], "0", 1.0, np.int64(1)]


def custom_calls(venv: VecEnv, log: Log) -> None:
    """SB3's test_vecenv_custom_calls, plus every index form of the issue."""
    log.add("seed", venv.seed(0))
    log.call("render rgb_array", venv.render, mode="rgb_array")
    log.call("render", venv.render)
    with pytest.warns(UserWarning):
        venv.render(mode="something_else")
    log.add("has dummy", venv.has_attr("dummy"))
    log.call("set dummy", venv.set_attr, "dummy", 12)
    log.call("get dummy", venv.get_attr, "dummy")
    log.add("has dummy2", venv.has_attr("dummy2"))
    log.call("set_wrapper_attr", venv.env_method, "set_wrapper_attr", "dummy2", 2)
    log.call("get dummy2", venv.get_attr, "dummy2")
    log.call("custom_method", venv.env_method, "custom_method", 1, indices=None, dim_1=2)
    for i in range(N_ENVS):
        log.call(f"set dummy1 {i}", venv.set_attr, "dummy1", i, indices=i)
    log.add("has dummy1", venv.has_attr("dummy1"))
    log.call("get dummy1", venv.get_attr, "dummy1")
    log.call("subset", venv.env_method, "custom_method", 1, indices=[0, 2], dim_1=3)
    log.call("set all", venv.set_attr, "dummy1", 42, indices=None)
    log.call("get all", venv.get_attr, "dummy1")
    log.add("reset", venv.reset())
    log.call("set step", venv.env_method, "set_wrapper_attr", "current_step", 12, indices=[0, 1])
    for indices in (None, [0, 1], [0, 2]):
        log.call(f"get step {indices}", venv.get_attr, "current_step", indices=indices)
    log.add("reset again", venv.reset())
    log.call("[0, -1]", venv.env_method, "set_wrapper_attr", "current_step", 12, indices=[0, -1])
    for indices in (None, [-1]):
        log.call(f"get step {indices}", venv.get_attr, "current_step", indices=indices)
    # Every index form the issue names, and a few steps in between.
    venv.action_space.seed(0)
    for t, indices in enumerate(INDEX_FORMS):
        log.call(f"set {indices!r}", venv.set_attr, "dummy3", t, indices=indices)
        log.call(f"get {indices!r}", venv.get_attr, "dummy3", indices=indices)
        log.call(f"step of {indices!r}", venv.get_attr, "current_step", indices=indices)
        log.call(f"wrapped {indices!r}", venv.env_is_wrapped, Monitor, indices=indices)
        log.call(f"custom {indices!r}", venv.env_method, "custom_method", t + 1, indices=indices)
        log.step(venv, [venv.action_space.sample() for _ in range(N_ENVS)], f"step {t}")
    # An index named twice runs twice, in order.
    log.call("twice", venv.env_method, "count_calls", indices=[2, 0, 2, 2])
    log.call("counts", venv.get_attr, "calls")
    # Bad indices: the same kind of error, raised before any env is touched.
    for bad in BAD_INDICES:
        log.call(f"env_method {bad!r}", venv.env_method, "count_calls", indices=bad)
        log.call(f"set_attr {bad!r}", venv.set_attr, "calls", 99, indices=bad)
        log.call(f"get_attr {bad!r}", venv.get_attr, "calls", indices=bad)
        log.call(f"env_is_wrapped {bad!r}", venv.env_is_wrapped, Monitor, indices=bad)
    log.call("counts after", venv.get_attr, "calls")
    # Options, used once at the next reset.
    log.call("options", venv.get_attr, "current_options")
    venv.set_options({"hello": 1})
    log.call("options pending", venv.get_attr, "current_options")
    log.add("reset with options", venv.reset())
    log.call("options used", venv.get_attr, "current_options")
    log.add("reset without", venv.reset())
    log.call("options gone", venv.get_attr, "current_options")
    options: list[dict] = [{"hello": 1}] * N_ENVS
    options[0] = {"other_option": 2}
    venv.set_options(options)
    log.add("reset with a list", venv.reset())
    log.call("options per env", venv.get_attr, "current_options")
    venv.set_options([{"hello": 1}])  # too short: IndexError at reset (last: DummyVecEnv
    log.call("reset short options", venv.reset)  # has reset its first env by then)


class CountingEnv(SpaceEnv):
    calls = 0

    def count_calls(self) -> int:
        self.calls += 1
        return self.calls


def counting_box_env() -> gym.Env:
    return Monitor(CountingEnv(UNIT_BOX))


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", KINDS)
def test_vecenv_custom_calls_and_indices(kind, wrapper):
    log = compare(kind, [counting_box_env] * N_ENVS, custom_calls, WRAPPERS[wrapper])
    values = dict(log)
    assert values["get step [-1]"] == [12]  # the case: the last env is addressed
    assert values["twice"] == [1, 1, 2, 3] and values["counts"] == [1, 0, 3]
    assert values["counts after"] == [1, 0, 3]  # no bad index reached an env
    assert all(isinstance(values[f"get_attr {bad!r}"], Raised) for bad in BAD_INDICES)
    assert values["options per env"] == options_expected()


def options_expected() -> list:
    return [{"other_option": 2}] + [{"hello": 1}] * (N_ENVS - 1)


def terminal_obs(venv: VecEnv, log: Log) -> None:
    zero_acts = np.zeros((N_ENVS,), dtype=int)
    log.add("reset", venv.reset())
    for t in range(1, 8):
        log.step(venv, zero_acts, f"step {t}")


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", KINDS)
def test_vecenv_terminal_obs(kind, wrapper):
    fns = [functools.partial(StepEnv, n) for n in (5, 6, 7)]
    log = compare(kind, fns, terminal_obs, WRAPPERS[wrapper])
    infos = dict(log)["step 5 infos"]
    assert "terminal_observation" in infos[0] and "terminal_observation" not in infos[1]


class UnorderedDictSpace(spaces.Dict):
    """SB3's: samples are plain dicts, here in reverse key order."""

    def sample(self, mask=None, probability=None):
        sample = super().sample()
        return {key: sample[key] for key in reversed(list(sample))}


ALL_SPACES = {
    **SPACES,
    "dict": spaces.Dict(SPACES),
    "unordered_dict": UnorderedDictSpace(SPACES),
    "tuple": spaces.Tuple(tuple(SPACES.values())),
}
NESTED = spaces.Dict({"a": spaces.Tuple(tuple(SPACES.values())), "b": spaces.Dict(SPACES)})


def stepping_with_samples(venv: VecEnv, log: Log) -> None:
    """SB3's check_vecenv_spaces: actions as a list of per-env samples, until done;
    for array spaces also as one stacked array (as test_vec_seeding does)."""
    venv.seed(0)
    venv.action_space.seed(0)
    log.add("reset", venv.reset())
    array_space = not isinstance(venv.action_space, (spaces.Dict, spaces.Tuple))
    for t in range(6):
        actions = [venv.action_space.sample() for _ in range(N_ENVS)]
        log.step(venv, np.array(actions) if array_space and t % 2 else actions, f"step {t}")
        log.call(f"steps {t}", venv.get_attr, "current_step")


@pytest.mark.parametrize("space", ALL_SPACES)
@pytest.mark.parametrize("kind", KINDS)
def test_vecenv_spaces(kind, space):
    log = compare(kind, [space_env(ALL_SPACES[space])] * N_ENVS, stepping_with_samples)
    assert dict(log)["step 3 dones"].all()  # the episodes of 4 steps ended


def test_nested_action_spaces_are_batched():
    """Beyond SB3 (its VecEnvs refuse nested observation spaces): nested Dict/Tuple
    actions given per env are stacked leaf by leaf."""
    with pytest.raises(NotImplementedError, match="Nested"):
        DummyVecEnv([space_env(NESTED)])
    space = NESTED
    samples = [space.sample() for _ in range(N_ENVS)]
    batch = batch_actions(space, samples, N_ENVS)
    assert batch["a"][1].shape == (N_ENVS, 2) and batch["b"]["continuous"].dtype == np.float32
    for i, sample in enumerate(samples):
        assert_value_equal(batch["a"][0][i], sample["a"][0], "a0")
        assert_value_equal(batch["b"]["multibinary"][i], sample["b"]["multibinary"], "mb")


def malformed(case: str, space: spaces.Space) -> Any:
    samples = [space.sample() for _ in range(N_ENVS)]
    if case == "too_few":
        return samples[:-1]
    if case == "too_few_array":
        return np.array(samples[:-1])
    if case == "too_many":
        return [*samples, samples[0]]
    if case == "scalar":
        return 1
    if case == "numpy_scalar":
        return np.int64(1)
    if case == "missing_key":
        samples[1] = {k: v for k, v in samples[1].items() if k != "multibinary"}
    elif case == "not_a_dict":
        samples[1] = 5
    elif case == "short_tuple":
        samples[1] = samples[1][:-1]
    elif case == "ragged":
        samples[1] = np.zeros(3, np.float32)
    return samples


MALFORMED = [
    # (case, space, the VecEnv whose error kind is the reference)
    ("too_few", "discrete", "dummy"),
    ("too_few_array", "continuous", "dummy"),
    ("too_few", "dict", "dummy"),
    ("too_few", "tuple", "dummy"),
    ("too_many", "discrete", "subproc"),  # DummyVecEnv drops the extra actions
    ("too_many", "dict", "subproc"),
    ("scalar", "discrete", "dummy"),
    ("numpy_scalar", "discrete", "subproc"),  # DummyVecEnv: IndexError (np.int64(1)[0])
    ("missing_key", "dict", "dummy"),
    ("not_a_dict", "dict", "dummy"),
    ("short_tuple", "tuple", "dummy"),
    # SB3's VecEnvs hand an action of another shape to the env, which decides; shared
    # memory holds the space's shape, so the adapter refuses it (a ValueError).
    ("ragged", "continuous", None),
]


@pytest.mark.parametrize("case,space,reference", MALFORMED)
def test_malformed_actions_raise_before_reaching_a_worker(case, space, reference):
    fns = [functools.partial(CountingEnv, ALL_SPACES[space])] * N_ENVS
    errors = {None: ValueError()}
    for kind in (reference or "dummy", "shm"):
        venv = make_vec(kind, fns)
        try:
            venv.seed(0)
            venv.reset()
            venv.action_space.seed(0)
            if reference is None and kind == "dummy":
                venv.step(malformed(case, venv.action_space))  # passes through
                continue
            with pytest.raises(Exception) as raised:
                venv.step(malformed(case, venv.action_space))
            errors[kind] = raised.value
            if kind == "shm":
                # Nothing reached a worker: no env stepped, and the next step is fine.
                assert venv.get_attr("current_step") == [0] * N_ENVS
                venv.step([venv.action_space.sample() for _ in range(N_ENVS)])
                assert venv.get_attr("current_step") == [1] * N_ENVS
        finally:
            venv.close()
    assert isinstance(errors["shm"], type(errors[reference])), (errors["shm"], errors[reference])


def test_action_count_error_is_both_index_and_value_error():
    assert issubclass(ActionCountError, IndexError) and issubclass(ActionCountError, ValueError)
    with pytest.raises(ActionCountError, match="2 actions for 3 envs"):
        batch_actions(spaces.Discrete(2), [0, 1], 3)


def test_float_actions_for_integer_spaces_are_cast_only_when_exact():
    space = spaces.Box(0, 255, (2,), np.uint8)
    batch = batch_actions(space, np.zeros((N_ENVS, 2)), N_ENVS)  # SB3's framestack test
    assert batch.dtype == np.uint8 and not batch.any()
    assert batch_actions(spaces.Discrete(3), [0.0, 2.0, 1.0], N_ENVS).tolist() == [0, 2, 1]
    with pytest.raises(TypeError, match="without changing their values"):
        batch_actions(spaces.Discrete(3), [0.5, 2.0, 1.0], N_ENVS)
    with pytest.raises(TypeError, match="without changing their values"):
        batch_actions(space, np.full((N_ENVS, 2), np.nan), N_ENVS)


class CustomWrapperA(VecNormalize):
    def __init__(self, venv: VecEnv) -> None:
        VecNormalize.__init__(self, venv)
        self.var_a = "a"


class CustomWrapperB(VecNormalize):
    def __init__(self, venv: VecEnv) -> None:
        VecNormalize.__init__(self, venv)
        self.var_b = "b"

    def func_b(self) -> str:
        return self.var_b

    def name_test(self) -> type:
        return self.__class__


class CustomWrapperBB(CustomWrapperB):
    def __init__(self, venv: VecEnv) -> None:
        CustomWrapperB.__init__(self, venv)
        self.var_bb = "bb"


def wrapper_getattr(venv: VecEnv, log: Log) -> None:
    wrapped = CustomWrapperA(CustomWrapperBB(venv))
    for name in ("var_a", "var_b", "var_bb", "num_envs", "render_mode"):
        log.call(name, getattr, wrapped, name)
    log.add("func_b", wrapped.func_b())
    log.add("name_test", wrapped.name_test())
    double = CustomWrapperA(CustomWrapperB(wrapped))
    for name in ("var_a", "var_b", "nonexistent_attribute"):
        log.call(f"double {name}", getattr, double, name)


def test_vecenv_wrapper_getattr():
    log = compare("shm", [space_env(UNIT_BOX)] * N_ENVS, wrapper_getattr)
    assert isinstance(dict(log)["double var_b"], Raised)


IMAGE_SHAPE = (12, 8, 3)


def framestack(channels_order: str | None):
    def scenario(venv: VecEnv, log: Log) -> None:
        try:
            stacked = VecFrameStack(venv, n_stack=2, channels_order=channels_order)
        except Exception as error:  # the kind of error is compared
            log.add("wrap", Raised(error))
            return
        stacked.seed(0)
        log.add("reset", stacked.reset())
        shape = stacked.venv.action_space.shape
        for t in range(5):  # float64 zeros for a uint8 action space, as SB3's test
            log.step(stacked, np.zeros((N_ENVS, *shape)), f"step {t}")

    return scenario


@pytest.mark.parametrize("shape", [IMAGE_SHAPE, IMAGE_SHAPE[::-1], (2,)])
@pytest.mark.parametrize("channels_order", [None, "last", "first", "not_valid"])
def test_framestack_vecenv(shape, channels_order):
    dtype = np.uint8 if len(shape) == 3 else np.float32
    space = spaces.Box(np.zeros(shape, dtype), np.full(shape, 255, dtype), dtype=dtype)
    log = compare("shm", [space_env(space)] * N_ENVS, framestack(channels_order))
    if channels_order == "not_valid":
        assert isinstance(dict(log)["wrap"], Raised)
    else:
        assert dict(log)["step 4 obs"].shape[0] == N_ENVS


def test_vec_env_is_wrapped():
    box = UNIT_BOX

    def scenario(venv: VecEnv, log: Log) -> None:
        log.add("plain", venv.env_is_wrapped(Monitor))
        log.add("stacked", VecFrameStack(venv, n_stack=2).env_is_wrapped(Monitor))
        log.add("indices", venv.env_is_wrapped(Monitor, indices=[-1, 0]))

    log = compare("shm", [space_env(box), monitored(space_env(box))], scenario)
    assert dict(log)["plain"] == [False, True]


def deterministic(venv: VecEnv, log: Log) -> None:
    venv.seed(3)
    log.add("obs", venv.reset())
    venv.seed(3)
    log.add("obs again", venv.reset())
    normalized = VecNormalize(venv)
    normalized.seed(3)
    log.add("normalized obs", venv.reset())
    normalized.seed(3)
    log.add("normalized obs again", venv.reset())


@pytest.mark.parametrize("kind", KINDS)
def test_vec_deterministic(kind):
    log = compare(kind, [space_env(UNIT_BOX)] * N_ENVS, deterministic)
    values = dict(log)
    np.testing.assert_array_equal(values["obs"], values["obs again"])


@pytest.mark.parametrize("kind", KINDS)
def test_vec_deterministic_make_vec_env(kind):
    results = {}
    for name in ("dummy", kind):
        cls, kwargs = vec_env_cls(name)
        log = Log()
        envs = [
            make_vec_env(
                "Pendulum-v1", n_envs=N_ENVS, vec_env_cls=cls, vec_env_kwargs=kwargs, seed=0
            )
            for _ in range(2)
        ]
        try:
            log.add("reset 1", envs[0].reset())
            log.add("reset 2", envs[1].reset())
            envs[0].action_space.seed(0)
            actions = [envs[0].action_space.sample() for _ in range(N_ENVS)]
            log.step(envs[0], actions, "1")
            log.step(envs[1], actions, "2")
        finally:
            for venv in envs:
                venv.close()
        results[name] = log
    assert_same_log(results[kind], results["dummy"], exact=kind != "subproc")
    values = dict(results[kind])
    np.testing.assert_array_equal(values["1 obs"], values["2 obs"])


def test_vec_seeding():
    def scenario(venv: VecEnv, log: Log) -> None:
        np.random.seed(11)  # seed() without a seed draws the base seed from numpy
        log.add("seeds", venv.seed())
        log.add("obs", venv.reset())
        venv.action_space.seed(0)
        log.step(venv, np.array([venv.action_space.sample() for _ in range(N_ENVS)]))

    log = compare("shm", [space_env(UNIT_BOX)] * N_ENVS, scenario)
    obs, rewards = dict(log)["obs"], dict(log)["step rewards"]
    for i in range(N_ENVS - 1):  # a distinct seed per env
        assert not np.allclose(obs[i], obs[i + 1]) and rewards[i] != rewards[i + 1]


def test_render_rgb_array():
    pytest.importorskip("pygame")
    results = {}
    for kind in ("dummy", "shm"):
        cls, kwargs = vec_env_cls(kind)
        venv = make_vec_env(
            "Pendulum-v1",
            2,
            seed=0,
            vec_env_cls=cls,
            vec_env_kwargs=kwargs,
            env_kwargs={"render_mode": "rgb_array"},
        )
        log = Log()
        try:
            log.add("reset", venv.reset())
            log.add("render", venv.render())
            log.add("render rgb_array", venv.render("rgb_array"))
            with pytest.warns(UserWarning):
                venv.render(mode="blah")
            venv.action_space.seed(0)
            for t in range(3):
                log.step(venv, [venv.action_space.sample() for _ in range(2)], f"step {t}")
                log.add(f"render {t}", venv.render())
            stacked = VecFrameStack(venv, 2)
            log.add("stacked render", stacked.render())
            log.add("stacked mode", stacked.render_mode)
            normalized = VecNormalize(stacked)
            log.add("normalized mode", normalized.render_mode)
            log.add("normalized render", normalized.render())
        finally:
            venv.close()
        results[kind] = log
    assert_same_log(results["shm"], results["dummy"])
    assert dict(results["shm"])["render"].shape == (1000, 500, 3)  # two 500x500 frames


def test_video_recorder(tmp_path):
    pytest.importorskip("moviepy", reason="VecVideoRecorder writes its videos with moviepy")
    videos = {}
    for kind in ("dummy", "shm"):
        folder = tmp_path / kind
        cls, kwargs = vec_env_cls(kind)
        venv = make_vec_env(
            "CartPole-v1",
            n_envs=1,
            seed=0,
            vec_env_cls=cls,
            vec_env_kwargs=kwargs,
            env_kwargs={"render_mode": "rgb_array"},
        )
        venv = VecVideoRecorder(
            VecNormalize(venv),
            str(folder),
            record_video_trigger=lambda x: x % 65 == 0,
            video_length=10,
            name_prefix="agent-CartPole-v1",
        )
        try:
            PPO("MlpPolicy", venv, n_steps=64, n_epochs=1, seed=0).learn(total_timesteps=128)
        finally:
            venv.close()
        videos[kind] = sorted(path.name for path in folder.glob("*.mp4"))
    assert (
        videos["shm"]
        == videos["dummy"]
        == [
            "agent-CartPole-v1-step-0-to-step-10.mp4",
            "agent-CartPole-v1-step-65-to-step-75.mp4",
        ]
    )


# -------------------------------------------------- test_vec_normalize.py's


def compare_runs(run, kind: str = "shm") -> Log:
    """``run(kind, log)`` for DummyVecEnv and ``kind``; asserts the logs agree."""
    logs = {}
    for name in ("dummy", kind):
        logs[name] = Log()
        run(name, logs[name])
    assert len(logs["dummy"]) > 0
    assert_same_log(logs[kind], logs["dummy"], exact=kind != "subproc")
    return logs["dummy"]


def rms_state(norm: VecNormalize) -> dict:
    """What SB3's check_vec_norm_equal compares: the running statistics and returns."""

    def one(rms) -> dict:
        return {"mean": rms.mean, "var": rms.var, "count": rms.count}

    obs_rms = getattr(norm, "obs_rms", None)  # absent with norm_obs=False
    if isinstance(obs_rms, dict):
        obs = {k: one(v) for k, v in obs_rms.items()}
    else:
        obs = None if obs_rms is None else one(obs_rms)
    return {"obs_rms": obs, "ret_rms": one(norm.ret_rms), "returns": norm.returns}


def sample_actions(venv: VecEnv) -> list:
    return [venv.action_space.sample() for _ in range(venv.num_envs)]


def test_obs_rms_vec_normalize():
    def scenario(venv: VecEnv, log: Log) -> None:
        norm = VecNormalize(venv)
        norm.action_space.seed(0)
        norm.reset()
        log.add("after reset", rms_state(norm))
        log.step(norm, sample_actions(norm), "first")
        log.add("after a step", rms_state(norm))
        for _ in range(300):
            norm.step(sample_actions(norm))
        log.add("after 300 steps", rms_state(norm))

    fns = [functools.partial(RewardEnv, 0), functools.partial(RewardEnv, 1)]
    log = compare("shm", fns, scenario)
    assert np.allclose(dict(log)["after a step"]["obs_rms"]["mean"], 1.25, atol=1e-4)


def image_env() -> gym.Env:
    return Monitor(SpaceEnv(spaces.Box(0, 255, (36, 36, 3), np.uint8)))


@pytest.mark.parametrize(
    "make", [pendulum(), monitored(GoalEnv), image_env], ids=["pendulum", "dict", "image"]
)
def test_vec_normalize_clip_save_load(tmp_path, make):
    def run(kind: str, log: Log) -> None:
        venv = make_vec(kind, [make])
        try:
            norm = VecNormalize(venv, clip_obs=0.5, clip_reward=5.0)
            log.add("render_mode", (venv.render_mode, norm.render_mode))
            norm.seed(0)
            norm.action_space.seed(0)
            norm.reset()
            for t in range(250):
                _, _, dones, _ = log.step(norm, sample_actions(norm), f"step {t}")
                if dones[0]:
                    break
            path = tmp_path / f"vec_normalize_{kind}"
            norm.save(path)
            loaded = VecNormalize.load(path, venv=venv)
            log.add("loaded render_mode", loaded.render_mode)
            log.add("loaded", rms_state(loaded))
            log.add("saved", rms_state(norm))
            log.add("settings", [getattr(loaded, k) for k in ("clip_obs", "clip_reward", "gamma")])
        finally:
            venv.close()

    log = compare_runs(run)
    assert any(label.endswith("dones") and value[0] for label, value in log)


def warmstart(env_fn, steps: int = 100, **kwargs):
    """SB3's _make_warmstart and what its tests then check, as a scenario."""

    def scenario(venv: VecEnv, log: Log) -> None:
        try:
            norm = VecNormalize(venv, **kwargs)
        except Exception as error:  # the kind of error is compared
            log.add("wrap", Raised(error))
            return
        log.add("wrap", "made")
        norm.seed(0)
        norm.action_space.seed(0)
        log.add("reset", norm.reset())
        log.add("original reset", norm.get_original_obs())
        for t in range(steps):
            log.step(norm, sample_actions(norm), f"step {t}")
        obs = log.add("last obs", norm.get_original_obs())
        reward = log.add("last reward", norm.get_original_reward())
        log.add("normalize_obs", norm.normalize_obs(obs))
        log.add("normalize_reward", norm.normalize_reward(reward))
        log.add("normalize external", norm.normalize_reward(np.array([1, 1])))
        log.add("rms", rms_state(norm))

    return scenario


def cliff_walking() -> gym.Env:
    return gym.make("CliffWalking-v1")


WARMSTARTS = {
    "cartpole": (cartpole(500), {}),
    "dict": (GoalEnv, {}),
    "dict_selected_keys": (GoalEnv, {"norm_obs_keys": ["observation"]}),
    "discrete_obs": (cliff_walking, {}),  # ValueError: "only supports" Box/Dict
    "discrete_obs_no_norm": (cliff_walking, {"norm_obs": False}),
    "box_with_keys": (RewardEnv, {"norm_obs_keys": ["key"]}),  # ValueError
    "mixed_dict": (functools.partial(GoalEnv, mixed=True), {}),  # ValueError
    "mixed_dict_keys": (
        functools.partial(GoalEnv, mixed=True),
        {"norm_obs_keys": ["obs1", "obs3"]},
    ),
    "mixed_dict_no_norm": (functools.partial(GoalEnv, mixed=True), {"norm_obs": False}),
}


@pytest.mark.parametrize("case", WARMSTARTS)
def test_vec_normalize_warmstart(case):
    env_fn, kwargs = WARMSTARTS[case]
    log = compare("shm", [env_fn], warmstart(env_fn, **kwargs))
    should_fail = case in ("discrete_obs", "box_with_keys", "mixed_dict")
    assert isinstance(dict(log)["wrap"], Raised) == should_fail


@pytest.mark.parametrize("make", [pendulum(), monitored(GoalEnv)], ids=["pendulum", "dict"])
def test_sync_vec_normalize(make):
    def run(kind: str, log: Log) -> None:
        original, eval_base = make_vec(kind, [make]), make_vec(kind, [make])
        try:
            settings = {"norm_obs": True, "norm_reward": True, "clip_obs": 100.0}
            env = VecNormalize(original, clip_reward=100.0, **settings)
            eval_env = VecNormalize(eval_base, training=False, clip_reward=100.0, **settings)
            if not isinstance(env.observation_space, spaces.Dict):
                env, eval_env = VecFrameStack(env, 1), VecFrameStack(eval_env, 1)
            env.seed(0)
            env.action_space.seed(0)
            env.reset()
            for t in range(100):
                _, rewards, _, _ = log.step(env, sample_actions(env), f"step {t}")
            log.add("original reward", env.get_original_reward())
            log.add("unnormalized reward", env.unnormalize_reward(rewards))
            obs = log.add("reset", env.reset())
            original_obs = log.add("original obs", env.get_original_obs())
            log.add("unnormalized obs", env.unnormalize_obs(obs))
            log.add("eval before sync", eval_env.normalize_obs(original_obs))
            sync_envs_normalization(env, eval_env)
            log.add("eval after sync", eval_env.normalize_obs(original_obs))
            log.add("rewards after sync", eval_env.normalize_reward(np.linspace(0, 1, 10)))
        finally:
            original.close()
            eval_base.close()

    compare_runs(run)


# ---------------------------------------------------- test_vec_monitor.py's


def read_monitor_file(path) -> tuple[list, list]:
    """The header's keys and the (r, l) of each logged episode (not t: wall clock)."""
    with open(path) as file:
        metadata = json.loads(file.readline()[1:])
        rows = list(csv.DictReader(file))
    return sorted(metadata), [(row["r"], row["l"], sorted(row)) for row in rows]


def _monitor_runs(tmp_path, env_fn, steps: int, info_keywords=()) -> Log:
    """``steps`` random steps under VecMonitor on each kind of VecEnv, compared;
    the log ends with the monitor file each wrote."""

    def run(kind: str, log: Log) -> None:
        path = tmp_path / f"{kind}.monitor.csv"
        venv = VecMonitor(make_vec(kind, [env_fn]), str(path), info_keywords)
        try:
            venv.seed(0)
            venv.action_space.seed(0)
            venv.reset()
            for t in range(steps):
                log.step(venv, sample_actions(venv), f"step {t}")
        finally:
            venv.close()
        log.add("file", read_monitor_file(path))

    return compare_runs(run)


def test_vec_monitor(tmp_path):
    log = _monitor_runs(tmp_path, cartpole(500), 300)
    keys, episodes = dict(log)["file"]
    assert keys == ["env_id", "t_start"] and len(episodes) > 5
    assert episodes[0][2] == ["l", "r", "t"]


def test_vec_monitor_info_keywords(tmp_path):
    log = _monitor_runs(tmp_path, BitFlippingEnv, 200, ("is_success",))
    episodes = dict(log)["file"][1]
    assert episodes and all(columns == ["is_success", "l", "r", "t"] for *_, columns in episodes)


def test_vec_monitor_load_results(tmp_path):
    pytest.importorskip("pandas", reason="SB3's load_results reads monitor files with pandas")

    def run(kind: str, log: Log) -> None:
        folder = tmp_path / kind
        folder.mkdir()
        for n in range(2):
            venv = VecMonitor(make_vec(kind, [cartpole(500)]), str(folder / f"{n}.monitor.csv"))
            try:
                log.add(f"files {n}", len(get_monitor_files(str(folder))))
                venv.seed(n)
                venv.action_space.seed(n)
                venv.reset()
                episodes = 0
                for _ in range(300):
                    _, _, dones, _ = venv.step(sample_actions(venv))
                    if dones[0]:
                        episodes += 1
                        venv.reset()
                log.add(f"episodes {n}", episodes)
            finally:
                venv.close()
            log.add(f"results {n}", len(load_results(str(folder)).index))

    log = dict(compare_runs(run))
    assert log["results 1"] == log["episodes 0"] + log["episodes 1"] > 0


def test_vec_monitor_ppo():
    def run(kind: str, log: Log) -> None:
        venv = VecMonitor(make_vec(kind, [cartpole(500)]))
        try:
            venv.seed(0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = PPO("MlpPolicy", venv, n_steps=64, seed=0, device="cpu")
                model.learn(total_timesteps=128)
                log.add("evaluation", evaluate_policy(model, venv, n_eval_episodes=3))
            log.add("warnings", [str(w.message) for w in caught])
        finally:
            venv.close()

    log = dict(compare_runs(run))
    assert log["warnings"] == []  # no "not wrapped with a Monitor" from evaluate_policy


def test_vec_monitor_warns_over_monitor_wrapped_envs():
    for kind in ("dummy", "shm"):
        venv = make_vec(kind, [pendulum()])
        try:
            with pytest.warns(UserWarning, match="Monitor"):
                VecMonitor(venv)
            with pytest.warns(UserWarning, match="Monitor"):
                VecMonitor(VecNormalize(venv))
        finally:
            venv.close()


# -------------------------------------- test_vec_check_nan.py's, and the others


def test_check_nan():
    def scenario(venv: VecEnv, log: Log) -> None:
        checked = VecCheckNan(venv, raise_exception=True)
        for actions in ([[0]], [[float("nan")]], [[float("inf")]], [[-1]], [[1]], [[0.0]]):
            log.call(f"step {actions}", lambda a=actions: list(checked.step(a)[:3]))
        log.call("reset", checked.reset)

    log = compare("shm", [NanAndInfEnv], scenario)
    assert [isinstance(value, Raised) for _, value in log] == [0, 1, 1, 1, 1, 0, 0]
    # SB3's last step gives two actions to one env: DummyVecEnv drops the second,
    # SubprocVecEnv raises a ValueError (zip strict), and so does the adapter.
    venv = VecCheckNan(make_vec("shm", [NanAndInfEnv]), raise_exception=True)
    try:
        with pytest.raises(ValueError, match="2 actions for 1 envs"):
            venv.step(np.array([[0, 1], [0, 1]]))
    finally:
        venv.close()


DICT_IMAGE = spaces.Dict(
    {"rgb": spaces.Box(0, 255, (86, 86), np.uint8), "vec": spaces.Box(-1, 1, (3,), np.float32)}
)


def test_extract_dict_obs():
    def scenario(venv: VecEnv, log: Log) -> None:
        extracted = VecExtractDictObs(venv, "rgb")
        extracted.seed(0)
        extracted.action_space.seed(0)
        log.add("reset", extracted.reset())
        for t in range(10):
            log.step(extracted, sample_actions(extracted), f"step {t}")

    log = dict(compare("shm", [space_env(DICT_IMAGE, ep_length=3)] * 4, scenario))
    assert log["reset"].shape == (4, 86, 86)
    assert log["step 2 infos"][0]["terminal_observation"].shape == (86, 86)


def test_frame_stack_dict_obs_over_episode_ends():
    """test_vec_stacked_obs.py's episode termination, through VecFrameStack."""
    space = spaces.Dict(
        {"key1": spaces.Box(0, 255, (3, 5, 4), np.uint8), "key2": spaces.Box(-1, 1, (4, 5))}
    )

    def scenario(venv: VecEnv, log: Log) -> None:
        stacked = VecFrameStack(venv, 4, channels_order={"key1": "first", "key2": "last"})
        stacked.seed(0)
        stacked.action_space.seed(0)
        log.add("reset", stacked.reset())
        for t in range(7):
            log.step(stacked, sample_actions(stacked), f"step {t}")

    fns = [space_env(space, ep_length=3), space_env(space, ep_length=4)]
    log = dict(compare("shm", fns, scenario))
    assert log["step 6 obs"]["key1"].shape == (2, 12, 5, 4)
