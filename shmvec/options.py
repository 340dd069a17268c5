"""ShmVectorEnv's constructor arguments, checked once and then read as typed values.

``ShmVectorEnv.__init__`` keeps ``AsyncVectorEnv``'s signature; its keyword-only
tuning options become one ``TuningOptions`` (each checked on its own), which
``sizes`` then fits to the number of envs. ``describe_envs`` builds the spaces
from a first env, as ``AsyncVectorEnv`` does. Every check raises before any
worker starts, with the option's name in the message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_differing_spaces, batch_space

from shmvec.codecs import TEXT_BYTES, check_text_bytes
from shmvec.spin import SpinPolicy, available_cpus, default_pinning, default_spin, fixed_spin
from shmvec.worker import check_env

__all__ = [
    "EnvSpaces",
    "Sizes",
    "TuningOptions",
    "check_env_fns",
    "check_max_concurrency",
    "check_no_worker",
    "describe_envs",
]


class Sizes(NamedTuple):
    """The counts that depend on ``num_envs``, resolved."""

    num_workers: int  # 0: every env in the main process
    batch_size: int
    ring_depth: int


@dataclass(frozen=True)
class TuningOptions:
    """ShmVectorEnv's keyword-only options, as given; see its docstring for each."""

    num_workers: int | None = None
    batch_size: int | None = None
    group_size: int = 1
    ring_depth: int = 2
    spin_ns: int | None = None
    on_worker_death: str = "raise"
    on_env_error: str = "raise"
    env_timeout: float | None = None
    step_in_main: bool = False
    fallback: str | None = None
    validate_actions: bool = False
    env_concurrency: int | None = None
    pin_workers: bool | None = None
    text_bytes: int = TEXT_BYTES
    step_deadline: float | None = None

    def __post_init__(self) -> None:
        """A ValueError naming the first option that is wrong whatever the envs."""
        _check_choice("on_worker_death", self.on_worker_death, "restart")
        _check_choice("on_env_error", self.on_env_error, "reset")
        if self.env_timeout is not None and not self.env_timeout > 0:
            raise ValueError(
                f"env_timeout must be a positive number of seconds, got {self.env_timeout}"
            )
        deadline = self.step_deadline
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float, np.integer, np.floating))
            or not 0 < deadline < float("inf")
        ):
            raise ValueError(
                f"step_deadline must be None or a positive number of seconds, got {deadline!r}"
            )
        if self.fallback not in (None, "serial"):
            raise ValueError(f"fallback must be None or 'serial', got {self.fallback!r}")
        concurrency = self.env_concurrency
        if concurrency is not None and (
            isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
        ):
            raise ValueError(f"env_concurrency must be None or an int >= 1, got {concurrency!r}")
        if self.pin_workers not in (None, True, False):
            raise ValueError(f"pin_workers must be None, True or False, got {self.pin_workers!r}")
        if self.spin_ns is not None:
            fixed_spin(self.spin_ns)  # its ValueError
        check_text_bytes(self.text_bytes)

    def check_deadline(self, num_workers: int, async_mode: bool) -> None:
        """A ValueError where ``step_deadline`` cannot be kept: envs in the main
        process (whose signals are the application's), or envs in threads in
        sync mode."""
        if self.step_deadline is None:
            return
        if num_workers == 0 or self.step_in_main:
            raise ValueError(
                "step_deadline needs every env in a worker process: not with num_workers=0 "
                "or step_in_main=True"
            )
        if not async_mode and self.env_concurrency not in (None, 1):
            raise ValueError(
                "step_deadline with env_concurrency needs async mode (batch_size < num_envs)"
            )

    def sizes(self, num_envs: int, max_concurrency: int | None) -> Sizes:
        """Workers, batch size and ring depth for ``num_envs`` envs; ValueError if out of range."""
        num_workers = self.num_workers
        if num_workers is None:
            num_workers = min(num_envs, available_cpus())
        if max_concurrency is not None:
            num_workers = min(num_workers, max_concurrency)
        _check_range("num_workers", num_workers, 0, num_envs)
        batch_size = num_envs if self.batch_size is None else int(self.batch_size)
        _check_range("batch_size", batch_size, 1, num_envs, self.batch_size)
        if self.group_size < 1 or num_envs % self.group_size:
            raise ValueError(f"group_size must divide num_envs={num_envs}, got {self.group_size}")
        ring_depth = self.ring_depth
        if batch_size < num_envs:
            # See csrc/result_ring.h: enough slots that a claim never overruns.
            ring_depth = max(ring_depth, -(-num_envs // batch_size) + 1)
        return Sizes(num_workers, batch_size, ring_depth)

    def spin(self, num_processes: int) -> SpinPolicy:
        """Each waiter's spin with ``num_processes`` worker processes."""
        return default_spin(num_processes) if self.spin_ns is None else fixed_spin(self.spin_ns)

    def pinning(self, num_processes: int, async_mode: bool) -> bool:
        """Whether each worker process stays on one CPU."""
        if self.pin_workers is None:
            return default_pinning(num_processes, async_mode)
        return self.pin_workers

    def per_worker_concurrency(self, max_concurrency: int | None, num_workers: int) -> int | None:
        """``env_concurrency`` per worker, bounded by ``max_concurrency`` too (at most
        that many envs inside ``step`` over all workers). None: one env at a time."""
        value = self.env_concurrency
        if max_concurrency is not None and value is not None:
            value = min(value, max(1, max_concurrency // num_workers))
        return value


class EnvSpaces(NamedTuple):
    """What a vector env takes from its first env."""

    metadata: dict[str, Any]
    render_mode: str | None
    single_action_space: gym.Space
    action_space: gym.Space
    single_observation_space: gym.Space
    observation_space: gym.Space


def describe_envs(env_fns: list[Callable[[], gym.Env]], observation_mode: Any) -> EnvSpaces:
    """The spaces and metadata of ``env_fns``, from a first env made and closed here."""
    dummy_env = env_fns[0]()
    try:
        check_env(dummy_env, 0)
        observation_space, single_observation_space = _observation_spaces(
            dummy_env, observation_mode, env_fns
        )
        return EnvSpaces(
            metadata=dict(dummy_env.metadata),
            render_mode=dummy_env.render_mode,
            single_action_space=dummy_env.action_space,
            action_space=batch_space(dummy_env.action_space, len(env_fns)),
            single_observation_space=single_observation_space,
            observation_space=observation_space,
        )
    finally:
        if hasattr(dummy_env, "close"):
            dummy_env.close()


def _observation_spaces(
    dummy_env: gym.Env, observation_mode: Any, env_fns: list[Callable[[], gym.Env]]
) -> tuple[gym.Space, gym.Space]:
    """(batched, single) observation spaces, as AsyncVectorEnv builds them."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        batched, single = observation_mode
        if not (isinstance(batched, gym.Space) and isinstance(single, gym.Space)):
            raise TypeError(
                "observation_mode as a tuple must be (batched space, single space), got "
                f"{observation_mode!r}"
            )
        return batched, single
    single = dummy_env.observation_space
    if observation_mode == "same":
        return batch_space(single, len(env_fns)), single
    if observation_mode == "different":
        spaces = [single] + [fn().observation_space for fn in env_fns[1:]]
        return batch_differing_spaces(spaces), single
    raise ValueError(
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
        f"and batch observation space, actual got {observation_mode}"
    )


def check_env_fns(env_fns: Any) -> list[Callable[[], gym.Env]]:
    """``env_fns`` as a list; TypeError unless a non-empty sequence of callables."""
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence):
        try:
            env_fns = list(env_fns)
        except TypeError:
            raise TypeError(
                f"env_fns must be a sequence of callables, got {type(env_fns).__name__}"
            ) from None
    env_fns = list(env_fns)
    if not env_fns:
        raise ValueError("env_fns is empty: a vector env needs at least one env")
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] is not callable: {fn!r}")
    return env_fns


def check_no_worker(worker: Any) -> None:
    """AsyncVectorEnv's ``worker`` argument, which only None passes."""
    if worker is not None:
        raise ValueError(
            "ShmVectorEnv runs its own worker loop over shared memory and cannot use a "
            "custom `worker`; use gymnasium.vector.AsyncVectorEnv for that."
        )


def check_max_concurrency(value: Any) -> int | None:
    """``max_concurrency`` as AsyncVectorEnv checks it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`max_concurrency` must be an integer or None, got {type(value)}.")
    if value < 1:
        raise ValueError(f"`max_concurrency` must be a positive or None, got {value}.")
    return int(value)


def _check_range(name: str, value: int, low: int, high: int, given: Any = None) -> None:
    if not low <= value <= high:
        got = value if given is None else given
        raise ValueError(f"{name} must be between {low} and num_envs={high}, got {got}")


def _check_choice(name: str, value: str, other: str) -> None:
    if value not in ("raise", other):
        raise ValueError(f"{name} must be 'raise' or {other!r}, got {value!r}")
