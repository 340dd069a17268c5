"""The backend registry: what a backend is, how it is registered, and the steppers
that the openers in ``shmvec_bench.backends`` build on.

A backend is one small function that opens ``num_envs`` copies of a workload,
resets them, draws random actions *before* the clock starts and returns a
``Stepper``; ``register`` records what it needs (a module that must be
importable, whether it takes ``num_workers``, whether it steps a batch of
``batch_size`` envs per call).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec_bench.workloads import WORKLOADS

#: Batches of random actions drawn before timing, then replayed in a cycle.
NUM_ACTION_BATCHES = 256
#: An async backend's returns per env before timing starts: its reset, then one step.
WARM_RETURNS_PER_ENV = 2


@dataclass
class Stepper:
    """One opened backend, reset and ready to time.

    ``step(actions[i])`` advances the envs by one batch, autoresetting finished
    ones, and runs the policy stand-in (``think``) once per batch received.
    ``close(terminate)`` releases everything; ``terminate=True`` is for a
    backend that may be stuck mid-call.
    """

    step: Callable[[Any], Any]
    actions: list[Any]
    num_envs: int
    #: Processes stepping the envs; 0 when they run in the calling process.
    num_workers: int
    close: Callable[[bool], None]
    #: Env steps one ``step`` call makes: ``num_envs``, or the batch of an async backend.
    steps_per_call: int | None = None
    #: Async backends: steps until every env has come back ``WARM_RETURNS_PER_ENV``
    #: times (its reset, then a step), so that slow resets stay out of the timed
    #: window; returns the calls it made.
    every_env_back: Callable[[], int] | None = None
    #: ``ShmVectorEnv.stats`` of the env, for shmvec backends.
    stats: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class OpenArgs:
    """What a backend's opener is given."""

    workload: str
    num_envs: int
    #: shmvec's worker processes, capped at num_envs (None: its default).
    num_workers: int | None
    context: str | None
    seed: int
    #: Async backends' batch (None: ``num_envs // 2``).
    batch_size: int | None
    #: The policy stand-in, run once per batch received (None: no policy).
    think: Callable[[], Any] | None

    @property
    def factory(self) -> Callable[[], gym.Env]:
        return WORKLOADS[self.workload]

    @property
    def fns(self) -> list[Callable[[], gym.Env]]:
        return [self.factory] * self.num_envs

    @property
    def batch(self) -> int:
        return async_batch(self.num_envs, self.batch_size)


def async_batch(num_envs: int, batch_size: int | None) -> int:
    """An async backend's batch: ``batch_size`` capped at num_envs, by default half the envs."""
    size = num_envs // 2 if batch_size is None else batch_size
    return max(1, min(size, num_envs))


@dataclass(frozen=True)
class Backend:
    """A registered backend."""

    name: str
    open: Callable[[OpenArgs], Stepper]
    #: A module that must be importable (an optional peer), or None.
    requires: str | None = None
    #: Takes ``num_workers`` (shmvec's backends): swept by ``--num-workers``.
    takes_workers: bool = False
    #: Steps ``batch_size < num_envs`` envs per call (``recv``/``send``).
    is_async: bool = False
    #: The workloads it can run (None: every one).
    workloads: frozenset[str] | None = None

    def is_importable(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def runs(self, workload: str) -> bool:
        return self.workloads is None or workload in self.workloads


#: Name -> backend, in the order they are listed.
REGISTRY: dict[str, Backend] = {}


def register(name: str, **options: Any) -> Callable:
    """Registers the decorated opener as backend ``name`` (options: see ``Backend``)."""

    def add(opener: Callable[[OpenArgs], Stepper]) -> Callable[[OpenArgs], Stepper]:
        REGISTRY[name] = Backend(name, opener, **options)
        return opener

    return add


def sample_actions(space: gym.Space, seed: int) -> list[Any]:
    space.seed(seed)
    return [space.sample() for _ in range(NUM_ACTION_BATCHES)]


def stacked_actions(space: gym.Space, batch: int, seed: int) -> list[np.ndarray]:
    """For backends that take one env's space: batches of ``batch`` actions, stacked."""
    space.seed(seed)
    return [np.stack([space.sample() for _ in range(batch)]) for _ in range(NUM_ACTION_BATCHES)]


def with_policy(step: Callable[[Any], Any], think: Callable[[], Any] | None) -> Callable:
    """``step`` then the policy stand-in: a sync loop thinks about each batch it gets."""
    if think is None:
        return step

    def step_and_think(actions):
        step(actions)
        think()

    return step_and_think


def opened_or_closed(close: Callable[[bool], None], make: Callable[[], Stepper]) -> Stepper:
    """``make()``; if it fails, ``close(terminate=True)`` before re-raising."""
    try:
        return make()
    except BaseException:
        close(True)
        raise


def vector_stepper(env, num_workers: int, args: OpenArgs, stats=None) -> Stepper:
    """An opened gymnasium-API vector env (shmvec, Sync, Async)."""

    def close(terminate: bool) -> None:
        env.close(terminate=terminate)

    def make() -> Stepper:
        env.reset(seed=args.seed)
        actions = sample_actions(env.action_space, args.seed)
        step = with_policy(env.step, args.think)
        return Stepper(step, actions, env.num_envs, num_workers, close, stats=stats)

    return opened_or_closed(close, make)


def async_stepper(env, num_workers: int, args: OpenArgs, seed: int | None, stats=None):
    """An EnvPool-style loop (shmvec's or EnvPool's): recv, think, send.

    ``seed`` goes to ``async_reset`` (None for EnvPool, seeded at construction).
    """
    batch, think = args.batch, args.think

    def step(actions):
        *_, infos = env.recv()
        if think is not None:
            think()
        env.send(actions, infos["env_id"])

    def every_env_back() -> int:
        returns = np.zeros(num_envs, dtype=np.int64)
        calls = 0
        while returns.min() < WARM_RETURNS_PER_ENV:
            *_, infos = env.recv()
            returns[infos["env_id"]] += 1
            env.send(actions[calls % len(actions)], infos["env_id"])
            calls += 1
        return calls

    num_envs = getattr(env, "num_envs", None) or env.config["num_envs"]

    def make() -> Stepper:
        env.async_reset() if seed is None else env.async_reset(seed=seed)
        space = getattr(env, "single_action_space", None) or env.action_space
        actions.extend(stacked_actions(space, batch, seed or 0))
        return Stepper(
            step, actions, num_envs, num_workers, lambda terminate: env.close(), batch,
            every_env_back=every_env_back, stats=stats,
        )  # fmt: skip

    actions: list[np.ndarray] = []
    return opened_or_closed(lambda terminate: env.close(), make)
