"""Batches of the Ray vector envs on the driver: which actor blocks env ids name, and
actor (or agent) batches joined into one batch, or cut into rows, with gymnasium's infos.

Env ``i`` belongs to one actor's contiguous block (``split_blocks``). The driver
sends each actor its block's actions and joins the actors' batches in env order
(sync mode) or in the order they arrived (async mode); infos are merged with
gymnasium's own ``VectorEnv._add_info``. Nothing here needs Ray.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space

from shmvec.batching import ARRAY_SPACES, batch_infos, rows_with_info, take_rows, unbatch_info

__all__ = [
    "actor_batches",
    "actor_env_fns",
    "concatenate_batches",
    "idle_actors",
    "join_step_batches",
    "merge_infos",
    "select_step_rows",
]

#: A step batch as ``recv`` returns it: ``(obs, rewards, terminations, truncations, infos)``.
StepBatch = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


def actor_batches(batch_size: int, blocks: list[range]) -> int:
    """The number of actor batches one ``recv()`` returns."""
    num_envs = blocks[-1].stop
    if batch_size == num_envs:
        return len(blocks)
    if not 1 <= batch_size <= num_envs:
        raise ValueError(f"batch_size must be between 1 and num_envs={num_envs}, got {batch_size}")
    sizes = {len(rows) for rows in blocks}
    block = len(blocks[0])
    if len(sizes) != 1 or batch_size % block:
        raise ValueError(
            f"batch_size < num_envs needs equal actor blocks and a multiple of them: "
            f"blocks of {sorted(sizes)} envs, batch_size={batch_size}"
        )
    return batch_size // block


def idle_actors(ids: np.ndarray, blocks: list[range], busy: set, name: str) -> list[int]:
    """The actors whose whole blocks ``ids`` (checked env ids) names; none may be ``busy``."""
    named = np.zeros(blocks[-1].stop, dtype=bool)
    named[ids] = True
    actors = []
    for k, rows in enumerate(blocks):
        block = named[rows.start : rows.stop]
        if not block.any():
            continue
        if not block.all():
            raise ValueError(
                f"{name}() steps whole actor blocks: actor {k} owns envs "
                f"{rows.start}..{rows.stop - 1}, env_ids names only "
                f"{(np.flatnonzero(block) + rows.start).tolist()}"
            )
        if k in busy:
            raise ValueError(
                f"envs {rows.start}..{rows.stop - 1} (actor {k}) are not awaiting an "
                "action: their previous call is still running (recv() its result first)"
            )
        actors.append(k)
    return actors


def actor_env_fns(
    env_fns: Sequence[Callable[[], gym.Env]] | str,
    num_actors: int,
    envs_per_actor: int | None,
    env_kwargs: dict[str, Any],
) -> list[Callable[[], gym.Env]]:
    if not isinstance(num_actors, int) or num_actors < 1:
        raise ValueError(f"num_actors must be a positive int, got {num_actors!r}")
    if isinstance(env_fns, str):
        per_actor = 1 if envs_per_actor is None else envs_per_actor
        return [functools.partial(gym.make, env_fns, **env_kwargs)] * (num_actors * per_actor)
    env_fns = list(env_fns)
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] is not callable: {fn!r}")
    if len(env_fns) < num_actors:
        raise ValueError(f"{len(env_fns)} env_fns cannot fill {num_actors} actors")
    if envs_per_actor is not None and envs_per_actor * num_actors != len(env_fns):
        raise ValueError(
            f"envs_per_actor={envs_per_actor} x num_actors={num_actors} != {len(env_fns)} env_fns"
        )
    return env_fns


def concatenate_batches(space: gym.Space, batches: list) -> Any:
    """One batch from consecutive batches of ``space``: gymnasium's ``concatenate``,
    for batches instead of single values (fresh arrays at fixed-size leaves, tuples
    of per-env values elsewhere, as gymnasium batches them)."""
    if isinstance(space, spaces.Dict):
        return {
            key: concatenate_batches(sub, [b[key] for b in batches])
            for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        return tuple(
            concatenate_batches(sub, [b[i] for b in batches]) for i, sub in enumerate(space.spaces)
        )
    if isinstance(space, ARRAY_SPACES):
        return np.concatenate(batches)
    return tuple(value for batch in batches for value in batch)


def merge_infos(
    parts: list[tuple[int, dict]], blocks: list[range], rows: int, by_env: bool = True
) -> dict[str, Any]:
    """Merges the actors' batched infos with ``VectorEnv._add_info``.

    ``parts`` are ``(actor, infos)``; an actor's rows land at its env ids
    (``by_env``) or one after another in the order given.
    """
    items = []
    offset = 0
    for k, block in parts:
        first = blocks[k].start if by_env else offset
        offset += len(blocks[k])
        items += [(first + row, [unbatch_info(block, row)]) for row in rows_with_info(block)]
    return batch_infos(items, rows)


def join_step_batches(space: gym.Space, batches: list[StepBatch]) -> StepBatch:
    """Step batches, one after another, as one (infos merged with ``_add_info``)."""
    if len(batches) == 1:
        return batches[0]
    items, offset = [], 0
    for batch in batches:
        infos = batch[4]
        items += [(offset + row, [unbatch_info(infos, row)]) for row in rows_with_info(infos)]
        offset += len(batch[1])
    obs = concatenate_batches(space, [b[0] for b in batches])
    outcomes = (np.concatenate([b[i] for b in batches]) for i in (1, 2, 3))
    return (obs, *outcomes, batch_infos(items, offset))


def select_step_rows(space: gym.Space, batch: StepBatch, rows: np.ndarray) -> StepBatch:
    """Rows ``rows`` of a step batch, in that order (infos cut with their masks)."""
    obs, rewards, terminations, truncations, infos = batch
    with_info = set(rows_with_info(infos))
    items = [(i, [unbatch_info(infos, int(r))]) for i, r in enumerate(rows) if r in with_info]
    return (
        take_rows(space, obs, rows),
        rewards[rows],
        terminations[rows],
        truncations[rows],
        batch_infos(items, len(rows)),
    )


def take_spaces(envs: Any, described: dict[str, Any]) -> None:
    """Sets a Ray vector env's spaces, metadata and render mode from its first actor's
    description (``single_*_space``, ``metadata``, ``render_mode``)."""
    envs.single_observation_space = described["single_observation_space"]
    envs.single_action_space = described["single_action_space"]
    envs.observation_space = batch_space(envs.single_observation_space, envs.num_envs)
    envs.action_space = batch_space(envs.single_action_space, envs.num_envs)
    envs.metadata = {**described["metadata"], "autoreset_mode": envs.autoreset_mode}
    envs.render_mode = described["render_mode"]
