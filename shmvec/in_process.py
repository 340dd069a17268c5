"""A worker in the main process: ``num_workers=0`` or ``step_in_main``.

The main process steps worker 0's block itself whenever it waits for a round
(``InProcessWorker.poll``), through the same ``shmvec.worker.Worker`` as a
worker process; messages go through a ``LoopbackPipe`` instead of a pipe.
"""

from __future__ import annotations

import os
import pickle
from collections import deque

from shmvec.worker import Worker, WorkerSpec, make_envs


class LoopbackPipe:
    """One end of an in-process pipe: what is sent lands in the other end's inbox."""

    def __init__(self, inbox: deque, outbox: deque) -> None:
        self.inbox, self.outbox = inbox, outbox

    @classmethod
    def pair(cls) -> tuple[LoopbackPipe, LoopbackPipe]:
        a: deque[bytes] = deque()
        b: deque[bytes] = deque()
        return cls(a, b), cls(b, a)

    def send_bytes(self, data: bytes) -> None:
        self.outbox.append(bytes(data))

    def recv_bytes(self) -> bytes:
        return self.inbox.popleft()  # the peer always sends before it asks

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self.inbox)

    def close(self) -> None:
        pass


class InProcessWorker:
    """``num_workers=0`` or ``step_in_main``: worker 0 runs in the main process,
    which steps its envs when it waits for a round (``poll``). It stands in for the
    ``multiprocessing.Process`` (``pid``, ``exitcode``, ``join``...), so the
    main process's code is the same, and a breakpoint inside ``env.step`` works.
    """

    def __init__(self, spec: WorkerSpec, segment, pipe: LoopbackPipe) -> None:
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self.worker = Worker(spec, segment, pipe, make_envs(spec))
        pipe.send_bytes(pickle.dumps({"ready": self.pid}))

    def poll(self) -> None:
        """Does whatever the main process has asked for and not had done yet."""
        if self.exitcode is None and not self.worker.wire.poll_now():
            self.exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self.exitcode is None:
            self.worker.close()
            self.exitcode = 0
