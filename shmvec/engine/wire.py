"""Wire: what the rest of the engine asks of a wire protocol.

A wire protocol is how commands reach the workers and results come back, and
what a dead worker's replacement must restore: ``sync_wire.SyncWire``
(``batch_size == num_envs``) or ``async_wire.AsyncWire`` (``batch_size <
num_envs``), each described in its module. ``RoundDriver`` and ``Supervisor``
see only this protocol; each wire owns the state its recovery restores.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any, Protocol

#: A ring row: (slot, row).
Row = tuple[int, int]


class Wire(Protocol):
    """The calls the barrier rounds and the supervisor make on a wire protocol."""

    def posted(self, kind: int, arg: int) -> None:
        """A barrier round of ``kind`` (shmvec/protocol.py) with ``arg`` was
        posted: the wire notes it or wakes the workers sleeping elsewhere."""

    def ended(self) -> None:
        """No round is pending any more: a restart now recovers as for a call."""

    def send_reset(self, index: int, payload: Any) -> None:
        """Sends worker ``index`` a reset and keeps it for a replacement."""

    def stuck_workers(self, round_started: float, env_timeout: float) -> list[int]:
        """The workers past ``env_timeout`` (the round posted at
        ``round_started``, by ``time.monotonic()``, or the env they began)."""

    def busy_workers(self, dead: Set[int]) -> list[int]:
        """The workers, not in ``dead``, that must finish what they were given
        before the replacements of ``dead`` are planned (none in sync mode)."""

    def recovery(self, dead: Set[int], read: Set[Row]) -> dict[int, tuple]:
        """``WorkerSpec.recover`` for the replacement of each worker in ``dead``
        (all of them dead at once): what it must deliver first. ``read``: the
        rows whose messages main has."""

    def resend(self, index: int) -> None:
        """Sends worker ``index``'s replacement what it waits for before it is ready."""

    def restarted(self, index: int) -> None:
        """Worker ``index``'s replacement is ready: lets it serve."""
