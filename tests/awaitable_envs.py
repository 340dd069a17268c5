"""Envs for the tests of awaitable envs and the trainer adapters.

Each env's episode depends only on its reset seed, its options and the actions.
Faults are asked for by the episode's options, so a test decides which episode
fails and at which step: ``{"fail_at": k}`` raises inside step ``k``,
``{"hang_at": k}`` sleeps ``hang_s`` there (past a deadline), ``{"die_at": k}``
SIGKILLs the env's own process there. ``{"wait_s": s}`` sleeps ``s`` every step.
"""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from shmvec import UnboundedText


class ScriptedFault(RuntimeError):
    pass


class FaultsByOptions:
    """The faults an episode's options ask for, at its step ``t`` (1-based)."""

    hang_s = 30.0

    def _faults(self, options: dict, t: int) -> None:
        if options.get("wait_s"):
            time.sleep(options["wait_s"])
        if options.get("fail_at") == t:
            raise ScriptedFault(f"scripted fault at step {t}")
        if options.get("hang_at") == t:
            time.sleep(self.hang_s)
        if options.get("die_at") == t:
            os.kill(os.getpid(), signal.SIGKILL)


class WalkEnv(FaultsByOptions, gym.Env):
    """Episodes of 1..8 steps (drawn at reset); noise from its own ``np_random``."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1e6, 1e6, (2,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.state = np.zeros(2)
        self.length = self.t = 0
        self.options: dict = {}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.options = dict(options or {})
        self.length = int(self.np_random.integers(1, 9))
        self.t = 0
        self.state = self.np_random.normal(size=2)
        return self.state.copy(), {"length": self.length}

    def step(self, action):
        self.t += 1
        self._faults(self.options, self.t)
        noise = self.np_random.normal()
        self.state = self.state * 0.9 + np.array([int(action) - 1, noise])
        reward = float(self.state[0] + noise)
        return self.state.copy(), reward, self.t >= self.length, False, {"t": self.t}


class GuessTextEnv(FaultsByOptions, gym.Env):
    """A text game: guess a number 1..9 drawn at reset, within ``max_turns`` turns.
    Observations and actions are ``UnboundedText``; reward 1.0 for a right guess."""

    max_turns = 4

    def __init__(self) -> None:
        self.observation_space = UnboundedText()
        self.action_space = UnboundedText()
        self.target = self.t = 0
        self.options: dict = {}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.options = dict(options or {})
        self.target = int(self.np_random.integers(1, 10))
        self.t = 0
        return "Guess my number, 1 to 9.", {}

    def step(self, action):
        self.t += 1
        self._faults(self.options, self.t)
        guess = "".join(c for c in action if c.isdigit())[:1]
        if guess == str(self.target):
            return f"Yes, {self.target}!", 1.0, True, False, {}
        hint = "higher" if guess and int(guess) < self.target else "lower"
        return f"No. Try {hint}.", 0.0, False, self.t >= self.max_turns, {}


def guess_envs():
    """16 ``GuessTextEnv`` in 2 workers (envs 0-7 and 8-15), set up for leasing: the
    env factory the verl adapter's tests name."""
    import shmvec

    return shmvec.ShmVectorEnv(
        [GuessTextEnv] * 16,
        num_workers=2,
        batch_size=2,
        env_concurrency=8,
        on_env_error="reset",
        on_worker_death="restart",
    )


class DigitGuessEnv(GuessTextEnv):
    """``GuessTextEnv`` whose action is one digit: ``Text(1, charset="0123456789")``."""

    def __init__(self) -> None:
        super().__init__()
        self.action_space = spaces.Text(1, min_length=1, charset="0123456789")


def digit_guess_envs():
    """8 ``DigitGuessEnv`` in 2 workers, set up for leasing."""
    import shmvec

    return shmvec.ShmVectorEnv(
        [DigitGuessEnv] * 8, num_workers=2, batch_size=2, env_concurrency=4,
        on_env_error="reset", on_worker_death="restart",
    )  # fmt: skip
