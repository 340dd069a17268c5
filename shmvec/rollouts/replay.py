"""Replaying one trajectory alone, to check that it is exactly reproducible.

A trajectory is reproducible when its env's randomness is its own: seeded by
``reset(seed=...)`` (gymnasium's ``self.np_random``) rather than drawn from
Python's global ``random`` or numpy's global generator, which other envs in
the same process (or thread) draw from too. ``replay`` re-creates the env,
resets it with the recorded seed and options, steps the recorded actions and
compares every observation and reward, bit for bit; it also notices an env
that moved a global generator, which it names as the likely cause.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmvec.rollouts.records import Trajectory


class ReplayMismatch(AssertionError):
    """A replayed step differed from the record."""


@dataclass
class ReplayReport:
    """A replay that matched: the steps it compared, and whether the env moved
    Python's or numpy's global generator (a replay that matched despite that
    was lucky: in a process shared with other envs it need not)."""

    steps: int
    used_global_random: bool


def replay(trajectory: Trajectory, env_fn: Callable[[], Any]) -> ReplayReport:
    """Steps ``env_fn()`` alone through ``trajectory``'s seed, options and actions.

    Raises ``ReplayMismatch`` naming the first step whose observation or reward
    differs, and ``ValueError`` if ``env_fn`` makes an env of another tag than
    the record's.
    """
    env = env_fn()
    try:
        _check_tag(trajectory, env, env_fn)
        moved = False
        with _GlobalRandomWatch() as watch:
            obs, _ = env.reset(seed=trajectory.seed, options=trajectory.options)
        moved |= watch.moved
        _compare(trajectory, 0, "observation", trajectory.observations[0], obs, moved)
        for t, action in enumerate(trajectory.actions):
            with _GlobalRandomWatch() as watch:
                obs, reward, _, _, _ = env.step(action)
            moved |= watch.moved
            if t + 1 < len(trajectory.observations):
                _compare(
                    trajectory, t + 1, "observation", trajectory.observations[t + 1], obs, moved
                )
            if t < len(trajectory.rewards):
                _compare(trajectory, t + 1, "reward", trajectory.rewards[t], float(reward), moved)
        return ReplayReport(len(trajectory.actions), moved)
    finally:
        env.close()


def _check_tag(trajectory: Trajectory, env: Any, env_fn: Callable[[], Any]) -> None:
    if trajectory.env_tag is None:
        return
    spec = getattr(env, "spec", None)
    names = {getattr(spec, "id", None), getattr(env_fn, "__name__", None)}
    if trajectory.env_tag not in names:
        raise ValueError(
            f"the trajectory ran on an env tagged {trajectory.env_tag!r} (env "
            f"{trajectory.env_id}), but env_fn makes {sorted(str(n) for n in names if n)}: "
            "replay it with that env's env_fn"
        )


def _compare(
    traj: Trajectory, step: int, what: str, recorded: Any, replayed: Any, moved: bool
) -> None:
    if _equal(recorded, replayed):
        return
    hint = (
        " The env moved Python's or numpy's global random generator: give it its own "
        "(seeded in reset) so that other envs cannot change its draws."
        if moved
        else ""
    )
    raise ReplayMismatch(
        f"replay of group {traj.group_id} trajectory {traj.index} (attempt {traj.attempt}, "
        f"seed {traj.seed}): the {what} at step {step} differs: recorded {recorded!r}, "
        f"replayed {replayed!r}.{hint}"
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape:
        return False
    if x.dtype.kind == "f" or y.dtype.kind == "f":  # bit for bit: NaN equals NaN, -0.0 not 0.0
        return x.astype(np.float64).tobytes() == y.astype(np.float64).tobytes()
    return bool(np.array_equal(x, y))


class _GlobalRandomWatch:
    """Notices whether the block moved ``random``'s or numpy's global state."""

    moved = False

    def __enter__(self) -> _GlobalRandomWatch:
        self.python = random.getstate()
        self.numpy = np.random.get_state(legacy=False)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        numpy = np.random.get_state(legacy=False)
        self.moved = random.getstate() != self.python or not _equal(
            numpy["state"], self.numpy["state"]
        )
