"""WaitingEnvsWarning (shmvec/engine/waiting_check.py): one warning when workers
that step their envs one after another mostly wait.

Envs that sleep are robust on a busy machine: sleeping costs no CPU, so a worker
stepping them is off-CPU whatever the load. The tests step for a fixed number of
seconds of stepping (the check needs 1 s) and assert on the warnings, not on
durations.
"""

from __future__ import annotations

import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import shmvec
from shmvec import ShmVectorEnv, WaitingEnvsWarning
from shmvec.engine import Stats

STEP_S = 3.0  # stepping time: three times the check's first window
GUARD_S = 30.0  # a busy machine may step slowly: keep going until a warning, this long


class SleepEnv(gym.Env):
    """A step that waits 5 ms (a tool call, a remote simulator)."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        time.sleep(0.005)
        return np.zeros(2, np.float32), 1.0, False, False, {}


def run(fns, until_warned: bool, **options) -> list[warnings.WarningMessage]:
    """Steps for STEP_S seconds (and, if ``until_warned``, on until a warning, up
    to GUARD_S), then 20 more steps; returns the WaitingEnvsWarnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = ShmVectorEnv(fns, **options)
        try:
            async_mode = envs.is_async
            if async_mode:
                envs.async_reset(seed=0)
            else:
                envs.reset(seed=0)
            started = time.monotonic()
            extra = 20
            while extra:
                elapsed = time.monotonic() - started
                warned = any(w.category is WaitingEnvsWarning for w in caught)
                if elapsed >= STEP_S and (warned or not until_warned or elapsed >= GUARD_S):
                    extra -= 1
                if async_mode:
                    infos = envs.recv()[4]
                    envs.send(np.zeros(len(infos["env_id"]), np.int64), infos["env_id"])
                else:
                    envs.step(np.zeros(envs.num_envs, np.int64))
        finally:
            envs.close()
    return [w for w in caught if w.category is WaitingEnvsWarning]


@pytest.mark.parametrize("batch_size", [None, 2], ids=["sync", "async"])
def test_one_warning_for_envs_that_wait(batch_size):
    got = run([SleepEnv] * 4, until_warned=True, num_workers=2, batch_size=batch_size)
    assert len(got) == 1
    message = str(got[0].message)
    assert "env_concurrency=2" in message and "busy stepping envs" in message


def test_no_warning_with_env_concurrency():
    assert run([SleepEnv] * 4, until_warned=False, num_workers=2, env_concurrency=2) == []


def test_no_warning_for_cartpole():
    """CPU-bound envs are on a CPU (or waiting for one) for all their busy time,
    however loaded the machine."""
    fns = [lambda: gym.make("CartPole-v1")] * 4
    assert run(fns, until_warned=False, num_workers=2) == []


def test_the_check_costs_one_comparison_between_checks():
    """Between checks a counted batch only compares the step count: the check
    asks again after about as many steps as its window has seen (doubling)."""
    stats = Stats()
    calls = []

    def check(steps: int) -> int:
        calls.append(steps)
        return 2 * steps

    stats.watch(check)
    for _ in range(1000):
        stats.count(4, 0)
    assert calls == [4 * 2**k for k in range(10)]  # 4 .. 2048 of 4000 steps
    assert stats.steps == 4000


def test_exported():
    assert shmvec.WaitingEnvsWarning is WaitingEnvsWarning
    assert issubclass(WaitingEnvsWarning, UserWarning)
