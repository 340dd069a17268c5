"""AsyncEngine: EnvPool-style rollouts with no barrier between envs.

Data flow (``batch_size < num_envs``): ``send``'s envs get their commands
over the ``AsyncWire`` (engine/async_wire.py); ``recv`` waits until a ring
slot's ``batch_size`` rows are published, reads their messages and hands the
slot back on the next ``recv``. ``recv(partial=True)`` with fewer envs running
waits for all of them instead: their rows are the first of the slot, and the
rest is padding (``AsyncWire.pad``) that never reaches the caller.
``recv(take_ready=True)`` whose timeout passes with some rows claimed closes
the slot (``AsyncWire.close``) and returns those rows. Each env's
trajectory is the one it would have alone with the same seed and actions; only
the order in which envs come back varies.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from typing import Any

import numpy as np

from shmvec import _worker_loop
from shmvec.batching import check_env_ids
from shmvec.engine.async_wire import AsyncWire
from shmvec.engine.decoder import ResultDecoder, raise_errors
from shmvec.engine.pool import WorkerPool
from shmvec.engine.rounds import RoundDriver
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.errors import WorkerDiedError
from shmvec.protocol import ENV_RESET, LIVENESS_CHECK_NS, LIVENESS_CHECK_S

#: The batch's waker yields its core to main after turns main blocked in, on a CPU < this share.
HANDOFF_MAX_CPU_SHARE = 0.5  # measurements: docs/design/heuristics.md, "Async core-yield"
HANDOFF_SAMPLE = 8  # main measures one turn in this many (two getrusage calls)
#: The running envs a ``recv`` timeout names (with a count of the rest).
SHOWN_ENVS = 16


class AsyncEngine:
    """The async API (``async_reset``, ``send``, ``recv``) of one vector env.

    Args:
        wire: the ring, doorbells and env commands.
        pool: the workers.
        supervisor: liveness, timeouts, restarts.
        decoder: turns ring rows into results.
        stats: counts results.
        rounds: the barrier rounds, whose ``before_slot_reuse`` hook runs
            before a ring slot is handed back to the workers.
        handoff: decide, from main's sampled turns, whether main asks for its
            waker's core (``HANDOFF_MAX_CPU_SHARE``); for a main that sleeps in
            ``recv``.
    """

    #: How often ``recv`` checks that every worker lives when it need not wait
    #: (a dead worker's envs would starve silently while the others fill batches).
    periodic_check_s = LIVENESS_CHECK_S

    def __init__(
        self,
        wire: AsyncWire,
        pool: WorkerPool,
        supervisor: Supervisor,
        decoder: ResultDecoder,
        stats: Stats,
        rounds: RoundDriver,
        handoff: bool = False,
    ) -> None:
        self.wire, self.pool, self.supervisor = wire, pool, supervisor
        self.decoder, self.stats, self.rounds = decoder, stats, rounds
        self.batch_size = wire.batch_size
        self.num_envs = wire.num_envs
        self.ring = wire.ring
        self.awaiting = wire.awaiting  # envs whose last result the user has
        self.book = wire.book
        self.in_flight = 0  # envs not awaiting: a count, so recv() needs no scan
        self.was_reset = False
        self.recv_slot = 0
        self.held_slot: int | None = None
        self.last_env_ids: np.ndarray | None = None
        self.liveness_checked = time.monotonic()
        self.decides_handoff = handoff
        self.handoff = False
        self.turns = 0  # recv() calls returned
        self.turn_started: tuple | None = None  # main's clocks at a sampled recv's return

    # --------------------------------------------------------------- commands

    def idle_env_ids(self, env_ids: Any) -> np.ndarray:
        """``async_reset``'s envs (None: all), checked: each must be idle."""
        ids = np.arange(self.num_envs) if env_ids is None else self.check_env_ids(env_ids)
        busy = self.running(ids)
        if busy.size:
            raise RuntimeError(
                f"async_reset() while envs {busy.tolist()} are still running: recv() their "
                "results first"
            )
        return ids

    def send_env_ids(self, env_ids: Any) -> np.ndarray:
        """``send``'s envs (None: those of the last ``recv``), checked."""
        if not self.was_reset:
            raise RuntimeError("send() before async_reset(): reset the envs first")
        if env_ids is None:
            if self.last_env_ids is None:
                raise ValueError("send() needs env_ids: no recv() has returned any yet")
            env_ids = self.last_env_ids
        ids = self.book.idle_ids(env_ids)  # the common case, in one C loop
        return self.check_env_ids(env_ids) if ids is None else ids

    def check_env_ids(self, env_ids: Any) -> np.ndarray:
        """``env_ids`` checked (``batching.check_env_ids``); each must await a command."""
        ids = check_env_ids(env_ids, self.num_envs)
        running = self.running(ids)
        if running.size:
            raise ValueError(
                f"envs {running.tolist()} are not awaiting an action: their previous "
                "step is still running (recv() its result first)"
            )
        return ids

    def reset_envs(self, ids: np.ndarray, seeds: list, per_env: list) -> None:
        """Sends each env of ``ids`` its (seed, options), then the reset command."""
        workers = self.wire.env_worker[ids]
        for index in np.unique(workers).tolist():
            envs = ids[workers == index].tolist()
            self.wire.send_reset(index, {e: (seeds[e], per_env[e]) for e in envs})
        self.start_envs(ids, ENV_RESET)
        self.was_reset = True

    def start_envs(self, env_ids: np.ndarray, command: int) -> None:
        """Gives each env of ``env_ids`` (int64, checked) ``command`` and rings
        their workers."""
        self.wire.start(env_ids, command)
        self.in_flight += len(env_ids)

    def running(self, ids: np.ndarray) -> np.ndarray:
        """The envs of ``ids`` whose previous command has not been received yet."""
        return ids[~self.awaiting[ids]]

    # ------------------------------------------------------------------- recv

    def recv(self, timeout: float | None, partial: bool = False, take_ready: bool = False) -> tuple:
        """The next ``batch_size`` results, with ``infos["env_id"]``; with
        ``partial``, while fewer envs run, the results of all of them; with
        ``take_ready``, once ``timeout`` has passed, those that are in (at least one)."""
        rows = self.batch_size
        if self.wire.closed is not None:  # a closed slot whose wait failed: its rows are due
            rows = self.wire.closed
        elif self.in_flight < rows:
            if not (partial and self.in_flight):
                raise RuntimeError(
                    f"recv() waits for batch_size={rows} results but only {self.in_flight} "
                    "envs are running: send() actions first"
                )
            rows = self.in_flight
        if self.decides_handoff:
            self._decide_handoff()
        if self.held_slot is not None:
            self.rounds.before_slot_reuse(self.held_slot)
            self.wire.release_slot(self.held_slot)
            self.held_slot = None
        slot = self.recv_slot
        views = self.pool.slots[slot]
        messages: dict[int, dict] = {}
        if rows < self.batch_size and self.wire.closed is None:
            self.wire.pad(slot, rows)
        try:
            while True:
                try:
                    self._check_workers_now_and_then()
                    self.pool.run_main_worker()
                    rows = self._wait_slot(slot, timeout, rows, take_ready)
                    self._row_messages(slot, views, messages)
                    break
                except WorkerDiedError as error:
                    if not self.supervisor.restart_on_death:
                        raise
                    read = {(slot, row) for row in messages}
                    self.supervisor.replace_dead(error.worker, read)
        except BaseException:
            self.wire.unpad()  # the envs still run; later sends claim those rows
            raise
        env_ids = self.wire.received(slot, rows)  # they await commands again
        self.in_flight -= rows
        self.last_env_ids = env_ids
        self.held_slot = slot
        self.recv_slot = (slot + 1) % len(self.pool.slots)
        decoder = self.decoder
        self.stats.count(rows, decoder.ended(slot, rows))
        raise_errors(messages.values(), decoder)
        region = self.wire.take_region(slot)
        obs = decoder.rows_obs(views, messages, rows, region)
        infos = decoder.merge_infos(
            views, lambda: self._worker_rows(env_ids), messages.values(), rows
        )
        if "env_error" in infos:
            self.stats.note_env_resets(infos, env_ids)
        if "step_deadline" in infos:
            self.stats.note_deadlines(infos, env_ids, self.wire.env_worker[env_ids])
        infos["env_id"] = env_ids
        self.turns += 1
        if self.decides_handoff and self.turns % HANDOFF_SAMPLE == 0:
            self.turn_started = (time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD))
        return (obs, *decoder.outcomes(slot, rows), infos)

    def _worker_rows(self, env_ids: np.ndarray) -> list[np.ndarray]:
        """Per worker, the rows of this batch that it wrote."""
        workers = self.wire.env_worker[env_ids]
        return [np.flatnonzero(workers == index) for index in range(self.pool.num_workers)]

    def _decide_handoff(self) -> None:
        """Sets the ring's hand-off from main's last turn (``HANDOFF_MAX_CPU_SHARE``)."""
        if self.turn_started is None:
            return
        wall, before = self.turn_started
        self.turn_started = None
        now = resource.getrusage(resource.RUSAGE_THREAD)
        cpu_s = now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime
        handoff = now.ru_nvcsw > before.ru_nvcsw and cpu_s < HANDOFF_MAX_CPU_SHARE * (
            time.perf_counter() - wall
        )
        if handoff != self.handoff:
            self.handoff = handoff
            self.ring.set_handoff(handoff)

    def _check_workers_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self.liveness_checked >= self.periodic_check_s:
            self.liveness_checked = now
            self.supervisor.kill_stuck_workers(0.0)
            self.pool.check_all_alive()

    def _wait_slot(self, slot: int, timeout: float | None, rows: int, take_ready: bool) -> int:
        """Waits until slot ``slot``'s ``rows`` rows are in, or with ``take_ready``
        until ``timeout`` has passed with some of them claimed (the slot is then
        closed, and their publishes follow their claims); returns the rows."""
        if self.wire.closed is not None:
            timeout = None  # every row due is claimed
        try:
            self._wait_full(slot, timeout, rows)
        except multiprocessing.TimeoutError:
            closed = self.wire.close(slot, rows) if take_ready else 0
            if not closed:
                raise
            self._wait_full(slot, None, closed)
            return closed
        return rows if self.wire.closed is None else self.wire.closed

    def _wait_full(self, slot: int, timeout: float | None, rows: int) -> None:
        supervisor = self.supervisor
        if timeout is None and supervisor.env_timeout is None:
            # The common case first: one wait, as RoundDriver.step_round does.
            waited = time.perf_counter()
            full = self.ring.wait_full(slot, LIVENESS_CHECK_NS)
            self.stats.wait_s += time.perf_counter() - waited
            if full:
                return
            self.pool.check_all_alive()

        def ready(budget_ns: int) -> bool:
            self.supervisor.kill_stuck_workers(0.0)
            return self.ring.wait_full(slot, budget_ns)

        self.supervisor.wait_for(
            ready,
            timeout,
            lambda: (
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{self.wire.published(slot)} of {rows} results arrived; "
                f"{self._running_envs()}."
            ),
        )

    def _running_envs(self) -> str:
        """The envs still running or queued, for a timeout's message: at most
        ``SHOWN_ENVS`` of them, so that a caller that polls with short timeouts (the
        awaitable envs' dispatcher) pays for no list of a thousand envs."""
        running = np.flatnonzero(~self.awaiting)
        shown = running[:SHOWN_ENVS].tolist()
        more = f" and {running.size - SHOWN_ENVS} more" if running.size > SHOWN_ENVS else ""
        return f"envs still running or queued: {shown}{more}"

    def _row_messages(self, slot: int, views, messages: dict) -> None:
        """Adds to ``messages`` those of the rows that have one, by row (after a
        worker's restart, the rows it still lacks)."""
        if not _worker_loop.row_messages(self.decoder.columns[slot]):
            return  # the common case: no row sent a message
        for row in np.flatnonzero(views.messages).tolist():
            if row in messages:
                continue
            index = int(self.wire.env_worker[views.env_ids[row]])
            message = self.pool.recv_row(index, (slot, row))
            self.decoder.learn_columns(index, message)
            messages[row] = message
