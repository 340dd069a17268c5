"""Supervisor: liveness while the main process waits, timeouts, and restarts.

Every wait of the main process (a round's end, an async batch) goes through
``wait_for``, which checks between futex waits that every worker lives.
``env_timeout`` kills a worker stuck past it (its death is then reported,
naming the env); ``replace_dead`` brings dead workers back under
``on_worker_death="restart"``: every worker dead once the live ones are idle,
together, and again any replacement that dies before it is ready. What a
replacement restores is the wire's business (engine/wire.py): the supervisor
only asks it.

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
from shmvec.errors import WorkerDiedError, add_note
from shmvec.protocol import LIVENESS_CHECK_S

logger = logging.getLogger("shmvec")

#: A worker whose replacements die this many times in a row before they are
#: ready (an env that kills its process while it is built or reset) is not
#: restarted again: its death is raised.
MAX_UNREADY_DEATHS = 3


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
        self.unready_deaths: dict[int, int] = {}  # worker -> replacements died unready in a row

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

    def replace_dead(self, dead: int, read: Set[Row] = frozenset()) -> dict[int, dict]:
        """``on_worker_death="restart"``: replaces dead worker ``dead`` and every
        other worker dead by the time the live ones are idle, all at once; the
        wire says what each replacement must deliver first (``Wire.recovery``;
        ``read``: the ring rows whose messages main already has). A replacement
        that dies before it is ready is replaced in turn, up to
        ``MAX_UNREADY_DEATHS`` times in a row. Returns the replacements' ready
        messages by worker."""
        pool, wire = self.pool, self.wire
        ready: dict[int, dict] = {}
        todo = {dead}
        while todo:
            todo = self._settle(todo)
            for index in todo:
                pool.workers[index].join(1.0)
                pool.drain(index)  # its row messages outlive it
            plans = wire.recovery(todo, read)
            for index in sorted(todo):
                pool.replace(
                    index,
                    generation=pool.barrier.generation,
                    recover=plans[index],
                    info_schema=dict(self.decoder.schemas[index]),
                )
                wire.resend(index)
                self.stats.restarts += 1  # a death recovered, whether or not its replacement lives
            todo = set()
            given_up: WorkerDiedError | None = None
            for index in sorted(plans):  # every one, so that no ready message is left unread
                try:
                    ready[index] = pool.expect_ready(
                        index, f"while restarting shmvec worker {index};"
                    )
                except WorkerDiedError as error:
                    if self._died_unready(index, error):
                        todo.add(index)
                    else:
                        given_up = given_up or error
                    continue
                self.unready_deaths.pop(index, None)
                wire.restarted(index)
                rows = pool.blocks[index]
                logger.warning(
                    "restarted worker %d (pid %d) for envs %d..%d",
                    index, pool.workers[index].pid, rows.start, rows.stop - 1,
                )  # fmt: skip
            if given_up is not None:
                raise given_up
        return ready

    def _settle(self, dead: set[int]) -> set[int]:
        """Waits until every live worker has finished all it was given (the
        wire's ``busy_workers``), reading their pipes so that none blocks on a
        full one and killing any past ``env_timeout``. Returns ``dead`` and the
        workers found dead meanwhile."""
        pool = self.pool
        while True:
            pool.run_main_worker()
            dead |= pool.dead_workers()
            busy = self.wire.busy_workers(dead)
            if not busy:
                return dead
            self.kill_stuck_workers(0.0, dead)
            for index in busy:
                pool.drain(index)
            time.sleep(0.0002)

    def _died_unready(self, index: int, error: WorkerDiedError) -> bool:
        """Counts a replacement of worker ``index`` that died before it was ready:
        True to replace it again; False (and a note on ``error``) once that
        happened ``MAX_UNREADY_DEATHS`` times in a row."""
        deaths = self.unready_deaths[index] = self.unready_deaths.get(index, 0) + 1
        if deaths >= MAX_UNREADY_DEATHS:
            add_note(
                error,
                f"its last {deaths} replacements died before they were ready (while "
                "building and resetting their envs): shmvec does not restart it again",
            )
            return False
        logger.warning("worker %d's replacement died before it was ready; replacing it", index)
        return True
