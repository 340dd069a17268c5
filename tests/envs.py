"""Environments for shmvec's tests.

They live in a module (not in the test files) so that workers started with
``spawn``/``forkserver`` can import them: env_fns built from these classes
with ``functools.partial`` pickle by reference.

Every env draws its randomness from ``self.np_random`` only, so that the
same seeds give the same trajectories in ``SyncVectorEnv`` and in
``ShmVectorEnv``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import signal
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode


class EnvBoom(Exception):
    """Raised on purpose by FailingEnv; a distinct type that tests can match."""


CHARSET = "abcde"


def custom_observation_space() -> spaces.Dict:
    """A nested space with every fixed-size leaf kind shmvec supports."""
    return spaces.Dict(
        {
            "pos": spaces.Box(-1.0, 1.0, (3,), np.float32),
            "img": spaces.Box(0, 255, (2, 2, 3), np.uint8),
            "half": spaces.Box(-2.0, 2.0, (2,), np.float16),
            "k": spaces.Discrete(5, start=-2),
            "tup": spaces.Tuple(
                (
                    spaces.Text(max_length=6, min_length=0, charset=CHARSET),
                    spaces.MultiDiscrete([3, 4, 5]),
                    spaces.MultiBinary(4),
                )
            ),
            "nested": spaces.Dict(
                {"flags": spaces.MultiBinary([2, 2]), "count": spaces.Discrete(1000)}
            ),
        }
    )


class CustomSpaceEnv(gym.Env):
    """Dict/Tuple/Text/MultiDiscrete/MultiBinary observations, random episode
    lengths (terminated or truncated), and infos that change from step to
    step: empty, numeric scalars, numpy arrays, strings, nested dicts.

    The action (a Dict of a Discrete and a Box) feeds into the observation, so
    a wrongly delivered action shows up in the results.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, max_len: int = 10, render_mode: str | None = None) -> None:
        self.observation_space = custom_observation_space()
        self.action_space = spaces.Dict(
            {"move": spaces.Discrete(3), "force": spaces.Box(-1.0, 1.0, (2,), np.float32)}
        )
        self.max_len = max_len
        self.render_mode = render_mode
        self.t = 0
        self.length = 1
        self.resets = 0
        self.last_move = 0

    def _obs(self) -> dict[str, Any]:
        rng = self.np_random
        text_len = int(rng.integers(0, 7))
        text = "".join(CHARSET[int(c)] for c in rng.integers(0, len(CHARSET), text_len))
        pos = rng.uniform(-1, 1, 3).astype(np.float32)
        pos[0] = np.float32(self.last_move - 1)  # the action is visible in the obs
        return {
            "pos": pos,
            "img": rng.integers(0, 256, (2, 2, 3), dtype=np.uint8),
            "half": rng.uniform(-2, 2, 2).astype(np.float16),
            "k": int(rng.integers(-2, 3)),
            "tup": (
                text,
                rng.integers([0, 0, 0], [3, 4, 5]).astype(np.int64),
                rng.integers(0, 2, 4).astype(np.int8),
            ),
            "nested": {
                "flags": rng.integers(0, 2, (2, 2)).astype(np.int8),
                "count": self.t,
            },
        }

    def _info(self) -> dict[str, Any]:
        rng = self.np_random
        kind = int(rng.integers(0, 10))
        if kind == 0:
            return {}
        if kind == 1:
            return {"score": int(rng.integers(0, 100))}
        if kind == 2:
            return {"ratio": float(rng.uniform()), "flag": bool(rng.integers(0, 2))}
        if kind == 3:
            return {"vec": rng.uniform(size=3), "count32": np.int32(self.t)}
        if kind == 4:
            return {"msg": f"t={self.t}"}
        if kind == 5:
            return {"nested": {"a": self.t, "b": {"c": np.float32(self.t) / 2, "s": "deep"}}}
        if kind == 6:
            return {"score": self.t, "msg": "both", "vec": np.arange(3, dtype=np.float64)}
        if kind == 7:
            # More numeric keys than shmvec's info columns (8): must still arrive.
            return {f"a{j}": j * self.t for j in range(10)}
        if kind == 8:
            # One key, different scalar types from step to step: the batch dtype
            # is the type of the first env reporting it, later values are cast.
            mixed = self.t + 0.5 if self.t % 2 else self.t
            return {"mixed": mixed, "u64": np.uint64(2**63 + self.t), "f16": np.float16(0.25)}
        return {"npbool": np.bool_(self.t % 2), "score": self.t, "neg": -(2**40) - self.t}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        self.resets += 1
        self.last_move = 0
        self.length = int(self.np_random.integers(1, self.max_len + 1))
        info: dict[str, Any] = {"resets": self.resets}
        if options:
            info["options"] = dict(options)
        if self.np_random.integers(0, 2):
            info["reset_vec"] = self.np_random.uniform(size=2)
        return self._obs(), info

    def step(self, action):
        move = int(action["move"])
        force = np.asarray(action["force"], dtype=np.float32)
        assert self.action_space.contains({"move": move, "force": force}), action
        self.t += 1
        self.last_move = move
        reward = float(move) + float(force.sum()) + float(self.np_random.uniform())
        ended = self.t >= self.length
        truncated = bool(ended and self.np_random.integers(0, 2))
        terminated = bool(ended and not truncated)
        return self._obs(), reward, terminated, truncated, self._info()

    def render(self):
        if self.render_mode == "rgb_array":
            frame = np.zeros((4, 6, 3), dtype=np.uint8)
            frame[..., 0] = self.t
            return frame
        return None


class GraphEnv(gym.Env):
    """Observations are Graph instances of random size (pickled by shmvec)."""

    def __init__(self, max_len: int = 8) -> None:
        self.observation_space = spaces.Graph(
            node_space=spaces.Box(-1.0, 1.0, (2,), np.float32), edge_space=spaces.Discrete(3)
        )
        self.action_space = spaces.Discrete(2)
        self.max_len = max_len
        self.t = 0
        self.length = 1

    def _obs(self):
        rng = self.np_random
        n = int(rng.integers(1, 5))
        m = int(rng.integers(0, 4))
        return spaces.GraphInstance(
            nodes=rng.uniform(-1, 1, (n, 2)).astype(np.float32),
            edges=rng.integers(0, 3, m).astype(np.int64),
            edge_links=rng.integers(0, n, (m, 2)).astype(np.int64),
        )

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(1, self.max_len + 1))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        ended = self.t >= self.length
        info = {"n_nodes": 0} if self.t % 3 else {}
        return self._obs(), float(action), ended, False, info


class SequenceEnv(gym.Env):
    """A Dict holding a Sequence (variable length) next to a Box."""

    def __init__(self, max_len: int = 8) -> None:
        self.observation_space = spaces.Dict(
            {
                "seq": spaces.Sequence(spaces.Box(0.0, 1.0, (2,), np.float64)),
                "x": spaces.Box(-1.0, 1.0, (1,), np.float32),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.max_len = max_len
        self.t = 0
        self.length = 1

    def _obs(self, x=0.0):
        k = int(self.np_random.integers(0, 4))
        return {
            "seq": tuple(self.np_random.uniform(0, 1, 2) for _ in range(k)),
            "x": np.array([x], dtype=np.float32),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(1, self.max_len + 1))
        return self._obs(), {"start": True}

    def step(self, action):
        self.t += 1
        ended = self.t >= self.length
        return self._obs(float(action[0])), float(action[0]), False, ended, {}


class WordSpace(spaces.Space):
    """An unregistered custom space of short words (no fixed size, not batchable)."""

    WORDS = ("red", "green", "blue", "cyan")

    def __init__(self, seed=None):
        super().__init__(shape=None, dtype=None, seed=seed)

    def sample(self, mask=None, probability=None):
        return self.WORDS[int(self.np_random.integers(len(self.WORDS)))]

    def contains(self, x):
        return x in self.WORDS

    def __eq__(self, other):
        return isinstance(other, WordSpace)


class WordEnv(gym.Env):
    """Custom space for both observations and actions: string actions must
    reach the env unchanged."""

    def __init__(self):
        self.observation_space = WordSpace()
        self.action_space = WordSpace()
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return WordSpace.WORDS[int(self.np_random.integers(4))], {}

    def step(self, action):
        assert isinstance(action, str), f"got {action!r}"
        self.t += 1
        return (
            action[::-1] if self.t % 2 else action,
            len(action),
            self.t >= 3,
            False,
            {"heard": action},
        )


class OneOfEnv(gym.Env):
    """OneOf observations (pickled by shmvec; wrong in gymnasium's shared memory)."""

    def __init__(self):
        self.observation_space = spaces.OneOf(
            (spaces.Discrete(5), spaces.Box(-1.0, 1.0, (2,), np.float32))
        )
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def _obs(self):
        if self.np_random.integers(2):
            return (0, np.int64(self.np_random.integers(5)))
        return (1, self.np_random.uniform(-1, 1, 2).astype(np.float32))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), self.t >= 4, False, {}


class ActionTypeEnv(gym.Env):
    """Records the type and value of every action it receives."""

    def __init__(self, kind: str = "discrete"):
        self.observation_space = spaces.Discrete(3)
        if kind == "discrete":
            self.action_space = spaces.Discrete(4)
        elif kind == "box":
            self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        elif kind == "text":
            self.action_space = spaces.Text(max_length=5, min_length=1, charset="xyz")
        else:
            raise ValueError(kind)
        self.seen: list = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        value = action.tolist() if isinstance(action, np.ndarray) else action
        self.seen.append(
            (type(action).__name__, getattr(action, "dtype", None) and str(action.dtype), value)
        )
        return 1, 0.0, False, False, {}


class ScriptedInfoEnv(gym.Env):
    """Returns the infos it is told to: step ``t`` returns ``script[t % len]``;
    the episode ends every ``episode_len`` steps (the NEXT_STEP reset info is
    ``reset_info``)."""

    def __init__(self, episode_len: int = 3):
        self.observation_space = spaces.Discrete(2)
        self.action_space = spaces.Discrete(2)
        self.script: list[dict] = [{}]
        self.reset_info: dict = {}
        self.episode_len = episode_len
        self.t = 0
        self.k = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 0, dict(self.reset_info)

    def step(self, action):
        info = dict(self.script[self.k % len(self.script)])
        self.k += 1
        self.t += 1
        return 1, 0.0, self.t >= self.episode_len, False, info


class CountingEnv(gym.Env):
    """Observation = number of steps since reset (plus an offset set by set_attr).

    Optional knobs: sleep ``delay`` seconds in step; end the episode after
    ``episode_len`` steps.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self,
        episode_len: int = 1000,
        delay: float = 0.0,
        render_mode: str | None = None,
        tag: str = "",
        high: int = 1_000_000,
        obs_len: int = 2,
        n_actions: int = 4,
    ) -> None:
        self.observation_space = spaces.Box(0, high, (obs_len,), np.int64)
        self.action_space = spaces.Discrete(n_actions)
        self.obs_len = obs_len
        self.episode_len = episode_len
        self.delay = delay
        self.render_mode = render_mode
        self.tag = tag
        self.offset = 0
        self.t = 0

    def _obs(self, action: int = 0):
        obs = np.zeros(self.obs_len, dtype=np.int64)
        obs[:2] = [self.t + self.offset, action][: self.obs_len]
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if self.delay:
            time.sleep(self.delay)
        self.t += 1
        ended = self.t >= self.episode_len
        return self._obs(int(action)), float(self.t), ended, False, {}

    def render(self):
        if self.render_mode == "rgb_array":
            return np.full((3, 5, 3), self.t % 256, dtype=np.uint8)
        return None

    def double(self, x):
        return 2 * x + self.offset


class ConcurrencyProbeEnv(CountingEnv):
    """Records, in a shared ``multiprocessing.Array('i', 2)`` inherited through
    fork, how many envs are inside ``step``/``reset`` at once ([0]: now,
    [1]: the maximum seen)."""

    def __init__(self, probe, delay: float = 0.01) -> None:
        super().__init__()
        self.probe = probe
        self.probe_delay = delay

    def _enter_exit(self, fn):
        with self.probe.get_lock():
            self.probe[0] += 1
            self.probe[1] = max(self.probe[1], self.probe[0])
        try:
            time.sleep(self.probe_delay)
            return fn()
        finally:
            with self.probe.get_lock():
                self.probe[0] -= 1

    def reset(self, *, seed=None, options=None):
        return self._enter_exit(lambda: super(ConcurrencyProbeEnv, self).reset(seed=seed))

    def step(self, action):
        return self._enter_exit(lambda: super(ConcurrencyProbeEnv, self).step(action))


class FailingEnv(CountingEnv):
    """Raises EnvBoom in step ``fail_step`` (1-based) and in reset when
    ``options`` has ``"fail"``; only if ``index == fail_index``."""

    def __init__(self, index: int, fail_index, fail_step: int = 3) -> None:
        super().__init__()
        if isinstance(fail_index, (tuple, list)):
            fail_index = index if index in fail_index else -1
        self.index = index
        self.fail_index = fail_index
        self.fail_step = fail_step

    def reset(self, *, seed=None, options=None):
        if options and options.get("fail") and self.index == self.fail_index:
            raise EnvBoom(f"reset boom in env {self.index}")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.index == self.fail_index and self.t + 1 == self.fail_step:
            raise EnvBoom(f"step boom in env {self.index} at step {self.fail_step}")
        return super().step(action)


class UnpicklableError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.callback = lambda: None  # a lambda does not pickle


class UnpicklableErrorEnv(CountingEnv):
    """Raises an exception that cannot be pickled in step 1."""

    def step(self, action):
        raise UnpicklableError("cannot travel")


class SelfKillingEnv(CountingEnv):
    """SIGKILLs its own process in step ``kill_step`` if ``index == kill_index``."""

    def __init__(self, index: int, kill_index: int, kill_step: int = 2) -> None:
        super().__init__()
        self.index = index
        self.kill_index = kill_index
        self.kill_step = kill_step

    def step(self, action):
        if self.index == self.kill_index and self.t + 1 == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


class WrongShapeEnv(gym.Env):
    """Declares Box(shape=(4,)) but env ``bad_index`` returns ``kind`` obs:
    ``"short"`` an array of shape (3,), ``"long_list"`` a list of 5 floats,
    ``"scalar"`` a numpy scalar, ``"column"`` an array of shape (4, 1)."""

    def __init__(self, index: int, bad_index: int, kind: str) -> None:
        self.observation_space = spaces.Box(-10.0, 10.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.index = index
        self.bad_index = bad_index
        self.kind = kind

    def _obs(self):
        if self.index != self.bad_index:
            return np.zeros(4, dtype=np.float32)
        if self.kind == "short":
            return np.zeros(3, dtype=np.float32)
        if self.kind == "long_list":
            return [0.0] * 5
        if self.kind == "scalar":
            return np.float32(1.5)
        if self.kind == "column":
            return np.zeros((4, 1), dtype=np.float32)
        raise ValueError(self.kind)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        return self._obs(), 0.0, False, False, {}


class RaisingEnvFactory:
    """An env_fn that raises ``EnvBoom`` when called (picklable)."""

    def __call__(self):
        raise EnvBoom("env_fn failed on purpose")


# --------------------------------------------------------------- factories


def make_gym(env_id: str, **kwargs) -> gym.Env:
    return gym.make(env_id, **kwargs)


def gym_fns(env_id: str, n: int, **kwargs) -> list:
    return [functools.partial(make_gym, env_id, **kwargs) for _ in range(n)]


def class_fns(cls, n: int, **kwargs) -> list:
    return [functools.partial(cls, **kwargs) for _ in range(n)]


def indexed_fns(cls, n: int, **kwargs) -> list:
    """env_fns[i] builds cls(index=i, **kwargs)."""
    return [functools.partial(cls, index=i, **kwargs) for i in range(n)]


class ObsLayoutEnv(gym.Env):
    """Observations of a float32 (3, 4) Box in a given memory layout: "c"
    (contiguous), "fortran", "strided" (a view of every other row of a bigger
    array), "float64" (cast on the way in) or "list" (nested lists); random
    values from the env's seed, episodes of 7 steps."""

    def __init__(self, layout: str = "c") -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (3, 4), np.float32)
        self.action_space = spaces.Discrete(2)
        self.layout = layout
        self.t = 0

    def _obs(self):
        obs = self.np_random.uniform(-1, 1, (3, 4)).astype(np.float32)
        if self.layout == "fortran":
            return np.asfortranarray(obs)
        if self.layout == "strided":
            big = np.zeros((6, 4), np.float32)
            big[::2] = obs
            return big[::2]
        if self.layout == "float64":
            return obs.astype(np.float64)
        if self.layout == "list":
            return obs.tolist()
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), self.t >= 7, False, {}


#: Equivalence test cases: name -> (factory of n env_fns).
ENV_CASES = {
    "CartPole-v1": lambda n: gym_fns("CartPole-v1", n),
    "MountainCar-v0": lambda n: gym_fns("MountainCar-v0", n, max_episode_steps=15),
    "Acrobot-v1": lambda n: gym_fns("Acrobot-v1", n, max_episode_steps=15),
    "Pendulum-v1": lambda n: gym_fns("Pendulum-v1", n, max_episode_steps=12),
    "FrozenLake-v1": lambda n: gym_fns("FrozenLake-v1", n),
    "Taxi-v4": lambda n: gym_fns("Taxi-v4", n, max_episode_steps=12),
    "Blackjack-v1": lambda n: gym_fns("Blackjack-v1", n),
    "CustomSpaceEnv": lambda n: class_fns(CustomSpaceEnv, n),
}


class ActionRecorderEnv(gym.Env):
    """Records the type and value of every action it receives, in ``received``."""

    def __init__(self, action_space: gym.Space) -> None:
        self.action_space = action_space
        self.observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
        self.received: list[tuple[str, str]] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.received.append((type(action).__name__, repr(action)))
        return np.zeros(1, np.float32), 0.0, False, False, {}


#: ChatEnv's characters: ASCII, Latin-1, card suits, bullets, currency signs,
#: CJK, characters outside the BMP (4 UTF-8 bytes) and a lone surrogate.
TEXT_ALPHABET = np.array(list("ab z09\n\t<>é€£¥♠♥♦♣•—…中文字😀🂡𝄞\ud800"))


def random_text(rng: np.random.Generator, longest: int = 50_000) -> str:
    """Text of 0 to ``longest`` characters from TEXT_ALPHABET: mostly short,
    often a few KB (around a 4 KiB row), sometimes far beyond."""
    kind = rng.random()
    if kind < 0.5:
        length = int(rng.integers(0, 300))
    elif kind < 0.8:
        length = int(rng.integers(300, 6_000))
    else:
        length = int(rng.integers(6_000, longest + 1))
    return "".join(TEXT_ALPHABET[rng.integers(0, len(TEXT_ALPHABET), length)].tolist())


def random_texts(rng: np.random.Generator, n: int, longest: int = 50_000) -> tuple[str, ...]:
    """A batch of ``n`` ``random_text``s, as gymnasium batches Text."""
    return tuple(random_text(rng, longest) for _ in range(n))


class ChatEnv(gym.Env):
    """Text in, text out, of any length (``shmvec.UnboundedText``): the
    observation is fresh random text followed by the action reversed, so a
    wrongly delivered action shows up in the results. Episodes of 2 to 6 turns,
    a numeric info every step and a pickled one (a str) now and then.

    ``dict_obs``: the observation is a Dict of a Box and the text.
    """

    def __init__(self, dict_obs: bool = False, longest: int = 50_000) -> None:
        from shmvec import UnboundedText

        text = UnboundedText()
        self.dict_obs = dict_obs
        self.longest = longest
        self.observation_space = (
            spaces.Dict({"turn": spaces.Box(0, np.inf, (2,), np.float32), "chat": text})
            if dict_obs
            else text
        )
        self.action_space = UnboundedText()
        self.t = 0
        self.length = 2

    def _obs(self, text: str, heard: int) -> Any:
        if self.dict_obs:
            return {"turn": np.array([self.t, heard], np.float32), "chat": text}
        return text

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(2, 7))
        return self._obs(random_text(self.np_random, self.longest), 0), {}

    def step(self, action):
        if not isinstance(action, str):
            raise TypeError(f"ChatEnv takes a str, got {action!r}")
        self.t += 1
        text = random_text(self.np_random, self.longest) + "|" + action[::-1]
        reward = float(len(action.encode("utf-8", "surrogatepass")))
        terminated = self.t >= self.length
        truncated = not terminated and bool(self.np_random.random() < 0.1)
        info: dict[str, Any] = {"heard": len(action)}
        if self.t % 3 == 0:
            info["tail"] = action[-5:]
        return self._obs(text, len(action)), reward, terminated, truncated, info


class StuckEnv(gym.Env):
    """Its step ``stuck_at`` blocks for ever (``hang="sleep"``: in ``time.sleep``,
    ``"busy"``: in a Python loop, ``"c"``: in a C loop), the first time only
    (``marker``: a file made when it happens, so that the new env built from the
    same env_fn does not block again). Episodes end at env-dependent lengths; the observation
    depends on the seed and the actions."""

    def __init__(self, index: int, stuck_at: int = -1, hang: str = "sleep", marker=None) -> None:
        self.index, self.stuck_at, self.hang, self.marker = index, stuck_at, hang, marker
        self.observation_space = spaces.Box(-1e6, 1e6, (3,), np.float64)
        self.action_space = spaces.Discrete(4)
        self.episode_len = 4 + index % 3

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.offset = float(self.np_random.integers(1000))
        return np.array([self.index, 0.0, self.offset]), {}

    def step(self, action):
        self.t += 1
        if self.t == self.stuck_at and self.marker is not None and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.hang == "busy":
                while True:
                    pass
            if self.hang == "c":  # a C loop that never returns to the interpreter
                collections.deque(itertools.repeat(None), maxlen=0)
            time.sleep(3600)
        self.offset += float(action) * self.t
        obs = np.array([self.index, self.t, self.offset])
        return obs, float(action), self.t == self.episode_len, False, {}


class Suicide:
    """SIGKILLs its own process when numpy converts it (an observation being
    written into its ring row; ``after`` seconds later) or when it is pickled
    (an info being sent)."""

    def __init__(self, after: float = 0.0) -> None:
        self.after = after

    def __array__(self, dtype=None, copy=None):
        time.sleep(self.after)
        os.kill(os.getpid(), signal.SIGKILL)

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


class DiesWhenTold(CountingEnv):
    """A CountingEnv whose worker dies in its next step once ``die`` is set:
    ``"step"`` inside the step (before its row is claimed), ``"obs"`` while its
    row is written (claimed, not published; ``"obs-late"``: 1 s after the claim),
    ``"info"`` while its message is sent (published, message lost)."""

    die = ""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.die == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.die in ("obs", "obs-late"):
            obs = Suicide(1.0 if self.die == "obs-late" else 0.0)
        if self.die == "info":
            info = {"note": Suicide()}
        return obs, reward, terminated, truncated, info


def reference_step(env, mode, ended, action):
    """What env gives alone for one action: (obs, reward, terminated, truncated, info, ended)."""
    if mode == AutoresetMode.NEXT_STEP and ended:
        obs, info = env.reset()
        return obs, 0.0, False, False, info, False
    obs, reward, terminated, truncated, info = env.step(action)
    if mode == AutoresetMode.SAME_STEP and (terminated or truncated):
        final_obs, final_info = obs, info
        obs, info = env.reset()
        info = {"final_obs": final_obs, "final_info": final_info, **info}
    return obs, reward, terminated, truncated, info, terminated or truncated
