"""Supervisor: liveness while the main process waits, timeouts, and restarts.

Every wait of the main process (a round's end, an async batch) goes through
``wait_for``, which checks between futex waits that every worker lives.
``env_timeout`` kills a worker stuck past it (its death is then reported,
naming the env); ``replace_worker`` brings a dead worker back under
``on_worker_death="restart"``. What a replacement restores is the wire's
business (engine/wire.py): the supervisor only asks it.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Set

from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.pool import WorkerPool
from shmvec.engine.stats import Stats
from shmvec.engine.wire import Row, Wire
from shmvec.protocol import LIVENESS_CHECK_S

logger = logging.getLogger("shmvec")


class Supervisor:
    """Watches a pool's workers.

    Args:
        pool: the workers.
        decoder: keeps each worker's info schema for its replacement.
        stats: counts the wait and the restarts.
        wire: the wire protocol, which says who is stuck and what a
            replacement restores.
        env_timeout: seconds a worker may take (None: no limit).
        restart_on_death: ``on_worker_death="restart"``.
    """

    def __init__(
        self,
        pool: WorkerPool,
        decoder: ResultDecoder,
        stats: Stats,
        wire: Wire,
        env_timeout: float | None,
        restart_on_death: bool,
    ) -> None:
        self.pool = pool
        self.decoder = decoder
        self.stats = stats
        self.wire = wire
        self.env_timeout = env_timeout
        self.restart_on_death = restart_on_death

    def wait_for(
        self, ready: Callable[[int], bool], timeout: float | None, why: Callable[[], str]
    ) -> None:
        """Calls ``ready(budget_ns)`` (a futex wait) until it returns True,
        checking between calls that every worker lives; ``multiprocessing.TimeoutError``
        with ``why()`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = time.perf_counter()
        try:
            while True:
                budget = LIVENESS_CHECK_S
                if deadline is not None:
                    budget = min(budget, max(deadline - time.monotonic(), 0.0))
                if ready(int(budget * 1e9)):
                    return
                self.pool.check_all_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    raise multiprocessing.TimeoutError(why())
        finally:
            self.stats.wait_s += time.perf_counter() - waited

    def kill_stuck_workers(self, round_started: float, spared: Set[int] = frozenset()) -> None:
        """``env_timeout``: kills the workers the wire finds past it (those still
        in the round posted at ``round_started``, or in the env they began),
        but not ``spared`` ones nor the main process."""
        if self.env_timeout is None:
            return
        pool = self.pool
        current = pool.current_env
        for index in self.wire.stuck_workers(round_started, self.env_timeout):
            process = pool.workers[index]
            if index in spared or process is pool.main_worker or process.exitcode is not None:
                continue
            where = f"env {current[index] - 1}" if current[index] else "its envs"
            limit = self.env_timeout
            why = f"killed by shmvec: stuck in {where} for more than env_timeout={limit} s"
            pool.kill(index, why)

    def replace_worker(self, dead: int, read: Set[Row] = frozenset()) -> dict:
        """``on_worker_death="restart"``: replaces dead worker ``dead``; the wire
        says what the replacement must deliver first (``Wire.recovery``;
        ``read``: the ring rows whose messages main already has). Returns the
        replacement's ready message."""
        pool, wire = self.pool, self.wire
        recover = wire.recovery(dead, read)
        pool.replace(
            dead,
            generation=pool.barrier.generation,
            recover=recover,
            info_schema=dict(self.decoder.schemas[dead]),
        )
        wire.resend(dead)
        message = pool.expect_ready(dead, f"while restarting shmvec worker {dead};")
        wire.restarted(dead)
        self.stats.restarts += 1
        rows = pool.blocks[dead]
        logger.warning(
            "restarted worker %d (pid %d) for envs %d..%d",
            dead, pool.workers[dead].pid, rows.start, rows.stop - 1,
        )  # fmt: skip
        return message
