"""Text-game workloads for the rollout benchmark: envs whose observations and actions are text.

Every env is a ``gymnasium.Env`` with ``Text`` observation and action spaces
(``text_space``), built by ``make_env(workload, index)`` (picklable with
``functools.partial``, so spawn and forkserver workers can build it). Games:

- ``guess``, ``minesweeper``, ``sudoku``: gem-llm's GuessTheNumber (1-20, 8 turns),
  Minesweeper-easy (5x5, 5 mines) and Sudoku-easy (4x4), imported without gem's
  registry (``import gem`` imports reasoning-gym: ~5 s and ~1,200 modules a process;
  the game modules alone take ~0.4 s and ~220).
- ``frozenlake``: gymnasium's ``FrozenLake-v1`` (4x4, slippery) rendered as text, the
  action parsed from ``\\boxed{left}`` and the like.

gem's games draw from Python's global ``random`` (and reseed it on every reset),
so two envs in one process, or env threads of one worker, would change each
other's games. ``TextGameEnv`` gives each env its own ``random`` state and swaps
it in and out of the module around every call, under one lock: episodes are
then a function of (seed, actions) whatever the interleaving, and replayable.
Everything else an env draws (tool waits, faults) comes from its own
``numpy.random.Generator``, seeded from the episode's seed.

Workloads (``WORKLOADS``): W1 the four games; W2 ``cpu200us`` (guess, plus
200 us of CPU a step); W3 ``tool`` (guess, plus a seeded lognormal wait per step:
median 20 ms, sigma 1.0, as a tool call); W4 ``faults`` (``tool`` where 1% of
steps raise and 0.2% hang for ``HANG_S``, and the runner kills an env process
every 10 s); ``tool-straggler`` (``tool`` where every eighth task, by seed,
waits 10x as long a step).
"""

from __future__ import annotations

import functools
import random
import string
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

#: Longest observation kept, characters: longer ones keep their end (the board and the
#: last message), as a chat context keeps its latest turns.
OBS_MAX_CHARS = 1024
#: Longest action, characters (the longest vocabulary entry is 18).
ACTION_MAX_CHARS = 32
#: Characters an observation may hold; others become ``?``. The games here print ASCII
#: and a few symbols (Sokoban's boxes on goals, suits, bullets, arrows).
CHARSET = string.printable + "√•·…→←↑↓♠♥♦♣°×÷–—“”‘’"
#: How long a hung step blocks (far past any deadline; released early when the
#: benchmark gives up on a backend that runs envs in its own process).
HANG_S = 120.0
#: Set by a runner that gives up on in-process envs: hung steps return at once.
RELEASE_HANGS = threading.Event()


def text_space(max_length: int) -> gym.spaces.Text:
    """The Text space of observations and actions: the one place to change when
    shmvec gains an unbounded text space."""
    return gym.spaces.Text(max_length=max_length, min_length=0, charset=CHARSET)


def clip_text(text: str, max_length: int = OBS_MAX_CHARS) -> str:
    """``text`` in ``CHARSET`` (others as ``?``), keeping its last ``max_length`` characters."""
    text = text[-max_length:]
    if all(c in _CHARSET_SET for c in text):
        return text
    return "".join(c if c in _CHARSET_SET else "?" for c in text)


_CHARSET_SET = frozenset(CHARSET)


# ----------------------------------------------------------------------- games


def import_gem_game(module: str) -> types.ModuleType:
    """``gem.envs.game_env.<module>`` without running gem's ``__init__`` (its registry
    imports reasoning-gym)."""
    return import_gem(f"gem.envs.game_env.{module}")


def import_gem(name: str) -> types.ModuleType:
    """Module ``name`` of gem-llm with its parent packages made as bare namespace
    modules, so that gem's ``__init__`` (and its registry) does not run."""
    if name in sys.modules:
        return sys.modules[name]
    import importlib
    import importlib.util

    if "gem" not in sys.modules:
        spec = importlib.util.find_spec("gem")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("gem-llm is not installed (pip install gem-llm)")
        root = spec.submodule_search_locations[0]
        for package in ("gem", "gem.envs", "gem.envs.game_env"):
            stub = types.ModuleType(package)
            stub.__path__ = [root + package[3:].replace(".", "/")]
            sys.modules[package] = stub
    return importlib.import_module(name)


def _gem(module: str, cls: str, **kwargs) -> Callable[[], object]:
    return lambda: getattr(import_gem_game(module), cls)(**kwargs)


#: Game -> (a factory of the game, the actions a policy chooses among).
GAMES: dict[str, tuple[Callable[[], object], tuple[str, ...]]] = {
    "guess": (
        _gem("guess_the_number", "GuessTheNumberEnv", min_number=1, max_number=20, max_turns=8),
        tuple(f"\\boxed{{{n}}}" for n in range(1, 21)),
    ),
    "minesweeper": (
        _gem("minesweeper", "MinesweeperEnv", rows=5, cols=5, num_mines=5, max_turns=25),
        tuple(f"\\boxed{{reveal {r} {c}}}" for r in range(5) for c in range(5)),
    ),
    "sudoku": (
        _gem("sudoku", "SudokuEnv", scale=4, clues=10, max_turns=15),
        tuple(
            f"\\boxed{{{r} {c} {v}}}"
            for r in range(1, 5)
            for c in range(1, 5)
            for v in (1, 2, 3, 4)
        ),
    ),
    "frozenlake": (
        lambda: FrozenLakeText(),
        tuple(f"\\boxed{{{a}}}" for a in ("left", "down", "right", "up")),
    ),
}

#: One lock for every swap of Python's global ``random`` state in this process.
_RANDOM_LOCK = threading.RLock()


class FrozenLakeText:
    """gymnasium's FrozenLake-v1 (4x4, slippery) as a text game: the map with the player
    as ``P``, moves as ``\\boxed{left|down|right|up}``; anything else ends the episode
    (reward 0), as gem's games end on a format error. Its randomness is gymnasium's
    own per-env generator."""

    MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}

    def __init__(self) -> None:
        self.env = gym.make("FrozenLake-v1", map_name="4x4", is_slippery=True)
        self.desc = self.env.unwrapped.desc.astype(str)

    def render(self, state: int) -> str:
        rows = [list(r) for r in self.desc]
        rows[state // 4][state % 4] = "P"
        return "\n".join(" ".join(r) for r in rows)

    def reset(self, seed=None):
        state, _ = self.env.reset(seed=seed)
        intro = (
            "You are on a frozen lake (S start, F ice, H hole, G goal, P you). Reach G without "
            "falling into a hole; the ice is slippery. Answer \\boxed{left|down|right|up}.\n"
        )
        return intro, {"suffix": self.render(state)}

    def step(self, action: str):
        word = action.removeprefix("\\boxed{").removesuffix("}")
        if word not in self.MOVES:
            return "That is not a move.", 0.0, True, False, {}
        state, reward, terminated, truncated, _ = self.env.step(self.MOVES[word])
        return "You moved.", float(reward), terminated, truncated, {"suffix": self.render(state)}


# ------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A game and what each of its steps costs besides the game itself."""

    name: str
    game: str
    #: One line for ``--help`` and the report.
    summary: str
    #: CPU burnt per step, seconds (W2).
    burn_s: float = 0.0
    #: Median of the lognormal wait per step, seconds (0: none) (W3).
    wait_median_s: float = 0.0
    wait_sigma: float = 1.0
    #: Share of steps that raise ``ToolError`` / that hang for ``HANG_S`` (W4).
    error_p: float = 0.0
    hang_p: float = 0.0
    #: The runner kills one env process this often, seconds (None: never) (W4).
    kill_every_s: float | None = None
    #: Tasks whose seed is ``STRAGGLER_EVERY - 1`` modulo ``STRAGGLER_EVERY`` wait this
    #: many times as long per step.
    straggle: float = 1.0
    #: Steps after which an episode is truncated.
    max_turns: int = 16

    @property
    def waits(self) -> bool:
        """Whether a step mostly waits (run such envs concurrently in threads)."""
        return self.wait_median_s > 0

    @property
    def actions(self) -> tuple[str, ...]:
        return GAMES[self.game][1]


#: A straggling task: seed % STRAGGLER_EVERY == STRAGGLER_EVERY - 1.
STRAGGLER_EVERY = 8

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("guess", "guess", "W1: gem GuessTheNumber 1-20, 8 turns"),
        Workload("minesweeper", "minesweeper", "W1: gem Minesweeper-easy, 5x5, 5 mines"),
        Workload("sudoku", "sudoku", "W1: gem Sudoku-easy, 4x4, 15 turns"),
        Workload("frozenlake", "frozenlake", "W1: gymnasium FrozenLake-v1 4x4 as text"),
        Workload("cpu200us", "guess", "W2: guess + 200 us of CPU a step", burn_s=200e-6),
        Workload(
            "tool", "guess", "W3: guess + a lognormal tool wait a step (median 20 ms, sigma 1)",
            wait_median_s=20e-3,
        ),
        Workload(
            "tool-straggler", "guess",
            "W3 where every 8th task waits 10x as long a step", wait_median_s=20e-3, straggle=10.0,
        ),
        Workload(
            "faults", "guess",
            "W4: tool + 1% of steps raise, 0.2% hang, an env process killed every 10 s",
            wait_median_s=20e-3, error_p=0.01, hang_p=0.002, kill_every_s=10.0,
        ),
    )
}  # fmt: skip


def is_straggler(seed: int | None) -> bool:
    return seed is not None and seed % STRAGGLER_EVERY == STRAGGLER_EVERY - 1


class ToolError(RuntimeError):
    """A failed tool call (W4's injected errors)."""


def burn_cpu(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class TextGameEnv(gym.Env):
    """One text game as a gymnasium env: ``Text`` observations (the game's message and,
    after it, the board) and ``Text`` actions, plus the workload's per-step costs.

    Observations are ``clip_text``-ed to ``OBS_MAX_CHARS``. Infos are empty: the text is
    the observation. Rewards are floats.
    """

    metadata = {"render_modes": []}

    def __init__(self, workload: str | Workload, index: int = 0) -> None:
        self.spec_ = spec = WORKLOADS[workload] if isinstance(workload, str) else workload
        self.index = index
        self.game = GAMES[spec.game][0]()
        self.observation_space = text_space(OBS_MAX_CHARS)
        self.action_space = text_space(ACTION_MAX_CHARS)
        self._random = random.Random(index)
        self._rng = np.random.default_rng([index])
        self._slow = 1.0
        self._turns = 0

    def _call(self, fn, *args, **kwargs):
        """``fn`` with this env's ``random`` state in the module, under the process's lock."""
        with _RANDOM_LOCK:
            saved = random.getstate()
            random.setstate(self._random.getstate())
            try:
                return fn(*args, **kwargs)
            finally:
                self._random.setstate(random.getstate())
                random.setstate(saved)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self._random.seed(seed)
            self._rng = np.random.default_rng([self.index if seed is None else seed, 1])
        self._slow = self.spec_.straggle if is_straggler(seed) else 1.0
        self._turns = 0
        text, info = self._call(self.game.reset, seed=seed)
        return clip_text(f"{text}\n{info.get('suffix', '')}"), {}

    def step(self, action):
        self._step_costs()
        self._turns += 1
        text, reward, terminated, truncated, info = self._call(self.game.step, action)
        if self._turns >= self.spec_.max_turns and not terminated:
            truncated = True
        return (
            clip_text(f"{text}\n{info.get('suffix', '')}"),
            float(reward),
            terminated,
            truncated,
            {},
        )

    def _step_costs(self) -> None:
        """The workload's per-step costs: CPU, a tool wait, injected faults."""
        spec, rng = self.spec_, self._rng
        if spec.burn_s:
            burn_cpu(spec.burn_s)
        if spec.wait_median_s:
            wait = (
                spec.wait_median_s
                * self._slow
                * float(np.exp(spec.wait_sigma * rng.standard_normal()))
            )
            time.sleep(wait)
        if spec.error_p or spec.hang_p:
            draw = rng.random()
            if draw < spec.error_p:
                raise ToolError(f"tool call failed (env {self.index})")
            if draw < spec.error_p + spec.hang_p:
                RELEASE_HANGS.wait(HANG_S)


def make_env(workload: str, index: int = 0) -> TextGameEnv:
    """Env ``index`` of ``workload`` (module level: picklable as a ``functools.partial``)."""
    return TextGameEnv(workload, index)


def env_fns(workload: str, num_envs: int) -> list[Callable[[], TextGameEnv]]:
    """``num_envs`` picklable factories of ``workload``'s envs."""
    return [functools.partial(make_env, workload, i) for i in range(num_envs)]
