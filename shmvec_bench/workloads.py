"""Workloads: the env factories the benchmark steps, by name.

The factories are module-level functions so that spawn and forkserver workers
can import them by name (``shmvec_bench.workloads.make_cartpole``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np

#: CPU time each ``cpu100us`` step burns, in seconds.
BURN_S = 100e-6
#: ``largeobs``: 512 x 2048 uint8 = 1 MiB per observation.
LARGE_OBS_SHAPE = (512, 2048)
#: Seconds each step of a waiting workload sleeps: the bound on its steps/s is
#: ``num_envs / wait``, whatever the cores.
WAIT_S = {"wait5ms": 5e-3, "wait20ms": 20e-3, "mixed": 2e-3}
#: Workloads whose step is the env's own CPU work: for them ``cores`` x one env's
#: steps/s bounds what any backend reaches, and parallel efficiency is the share
#: of that bound a backend gets. A step that does nothing (``noop``, ``largeobs``,
#: ``pongsize``) measures the backend, not the env, and a waiting step is bound by
#: ``num_envs / wait`` instead, so neither has an efficiency.
CPU_BOUND = frozenset({"cartpole", "cpu100us", "varstep", "pong"})


def burn_cpu(seconds: float) -> None:
    """Spin on ``time.perf_counter`` for ``seconds`` of wall time (keeps one core busy)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class BusyStep(gym.Wrapper):
    """Burns ``burn_s`` seconds of CPU in every ``step`` before stepping the wrapped env.

    Stands in for an env whose step is expensive (a physics engine, an emulator):
    with it the benchmark measures how well a backend spreads work over cores.
    """

    def __init__(self, env: gym.Env, burn_s: float = BURN_S):
        super().__init__(env)
        self.burn_s = burn_s

    def step(self, action):
        burn_cpu(self.burn_s)
        return self.env.step(action)


class NoopEnv(gym.Env):
    """An env whose ``step`` does nothing: stepping it measures a backend's round trip."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._obs = np.zeros(1, dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


class LargeObsEnv(gym.Env):
    """An env with a 1 MiB uint8 observation; ``step`` returns a preallocated array.

    Measures the cost of moving observations: the env itself does no work.
    """

    metadata = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...] = LARGE_OBS_SHAPE):
        self.observation_space = gym.spaces.Box(0, 255, shape=shape, dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        # Random bytes rather than np.zeros: untouched zero pages all map to one
        # physical page, which would make every copy of them unrealistically cheap.
        self._obs = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


def make_cartpole() -> gym.Env:
    """``gym.make("CartPole-v1")``: a cheap, pure-Python env (~10 us a step)."""
    return gym.make("CartPole-v1")


def make_cpu100us() -> gym.Env:
    """CartPole-v1 whose every step also burns 100 us of CPU."""
    return BusyStep(gym.make("CartPole-v1"), BURN_S)


def make_noop() -> gym.Env:
    """A step that does nothing, Box(1,) observations (a ``NoopEnv``): the round trip."""
    return NoopEnv()


def make_largeobs() -> gym.Env:
    """1 MiB uint8 observations, a step that does nothing else (a ``LargeObsEnv``)."""
    return LargeObsEnv()


class VariableStep(gym.Wrapper):
    """CartPole whose step burns 1 to 20 times 9.5 us of CPU, drawn anew each
    step (mean ~100 us): the workload where envs finish at different times."""

    def __init__(self, env: gym.Env, seed: int | None = None) -> None:
        super().__init__(env)
        self._rng = np.random.default_rng(seed)

    def step(self, action):
        burn_cpu(9.5e-6 * self._rng.integers(1, 21))
        return self.env.step(action)


def make_varstep() -> gym.Env:
    """CartPole-v1 whose every step burns 9.5 to 190 us of CPU, drawn anew (a ``VariableStep``)."""
    return VariableStep(gym.make("CartPole-v1"))


def make_pong() -> gym.Env:
    """ALE Pong with gymnasium's Atari preprocessing (84x84 gray, frame skip 4) and 4
    stacked frames, what Atari PPO steps (needs ``shmvec[atari]``)."""
    import ale_py
    import cv2
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    # One thread per env, as EnvPool's C++ preprocessing: OpenCV's own pool
    # would have every process's resize fight for all the cores.
    cv2.setNumThreads(1)
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    return FrameStackObservation(AtariPreprocessing(env, frame_skip=4), 4)


class WaitingStep(gym.Wrapper):
    """Sleeps ``wait_s`` (no CPU) and then burns ``burn_s`` of CPU in every ``step``.

    Stands in for an env that waits on something outside the process (a
    simulator over a socket, a game server, an LLM call): a backend that
    blocks one worker per env step leaves the cores idle while the envs wait.
    """

    def __init__(self, env: gym.Env, wait_s: float, burn_s: float = 0.0):
        super().__init__(env)
        self.wait_s = wait_s
        self.burn_s = burn_s

    def step(self, action):
        time.sleep(self.wait_s)
        if self.burn_s:
            burn_cpu(self.burn_s)
        return self.env.step(action)


def make_wait5ms() -> gym.Env:
    """CartPole-v1 whose every step first sleeps 5 ms (waits, ~no CPU)."""
    return WaitingStep(gym.make("CartPole-v1"), WAIT_S["wait5ms"])


def make_wait20ms() -> gym.Env:
    """CartPole-v1 whose every step first sleeps 20 ms."""
    return WaitingStep(gym.make("CartPole-v1"), WAIT_S["wait20ms"])


def make_mixed() -> gym.Env:
    """CartPole-v1 whose every step sleeps 2 ms, then burns 100 us of CPU."""
    return WaitingStep(gym.make("CartPole-v1"), WAIT_S["mixed"], BURN_S)


#: Pong's observation after AtariPreprocessing and FrameStackObservation(4).
PONG_OBS_SHAPE = (4, 84, 84)


def make_pongsize() -> gym.Env:
    """Pong-sized observations (4 x 84 x 84 uint8, 6 actions), a step that does nothing.

    The hand-off's stand-in for Pong when ale-py is not installed."""
    env = LargeObsEnv(PONG_OBS_SHAPE)
    env.action_space = gym.spaces.Discrete(6)
    return env


#: Workload name -> env factory (a module-level function, so workloads pickle by name).
WORKLOADS: dict[str, Callable[[], gym.Env]] = {
    "cartpole": make_cartpole,
    "cpu100us": make_cpu100us,
    "varstep": make_varstep,
    "noop": make_noop,
    "largeobs": make_largeobs,
    "pong": make_pong,
    "wait5ms": make_wait5ms,
    "wait20ms": make_wait20ms,
    "mixed": make_mixed,
    "pongsize": make_pongsize,
}
#: EnvPool's task for a workload, where it has one.
ENVPOOL_TASKS = {"cartpole": "CartPole-v1", "pong": "Pong-v5"}
