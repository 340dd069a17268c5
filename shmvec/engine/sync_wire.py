"""SyncWire: barrier rounds carry every command (``batch_size == num_envs``).

Data flow: ``RoundDriver`` posts each round (its payloads already sent) and
tells the wire (``posted``); the workers write their rows at their env ids
and arrive. A replacement for a dead worker starts at the round being
finished and redoes its block's part of it (``Worker.recover``): a STEP
round's envs report a truncated episode, a RESET round's envs the reset asked
for (sent again: ``resend``), any other round only resets them.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import time
from collections.abc import Set
from typing import Any

from shmvec.engine.pool import WorkerPool
from shmvec.engine.wire import Row
from shmvec.protocol import CALL, RESET, SLOT_MASK, STEP


class SyncWire:
    """The round a replacement recovers, and each worker's last reset.

    Args:
        pool: the workers.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.kind: int | None = None  # the kind of the round pending, if any
        self.arg = 0  # the last STEP or RESET round's arg: its slot and region
        self.resets: dict[int, Any] = {}  # per worker: its last reset's payload

    def posted(self, kind: int, arg: int) -> None:
        self.kind = kind
        if kind in (STEP, RESET):
            self.arg = arg

    def ended(self) -> None:
        self.kind = None

    def send_reset(self, index: int, payload: Any) -> None:
        self.resets[index] = payload
        self.pool.send(index, "reset", payload)

    def stuck_workers(self, round_started: float, env_timeout: float) -> list[int]:
        """The workers that have not finished a round posted ``env_timeout`` ago."""
        if time.monotonic() - round_started < env_timeout:
            return []
        pool = self.pool
        generation = pool.barrier.generation
        return [i for i in range(pool.num_workers) if pool.finished[i] != generation]

    def busy_workers(self, dead: Set[int]) -> list[int]:
        """None: the round's wait waits for the other workers."""
        return []

    def recovery(self, dead: Set[int], read: Set[Row]) -> dict[int, tuple]:
        """``(kind, arg)`` of the round pending, for each of ``dead``: STEP and
        RESET rounds with their arg; any other round (or none) as a CALL into
        the last round's slot."""
        if self.kind in (STEP, RESET):
            plan = (self.kind, self.arg)
        else:
            plan = (CALL, self.arg & SLOT_MASK)
        return dict.fromkeys(dead, plan)

    def resend(self, index: int) -> None:
        """A RESET round's replacement waits for that reset again."""
        if self.kind == RESET:
            self.pool.send(index, "reset", self.resets[index])

    def restarted(self, index: int) -> None:
        """Nothing: the replacement serves from the round's generation."""
