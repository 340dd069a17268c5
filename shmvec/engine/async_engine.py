"""AsyncEngine: EnvPool-style rollouts with no barrier between envs.

Data flow (``batch_size < num_envs``): ``start_envs`` writes each env's
command (shmvec/protocol.py, env commands) and rings the doorbell of every
worker owning one (``_worker_loop.EnvBook`` keeps these books in C loops); a
worker steps each env with a command, claims the next row of the result ring
(csrc/result_ring.h), writes the result and the env id there and publishes
the row; ``recv`` waits until a slot's ``batch_size`` rows are published,
reads their messages and hands the slot back on the next ``recv``. Each env's
trajectory is the one it would have alone with the same seed and actions;
only the order in which envs come back varies.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np

from shmvec import _core, _worker_loop
from shmvec.batching import check_env_ids
from shmvec.engine.decoder import raise_errors
from shmvec.engine.pool import WorkerPool
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.errors import WorkerDiedError
from shmvec.protocol import ENV_IDLE, ENV_RESET, LIVENESS_CHECK_NS, LIVENESS_CHECK_S, UNWRITTEN

#: When main sleeps in ``recv`` (it shares cores with the workers), the worker
#: whose row completes a batch wakes it, and the scheduler tends to put main on
#: that worker's core and let the worker run on through its next envs. Main
#: therefore asks that worker to yield its core (``ResultRing.set_handoff``)
#: when its last measured turn (from a ``recv``'s return to the next ``recv``)
#: was spent waiting, as for a policy on a GPU: its thread blocked at least once
#: and ran on a CPU for less than this share of the turn. Then running main at
#: once costs the worker little and starts main's wait early. A main that
#: computes or spins through its turn (even one kept off a CPU meanwhile) is
#: not handed the core: the worker's envs are worth as much to the loop.
#:
#: Measured on 2 cores (8 x 100 us envs on 2 workers, batches of 4, a policy
#: that sleeps, then spins its last 100 us): with a 200 us policy main sat
#: queued 100-230 us after many wake-ups (perf sched: 242 ms of a 1.5 s run,
#: 128 ms with the yield) and the yield took the loop from 14.1k to 15.1k
#: steps/s; with a 50 us policy (all spin) an unconditional yield cost 6%
#: (17.9k -> 16.6k), hence the rule. Main measures one turn in
#: ``HANDOFF_SAMPLE`` (two ``getrusage`` calls): measuring every turn cost ~2%
#: of the 100 us loop in alternated runs.
HANDOFF_MAX_CPU_SHARE = 0.5
HANDOFF_SAMPLE = 8


class AsyncEngine:
    """The ring, the doorbells and the env commands of one vector env.

    Args:
        batch_size: rows per ``recv``.
        pool: the workers (segment open, workers not yet started).
        supervisor: liveness, timeouts, restarts.
        decoder: the ResultDecoder, which turns ring rows into results.
        stats: counts results.
        handoff: decide, from main's sampled turns, whether main asks for its
            waker's core (``HANDOFF_MAX_CPU_SHARE``); for a main that sleeps in
            ``recv``.
    """

    #: How often ``recv`` checks that every worker lives when it need not wait
    #: (a dead worker's envs would starve silently while the others fill batches).
    periodic_check_s = LIVENESS_CHECK_S

    def __init__(
        self,
        batch_size: int,
        pool: WorkerPool,
        supervisor: Supervisor,
        decoder,
        stats: Stats,
        handoff: bool = False,
    ) -> None:
        layout, segment = pool.layout, pool.segment
        self.pool, self.supervisor, self.decoder, self.stats = pool, supervisor, decoder, stats
        supervisor.async_engine = self
        self.rounds = None  # the RoundDriver, for its before_slot_reuse hook
        self.batch_size = batch_size
        self.num_envs = num_envs = layout.num_envs
        self.ring = _core.ResultRing(segment, layout.ring_offset, layout.num_slots, batch_size)
        self.doorbells = [_core.Doorbell(segment, off) for off in layout.doorbell_offsets]
        self.env_commands = layout.env_commands(memoryview(segment))
        self.env_worker = np.empty(num_envs, dtype=np.int64)
        for index, rows in enumerate(pool.blocks):
            self.env_worker[rows.start : rows.stop] = index
        # Envs whose last result the user has (or that were never reset).
        self.awaiting = np.ones(num_envs, dtype=bool)
        self.in_flight = 0  # envs not awaiting: a count, so recv() needs no scan
        self.was_reset = False
        self.recv_slot = 0
        self.held_slot: int | None = None
        self.last_env_ids: np.ndarray | None = None
        # For on_worker_death="restart": rows consumed so far (claims before this
        # one are done with), each env's last command and reset arguments.
        self.consumed_rows = 0
        self.liveness_checked = time.monotonic()
        self.last_command = np.zeros(num_envs, dtype=np.uint8)
        self.book = _worker_loop.EnvBook(
            self.awaiting.view(np.uint8), self.env_commands, self.last_command, self.env_worker,
            [segment.address + offset for offset in layout.doorbell_offsets],
        )  # fmt: skip
        self.env_reset_args: dict[int, tuple] = {}
        self.decides_handoff = handoff
        self.handoff = False
        self.turns = 0  # recv() calls returned
        self.turn_started: tuple | None = None  # main's clocks at a sampled recv's return
        # Lease regions (engine/leases.py): each ring slot is bound to a free
        # one while results are copies, rebound whenever main releases it.
        self.leases = decoder.leases
        self.slot_regions = layout.slot_regions(memoryview(segment))
        self.bound: list[int | None] = [None] * len(pool.slots)  # not yet read
        for slot, views in enumerate(pool.slots):
            views.env_ids[:] = UNWRITTEN
            self._bind_region(slot)

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
        workers = self.env_worker[ids]
        for index in np.unique(workers).tolist():
            args = {e: (seeds[e], per_env[e]) for e in ids[workers == index].tolist()}
            self.env_reset_args.update(args)
            self.pool.send(index, "reset", args)
        self.start_envs(ids, ENV_RESET)
        self.was_reset = True

    def start_envs(self, env_ids: np.ndarray, command: int) -> None:
        """Gives each env of ``env_ids`` (int64, checked) ``command`` and rings
        their workers."""
        self.book.start(env_ids, command)
        self.in_flight += len(env_ids)

    def running(self, ids: np.ndarray) -> np.ndarray:
        """The envs of ``ids`` whose previous command has not been received yet."""
        return ids[~self.awaiting[ids]]

    # ------------------------------------------------------------------- recv

    def recv(self, timeout: float | None) -> tuple:
        """The next ``batch_size`` results, with ``infos["env_id"]``."""
        if self.in_flight < self.batch_size:
            raise RuntimeError(
                f"recv() waits for batch_size={self.batch_size} results but only {self.in_flight} "
                "envs are running: send() actions first"
            )
        if self.decides_handoff:
            self._decide_handoff()
        pool = self.pool
        if self.held_slot is not None:
            self.rounds.before_slot_reuse(self.held_slot)
            pool.slots[self.held_slot].env_ids[:] = UNWRITTEN
            self._bind_region(self.held_slot)
            self.ring.release(self.held_slot)  # publishes the two lines above
            self.held_slot = None
        slot = self.recv_slot
        views = pool.slots[slot]
        messages: dict[int, dict] = {}
        while True:
            try:
                self._check_workers_now_and_then()
                pool.run_main_worker(True)
                self._wait_slot(slot, timeout)
                self._row_messages(slot, views, messages)
                break
            except WorkerDiedError as error:
                if not self.supervisor.restart_on_death:
                    raise
                read = {(slot, row) for row in messages}
                self.supervisor.replace_worker(error.worker, self.rounds, read)
        self.consumed_rows += self.batch_size
        env_ids = self.book.received(views.env_ids)  # as int64; they await commands again
        self.in_flight -= self.batch_size
        self.last_env_ids = env_ids
        self.held_slot = slot
        self.recv_slot = (slot + 1) % len(pool.slots)
        self.stats.count(self.batch_size, self.decoder.ended(slot))
        raise_errors(messages.values(), self.decoder)
        decoder = self.decoder
        region, self.bound[slot] = self.bound[slot], None  # the caller's arrays hold it now
        obs = decoder.rows_obs(views, messages, self.batch_size, region)
        infos = decoder.merge_infos(
            views, lambda: self._worker_rows(env_ids), messages.values(), self.batch_size
        )
        if "env_error" in infos:
            self.stats.note_env_resets(infos, env_ids)
        infos["env_id"] = env_ids
        self.turns += 1
        if self.decides_handoff and self.turns % HANDOFF_SAMPLE == 0:
            self.turn_started = (time.perf_counter(), _thread_usage())
        return (obs, *decoder.outcomes(slot), infos)

    def _bind_region(self, slot: int) -> None:
        """Binds ``slot``, whose rows no worker may claim now, to a free lease
        region while results are copies (else to its own columns); a region it
        was bound to and whose rows were never read is free again."""
        if self.leases is None:
            return
        region = self.leases.next_region(self.bound[slot], self.decoder.copy)
        self.bound[slot] = region
        self.slot_regions[slot] = 0 if region is None else region + 1

    def _worker_rows(self, env_ids: np.ndarray) -> list[np.ndarray]:
        """Per worker, the rows of this batch that it wrote."""
        workers = self.env_worker[env_ids]
        return [np.flatnonzero(workers == index) for index in range(self.pool.num_workers)]

    def _decide_handoff(self) -> None:
        """Sets the ring's hand-off from main's last turn (``HANDOFF_MAX_CPU_SHARE``)."""
        if self.turn_started is None:
            return
        wall, before = self.turn_started
        self.turn_started = None
        now = _thread_usage()
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

    def _wait_slot(self, slot: int, timeout: float | None) -> None:
        supervisor = self.supervisor
        if timeout is None and supervisor.env_timeout is None:
            # The common case first: one wait, as RoundDriver.step_round does.
            waited = time.perf_counter()
            full = self.ring.wait_full(slot, supervisor.main_spin_ns, LIVENESS_CHECK_NS)
            self.stats.wait_s += time.perf_counter() - waited
            if full:
                return
            self.pool.check_all_alive()

        def ready(spin_ns: int, budget_ns: int) -> bool:
            self.supervisor.kill_stuck_workers(0.0)
            return self.ring.wait_full(slot, spin_ns, budget_ns)

        self.supervisor.wait_for(
            ready,
            timeout,
            lambda: (
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{self.ring.filled(slot)} of {self.batch_size} results arrived; envs "
                f"still running or queued: {np.flatnonzero(~self.awaiting).tolist()}."
            ),
        )

    def _row_messages(self, slot: int, views, messages: dict) -> None:
        """Adds to ``messages`` those of the rows that have one, by row (after a
        worker's restart, the rows it still lacks)."""
        if not _worker_loop.row_messages(self.decoder.columns[slot]):
            return  # the common case: no row sent a message
        for row in np.flatnonzero(views.messages).tolist():
            if row in messages:
                continue
            index = int(self.env_worker[views.env_ids[row]])
            message = self.pool.recv(index, timeout=None, row=True)
            if message["row"] != (slot, row):
                raise RuntimeError(
                    f"shmvec internal error: worker {index} sent the message of row "
                    f"{message['row']} where ({slot}, {row}) was expected"
                )
            self.decoder.learn_columns(index, message)
            messages[row] = message

    # ---------------------------------------------------------------- restart

    def quiesce(self, dead: int) -> None:
        """Waits until every worker but ``dead`` has finished every env it was
        given (their commands clear, none in an env), reading their pipes so
        that none blocks on a full one."""
        pool = self.pool
        while True:
            pool.run_main_worker(True)
            busy = [
                index
                for index, rows in enumerate(pool.blocks)
                if index != dead
                and (pool.current_env[index] or self.env_commands[rows.start : rows.stop].any())
            ]
            if not busy:
                return
            for index in busy:
                pool.check_alive(index)
                pool.drain(index)
            time.sleep(0.0002)

    def recovery_plan(self, dead: int, read: frozenset | set) -> dict[int, tuple]:
        """What the replacement of ``dead`` must deliver: env -> (how, slot, row,
        command), ``how`` one of "hole", "claim", "rewrite" (Worker.recover_async).

        Once the other workers have done all they were given, the ring tells
        what the dead worker left: rows it published (their messages are read
        from its pipe, which outlives it), at most one row it claimed but never
        published (a hole that would keep its slot from filling), and at most
        one env whose command it took but whose row it never claimed. Every
        other env of its block reports a truncated episode for its next command.
        """
        pool = self.pool
        batch, slots = self.batch_size, len(pool.slots)
        first, claimed = self.consumed_rows, self.ring.claimed()
        block = pool.blocks[dead]
        where: dict[int, tuple[int, int]] = {}  # env -> its unconsumed row
        unwritten, last_of_dead, per_slot = [], None, {}
        for n in range(first, claimed):
            slot, row = (n // batch) % slots, n % batch
            per_slot[slot] = per_slot.get(slot, 0) + 1
            env = int(pool.slots[slot].env_ids[row])
            if env == UNWRITTEN:
                unwritten.append((slot, row))
            else:
                where[env] = (slot, row)
                if env in block:
                    last_of_dead = env
        holes = (claimed - first) - sum(self.ring.filled(s) for s in per_slot)
        if holes not in (0, 1) or len(unwritten) > holes:
            raise RuntimeError(
                f"shmvec internal error: {holes} unpublished rows, {len(unwritten)} unwritten, "
                f"after worker {dead} died"
            )
        hole_env, hole = None, None
        if holes:  # the dead worker's last claim
            hole = unwritten[0] if unwritten else where.pop(last_of_dead)
            hole_env = None if unwritten else last_of_dead
        plan = {}
        for env in block:
            command = int(self.last_command[env])
            if self.awaiting[env] or self.env_commands[env] != ENV_IDLE:
                continue  # idle, or not started: the replacement's first command does it
            if env == hole_env:
                plan[env] = ("hole", *hole, command)
            elif env in where:
                slot, row = where[env]
                if (
                    pool.slots[slot].messages[row]
                    and (slot, row) not in read
                    and not any(m["row"] == (slot, row) for m in pool.stashed[dead][True])
                ):
                    plan[env] = ("rewrite", slot, row, command)  # its message was lost
            else:
                plan[env] = ("claim", 0, 0, command)
        if hole is not None and hole_env is None:
            claims = [env for env, how in plan.items() if how[0] == "claim"]
            if len(claims) != 1:
                raise RuntimeError(
                    f"shmvec internal error: an unwritten row and envs {claims} without one"
                )
            plan[claims[0]] = ("hole", *hole, plan[claims[0]][3])
        return plan

    def resend_resets(self, index: int) -> None:
        """Sends worker ``index``'s replacement the resets its running envs wait for."""
        running = [e for e in self.pool.blocks[index] if not self.awaiting[e]]
        resets = {e: self.env_reset_args[e] for e in running if e in self.env_reset_args}
        if resets:
            self.pool.send(index, "reset", resets)


def _thread_usage():
    """The calling thread's CPU times and context switches (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_THREAD)
