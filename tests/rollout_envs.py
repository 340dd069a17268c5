"""Envs and policies for the rollout layer's tests.

``TaskEnv``'s trajectory depends only on its reset seed, its options and the
actions (its own ``np_random``); its faults and waits come from a generator of
their own, seeded from the OS, so that a retry of a failed trajectory meets
other faults and a fault never changes what a trajectory is.
"""

from __future__ import annotations

import os
import random
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class TaskFault(RuntimeError):
    pass


class TaskEnv(gym.Env):
    """Episodes of 1..``max_len`` steps (drawn at reset); ``options["bonus"]``
    is added to every reward. ``fault_rate``: each step raises with this
    probability; ``hang_rate``: sleeps ``hang_s`` instead; ``wait_s``: each
    step sleeps a lognormal time of this median (sigma 1)."""

    def __init__(
        self,
        max_len: int = 8,
        fault_rate: float = 0.0,
        hang_rate: float = 0.0,
        hang_s: float = 30.0,
        wait_s: float = 0.0,
    ) -> None:
        self.observation_space = spaces.Box(-1e6, 1e6, (2,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.max_len, self.fault_rate, self.wait_s = max_len, fault_rate, wait_s
        self.hang_rate, self.hang_s = hang_rate, hang_s
        self.faults = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.state = np.zeros(2)
        self.length = self.t = 0
        self.bonus = 0.0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.bonus = float((options or {}).get("bonus", 0.0))
        self.length = int(self.np_random.integers(1, self.max_len + 1))
        self.t = 0
        self.state = self.np_random.normal(size=2)
        return self.state.copy(), {"length": self.length}

    def step(self, action):
        self._wait_or_fail()
        self.t += 1
        noise = self.np_random.normal()
        self.state = self.state * 0.9 + np.array([int(action) - 1, noise])
        reward = float(self.state[0] + noise + self.bonus)
        return self.state.copy(), reward, self.t >= self.length, False, {"t": self.t}

    def _wait_or_fail(self) -> None:
        if self.wait_s:
            time.sleep(self.wait_s * float(np.exp(self.faults.gauss(0.0, 1.0))))
        if self.hang_rate and self.faults.random() < self.hang_rate:
            time.sleep(self.hang_s)
        if self.fault_rate and self.faults.random() < self.fault_rate:
            raise TaskFault("a flaky tool call")


class GlobalRandomEnv(TaskEnv):
    """Draws its noise from Python's global ``random``: not reproducible."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + random.random(), terminated, truncated, info


class GatedResetEnv(TaskEnv):
    """Its reset returns only once the file ``gate`` exists (60 s at most)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def reset(self, *, seed=None, options=None):
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().reset(seed=seed, options=options)


def obs_policy(batch):
    """A deterministic batched policy: the action from the observation."""
    return (np.abs(batch.observations[:, 1] * 10).astype(np.int64)) % 3
