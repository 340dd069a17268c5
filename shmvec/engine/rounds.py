"""RoundDriver: one barrier round at a time: post, wait, finish.

Data flow: a caller sends a round's payloads (``pool.send``), then ``post``
(or ``step_round``, the short path of a plain step) bumps the barrier's
generation with a command kind and the ring slot it fills (and, for a round
of observations, the lease region they go to: engine/leases.py); ``finish`` waits
until every worker arrived (replacing dead ones under
``on_worker_death="restart"``), reads the messages the workers flagged and
re-raises env errors. A round whose wait timed out is ``unfinished``: the next
round first waits for it and drops its results. Barrier rounds carry every
command in sync mode and the non-env ones in async mode: the wire
(engine/wire.py) hears of each round and owns what a replacement restores.

Who may call what: the main process's one thread, one round at a time.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmvec.engine.decoder import ResultDecoder, raise_errors
from shmvec.engine.pool import WorkerPool
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.engine.wire import Wire
from shmvec.errors import WorkerDiedError, add_note
from shmvec.protocol import (
    BY_VALUE_BIT,
    CALL,
    LIVENESS_CHECK_NS,
    LIVENESS_CHECK_S,
    REGION_SHIFT,
    RESET,
    SET_ATTR,
    STEP,
)


class RoundDriver:
    """Runs barrier rounds over a pool's workers.

    Args:
        pool: the workers.
        supervisor: waits, timeouts and restarts.
        decoder: owns the info schemas a clean round must not have.
        stats: counts the main process's wait.
        wire: the wire protocol, told of every round posted and ended.
    """

    def __init__(
        self,
        pool: WorkerPool,
        supervisor: Supervisor,
        decoder: ResultDecoder,
        stats: Stats,
        wire: Wire,
    ) -> None:
        self.pool = pool
        self.barrier = pool.barrier
        self.main_worker = pool.main_worker
        self.supervisor = supervisor
        self.decoder = decoder
        self.stats = stats
        self.wire = wire
        self.wire_posted = wire.posted  # step_round's: one attribute less per step
        self.ring_depth = len(pool.slots)
        self.slot = 0  # the ring slot of the last round
        self.leases = decoder.leases
        # Per slot, the lease region its last round of observations went to
        # (None: the slot's own columns); the last such round's, until read.
        self.slot_regions: list[int | None] = [None] * self.ring_depth
        self.unread: int | None = None
        self.kind: int | None = None  # the command kind of the round being finished
        self.started = 0.0  # time.monotonic() of the last post (env_timeout)
        self.unfinished = False  # the last round's wait timed out
        self.recovered: dict[int, dict] = {}  # messages of replacement workers
        self.reset_mask: np.ndarray | None = None  # the last reset's mask
        self.before_slot_reuse: Callable[[int], None] = lambda slot: None  # nothing to wait for

    def next_slot(self) -> int:
        """The slot the next round fills, once ``before_slot_reuse`` allowed it."""
        self.slot = (self.slot + 1) % self.ring_depth
        self.before_slot_reuse(self.slot)
        return self.slot

    def obs_arg(self, slot: int) -> int:
        """The arg of a round of observations (STEP, RESET) into ``slot``: with
        a free lease region when results are copies and one is free."""
        if self.leases is None:
            return slot
        region = self.leases.next_region(self.unread, self.decoder.copy)
        self.unread = self.slot_regions[slot] = region
        return slot if region is None else slot | (region + 1) << REGION_SHIFT

    def read_obs(self, messages: dict[int, dict]) -> Any:
        """The last round's observations (``ResultDecoder.batch_obs``)."""
        region, self.unread = self.unread, None
        return self.decoder.batch_obs(self.slot, messages, region)

    def obs_views(self, slot: int) -> list:
        """The columns that the last round of observations into ``slot`` wrote."""
        region, leases = self.slot_regions[slot], self.leases
        return (
            self.pool.slots[slot].obs if region is None or leases is None else leases.views[region]
        )

    def post(self, kind: int, arg: int = 0) -> None:
        """Starts a round, and tells the wire."""
        self.kind = kind
        self.started = time.monotonic()
        self.barrier.post(kind, arg)
        self.wire.posted(kind, arg)

    def send_blocks(self, tag: str, per_env: list, wrap: Callable = lambda block: block) -> None:
        """Sends each worker ``wrap(its block's slice of per_env)`` under ``tag``."""
        for index, rows in enumerate(self.pool.blocks):
            self.pool.send(index, tag, wrap(per_env[rows.start : rows.stop]))

    def post_step(self, per_env: list | None) -> None:
        """Posts a STEP round into the next slot, its actions in the slab or, by
        value, ``per_env`` (sent to each worker first)."""
        if per_env is not None:
            self.send_blocks("actions", per_env)
        by_value = 0 if per_env is None else BY_VALUE_BIT
        self.post(STEP, self.obs_arg(self.next_slot()) | by_value)

    def post_call(self, name: str, args: tuple, kwargs: dict) -> None:
        """Sends every worker the call, then posts a CALL round."""
        for index in range(self.pool.num_workers):
            self.pool.send(index, "call", (name, args, kwargs))
        self.post(CALL)

    def post_set_attr(self, name: str, values: list) -> None:
        """Sends each worker its block's values, then posts a SET_ATTR round."""
        self.send_blocks("set_attr", values, lambda block: (name, block))
        self.post(SET_ATTR)

    def post_reset(self, seeds: list, options: list, mask: np.ndarray | None) -> None:
        """Sends each worker its block's reset (kept for a replacement), then posts
        a RESET round into the next slot."""
        slot = self.next_slot()
        for index, rows in enumerate(self.pool.blocks):
            block = slice(rows.start, rows.stop)
            block_mask = None if mask is None else mask[block]
            self.wire.send_reset(index, (seeds[block], options[block], block_mask))
        self.reset_mask = None if mask is None else mask.copy()
        self.post(RESET, self.obs_arg(slot))

    def reset_result(self, messages: dict[int, dict]) -> tuple[Any, dict[str, Any]]:
        """The finished RESET round's ``(obs, infos)``; envs its mask left out keep
        their previous observation."""
        decoder, slot = self.decoder, self.slot
        infos = decoder.batch_infos(slot, messages)
        mask = self.reset_mask
        if mask is not None and not mask.all():
            previous = self.obs_views((slot - 1) % self.ring_depth)
            decoder.carry_over_obs(~mask, self.obs_views(slot), previous)
        obs = self.read_obs(messages)
        if "step_deadline" in infos:
            self.stats.note_block_deadlines(infos, self.pool.blocks)
        return obs, infos

    def step_result(self, messages: dict[int, dict]) -> tuple:
        """The finished STEP round's ``(obs, rewards, terminations, truncations,
        infos)``, its env resets, deadlines and steps counted in the stats."""
        decoder, slot, stats = self.decoder, self.slot, self.stats
        infos = decoder.batch_infos(slot, messages)
        if "env_error" in infos:
            stats.note_env_resets(infos, np.arange(decoder.num_envs))
        if "step_deadline" in infos:
            stats.note_block_deadlines(infos, self.pool.blocks)
        stats.count(decoder.num_envs, decoder.ended(slot))
        obs = self.read_obs(messages)
        return (obs, *decoder.outcomes(slot), infos)

    def step_round(self) -> bool:
        """A STEP round into the next slot, actions already in the slab, then one
        wait: True if it ended with nothing but columns to read (info columns
        included). Otherwise ``finish`` takes the round over (an error, a
        message, a late worker).

        The short path of ``ShmVectorEnv.step``, for sync mode without
        ``env_timeout``: no round clock.
        """
        slot = self.slot = (self.slot + 1) % self.ring_depth
        self.before_slot_reuse(slot)
        self.kind = STEP
        # obs_arg(slot) is slot without regions: a call fewer per step there.
        arg = slot if self.leases is None else self.obs_arg(slot)
        barrier = self.barrier
        barrier.post(STEP, arg)
        self.wire_posted(STEP, arg)
        if self.main_worker is not None:
            self.pool.run_main_worker()
        waited = time.perf_counter()
        done = barrier.wait_done(LIVENESS_CHECK_NS)
        self.stats.wait_s += time.perf_counter() - waited
        return done and not (barrier.messages() or self.recovered)

    def finish(self, timeout: float | None, name: str) -> dict[int, dict]:
        """Ends the pending round: waits, reads messages, re-raises env errors.
        Returns the messages by worker."""
        try:
            self.wait(timeout, name)
        except multiprocessing.TimeoutError:
            self.unfinished = True
            raise
        finally:
            self.kind = None  # no round pending: a restart now recovers as for a call
            self.wire.ended()
        messages = self.collect_messages()
        if messages:
            raise_errors(messages.values(), self.decoder)
        return messages

    def finish_unfinished(self, timeout: float | None = None) -> None:
        """Completes a round whose wait timed out, dropping its results."""
        if self.unfinished:
            self.kind = None
            self.wire.ended()
            self.wait(timeout, "close" if timeout is not None else "step_wait")
            self.collect_messages()
            self.unfinished = False

    def collect_messages(self) -> dict[int, dict]:
        """This round's messages, by worker, in worker (so row) order."""
        # The barrier's count first: reading the workers' own words (numpy's
        # any() above all) costs several microseconds a round.
        if not (self.barrier.messages() or self.recovered):
            return {}
        flags = self.pool.message_flags
        messages = self.recovered
        self.recovered = {}
        for index in np.flatnonzero(flags).tolist():
            flags[index] = 0
            messages[index] = self.pool.recv(index, timeout=None)
        return dict(sorted(messages.items()))

    def wait(self, timeout: float | None, name: str) -> None:
        """Waits for every worker to arrive; raises on timeout or a worker's death.

        With ``on_worker_death="restart"`` a dead worker is replaced and the
        replacement does its part of the round (``Worker.recover``); the round
        then ends when every other worker has finished it, whatever the
        barrier's count (the dead worker may or may not have arrived).
        """
        supervisor = self.supervisor
        self.pool.run_main_worker()
        deadline = None if timeout is None else time.monotonic() + timeout
        if supervisor.env_timeout is None:  # the common case first: one wait, no checks
            budget = LIVENESS_CHECK_S if timeout is None else min(timeout, LIVENESS_CHECK_S)
            waited = time.perf_counter()
            done = self.barrier.wait_done(int(budget * 1e9))
            self.stats.wait_s += time.perf_counter() - waited
            if done:
                return
        restarted: dict[int, WorkerDiedError] = {}

        def ready(budget_ns: int) -> bool:
            supervisor.kill_stuck_workers(self.started, restarted.keys())
            if restarted:
                return self.finished_except(restarted, budget_ns)
            return self.barrier.wait_done(budget_ns)

        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                supervisor.wait_for(
                    ready,
                    remaining,
                    lambda: (
                        f"The call to `{name}` has timed out after {timeout} second(s). "
                        f"Not finished: {self.unfinished_workers()}."
                    ),
                )
                break
            except WorkerDiedError as error:
                if not supervisor.restart_on_death or name == "close":
                    raise
                for index, message in supervisor.replace_dead(error.worker).items():
                    self._replaced(index, message)
                    restarted.setdefault(index, error)
        if restarted and self.kind not in (None, STEP, RESET):
            died = next(iter(restarted.values()))
            add_note(died, f"the worker was restarted and its envs reset; `{name}` again")
            raise died

    def _replaced(self, index: int, ready: dict) -> None:
        """Worker ``index`` was replaced during this round: keeps what its
        replacement recovered of the round (sync mode), and a RESET round's
        mask names its envs, all new (none keeps its obs)."""
        if "recovered" in ready:
            self.recovered[index] = ready["recovered"]
        if self.kind == RESET and self.reset_mask is not None:
            rows = self.pool.blocks[index]
            self.reset_mask[rows.start : rows.stop] = True

    def unfinished_workers(self) -> str:
        """The workers that have not finished the current round, and their env."""
        pool = self.pool
        generation = self.barrier.generation
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
        generation = self.barrier.generation
        others = [i for i in range(self.pool.num_workers) if i not in restarted]
        deadline = time.monotonic() + budget_ns / 1e9
        while not all(finished[i] == generation for i in others):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)  # a round with a restart: no need for a futex
        return True
