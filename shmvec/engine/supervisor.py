"""Supervisor: liveness while the main process waits, timeouts, and restarts.

Every wait of the main process (a round's end, an async batch) goes through
``wait_for``, which checks between futex waits that every worker lives.
``env_timeout`` kills a worker stuck past it (its death is then reported,
naming the env); ``replace_worker`` brings a dead worker back under
``on_worker_death="restart"``, in sync and async mode alike.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.pool import WorkerPool
from shmvec.engine.stats import Stats
from shmvec.protocol import CALL, LIVENESS_CHECK_S, RESET, STEP

if TYPE_CHECKING:
    from shmvec.engine.async_engine import AsyncEngine
    from shmvec.engine.rounds import RoundDriver

logger = logging.getLogger("shmvec")


class Supervisor:
    """Watches a pool's workers.

    Args:
        pool: the workers.
        decoder: keeps each worker's info schema for its replacement.
        stats: counts the wait and the restarts.
        main_spin_ns: how long the main process spins before it sleeps.
        env_timeout: seconds a worker may take (None: no limit).
        restart_on_death: ``on_worker_death="restart"``.
    """

    def __init__(
        self,
        pool: WorkerPool,
        decoder: ResultDecoder,
        stats: Stats,
        main_spin_ns: int,
        env_timeout: float | None,
        restart_on_death: bool,
    ) -> None:
        self.pool = pool
        self.decoder = decoder
        self.stats = stats
        self.main_spin_ns = main_spin_ns
        self.env_timeout = env_timeout
        self.restart_on_death = restart_on_death
        self.async_engine: AsyncEngine | None = None  # set by the async engine

    def wait_for(
        self, ready: Callable[[int, int], bool], timeout: float | None, why: Callable[[], str]
    ) -> None:
        """Calls ``ready(spin_ns, budget_ns)`` (a futex wait) until it returns True,
        checking between calls that every worker lives; ``multiprocessing.TimeoutError``
        with ``why()`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = time.perf_counter()
        try:
            while True:
                budget = LIVENESS_CHECK_S
                if deadline is not None:
                    budget = min(budget, max(deadline - time.monotonic(), 0.0))
                if ready(self.main_spin_ns, int(budget * 1e9)):
                    return
                self.pool.check_all_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    raise multiprocessing.TimeoutError(why())
        finally:
            self.stats.wait_s += time.perf_counter() - waited

    def unfinished_workers(self) -> str:
        """The workers that have not finished the current round, and their env."""
        pool = self.pool
        generation = pool.barrier.generation
        late = []
        for index, rows in enumerate(pool.blocks):
            if pool.finished[index] != generation:
                current = pool.current_env[index]
                where = f", in env {current - 1}" if current else ""
                late.append(f"worker {index} (envs {rows.start}..{rows.stop - 1}{where})")
        return ", ".join(late) or "none (they finished as the wait ended)"

    def finished_except(self, restarted: dict, budget_ns: int) -> bool:
        """True once every worker but the ``restarted`` ones finished this round."""
        finished = self.pool.finished
        generation = self.pool.barrier.generation
        others = [i for i in range(self.pool.num_workers) if i not in restarted]
        deadline = time.monotonic() + budget_ns / 1e9
        while not all(finished[i] == generation for i in others):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)  # a round with a restart: no need for a futex
        return True

    def kill_stuck_workers(self, round_started: float, spared=()) -> None:
        """``env_timeout``: kills the workers past it: in sync mode those still in
        the round posted at ``round_started``, in async mode those still in the
        env they began."""
        if self.env_timeout is None:
            return
        pool = self.pool
        current = pool.current_env
        workers = range(pool.num_workers)
        if self.async_engine is not None:
            started = pool.env_started_ns
            limit_ns = time.monotonic_ns() - int(self.env_timeout * 1e9)
            late = [i for i in workers if current[i] and started[i] < limit_ns]
        elif time.monotonic() - round_started >= self.env_timeout:
            generation = pool.barrier.generation
            late = [i for i in workers if pool.finished[i] != generation]
        else:
            return
        for index in late:
            process = pool.workers[index]
            if index in spared or process is pool.main_worker or process.exitcode is not None:
                continue
            where = f"env {current[index] - 1}" if current[index] else "its envs"
            limit = self.env_timeout
            why = f"killed by shmvec: stuck in {where} for more than env_timeout={limit} s"
            pool.kill(index, why)

    def replace_worker(
        self, index: int, rounds: RoundDriver, read: frozenset | set = frozenset()
    ) -> None:
        """``on_worker_death="restart"``: replaces dead worker ``index``.

        Sync mode: the replacement recovers the round being finished
        (``Worker.recover``). Async mode: each of its envs still running
        delivers exactly one result (``AsyncEngine.recovery_plan``); ``read``
        are the (slot, row)s whose messages main already has.
        """
        pool, engine = self.pool, self.async_engine
        rows = pool.blocks[index]
        if engine is not None:
            pool.workers[index].join(1.0)
            pool.drain(index)  # its row messages outlive it
            engine.quiesce(index)
            recover = ("async", engine.recovery_plan(index, read))
            kind = None
        else:
            kind = rounds.kind if rounds.kind in (STEP, RESET) else CALL
            recover = (kind, rounds.arg if kind in (STEP, RESET) else rounds.slot)
        pool.replace(
            index,
            generation=pool.barrier.generation,
            recover=recover,
            info_schema=dict(self.decoder.schemas[index]),
        )
        if engine is not None:
            engine.resend_resets(index)
        elif kind == RESET:
            pool.send(index, "reset", rounds.reset_payloads[index])
            if rounds.reset_mask is not None:  # its envs are all new: none keeps its obs
                rounds.reset_mask[rows.start : rows.stop] = True
        message = pool.expect_ready(index, f"while restarting shmvec worker {index};")
        if engine is not None:
            engine.doorbells[index].ring()
        else:
            rounds.recovered[index] = message.get("recovered", {})
        self.stats.restarts += 1
        logger.warning(
            "restarted worker %d (pid %d) for envs %d..%d",
            index, pool.workers[index].pid, rows.start, rows.stop - 1,
        )  # fmt: skip
