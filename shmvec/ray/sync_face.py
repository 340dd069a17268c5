"""The step API of a ClusterVectorEnv with ``batch_size == num_envs`` (``StepAPI``):
``reset`` and ``step`` over its async ``async_reset``/``send``/``recv``, each env's row
put back in env order (``SyncFace``), with ``SyncVectorEnv``'s results (seeds
``seed + i``, ``reset_mask``, the three autoreset modes, infos without ``env_id``).
Nothing here needs Ray.

Who may call what: the driver's thread, through the vector env's methods.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import create_empty_array

from shmvec.batching import (
    Options,
    Seeds,
    VectorEnvBase,
    batch_infos,
    check_reset_mask,
    take_reset_mask,
)
from shmvec.row_infos import RowInfos

__all__ = ["StepAPI", "SyncFace"]


class SyncFace:
    """Puts a cluster's rows back in env order; keeps each env's last observation (an env
    that ``reset_mask`` leaves out keeps it, as ``SyncVectorEnv``'s does)."""

    def __init__(self, space: gym.Space, num_envs: int) -> None:
        self.space, self.num_envs = space, num_envs
        self.obs: Any = create_empty_array(space, num_envs, fn=np.zeros)

    def collect(self, envs: Any, timeout: float | None) -> tuple:
        """The row of every env with a command in flight, in env order: ``(obs, rewards,
        terminations, truncations, infos)`` over all envs (an env without one keeps its
        last observation, zeros elsewhere), and the infos row by row (``RowInfos``)."""
        n = self.num_envs
        rewards, terms, truncs = np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        obs, reward, term, trunc, infos = envs._recv(timeout, True, False)  # all in flight
        rows, ids = envs.row_infos(), infos["env_id"]
        self.obs = _put_rows(self.space, self.obs, ids, obs)
        rewards[ids], terms[ids], truncs[ids] = reward, term, trunc
        items = sorted(
            (int(env), [info]) for i, env in enumerate(ids.tolist()) if (info := rows.info(i))
        )
        batched = batch_infos(items, n)
        return (_copy(self.space, self.obs), rewards, terms, truncs, batched), RowInfos(
            batched, items
        )


def _put_rows(space: gym.Space, batch: Any, ids: np.ndarray, rows: Any) -> Any:
    """``batch`` with rows ``ids`` replaced by ``rows`` (arrays in place; tuples rebuilt)."""
    if isinstance(space, gym.spaces.Dict):
        return {k: _put_rows(sub, batch[k], ids, rows[k]) for k, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_put_rows(sub, batch[i], ids, rows[i]) for i, sub in enumerate(space.spaces))
    if isinstance(batch, np.ndarray):
        batch[ids] = rows
        return batch
    out = list(batch)
    for i, env in enumerate(ids.tolist()):
        out[env] = rows[i]
    return tuple(out)


def _copy(space: gym.Space, batch: Any) -> Any:
    """A fresh batch: the caller may keep or change it."""
    if isinstance(space, gym.spaces.Dict):
        return {k: _copy(sub, batch[k]) for k, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_copy(sub, batch[i]) for i, sub in enumerate(space.spaces))
    return batch.copy() if isinstance(batch, np.ndarray) else tuple(batch)


class StepAPI(VectorEnvBase):
    """gymnasium's step API for a ClusterVectorEnv in sync mode: ``reset_async``,
    ``reset_wait``, ``step_async``, ``step_wait`` and ``step`` over its ``_async_reset``,
    ``_send`` and ``_recv``, with its ``_sync`` (a ``SyncFace``) putting rows in order."""

    _sync: SyncFace
    _row_infos: RowInfos | None

    def reset_async(
        self, seed: Seeds = None, options: Options = None, reset_mask: np.ndarray | None = None
    ) -> None:
        """Resets every env, or those of the reset mask (``options["reset_mask"]`` too)."""
        self._assert_is_running()
        self._assert_sync("reset_async")
        self._assert_idle("reset_async", "")
        mask = take_reset_mask(options, reset_mask)
        ids = np.flatnonzero(check_reset_mask(mask, self.num_envs)) if mask is not None else None
        self._async_reset(seed, options, ids)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        self._assert_waiting(AsyncState.WAITING_RESET, "reset_wait", "reset_async")
        (obs, _, _, _, infos), self._row_infos = self._sync.collect(self, timeout)
        self._state = AsyncState.DEFAULT
        return obs, infos

    def step_async(self, actions: Any) -> None:
        self._assert_is_running()
        self._assert_sync("step_async")
        self._assert_idle("step_async")
        self._send(actions, np.arange(self.num_envs))
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._assert_waiting(AsyncState.WAITING_STEP, "step_wait", "step_async")
        result, self._row_infos = self._sync.collect(self, timeout)
        self._state = AsyncState.DEFAULT
        return result

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Steps every env; ``SyncVectorEnv.step``'s results."""
        self.step_async(actions)
        return self.step_wait()
