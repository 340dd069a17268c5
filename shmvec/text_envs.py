"""Text envs as gymnasium envs: string observations, string actions, exact replay.

Two adapters bring text envs written elsewhere to ``ShmVectorEnv`` and the
rollout layer (:mod:`shmvec.rollouts`):

- :class:`GemEnv` wraps a game of GEM (``pip install "shmvec[text]"``, which
  installs ``gem-llm``), such as ``"game:GuessTheNumber-v0-easy"``,
  ``"game:Minesweeper-v0-easy"`` or ``"game:Sudoku-v0-easy"``.
- :class:`FrozenLakeText` is gymnasium's FrozenLake with the map as text and
  actions parsed from text.

Both observe and act in :func:`text_space`.

Randomness: each env's draws depend only on its own seed and actions. GEM's
games draw from Python's global ``random`` (GuessTheNumber and Sudoku when
they reset, Minesweeper also when the first cell is revealed), and
``reset(seed=s)`` reseeds the global ``random`` and ``np.random``. Envs that
share a process (the envs of one worker, and the env threads of a worker with
``env_concurrency > 1``) would then draw from one generator, and a trajectory
would depend on what its neighbours did in between: replaying it alone would
not reproduce it. So :class:`GemEnv` keeps a private copy of both global
states and swaps it in around every call of the wrapped game (its
construction, ``reset`` and ``step``), under one lock shared by all the
adapters of the process, and puts the caller's states back afterwards. The
rule holds among adapters; code outside them that draws from the global
generators in another thread while an adapter's call runs would draw from
that adapter's state (the lock does not cover it). The lock also means the
games of one process run one call at a time, which costs nothing for games
that compute in Python (they hold the GIL anyway), but a wrapped call that
waits on I/O would hold up the others.

Example:
    >>> from shmvec.text_envs import FrozenLakeText
    >>> env = FrozenLakeText(is_slippery=False)
    >>> obs, info = env.reset(seed=0)
    >>> print(obs)
    FrozenLake: reach G, never step on H. You are @.
    @FFF
    FHFH
    FFFH
    HFFG
    You are at row 0, column 0. Move left, down, right or up.
    >>> obs, reward, terminated, truncated, info = env.step("I go right")
    >>> obs.splitlines()[1], reward, info["invalid_action"]
    ('S@FF', 0.0, False)
    >>> obs, reward, terminated, truncated, info = env.step("north-east!")
    >>> obs.splitlines()[1], info["invalid_action"]
    ('S@FF', True)
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import random
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from shmvec.text import UnboundedText

__all__ = ["FrozenLakeText", "GemEnv", "text_space"]


def text_space() -> UnboundedText:
    """The observation and action space of the text adapters: any text, of any
    length (``shmvec.UnboundedText``): games print boards, rules and histories
    of thousands of characters, with symbols (card suits, bullets, currency
    signs) that no narrow charset foresees."""
    return UnboundedText()


def check_text(value: Any, space: spaces.Space, what: str) -> str:
    """``value`` if it is in the text ``space``; otherwise a ValueError (a
    TypeError for a non-string) that names what is wrong with it."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r:.200}")
    if type(space) is spaces.Text:  # Text.contains looks each character up through a property
        if space.min_length <= len(value) <= space.max_length and space.character_set.issuperset(
            value
        ):
            return value
    elif space.contains(value):
        return value
    problems = []
    if isinstance(space, spaces.Text):
        if len(value) > space.max_length:
            problems.append(f"{len(value)} characters, over max_length={space.max_length}")
        outside = sorted(set(value) - set(space.character_set))
        if outside:
            problems.append(f"characters outside the space's charset: {''.join(outside)!r}")
    detail = "; ".join(problems) or "not in the space"
    raise ValueError(f"{what} does not fit its text space: {detail} (text {value!r:.200})")


# ------------------------------------------------------------ global random state

#: Held while an adapter's private generator states are swapped in.
_GLOBAL_RANDOM_LOCK = threading.RLock()


def _new_lock_in_child() -> None:
    # A worker forked while another thread of its parent held the lock would
    # otherwise inherit it held, by a thread that does not exist in the child.
    global _GLOBAL_RANDOM_LOCK
    _GLOBAL_RANDOM_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)


class PrivateGlobalRandom:
    """One env's own state of Python's global ``random`` (and, with ``numpy``,
    of numpy's global ``np.random``), seeded from the OS until the env reseeds it.

    ``with state.swapped():`` installs them as the global states (holding the
    process's adapter lock), and on exit keeps what the block did to them and
    restores the caller's states. A swap of Python's state costs about 0.1 ms;
    numpy's about 0.9 ms more (numpy copies its 624-word state element by
    element), measured on a 2-vCPU x86-64 VM.
    """

    def __init__(self, numpy: bool = True) -> None:
        self.python = random.Random().getstate()
        self.numpy = np.random.RandomState().get_state() if numpy else None

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        with _GLOBAL_RANDOM_LOCK:
            saved_python = random.getstate()
            random.setstate(self.python)
            saved_numpy = None
            if self.numpy is not None:
                saved_numpy = np.random.get_state()
                np.random.set_state(self.numpy)
            try:
                yield
            finally:
                self.python = random.getstate()
                random.setstate(saved_python)
                if saved_numpy is not None:
                    self.numpy = np.random.get_state()
                    np.random.set_state(saved_numpy)


def as_reward(value: Any, what: str) -> float:
    """A reward as a float: Python and numpy numbers convert; anything else
    (a text message, None, an array of several values) is a TypeError."""
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "biuf":
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"{what} is {type(value).__name__} {value!r:.200}, not a number: a reward must be a "
        "real number (the vector env stores it as a float)"
    )


# ----------------------------------------------------------------------- GEM


def _add_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


class GemEnv(gym.Env[str, str]):
    """A GEM (``gem-llm``) env as a gymnasium env of text observations and actions.

    Args:
        env_id: a GEM env id, e.g. ``"game:Minesweeper-v0-easy"``
            (``gem.print_envs()`` lists them), or a callable that makes the
            GEM env, such as its class (``GuessTheNumberEnv``) or a
            ``functools.partial`` of it with its arguments: a game that is not
            registered, or one imported without ``gem``'s registry.
        append_suffix: GEM games put the current board (or the prompt for the
            next move) in ``info["suffix"]``; with True (default) the
            observation is the game's text, a newline, then the suffix, as GEM's
            own observation wrapper joins them, and ``info`` no longer carries
            it. With False, the observation is the game's text alone.
        isolate_numpy: swap numpy's global generator state too (default). GEM's
            ``reset(seed=s)`` reseeds it, and a game may draw from it. With
            False, only Python's ``random`` is this env's own, and a seeded
            reset reseeds the process's ``np.random``: enough for GEM's
            GuessTheNumber, Minesweeper and Sudoku games, which never draw from
            numpy's generator, and about 0.9 ms a call cheaper.
        **kwargs: the game's arguments, over those of its registration
            (``max_turns``, ``rows``, ...).

    ``reset(seed=s)`` reseeds the game (GEM's own reset takes only a seed;
    ``options`` must be None or empty); ``step(action)`` takes a ``str``. A
    reward that is not a real number raises ``TypeError``, an observation
    outside :func:`text_space` a ``ValueError`` naming the characters or the
    length. The game's global-random draws are this env's own: see the module
    docstring.

    Importing ``gem`` takes several seconds (it imports ``reasoning_gym``) and
    calls ``logging.basicConfig(level=INFO)``; import it in the main process
    before making the vector env, so that forked workers inherit it. A callable
    ``env_id`` is made as it is: ``gem`` is not imported for it.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        env_id: str | Callable[..., Any],
        *,
        append_suffix: bool = True,
        isolate_numpy: bool = True,
        **kwargs: Any,
    ) -> None:
        if callable(env_id):
            make: Callable[..., Any] = env_id
            func = getattr(env_id, "func", env_id)  # a functools.partial names its function
            self.env_id: str = getattr(func, "__name__", repr(env_id))
        else:
            try:
                import gem
            except ImportError as error:
                raise ImportError(
                    'GemEnv needs GEM: pip install "shmvec[text]" (or gem-llm)'
                ) from error
            make = functools.partial(gem.make, env_id)
            self.env_id = env_id
        self.append_suffix = append_suffix
        self.observation_space = text_space()
        self.action_space = text_space()
        self.random_state = PrivateGlobalRandom(numpy=isolate_numpy)
        self.turns = 0
        with self.random_state.swapped():  # GEM's games reset (and draw) when made
            self.game = make(**kwargs)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        if options:
            raise ValueError(
                f"GemEnv({self.env_id!r}) takes no reset options (GEM's reset takes only a "
                f"seed), got {options!r}"
            )
        super().reset(seed=seed)
        self.turns = 0
        with self.random_state.swapped():
            obs, info = self.game.reset(seed=seed)
        return self._observation(obs, info, "the observation of reset")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(
                f"GemEnv({self.env_id!r}) takes text actions (str), got "
                f"{type(action).__name__} {action!r:.200}"
            )
        self.turns += 1
        with self.random_state.swapped():
            obs, reward, terminated, truncated, info = self.game.step(action)
        where = f"step {self.turns} of GemEnv({self.env_id!r})"
        observation, info = self._observation(obs, info, f"the observation of {where}")
        reward = as_reward(reward, f"the reward of {where}")
        return observation, reward, bool(terminated), bool(truncated), info

    def _observation(self, obs: Any, info: Any, what: str) -> tuple[str, dict[str, Any]]:
        info = dict(info or {})
        if not isinstance(obs, str):
            raise TypeError(f"{what} must be a str, got {type(obs).__name__} {obs!r:.200}")
        if self.append_suffix and isinstance(info.get("suffix"), str):
            obs = _add_newline(obs) + info.pop("suffix")
        return check_text(obs, self.observation_space, what), info

    def close(self) -> None:
        close = getattr(self.game, "close", None)
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"GemEnv({self.env_id!r})"


# ---------------------------------------------------------------- FrozenLake


#: An action word or digit, on its own (not inside a longer word or number).
_FROZEN_LAKE_ACTION = re.compile(r"(?<![a-z0-9])(left|down|right|up|[0-3])(?![a-z0-9])")
_FROZEN_LAKE_ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}


class FrozenLakeText(gym.Env[str, str]):
    """Gymnasium's FrozenLake with the map as the observation and text actions.

    Args:
        max_episode_steps: the episode is truncated after this many steps,
            invalid ones included (FrozenLake-v1's limit is 100).
        **kwargs: ``FrozenLakeEnv``'s arguments (``map_name``, ``desc``,
            ``is_slippery``, ``success_rate``, ``reward_schedule``). A random
            map (``map_name=None`` without ``desc``) is drawn once, when the
            env is made, from fresh entropy: it is not part of a reset's seed,
            so replaying a trajectory on another instance needs ``desc``.

    The observation is the map with the player as ``@``, between a line of
    rules and a line with the player's row and column. An action is text: its
    last action word (``left``, ``down``, ``right``, ``up``, any case) or digit
    ``0``-``3`` standing on its own (not part of a longer word or number) is
    the move, as in FrozenLake's ``Discrete(4)``. Text without one is an
    invalid action: the player does not move, the reward is 0, the step counts
    toward ``max_episode_steps``, and ``info["invalid_action"]`` is True (it is
    False after every valid one). Its randomness is FrozenLake's own
    ``np_random``, seeded by ``reset(seed=...)``.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_episode_steps: int = 100, **kwargs: Any) -> None:
        if kwargs.get("render_mode") is not None:
            raise ValueError("FrozenLakeText renders its observations as text: no render_mode")
        if not isinstance(max_episode_steps, int) or max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be an int >= 1, got {max_episode_steps!r}")
        self.lake = FrozenLakeEnv(**kwargs)
        self.max_episode_steps = max_episode_steps
        self.observation_space = text_space()
        self.action_space = text_space()
        desc: np.ndarray = np.asarray(self.lake.desc, dtype="c")
        self.map_rows = ["".join(cell.decode() for cell in row) for row in desc]
        self.columns = len(self.map_rows[0])
        self.steps = 0

    @staticmethod
    def parse_action(text: str) -> int | None:
        """The move (0 left, 1 down, 2 right, 3 up) that ``text`` names, or None."""
        matches = _FROZEN_LAKE_ACTION.findall(text.lower())
        if not matches:
            return None
        last = matches[-1]
        return _FROZEN_LAKE_ACTIONS[last] if last in _FROZEN_LAKE_ACTIONS else int(last)

    def render_text(self) -> str:
        """The observation: rules, the map with the player as ``@``, the position."""
        row, column = divmod(int(self.lake.s), self.columns)
        lines = ["FrozenLake: reach G, never step on H. You are @."]
        for r, cells in enumerate(self.map_rows):
            lines.append(cells[:column] + "@" + cells[column + 1 :] if r == row else cells)
        lines.append(f"You are at row {row}, column {column}. Move left, down, right or up.")
        return "\n".join(lines)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.lake.reset(seed=seed, options=options)
        self.steps = 0
        return self.render_text(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(
                f"FrozenLakeText takes text actions (str), got {type(action).__name__} "
                f"{action!r:.200}"
            )
        self.steps += 1
        move = self.parse_action(action)
        reward, terminated = 0.0, False
        if move is not None:
            _, lake_reward, terminated, _, _ = self.lake.step(move)
            reward = float(lake_reward)
        truncated = not terminated and self.steps >= self.max_episode_steps
        return self.render_text(), reward, terminated, truncated, {"invalid_action": move is None}
