"""Where each env of a ClusterVectorEnv stands (in flight, answered, reset, stale, in an
episode), and the rows its agents sent that ``recv`` has not returned yet. Nothing here
needs Ray.

An env is *stale* once its agent was lost or drained, or it was answered with a
``node_lost`` row: only a reset, on a live agent, routes it again. A stale env is *told*
once a ``node_lost`` row said so; under an autoreset mode its next step on a live agent is
then its reset (as the step after any truncation is), not another ``node_lost`` row.
"""

from __future__ import annotations

from collections import deque

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import create_empty_array

from shmvec.ray.agent import NODE_LOST
from shmvec.ray.blocks import StepBatch, join_step_batches, select_step_rows
from shmvec.ray.members import SlotState

__all__ = ["EnvStates", "ReadyRows"]


class ReadyRows:
    """The rows the agents sent that ``recv`` has not returned yet, in arrival order, with
    each row's info as its env returned it (None for a part whose rows have none). The
    batches carry no infos: ``recv`` batches them from the rows' own."""

    def __init__(self, space: gym.Space) -> None:
        self.space = space
        # (batch, global env ids, row infos or None)
        self.batches: deque[tuple[StepBatch, np.ndarray, list[dict] | None]] = deque()
        self.count = 0

    def add(self, batch: StepBatch, env_ids: np.ndarray, infos: list[dict] | None) -> None:
        self.batches.append((batch, env_ids, infos))
        self.count += len(env_ids)

    def take(self, need: int) -> tuple[StepBatch, np.ndarray, list[dict] | None]:
        """The first ``need`` rows (fewer if fewer are in), their env ids and infos."""
        batches, id_parts, info_parts, taken = [], [], [], 0
        while self.batches and taken < need:
            batch, ids, infos = self.batches.popleft()
            if taken + len(ids) > need:
                cut, rows = need - taken, np.arange(len(ids))
                rest = select_step_rows(self.space, batch, rows[cut:])
                self.batches.appendleft((rest, ids[cut:], None if infos is None else infos[cut:]))
                batch, ids = select_step_rows(self.space, batch, rows[:cut]), ids[:cut]
                infos = None if infos is None else infos[:cut]
            batches.append(batch)
            id_parts.append(ids)
            info_parts.append(infos)
            taken += len(ids)
        self.count -= taken
        row_infos = None
        if any(part is not None for part in info_parts):
            row_infos = [
                info
                for part, ids in zip(info_parts, id_parts)
                for info in (part if part is not None else [{}] * len(ids))
            ]
        return join_step_batches(self.space, batches), np.concatenate(id_parts), row_infos


class EnvStates:
    """The per-env state of ``num_envs`` envs; ``rows`` once the spaces are known."""

    def __init__(self, num_envs: int) -> None:
        self.in_flight = np.zeros(num_envs, dtype=bool)  # command sent, row not returned
        self.answered = np.zeros(num_envs, dtype=bool)  # its row is buffered
        self.was_reset = np.zeros(num_envs, dtype=bool)  # reset on its current agent
        self.stale = np.zeros(num_envs, dtype=bool)
        self.told = np.zeros(num_envs, dtype=bool)  # a node_lost row said it is stale
        self.open = np.zeros(num_envs, dtype=bool)  # in an episode: a drained agent lets it end
        self.rows: ReadyRows | None = None

    def start(self, ids: np.ndarray) -> None:
        """Checks that ``ids`` await a command; marks them in flight."""
        busy = ids[self.in_flight[ids]]
        if len(busy):
            raise ValueError(
                f"envs {busy.tolist()} are not awaiting a command: their previous one is still "
                "running (recv() its result first)"
            )
        self.in_flight[ids] = True

    def assert_idle(self, name: str) -> None:
        if self.in_flight.any():
            running = np.flatnonzero(self.in_flight).tolist()
            raise RuntimeError(f"{name}() while envs {running} run: recv() their results first")

    def never_reset(self, ids: np.ndarray) -> np.ndarray:
        return ids[~self.was_reset[ids] & ~self.stale[ids]]

    def refused(
        self, ids: np.ndarray, reset: bool, state: SlotState, autoreset: bool
    ) -> np.ndarray:
        """Which of ``ids`` (one agent's, in ``state``) cannot take the command: none live,
        a step to a stale env (but a told one under ``autoreset``: ``restarts``), a new
        episode on a draining agent."""
        if state is SlotState.LIVE:
            if reset:
                return np.zeros(len(ids), dtype=bool)
            return self.stale[ids] & ~(self.told[ids] & autoreset)
        if state is SlotState.DRAINING:
            return ~self.open[ids] | self.stale[ids]
        return np.ones(len(ids), dtype=bool)

    def restarts(self, ids: np.ndarray, state: SlotState, autoreset: bool) -> np.ndarray:
        """Which of ``ids``, sent a step, are reset instead (told, stale, on a live agent,
        under an autoreset mode)."""
        if state is not SlotState.LIVE or not autoreset:
            return np.zeros(len(ids), dtype=bool)
        return self.stale[ids] & self.told[ids]

    def routed(self, ids: np.ndarray, reset: bool) -> None:
        if reset:
            self.was_reset[ids], self.stale[ids], self.open[ids] = True, False, True
            self.told[ids] = False

    def rows_in(self, batch: StepBatch, ids: np.ndarray, infos: list[dict] | None) -> None:
        """An agent's rows of envs ``ids`` (global), and their infos."""
        assert self.rows is not None
        self.answered[ids] = True
        self.open[ids] = ~(batch[2] | batch[3])
        self.rows.add(batch, ids, infos)

    def lost_rows(self, ids: np.ndarray, reason: str) -> None:
        """Buffers a ``node_lost`` row (truncated, zero observation) for each env of ``ids``."""
        assert self.rows is not None
        n = len(ids)
        obs = create_empty_array(self.rows.space, n, fn=np.zeros)
        batch: StepBatch = (obs, np.zeros(n), np.zeros(n, dtype=bool), np.ones(n, dtype=bool), {})
        self.answered[ids] = True
        self.open[ids], self.stale[ids], self.told[ids] = False, True, True
        self.rows.add(batch, ids, [{NODE_LOST: reason} for _ in range(n)])

    def running(self, ids: np.ndarray) -> np.ndarray:
        """Those of ``ids`` whose command runs on their agent (no row buffered yet)."""
        return ids[self.in_flight[ids] & ~self.answered[ids]]

    def lose(self, ids: np.ndarray, reason: str) -> None:
        """Their agent is gone: the running ones get ``node_lost`` rows; all are stale."""
        running = self.running(ids)
        idle = ids[~np.isin(ids, running)]
        self.stale[idle], self.told[idle], self.open[idle] = True, False, False
        if len(running):
            self.lost_rows(running, reason)

    def busy(self, ids: np.ndarray) -> bool:
        """Whether any of ``ids`` is in an episode or runs a command."""
        return bool(self.open[ids].any() or len(self.running(ids)))

    def take(self, need: int) -> tuple[StepBatch, np.ndarray, list[dict] | None]:
        assert self.rows is not None
        batch, env_ids, infos = self.rows.take(need)
        self.in_flight[env_ids] = False
        self.answered[env_ids] = False
        return batch, env_ids, infos
