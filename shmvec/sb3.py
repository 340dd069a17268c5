"""Stable-Baselines3 adapter: a ShmVectorEnv behind SB3's ``VecEnv`` API.

Install with ``pip install stable-baselines3``.

How it translates SB3's conventions (dones, infos, ``indices``, action batches) and
its limits: docs/guides/sb3.md.

Example:
    >>> import gymnasium as gym
    >>> from stable_baselines3 import PPO
    >>> from shmvec.sb3 import ShmSB3VecEnv
    >>> venv = ShmSB3VecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2)
    >>> model = PPO("MlpPolicy", venv, n_steps=16, batch_size=64, seed=0)
    >>> _ = model.learn(64)
    >>> venv.close()

``stable_baselines3.common.env_util.make_vec_env("CartPole-v1", n_envs=8,
vec_env_cls=ShmSB3VecEnv, vec_env_kwargs={"num_workers": 2})`` works as well.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import VectorEnv
from gymnasium.vector.vector_env import AutoresetMode
from stable_baselines3.common.vec_env.base_vec_env import (
    VecEnv,
    VecEnvIndices,
    VecEnvObs,
    VecEnvStepReturn,
)

from shmvec.batching import ARRAY_SPACES, unbatch_infos
from shmvec.vector_env import ShmVectorEnv

__all__ = ["ActionCountError", "ShmSB3VecEnv", "batch_actions", "sb3_env_fns", "unbatch_infos"]

#: The attribute, set on each env's outermost wrapper, holding its ``_EnvOps``.
OPS_ATTR = "_shmvec_sb3"

#: gymnasium's SAME_STEP keys of a done env's final observation and info.
_FINAL_KEYS = ("final_obs", "_final_obs", "final_info", "_final_info")


# ---------------------------------------------------------------- worker side


class _EnvOps:
    """Runs SB3's per-env operations inside the worker, on the env that holds it.

    ``ShmVectorEnv.call(OPS_ATTR, op, indices, ...)`` sends the same arguments to
    every env; each one knows its own index and does nothing (returns None)
    unless ``indices`` names it.
    """

    def __init__(self, env: gym.Env, index: int) -> None:
        self.env = env
        self.index = index

    def __call__(self, op: str, indices: frozenset | None, *args: Any, **kwargs: Any) -> Any:
        if indices is not None and self.index not in indices:
            return None
        env = self.env
        if op == "env_method":
            name, method_args, method_kwargs = args
            return env.get_wrapper_attr(name)(*method_args, **method_kwargs)
        if op == "get_attr":
            return env.get_wrapper_attr(args[0])
        if op == "set_attr":
            name, value = args
            setattr(env, name, value)
            return None
        if op == "is_wrapped":
            return _is_wrapped(env, args[0])
        raise ValueError(f"unknown operation {op!r}")


def _is_wrapped(env: gym.Env, wrapper_class: type) -> bool:
    """SB3's ``env_util.is_wrapped``: is any wrapper of the chain a ``wrapper_class``?"""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, wrapper_class):
            return True
        env = env.env
    return False


class _SB3EnvFn:
    """An env factory that attaches the env's ``_EnvOps`` (picklable: top level)."""

    def __init__(self, env_fn: Callable[[], gym.Env], index: int) -> None:
        self.env_fn = env_fn
        self.index = index

    def __call__(self) -> gym.Env:
        env = self.env_fn()
        try:
            setattr(env, OPS_ATTR, _EnvOps(env, self.index))
        except (AttributeError, TypeError):  # an env class that forbids new attributes
            pass  # the adapter falls back to its slower paths
        return env


def sb3_env_fns(env_fns: Sequence[Callable[[], gym.Env]]) -> list[Callable[[], gym.Env]]:
    """``env_fns`` whose envs support exact per-env SB3 operations.

    Use these to build a ShmVectorEnv of your own that you then hand to
    ``ShmSB3VecEnv``; the adapter does it by itself when given ``env_fns``.
    """
    return [_SB3EnvFn(fn, i) for i, fn in enumerate(env_fns)]


# ------------------------------------------------------------- action batches


class ActionCountError(IndexError, ValueError):
    """A batch of actions that does not hold one action per env.

    An ``IndexError``, as ``DummyVecEnv`` raises for too few actions, and a
    ``ValueError``, as ``SubprocVecEnv`` raises for too few or too many.
    """


def batch_actions(space: spaces.Space, actions: Any, num_envs: int) -> Any:
    """SB3's forms of an action batch as the batched form of ``space``.

    Args:
        space: one env's action space.
        actions: a batched array, a list (or tuple, or object array) of one
            action per env, or gymnasium's batched form of a Dict space (a dict
            of batches) or of a Tuple space (a tuple of one batch per subspace).
        num_envs: the number of envs.

    Returns:
        The batch as ``ShmVectorEnv.step`` takes it: an array for Box,
        Discrete, MultiDiscrete and MultiBinary, a dict or tuple of those for
        Dict and Tuple spaces; a list for other spaces.

    Raises:
        ActionCountError: not one action per env.
        TypeError: not a batch, a per-env action not a dict (tuple) for a Dict
            (Tuple) space, or a dtype the space's cannot hold without changing
            values.
        KeyError: a per-env dict without a key of the space.
        ValueError: per-env actions of different shapes, a per-env tuple of
            the wrong length.
    """
    if isinstance(space, spaces.Dict) and isinstance(actions, dict):
        return actions  # gymnasium's batched form
    if (
        isinstance(space, spaces.Tuple)
        and isinstance(actions, tuple)
        and len(actions) == len(space.spaces)
    ):
        return actions  # gymnasium's batched form (also when len(space.spaces) == num_envs)
    try:
        count = len(actions)
    except TypeError:
        raise TypeError(
            f"actions must be a batch of one action per env (an array or a list), got {actions!r}"
        ) from None
    if count != num_envs:
        raise ActionCountError(f"got {count} actions for {num_envs} envs")
    return _stack_actions(space, actions, "")


def _stack_actions(space: spaces.Space, items: Any, path: str) -> Any:
    """Per-env actions ``items`` (one per env) stacked into ``space``'s batched form."""
    if isinstance(space, spaces.Dict):
        columns: dict[str, list] = {key: [] for key in space.spaces}
        for env, item in enumerate(items):
            if not isinstance(item, dict):
                raise TypeError(f"action{path} of env {env} is not a dict for {space}: {item!r}")
            for key, column in columns.items():
                if key not in item:
                    raise KeyError(f"action{path} of env {env} has no key {key!r} of {space}")
                column.append(item[key])
        return {
            key: _stack_actions(sub, columns[key], f"{path}[{key!r}]")
            for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        width = len(space.spaces)
        for env, item in enumerate(items):
            if not isinstance(item, (tuple, list, np.ndarray)):
                raise TypeError(f"action{path} of env {env} is not a tuple for {space}: {item!r}")
            if len(item) != width:
                raise ValueError(
                    f"action{path} of env {env} has {len(item)} entries, {space} has {width}"
                )
        return tuple(
            _stack_actions(sub, [item[j] for item in items], f"{path}[{j}]")
            for j, sub in enumerate(space.spaces)
        )
    if not isinstance(space, ARRAY_SPACES):
        return list(items)  # Text, Graph, ...: the ShmVectorEnv sends them pickled
    if type(items) is np.ndarray and items.dtype == space.dtype:
        return items
    try:
        array = np.asarray(items)
    except ValueError as error:
        raise ValueError(f"actions{path} of different shapes for {space}: {error}") from None
    if not np.can_cast(array.dtype, space.dtype, casting="same_kind"):
        # Floats for an integer space (SB3's VecEnvs pass them on as they are): shared
        # memory holds the space's dtype, so only a cast that keeps the values will do.
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cast = array.astype(space.dtype) if array.dtype != object else None
        if cast is None or not np.array_equal(cast, array):
            raise TypeError(
                f"actions{path} of dtype {array.dtype} do not fit the dtype {space.dtype} "
                f"of {space} without changing their values"
            )
        array = cast
    return array


# -------------------------------------------------------------------- adapter


class ShmSB3VecEnv(VecEnv):
    """A ShmVectorEnv as a Stable-Baselines3 ``VecEnv``.

    Args:
        env_fns: zero-argument env factories, or an already built gymnasium
            vector env (a ShmVectorEnv, possibly inside gymnasium vector
            wrappers) whose autoreset mode is ``AutoresetMode.SAME_STEP``.
        **kwargs: ShmVectorEnv arguments (``num_workers``, ``copy``, ``context``,
            ...) when ``env_fns`` are factories. ``autoreset_mode`` must be
            left out or be SAME_STEP, and ``batch_size`` must be left out: SB3
            steps every env each time.

    Attributes:
        shm_env: the gymnasium vector env underneath (a ShmVectorEnv, or the
            vector wrapper given).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | VectorEnv,
        **kwargs: Any,
    ) -> None:
        if isinstance(env_fns, VectorEnv):
            if kwargs:
                raise TypeError(
                    "ShmSB3VecEnv: ShmVectorEnv arguments "
                    f"({', '.join(sorted(kwargs))}) apply only when it is built from env_fns"
                )
            shm_env = env_fns
        else:
            mode = kwargs.pop("autoreset_mode", AutoresetMode.SAME_STEP)
            if AutoresetMode(mode) != AutoresetMode.SAME_STEP:
                raise ValueError(
                    "ShmSB3VecEnv needs autoreset_mode=AutoresetMode.SAME_STEP (SB3 resets "
                    f"a done env within the step), got {mode!r}"
                )
            if kwargs.get("batch_size") not in (None, len(env_fns)):
                raise ValueError("ShmSB3VecEnv steps every env: batch_size must be num_envs")
            shm_env = ShmVectorEnv(
                sb3_env_fns(env_fns), autoreset_mode=AutoresetMode.SAME_STEP, **kwargs
            )
        try:
            self._check_vector_env(shm_env)
            # A ShmVectorEnv, or a gymnasium vector wrapper around one: used by what
            # it has (step_async, call), as SB3 uses a VecEnv.
            self.shm_env: Any = shm_env
            # gymnasium's vector wrappers have no call/set_attr: those reach the sub-envs,
            # through the vector env inside.
            calls = shm_env if hasattr(shm_env, "call") else shm_env.unwrapped
            self._calls: Any = cast(Any, calls)  # duck-typed: call, set_attr
            self._closed = False
            self._actions: Any = None
            self._has_ops = bool(all(self._calls.call("has_wrapper_attr", OPS_ATTR)))
            super().__init__(
                shm_env.num_envs, shm_env.single_observation_space, shm_env.single_action_space
            )
        except BaseException:
            if not isinstance(env_fns, VectorEnv):
                shm_env.close()
            raise

    @staticmethod
    def _check_vector_env(env: VectorEnv) -> None:
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if mode != AutoresetMode.SAME_STEP:
            raise ValueError(
                "ShmSB3VecEnv needs a vector env with autoreset_mode=AutoresetMode.SAME_STEP "
                f"(SB3 resets a done env within the step); this one has {mode}"
            )
        if getattr(env.unwrapped, "is_async", False):
            raise ValueError("ShmSB3VecEnv steps every env: batch_size must be num_envs")

    # ------------------------------------------------------------ reset & step

    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """Seeds for the next ``reset()`` only: env ``i`` gets ``seed + i``.

        With ``seed=None`` a random base seed is drawn, as in SB3's VecEnvs, so
        that the envs still get distinct seeds. Returns the seeds.
        """
        return super().seed(seed)

    def reset(self) -> VecEnvObs:
        """Resets every env with the pending seeds and options; returns the observations."""
        # Read as DummyVecEnv does: too short a list of options is an IndexError.
        options = [self._options[i] or None for i in range(self.num_envs)]
        seeds = [self._seeds[i] for i in range(self.num_envs)]
        obs, infos = self.shm_env.reset(
            seed=None if all(s is None for s in seeds) else seeds,
            options=None if all(o is None for o in options) else options,
        )
        self.reset_infos = unbatch_infos(infos, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray | Sequence[Any]) -> None:
        """Starts a step (the ShmVectorEnv's ``step_async`` when it has one).

        ``actions``: a batched array or a list of one action per env (see
        ``batch_actions``), checked and stacked before anything reaches a worker.
        """
        actions = batch_actions(self.action_space, actions, self.num_envs)
        if hasattr(self.shm_env, "step_async"):
            self.shm_env.step_async(actions)
        else:  # a gymnasium vector wrapper: step in step_wait
            self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        """``(obs, rewards, dones, infos)`` in SB3's conventions (see the module doc)."""
        if hasattr(self.shm_env, "step_async"):
            obs, rewards, terminations, truncations, infos = self.shm_env.step_wait()
        else:
            actions, self._actions = self._actions, None
            obs, rewards, terminations, truncations, infos = self.shm_env.step(actions)
        terminations = np.asarray(terminations, dtype=bool)
        truncations = np.asarray(truncations, dtype=bool)
        dones = terminations | truncations
        infos = self._sb3_infos(infos, dones, terminations, truncations)
        return obs, np.asarray(rewards, dtype=np.float32), dones, infos

    def _sb3_infos(self, infos: dict, dones: np.ndarray, terminations, truncations) -> list[dict]:
        n = self.num_envs
        if dones.any():
            final_obs: Any = infos.get("final_obs")
            final_infos = unbatch_infos(infos.get("final_info", {}), n)
            infos = {k: v for k, v in infos.items() if k not in _FINAL_KEYS}
        per_env = unbatch_infos(infos, n)
        for i in np.flatnonzero(dones).tolist():
            # The top-level info of a done env is the reset's; the step's is final_info.
            self.reset_infos[i] = per_env[i]
            per_env[i] = final_infos[i]
            per_env[i]["terminal_observation"] = final_obs[i]
        time_limit = (truncations & ~terminations).tolist()
        for info, truncated in zip(per_env, time_limit):
            info["TimeLimit.truncated"] = truncated
        return per_env

    def close(self) -> None:
        """Closes the ShmVectorEnv (its workers and their envs); closing twice is fine."""
        if self._closed:
            return
        self._closed = True
        self.shm_env.close()

    # --------------------------------------------------------- attributes & co

    def _indices(self, indices: VecEnvIndices) -> list[int]:
        """``indices`` as env positions, read as a Python list reads indices (as SB3 does)."""
        envs = range(self.num_envs)
        try:
            return [envs[i] for i in self._get_indices(indices)]
        except IndexError:
            raise IndexError(
                f"env indices {indices!r} out of range for {self.num_envs} envs"
            ) from None

    def _ops(self, op: str, indices: list[int], *args: Any) -> list[Any]:
        """Runs ``op`` in the envs of ``indices`` (only those) through their ``_EnvOps``.

        An env named n times runs ``op`` n times, in n rounds, as in DummyVecEnv.
        """
        results: list[Any] = [None] * len(indices)
        pending = list(enumerate(indices))
        while pending:
            this_round: dict[int, int] = {}  # env -> position in results
            later = []
            for position, env in pending:
                if env in this_round:
                    later.append((position, env))
                else:
                    this_round[env] = position
            subset = None if len(this_round) == self.num_envs else frozenset(this_round)
            outputs = self._calls.call(OPS_ATTR, op, subset, *args)
            for env, position in this_round.items():
                results[position] = outputs[env]
            pending = later
        return results

    def has_attr(self, attr_name: str) -> bool:
        """Whether every env (or one of its wrappers) has ``attr_name``."""
        return bool(all(self._calls.call("has_wrapper_attr", attr_name)))

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """``env.get_wrapper_attr(attr_name)`` of each env of ``indices``, not called."""
        indices = self._indices(indices)
        if self._has_ops:
            return self._ops("get_attr", indices, attr_name)
        # get_wrapper_attr is itself a method: calling it by name reads the attribute.
        values = self._calls.call("get_wrapper_attr", attr_name)
        return [values[i] for i in indices]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """``setattr(env, attr_name, value)`` on each env of ``indices`` (the outermost wrapper)."""
        indices = self._indices(indices)
        if self._has_ops:
            self._ops("set_attr", indices, attr_name, value)
        elif indices == list(range(self.num_envs)):
            self._calls.call("__setattr__", attr_name, value)
        else:
            # Without _EnvOps the only per-env channel is set_attr, with one value per
            # env: the others get their current value back (a pickled copy of it).
            values = list(self._calls.call("get_wrapper_attr", attr_name))
            for i in indices:
                values[i] = value
            self._calls.set_attr(attr_name, values)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Calls ``method_name`` of each env of ``indices``; returns the results."""
        indices = self._indices(indices)
        if self._has_ops:
            return self._ops("env_method", indices, method_name, method_args, method_kwargs)
        if indices != list(range(self.num_envs)):
            warnings.warn(
                f"ShmSB3VecEnv.env_method({method_name!r}, indices=...): this vector env was "
                "not built from shmvec.sb3.sb3_env_fns, so the method runs in every env and "
                "only the requested results are kept",
                RuntimeWarning,
                stacklevel=2,
            )
        results = self._calls.call(method_name, *method_args, **method_kwargs)
        return [results[i] for i in indices]

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether each env of ``indices`` has a ``wrapper_class`` in its wrapper chain."""
        indices = self._indices(indices)
        if self._has_ops:
            return [bool(r) for r in self._ops("is_wrapped", indices, wrapper_class)]
        names = {cls.__name__ for cls in _subclasses(wrapper_class)}
        chains = self._calls.call("__str__")
        return [bool(names.intersection(_wrapper_names(chains[i]))) for i in indices]

    # --------------------------------------------------------------- rendering

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's ``render()`` (the envs must have ``render_mode="rgb_array"``)."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is "
                "`rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return list(self._calls.call("render"))

    def render(self, mode: str | None = None) -> np.ndarray | None:
        """SB3's rendering: the envs' images tiled into one (see ``VecEnv.render``)."""
        return super().render(mode=mode)


def _subclasses(cls: type) -> Iterable[type]:
    yield cls
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        yield from _subclasses(sub)


def _wrapper_names(chain: str) -> list[str]:
    """Class names along ``str(env)``: ``"<TimeLimit<OrderEnforcing<...>>>"``."""
    names = []
    while (match := re.match(r"<([A-Za-z_]\w*)", chain)) is not None:
        names.append(match.group(1))
        chain = chain[match.end() :]
    return names
