"""The seam between a ShmVectorEnv and a device bridge (shmvec.torch).

A bridge reads results straight out of the ring slots and writes actions into
the action slab; ``ResultHandoff`` gives it exactly those, and a hook before a
slot is reused, and nothing else of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shmvec.engine.async_engine import AsyncEngine
from shmvec.engine.pool import WorkerPool
from shmvec.engine.rounds import RoundDriver
from shmvec.layout import SlotViews

__all__ = ["ResultHandoff"]


class ResultHandoff:
    """A ShmVectorEnv's results and action slab, for a device bridge.

    Results rotate through ``num_slots`` ring slots; ``on_slot_reuse(hook)``
    has ``hook(slot)`` called before workers may overwrite a slot, so a bridge
    can wait there for its device copy out of it. Call it from the thread that
    steps the vector env.
    """

    def __init__(
        self,
        pool: WorkerPool,
        rounds: RoundDriver,
        async_engine: AsyncEngine | None,
        action_slab: np.ndarray | None,
        step_written: Callable[[], tuple[Any, ...]],
    ) -> None:
        self._pool, self._rounds, self._async = pool, rounds, async_engine
        self._action_slab, self._step_written = action_slab, step_written
        assert pool.segment is not None, "the workers are up"
        # What a bridge pins: the segment up to the lease regions, which a
        # bridge does not use (it reads ring slots with copy=False).
        self.region: tuple[int, int] = (pool.segment.address, pool.layout.ring_end)
        self.num_slots: int = len(pool.slots)

    @property
    def last_slot(self) -> int:
        """The ring slot that the last ``step``/``reset``/``recv`` returned."""
        if self._async is None:
            return self._rounds.slot
        held = self._async.held_slot
        if held is None:
            raise RuntimeError("no result to read yet: recv() first")
        return held

    def slot_views(self, slot: int) -> SlotViews:
        """The arrays of ring slot ``slot``."""
        return self._pool.slots[slot]

    def on_slot_reuse(self, hook: Callable[[int], None]) -> None:
        """Has ``hook(slot)`` called before workers may overwrite ring slot ``slot``."""
        self._rounds.before_slot_reuse = hook

    def action_slab(self) -> np.ndarray | None:
        """The action slab when actions are one array column, else None: write a
        batch there and call ``step_written``."""
        return self._action_slab

    def step_written(self) -> tuple[Any, ...]:
        """``step`` with the actions already written into ``action_slab()``."""
        return self._step_written()
