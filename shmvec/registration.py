"""``shmvec.make_vec``: ``gymnasium.make_vec`` that builds a ShmVectorEnv."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from shmvec.vector_env import ShmVectorEnv


def make_vec(
    id: str | EnvSpec,
    num_envs: int = 1,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Wrapper]] | None = None,
    **kwargs: Any,
) -> ShmVectorEnv:
    """Creates ``num_envs`` copies of a registered env in a ShmVectorEnv.

    Args:
        id: the registered env id (``"CartPole-v1"``) or its ``EnvSpec``.
        num_envs: how many envs.
        vector_kwargs: keyword arguments of ``ShmVectorEnv`` (``num_workers``,
            ``autoreset_mode``, ``copy``, ...).
        wrappers: wrappers applied, in order, to each single env.
        **kwargs: keyword arguments of ``gymnasium.make`` for each env.

    Example:
        >>> import shmvec
        >>> envs = shmvec.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"num_workers": 2})
        >>> envs.num_envs
        4
        >>> envs.close()
    """
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    env_spec = gym.spec(id) if isinstance(id, str) else id
    wrappers = list(wrappers or [])

    def create_single_env() -> gym.Env:
        env = gym.make(env_spec, **kwargs)
        for wrapper in wrappers:
            env = wrapper(env)
        return env

    envs = ShmVectorEnv([create_single_env] * num_envs, **(vector_kwargs or {}))
    spec = copy.deepcopy(env_spec)
    spec.kwargs = {**spec.kwargs, **kwargs, "num_envs": num_envs,
                   "vectorization_mode": "shmvec"}
    if vector_kwargs:
        spec.kwargs["vector_kwargs"] = dict(vector_kwargs)
    envs.unwrapped.spec = spec
    return envs
