"""Env factories and a random-text policy for the text adapters' tests.

Each factory's ``__name__`` is its env tag in ``make_mix`` and the name that
``replay`` checks a trajectory's tag against.
"""

from __future__ import annotations

import numpy as np

from shmvec.text_envs import FrozenLakeText, GemEnv


def guess_the_number() -> GemEnv:
    return GemEnv("game:GuessTheNumber-v0-easy")


def minesweeper() -> GemEnv:
    return GemEnv("game:Minesweeper-v0-easy")


def sudoku() -> GemEnv:
    return GemEnv("game:Sudoku-v0-easy")


def frozen_lake() -> FrozenLakeText:
    return FrozenLakeText(max_episode_steps=30)


ENV_FNS = {fn.__name__: fn for fn in (guess_the_number, minesweeper, sudoku, frozen_lake)}

JUNK = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789 {}\\!?.\n"))


def random_action(rng: np.random.Generator) -> str:
    """Text that each game reads as a move now and then: a boxed guess, cell or
    placement, a direction, or junk (a format error)."""
    a, b, c = (int(x) for x in rng.integers(0, 6, size=3))
    kind = int(rng.integers(6))
    if kind == 0:
        return f"\\boxed{{{a + b}}}"
    if kind == 1:
        return f"\\boxed{{{'reveal' if c else 'flag'} {a % 5} {b % 5}}}"
    if kind == 2:
        return f"\\boxed{{{a % 4 + 1} {b % 4 + 1} {c % 4 + 1}}}"
    if kind == 3:
        return ("left", "down", "right", "up")[a % 4]
    return "".join(rng.choice(JUNK, size=int(rng.integers(0, 17))))


class RandomTextPolicy:
    """A batched rollout policy: a random action per row."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch) -> list[str]:
        return [random_action(self.rng) for _ in range(len(batch))]
