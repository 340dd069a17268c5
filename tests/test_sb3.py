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
