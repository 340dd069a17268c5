"""``shmvec.make_vec``: ``gymnasium.make_vec`` that builds a ShmVectorEnv."""

from __future__ import annotations

import copy
import functools
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
    if isinstance(id, str):
        env_spec = gym.spec(id)
    else:  # e.g. envs.spec of an earlier make_vec: take back what it recorded
        env_spec = copy.deepcopy(id)
        recorded = env_spec.kwargs.pop("num_envs", num_envs)
        num_envs = recorded if num_envs == 1 else num_envs
        env_spec.kwargs.pop("vectorization_mode", None)
        vector_kwargs = {**env_spec.kwargs.pop("vector_kwargs", {}), **(vector_kwargs or {})}
    wrappers = list(wrappers or [])

    def create_single_env() -> gym.Env:
        env = gym.make(env_spec, **kwargs)
        for wrapper in wrappers:
            env = wrapper(env)
        return env

    envs = ShmVectorEnv([create_single_env] * num_envs, **(vector_kwargs or {}))
    spec = copy.deepcopy(env_spec)
    spec.kwargs = {**spec.kwargs, **kwargs, "num_envs": num_envs, "vectorization_mode": "shmvec"}
    if vector_kwargs:
        spec.kwargs["vector_kwargs"] = dict(vector_kwargs)
    envs.unwrapped.spec = spec
    return envs


def make_mix(
    envs: dict[str | Callable[[], gym.Env], int],
    group_size: int = 1,
    **vector_kwargs: Any,
) -> ShmVectorEnv:
    """One vector env from several env types or configurations that share spaces.

    Args:
        envs: ``{env id or zero-argument env factory: how many}``, in the order
            the envs are laid out (env ids ``0 ..``).
        group_size: passed to ShmVectorEnv; every count must be a multiple of it,
            so that each group holds one env type.
        **vector_kwargs: keyword arguments of ShmVectorEnv.

    Returns:
        A ShmVectorEnv whose ``env_tags[i]`` names env ``i``'s type: the env id,
        or the factory's ``__name__``.

    Raises:
        ValueError: when two types' observation or action spaces differ (both are
            named), or a count is not a positive multiple of ``group_size``.

    Example:
        >>> import gymnasium as gym
        >>> import shmvec
        >>> def heavy_pole():
        ...     return gym.make("CartPole-v1", max_episode_steps=200)
        >>> envs = shmvec.make_mix({"CartPole-v1": 2, heavy_pole: 2}, num_workers=2)
        >>> envs.env_tags
        ['CartPole-v1', 'CartPole-v1', 'heavy_pole', 'heavy_pole']
        >>> envs.close()
    """
    if not envs:
        raise ValueError("make_mix needs at least one env type")
    env_fns, tags, first = [], [], None
    for kind, count in envs.items():
        tag = kind if isinstance(kind, str) else getattr(kind, "__name__", repr(kind))
        if not isinstance(count, int) or count < 1 or count % group_size:
            raise ValueError(
                f"make_mix: the count of {tag!r} must be a positive multiple of "
                f"group_size={group_size}, got {count!r}"
            )
        env_fn = functools.partial(gym.make, kind) if isinstance(kind, str) else kind
        probe = env_fn()
        spaces = (probe.observation_space, probe.action_space)
        probe.close()
        if first is None:
            first = (tag, spaces)
        else:
            for name, mine, theirs in zip(("observation", "action"), spaces, first[1]):
                if mine != theirs:
                    raise ValueError(
                        f"make_mix: {tag!r} has {name} space {mine}, but {first[0]!r} has "
                        f"{theirs}; every env type must share both spaces"
                    )
        env_fns += [env_fn] * count
        tags += [tag] * count
    vec = ShmVectorEnv(env_fns, group_size=group_size, **vector_kwargs)
    vec.env_tags = tags
    return vec
