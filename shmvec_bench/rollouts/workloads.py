"""Text-game workloads for the rollout benchmark: envs whose observations and actions are text.

The games are ``shmvec.text_envs``'s adapters, observing and acting in
``shmvec.UnboundedText`` (any text, never clipped); ``make_env(workload, index)``
(picklable with ``functools.partial``, so spawn and forkserver workers can build
it) wraps one in ``WorkloadEnv``, which adds what the benchmark measures with:
a workload's CPU burn, tool wait, injected faults and stragglers. Games:

- ``guess``, ``minesweeper``, ``sudoku``: gem-llm's GuessTheNumber (1-20, 8 turns),
  Minesweeper-easy (5x5, 5 mines) and Sudoku-easy (4x4) through ``GemEnv``, each
  with its own global-random state. The game classes are imported without gem's
  registry (``import gem`` imports reasoning-gym: ~3 s and ~1,200 modules a process;
  the game modules alone take ~0.4 s and ~220), and handed to ``GemEnv`` as callables.
- ``frozenlake``: ``FrozenLakeText`` (gymnasium's FrozenLake 4x4, slippery), the move
  parsed from ``\\boxed{left}`` and the like.

Everything a workload adds draws from the env's own ``numpy.random.Generator``,
seeded from the episode's seed: episodes are a function of (seed, actions)
whatever the interleaving, and replayable.

Workloads (``WORKLOADS``): W1 the four games; W2 ``cpu200us`` (guess, plus
200 us of CPU a step); W3 ``tool`` (guess, plus a seeded lognormal wait per step:
median 20 ms, sigma 1.0, as a tool call); W4 ``faults`` (``tool`` where 1% of
steps raise and 0.2% hang for ``HANG_S``, and the runner kills an env process
every 10 s); ``tool-straggler`` (``tool`` where every eighth task, by seed,
waits 10x as long a step).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec.text_envs import FrozenLakeText, GemEnv

#: How long a hung step blocks (far past any deadline; released early when the
#: benchmark gives up on a backend that runs envs in its own process).
HANG_S = 120.0
#: Set by a runner that gives up on in-process envs: hung steps return at once.
RELEASE_HANGS = threading.Event()


# ----------------------------------------------------------------------- games


#: Held while ``import_gem`` imports: env threads that make their games at once would
#: otherwise find a module in ``sys.modules`` that another thread is still executing.
_IMPORT_LOCK = threading.Lock()


def import_gem(name: str) -> types.ModuleType:
    """Module ``name`` of gem-llm with its parent packages made as bare namespace
    modules, so that gem's ``__init__`` (and its registry) does not run."""
    with _IMPORT_LOCK:
        return _import_gem(name)


def _import_gem(name: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    import importlib
    import importlib.util

    if "gem" in sys.modules:
        return importlib.import_module(name)
    spec = importlib.util.find_spec("gem")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("gem-llm is not installed (pip install gem-llm)")
    root = spec.submodule_search_locations[0]
    stubs = {}
    for package in ("gem", "gem.envs", "gem.envs.game_env"):
        stub = types.ModuleType(package)
        stub.__path__ = [root + package[3:].replace(".", "/")]
        sys.modules[package] = stubs[package] = stub
    try:
        return importlib.import_module(name)
    finally:
        # The stubs stand only while the module imports: a later ``import gem``
        # runs gem's own ``__init__`` (and its registry), as it would have.
        for package, stub in stubs.items():
            if sys.modules.get(package) is stub:
                del sys.modules[package]


def gem_game(module: str, cls: str, **kwargs: Any) -> gym.Env:
    """``GemEnv`` of ``gem.envs.game_env.<module>.<cls>(**kwargs)``, imported without
    gem's registry. GEM's games never draw from numpy's global generator, so only
    Python's ``random`` is swapped (``isolate_numpy=False``, ~0.9 ms a call cheaper)."""
    game = getattr(import_gem(f"gem.envs.game_env.{module}"), cls)
    return GemEnv(functools.partial(game, **kwargs), isolate_numpy=False)


class TextArenaGuess(gym.Env):
    """textarena's GuessTheNumber-v0 (1-20, 10 turns; ``pip install textarena``) with
    bounded gymnasium ``Text`` spaces (printable ASCII): observations of up to 16,384
    characters, the game's whole transcript (516 characters at reset), actions up to 64.
    The game draws from Python's global ``random``: each env keeps its own state."""

    def __init__(self) -> None:
        import string

        import textarena

        from shmvec.text_envs import PrivateGlobalRandom

        self.observation_space = gym.spaces.Text(16384, min_length=0, charset=string.printable)
        self.action_space = gym.spaces.Text(64, min_length=0, charset=string.printable)
        self.random_state = PrivateGlobalRandom(numpy=False)
        with self.random_state.swapped():
            self.game = textarena.make("GuessTheNumber-v0")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        with self.random_state.swapped():
            self.game.reset(num_players=1, seed=seed)
        return self.game.get_observation()[1], {}

    def step(self, action):
        with self.random_state.swapped():
            done, _ = self.game.step(action)
            reward = float(self.game.close()[0][0]) if done else 0.0
        return self.game.get_observation()[1], reward, bool(done), False, {}


#: Steps after which an episode is truncated.
MAX_TURNS = 16

#: Game -> (a factory of the game as a text env, the actions a policy chooses among).
GAMES: dict[str, tuple[Callable[[], gym.Env], tuple[str, ...]]] = {
    "guess": (
        functools.partial(
            gem_game, "guess_the_number", "GuessTheNumberEnv",
            min_number=1, max_number=20, max_turns=8,
        ),
        tuple(f"\\boxed{{{n}}}" for n in range(1, 21)),
    ),
    "minesweeper": (
        functools.partial(
            gem_game, "minesweeper", "MinesweeperEnv", rows=5, cols=5, num_mines=5, max_turns=25
        ),
        tuple(f"\\boxed{{reveal {r} {c}}}" for r in range(5) for c in range(5)),
    ),
    "sudoku": (
        functools.partial(gem_game, "sudoku", "SudokuEnv", scale=4, clues=10, max_turns=15),
        tuple(
            f"\\boxed{{{r} {c} {v}}}"
            for r in range(1, 5)
            for c in range(1, 5)
            for v in (1, 2, 3, 4)
        ),
    ),
    "frozenlake": (
        functools.partial(
            FrozenLakeText, map_name="4x4", is_slippery=True, max_episode_steps=MAX_TURNS
        ),
        tuple(f"\\boxed{{{a}}}" for a in ("left", "down", "right", "up")),
    ),
    "ta-guess": (TextArenaGuess, tuple(f"[{n}]" for n in range(1, 21))),
}  # fmt: skip


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
    #: A uniform wait per step between these, seconds, instead (None: none).
    wait_range_s: tuple[float, float] | None = None
    #: Share of steps that raise ``ToolError`` / that hang for ``HANG_S`` (W4).
    error_p: float = 0.0
    hang_p: float = 0.0
    #: The runner kills one env process this often, seconds (None: never) (W4).
    kill_every_s: float | None = None
    #: Tasks whose seed is ``STRAGGLER_EVERY - 1`` modulo ``STRAGGLER_EVERY`` wait this
    #: many times as long per step.
    straggle: float = 1.0
    #: Steps after which an episode is truncated.
    max_turns: int = MAX_TURNS

    @property
    def waits(self) -> bool:
        """Whether a step mostly waits (run such envs concurrently in threads)."""
        return self.wait_median_s > 0 or self.wait_range_s is not None

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
        Workload(
            "ta-tool", "ta-guess",
            "textarena GuessTheNumber with Text spaces + a 10-30 ms tool wait a step",
            wait_range_s=(10e-3, 30e-3),
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


class WorkloadEnv(gym.Wrapper):
    """A text game plus the workload's per-step costs: CPU burnt, a tool wait, injected
    faults, a straggling task's slowdown, and truncation after ``max_turns`` steps.
    Infos are empty (the text is the observation); rewards are floats."""

    def __init__(self, workload: str | Workload, index: int = 0) -> None:
        self.spec_ = spec = WORKLOADS[workload] if isinstance(workload, str) else workload
        super().__init__(GAMES[spec.game][0]())
        self.index = index
        self._rng = np.random.default_rng([index])
        self._slow = 1.0
        self._turns = 0

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self._rng = np.random.default_rng([seed, 1])
        self._slow = self.spec_.straggle if is_straggler(seed) else 1.0
        self._turns = 0
        obs, _ = self.env.reset(seed=seed, options=options)
        return obs, {}

    def step(self, action):
        self._step_costs()
        self._turns += 1
        obs, reward, terminated, truncated, _ = self.env.step(action)
        truncated = bool(truncated or (self._turns >= self.spec_.max_turns and not terminated))
        return obs, float(reward), bool(terminated), truncated, {}

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
        if spec.wait_range_s is not None:
            time.sleep(float(rng.uniform(*spec.wait_range_s)))
        if spec.error_p or spec.hang_p:
            draw = rng.random()
            if draw < spec.error_p:
                raise ToolError(f"tool call failed (env {self.index})")
            if draw < spec.error_p + spec.hang_p:
                RELEASE_HANGS.wait(HANG_S)


def make_env(workload: str, index: int = 0) -> WorkloadEnv:
    """Env ``index`` of ``workload`` (module level: picklable as a ``functools.partial``)."""
    return WorkloadEnv(workload, index)


def env_fns(workload: str, num_envs: int) -> list[Callable[[], WorkloadEnv]]:
    """``num_envs`` picklable factories of ``workload``'s envs."""
    return [functools.partial(make_env, workload, i) for i in range(num_envs)]
