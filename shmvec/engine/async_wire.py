"""AsyncWire: env commands, doorbells and the result ring (``batch_size < num_envs``).

Data flow: ``start`` writes each env's command (shmvec/protocol.py, env
commands) and rings the doorbell of every worker owning one
(``_worker_loop.EnvBook`` keeps these books in C loops); a worker steps each
env with a command, claims the next row of the result ring
(csrc/result_ring.h), writes the result and the env id there and publishes the
row; main waits until a slot's rows are all published (``AsyncEngine.recv``)
and hands the slot back (``release_slot``) on its next ``recv``. Barrier
rounds (``call``, ``set_attr``, ``close``) ring every doorbell (``posted``),
since idle workers sleep on theirs.

A batch of fewer rows (``recv(partial=True)`` while ``n < batch_size`` envs
run): the claims of those ``n`` envs are the first ``n`` rows of the slot main
waits for, so main counts the other rows as published (``pad``) and the slot
fills when the last of the ``n`` rows is published; ``received`` then moves
the claim counter past the padding, before any env has a new command.

A batch of the rows in so far (``recv(take_ready=True)`` past its timeout):
``close`` moves the claim counter to the end of the slot main waits for in
one compare-exchange (later claims are the next slot's) and pads the rows
after the ``k`` claimed; the slot fills when those ``k`` are published. A
closed slot stays closed if its wait then fails (``unpad`` keeps it): the next
``recv`` returns its ``k`` rows.

Recovery: once every live worker is idle, the replacements of any number of
dead workers deliver exactly one result for each env of their blocks still
running (``recovery_plans``, engine/lost_rows.py); padding is no row of any
env and no claim.

Who may call what: the main process's one thread.
"""

from __future__ import annotations

import time
from collections.abc import Set
from typing import Any

import numpy as np

from shmvec import _core, _worker_loop
from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.lost_rows import RingState, find_lost
from shmvec.engine.pool import WorkerPool
from shmvec.engine.wire import Row
from shmvec.protocol import ENV_IDLE, ENV_RESET, UNWRITTEN


class AsyncWire:
    """The ring, the doorbells and the env commands of one segment.

    Args:
        batch_size: rows per ring slot.
        pool: the workers (segment open; built before they start, since it
            marks every ring row unwritten).
        decoder: its lease regions and whether results are copies.
    """

    def __init__(self, batch_size: int, pool: WorkerPool, decoder: ResultDecoder) -> None:
        layout, segment = pool.layout, pool.segment
        self.pool, self.decoder = pool, decoder
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
        # For a replacement: rows consumed so far (claims before this one are
        # done with), each env's last command and reset arguments.
        self.consumed_rows = 0
        # (slot, rows) that ``pad`` counted as published, until main consumes
        # the slot or gives it up (``unpad``).
        self.padding: tuple[int, int] | None = None
        # The rows of main's next slot once ``close`` closed it (the claim
        # counter is past its padding), until main consumes it.
        self.closed: int | None = None
        self.last_command = np.zeros(num_envs, dtype=np.uint8)
        self.resets: dict[int, tuple] = {}
        # Workers whose replacement was planned and has not said it is ready,
        # with the envs whose rows the plan has it publish.
        self.unready: dict[int, set[int]] = {}
        # Workers being replaced, with the envs their plan has them deliver.
        self.planned: dict[int, set[int]] = {}
        self.book = _worker_loop.EnvBook(
            self.awaiting.view(np.uint8), self.env_commands, self.last_command, self.env_worker,
            [segment.address + offset for offset in layout.doorbell_offsets],
        )  # fmt: skip
        # Lease regions (engine/leases.py): each ring slot is bound to a free
        # one while results are copies, rebound whenever main releases it.
        self.leases = decoder.leases
        self.slot_regions = layout.slot_regions(memoryview(segment))
        self.bound: list[int | None] = [None] * len(pool.slots)  # not yet read
        for slot, views in enumerate(pool.slots):
            views.env_ids[:] = UNWRITTEN
            self._bind_region(slot)

    # ------------------------------------------------------------- the ring

    def start(self, env_ids: np.ndarray, command: int) -> None:
        """Gives each env of ``env_ids`` (int64, checked) ``command`` and rings
        their workers."""
        self.book.start(env_ids, command)

    def received(self, slot: int, rows: int | None = None) -> np.ndarray:
        """The env ids of full slot ``slot`` (int64), which await commands again:
        its first ``rows`` (None: all; fewer after ``pad``)."""
        self.consumed_rows += self.batch_size
        env_ids = self.pool.slots[slot].env_ids
        if self.padding is not None:
            if self.closed is None:
                self.ring.skip(self.padding[1])  # every running env's row is in: none claims
            env_ids = env_ids[:rows]
        self.padding = self.closed = None
        return self.book.received(env_ids)

    def pad(self, slot: int, running: int) -> None:
        """Has slot ``slot``, whose rows the ``running`` envs (fewer than
        ``batch_size``, every claim since the last consumed row) claim first, fill
        once their rows are published: the rows after theirs count as published,
        with no message."""
        rows = self.batch_size - running
        self.pool.slots[slot].messages[running:] = 0  # a flag of an earlier lap
        self.ring.pad(slot, rows)
        self.padding = (slot, rows)

    def close(self, slot: int, running: int) -> int:
        """Closes slot ``slot``, main's next (its ``running`` envs' rows due, padded
        if fewer than ``batch_size``), to claims once some of its rows are claimed:
        those rows become its batch, the rest padding. Returns their count (0: none
        claimed, nothing changed); ``running``: every row due is claimed."""
        claimed = self.ring.close(self.consumed_rows)
        if claimed == 0:
            return 0
        if claimed >= running:  # all due: the slot was full of claims, or padded
            if claimed < self.batch_size:  # padded, and the claim counter is past it
                self.closed = running
            return running
        rows = running - claimed
        self.pool.slots[slot].messages[claimed:running] = 0  # flags of an earlier lap
        self.ring.pad(slot, rows)
        padded = self.padding[1] if self.padding is not None else 0
        self.padding = (slot, padded + rows)
        self.closed = claimed
        return claimed

    def unpad(self) -> None:
        """Takes back ``pad``'s rows of a slot main did not consume (its wait
        ended in an error): envs sent later claim them as usual. A closed slot's
        stay: no env can claim them now."""
        if self.padding is not None and self.closed is None:
            self.ring.unpad(*self.padding)
            self.padding = None

    def published(self, slot: int) -> int:
        """Rows of ``slot`` that workers published (padding not counted)."""
        padded = self.padding[1] if self.padding and self.padding[0] == slot else 0
        return self.ring.filled(slot) - padded

    def take_region(self, slot: int) -> int | None:
        """The lease region that slot ``slot``'s observations were written to
        (None: its own columns); the caller's arrays hold it from now on."""
        region, self.bound[slot] = self.bound[slot], None
        return region

    def release_slot(self, slot: int) -> None:
        """Hands slot ``slot`` back to the workers, its rows unwritten."""
        self.pool.slots[slot].env_ids[:] = UNWRITTEN
        self._bind_region(slot)
        self.ring.release(slot)  # publishes the two lines above

    def _bind_region(self, slot: int) -> None:
        """Binds ``slot``, whose rows no worker may claim now, to a free lease
        region while results are copies (else to its own columns); a region it
        was bound to and whose rows were never read is free again."""
        if self.leases is None:
            return
        region = self.leases.next_region(self.bound[slot], self.decoder.copy)
        self.bound[slot] = region
        self.slot_regions[slot] = 0 if region is None else region + 1

    # ------------------------------------------------------------ the wire

    def posted(self, kind: int, arg: int) -> None:
        """Rings every doorbell: idle workers sleep on theirs."""
        for bell in self.doorbells:
            bell.ring()

    def ended(self) -> None:
        """Nothing: a barrier round here carries no env's result."""

    def send_reset(self, index: int, payload: Any) -> None:
        """``payload``: env -> (seed, options), for envs of worker ``index``."""
        self.resets.update(payload)
        self.pool.send(index, "reset", payload)

    def stuck_workers(self, round_started: float, env_timeout: float) -> list[int]:
        """The workers in an env they began more than ``env_timeout`` ago."""
        pool = self.pool
        current, started = pool.current_env, pool.env_started_ns
        limit_ns = time.monotonic_ns() - int(env_timeout * 1e9)
        return [i for i in range(pool.num_workers) if current[i] and started[i] < limit_ns]

    def busy_workers(self, dead: Set[int]) -> list[int]:
        """The workers not in ``dead`` with an env still to finish (a command
        not taken, or one in an env)."""
        pool, commands = self.pool, self.env_commands
        return [
            index
            for index, rows in enumerate(pool.blocks)
            if index not in dead
            and (pool.current_env[index] or commands[rows.start : rows.stop].any())
        ]

    def recovery(self, dead: Set[int], read: Set[Row]) -> dict[int, tuple]:
        """``("async", plan)`` for each of ``dead``, once every other worker has
        done all it was given (``busy_workers``) and the pipes of ``dead`` were
        drained."""
        plans = self.recovery_plans(dead, read)
        for index, plan in plans.items():
            self.unready[index] = {env for env, how in plan.items() if how[0] != "rewrite"}
            self.planned[index] = set(plan)
        return {index: ("async", plan) for index, plan in plans.items()}

    def resend(self, index: int) -> None:
        """Sends the replacement the resets it will run: those of its envs whose
        command is a reset not yet taken, or a reset its plan has it deliver.
        No others: a reset whose published row stands is done, and arguments
        the replacement never takes would be taken by that env's next reset
        (every later reset would then get the one before it)."""
        planned, commands = self.planned.pop(index, set()), self.env_commands
        running = [
            e
            for e in self.pool.blocks[index]
            if not self.awaiting[e]
            and self.last_command[e] == ENV_RESET
            and (commands[e] == ENV_RESET or e in planned)
        ]
        resets = {e: self.resets[e] for e in running if e in self.resets}
        if resets:
            self.pool.send(index, "reset", resets)

    def restarted(self, index: int) -> None:
        """Rings the replacement's doorbell: its envs may have commands."""
        self.unready.pop(index, None)
        self.doorbells[index].ring()

    # ------------------------------------------------------------- recovery

    def recovery_plans(self, dead: Set[int], read: Set[Row]) -> dict[int, dict[int, tuple]]:
        """What the replacement of each worker in ``dead`` must deliver: env ->
        (how, slot, row, command), ``how`` one of "hole", "claim", "rewrite"
        (``Worker.recover`` over ``shmvec.wires.AsyncWire``; engine/lost_rows.py
        says how the ring tells them). An env whose published row stands but
        whose message neither main (``read``) nor a dead worker's pipe holds
        rewrites it; every other env of those blocks reports a truncated
        episode for its next command."""
        pool = self.pool
        for index in dead:  # their info columns: a replacement numbers new ones after them
            for message in pool.row_messages[index].values():
                self.decoder.learn_columns(index, message)
        lost = find_lost(self._ring_state(dead))
        plans: dict[int, dict[int, tuple]] = {index: {} for index in dead}
        for env, (how, slot, row) in lost.deliver.items():
            index = int(self.env_worker[env])
            if how != "claim":
                pool.row_messages[index].pop((slot, row), None)  # a message it replaces
                # Main reads the row only once its new message came: a rewrite in
                # a slot that another replacement's publish fills is not read half done.
                pool.slots[slot].messages[row] = 1
            plans[index][env] = (how, slot, row, int(self.last_command[env]))
        for env, (slot, row) in lost.kept.items():
            index = int(self.env_worker[env])
            kept = (slot, row) in read or (slot, row) in pool.row_messages[index]
            if pool.slots[slot].messages[row] and not kept:
                plans[index][env] = ("rewrite", slot, row, int(self.last_command[env]))
        return plans

    def _ring_state(self, dead: Set[int]) -> RingState:
        """The ring since the last consumed row, and the running envs of ``dead``."""
        pool = self.pool
        batch, num_slots = self.batch_size, len(pool.slots)
        claims = []
        # A closed slot's rows past its batch are padding, claimed by no worker.
        padded = range(self.consumed_rows + (self.closed or 0), self.consumed_rows + batch)
        for n in range(self.consumed_rows, self.ring.claimed()):
            if self.closed is not None and n in padded:
                continue
            slot, row = (n // batch) % num_slots, n % batch
            claims.append((slot, row, int(pool.slots[slot].env_ids[row])))
        running = {
            env: index
            for index in sorted(dead)
            for env in pool.blocks[index]
            if not self.awaiting[env] and self.env_commands[env] == ENV_IDLE
        }
        published = {slot: self.published(slot) for slot, _, _ in claims}
        unready = {index: self.unready[index] for index in dead if index in self.unready}
        return RingState(claims, published, running, unready)
