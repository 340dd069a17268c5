"""How work reaches a worker, and how a replacement worker recovers, per mode.

The worker's loop (``shmvec.worker.Worker.serve``) is one for both modes:
``wait_for_work``, then ``work``; a replacement first does ``recover(plan)``
(``RoundRecovery``, ``EnvRecovery``). Which thread may call: the worker's own
(for a block in the main process, the main thread).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmvec import _worker_loop
from shmvec.protocol import ENV_RESET, RESET, SLOT_MASK, STEP


@dataclass(frozen=True)
class RoundRecovery:
    """Sync mode: a replacement redoes its part of the round its predecessor
    died in (the main process's ``engine.sync_wire.SyncWire.recovery``)."""

    kind: int  # the round's command: STEP, RESET, or CALL for any other
    arg: int  # the round's arg (ring slot and observation region)


@dataclass(frozen=True)
class EnvRecovery:
    """Async mode: each env of the block whose result died with the old worker
    (or with a replacement that died before it was ready), mapped to ``(how,
    slot, row, command)`` (the main process's
    ``engine.async_wire.AsyncWire.recovery_plans``)."""

    lost: dict[int, tuple[str, int, int, int]]


def recovery_plan(recover: tuple | None) -> RoundRecovery | EnvRecovery | None:
    """``WorkerSpec.recover`` as a typed plan (None: not a replacement)."""
    match recover:
        case None:
            return None
        case ("async", lost):
            return EnvRecovery(lost)
        case (kind, arg):
            return RoundRecovery(kind, arg)
    raise ValueError(f"not a recovery plan: {recover!r}")


class SyncWire:
    """Sync mode: work is the step barrier's next command. Plain step rounds run
    in ``Block.serve_rounds``, for as many rounds as concurrent_envs allows
    (pickled observations need ``Worker.message``'s dict: those go through
    ``Worker.run_command``)."""

    def __init__(self, worker: Any) -> None:  # a shmvec.worker.Worker
        self.worker = worker
        self.block = worker.block
        self.serial = not worker.obs_codec.pickled
        self.command: tuple | None = None
        self.waiter = self.block.barrier  # what wait_for_work sleeps on (its spin: Worker)

    def wait_for_work(self, timeout_ns: int) -> bool:
        """Waits for a command (running plain step rounds meanwhile); False if
        the wait timed out."""
        block, concurrency = self.block, self.worker.concurrency
        serial = concurrency.serial_rounds() if self.serial else 0  # hook: concurrent_envs
        if not serial:
            self.command = block.barrier.wait_command(block.generation, timeout_ns)
            return self.command is not None
        ran, self.command = block.serve_rounds(timeout_ns, serial)
        # all rounds ran: a pinned worker's check for child processes is due
        return self.command is not None or ran == serial

    def work(self) -> bool:
        """Runs the command waited for; False once the worker must exit."""
        command, self.command = self.command, None
        return command is None or self.worker.run_command(command)

    def poll_now(self) -> bool:
        """Runs a command posted since the last one, if any, without waiting."""
        barrier = self.block.barrier
        if barrier.generation_now() == self.block.generation:
            return True
        return self.worker.run_command(barrier.wait_command(self.block.generation, 0))

    def recover(self, plan: RoundRecovery | EnvRecovery) -> dict:
        """Resets every env (all are new) as the round of ``plan`` asks: in a STEP
        round each reports a truncated episode (``Worker.truncated_reset``), in a
        RESET round the reset asked for (the main process sends it again); both
        with ``info["worker_restarted"]``. Returns the round's message."""
        if not isinstance(plan, RoundRecovery):
            raise TypeError(f"a sync-mode worker cannot recover by {plan!r}")
        worker, kind = self.worker, plan.kind
        obs_target = worker.obs_target(plan.arg)
        slot = plan.arg & SLOT_MASK
        worker.slot_views[slot].info_codes[worker.rows.start : worker.rows.stop] = 0
        why = {"worker_restarted": True}
        infos, errors, spills = [], [], []
        if kind == RESET:  # the reset asked for, of every env (all are new)
            seeds, options, mask = worker.recv("reset")
            if mask is not None:
                seeds = [s if m else None for s, m in zip(seeds, mask)]
                options = [o if m else None for o, m in zip(options, mask)]
        for i, row in enumerate(worker.rows):
            try:
                if kind == STEP:
                    result = worker.truncated_reset(i, why)
                    worker.autoreset[i] = 1
                elif kind == RESET:
                    result = _worker_loop.reset_result(worker.envs[i], seeds[i], options[i], why)
                else:
                    worker.envs[i].reset()
                    continue
                spill = self.block.stepper.write(obs_target, self.block.slots[slot], row, result)
                infos.append((row, result[4]))
                if spill:
                    spills.append((row, spill))
            except Exception as exc:  # noqa: BLE001 - re-raised in the main process
                errors.append((row, exc, traceback.format_exc()))
        if kind not in (STEP, RESET):
            return worker.message([], errors, {})
        return worker.message(infos, errors, obs_target, (), spills)


class AsyncWire:
    """Async mode: the worker's doorbell says there is work: a barrier command
    (call, set_attr, close), then every env that has a command
    (``Block.step_pending``), each result a ring row."""

    def __init__(self, worker: Any, address: int, layout, buffer) -> None:
        """``worker``: the ``shmvec.worker.Worker`` it serves; ``address``: the
        segment's, whose ``layout`` places the doorbell and ring; ``buffer``: the
        segment as a buffer."""
        spec = worker.spec
        self.worker = worker
        self.block = block = worker.block
        self.doorbell = _worker_loop.WorkerDoorbell(address + layout.doorbell_offsets[spec.index])
        self.rings = 0  # the doorbell's count last seen
        self.ring = block.ring = _worker_loop.WorkerRing(
            address + layout.ring_offset, layout.num_slots, spec.batch_size
        )
        block.commands = layout.env_commands(buffer)[worker.rows.start : worker.rows.stop]
        self.restarted = np.zeros(len(worker.envs), dtype=np.uint8)  # see recover
        block.restarted = self.restarted
        self.reset_args: dict = {}
        block.take_reset_args = self.take_reset_args
        block.restart = self.restart_result
        self.waiter = self.doorbell  # what wait_for_work sleeps on (its spin: Worker)

    def wait_for_work(self, timeout_ns: int) -> bool:
        """Waits for the doorbell; False if the wait timed out."""
        seen = self.doorbell.wait(self.rings, timeout_ns)
        if seen is None:
            return False
        self.rings = seen
        return True

    def work(self) -> bool:
        """Runs a barrier command if one was posted, then every env that has a
        command; False once the worker must exit."""
        worker, block = self.worker, self.block
        if block.barrier.generation_now() != block.generation:
            worker.concurrency.drain()  # hook: no env thread runs during call/set_attr/close
            if not worker.run_command(block.barrier.wait_command(block.generation, 0)):
                return False
        started = time.perf_counter_ns()
        worker.concurrency.run_pending(block)  # hook: Block.step_pending, or threads
        worker.busy_ns[0] += time.perf_counter_ns() - started
        return True

    poll_now = work

    def take_reset_args(self, env_id: int) -> tuple:
        """(seed, options) of env_id's reset; the main sent them before the command."""
        while env_id not in self.reset_args:
            self.reset_args.update(self.worker.recv("reset"))
        return self.reset_args.pop(env_id)

    def restart_result(self, i: int, command: int) -> tuple:
        """The result env ``i`` reports for its first command after a restart: a
        reset as asked, or a truncated episode, both with
        ``info["worker_restarted"]``."""
        why = {"worker_restarted": True}
        worker = self.worker
        if command == ENV_RESET:
            seed, options = self.take_reset_args(worker.rows.start + i)
            return _worker_loop.reset_result(worker.envs[i], seed, options, why)
        return worker.truncated_reset(i, why)

    def recover(self, plan: RoundRecovery | EnvRecovery) -> None:
        """Delivers the result of each env in ``plan.lost``: it claims a new row
        (``"claim"``), fills the ``"hole"`` (slot, row) the old worker claimed
        but never published, or rewrites (``"rewrite"``) a published row whose
        message was lost. Every other env reports ``restart_result`` for its
        next command (``restarted``)."""
        if not isinstance(plan, EnvRecovery):
            raise TypeError(f"an async-mode worker cannot recover by {plan!r}")
        worker, pickled = self.worker, self.worker.obs_codec.pickled
        for env_id, (how, slot, row, command) in plan.lost.items():
            i = env_id - worker.rows.start
            result = self.restart_result(i, command)
            if how == "claim":
                slot, row = self.ring.claim()
            views, columns = worker.slot_views[slot], self.block.slots[slot]
            obs_target = {} if pickled else columns.obs_columns()
            spill = self.block.stepper.write(obs_target, columns, row, result)
            views.info_codes[row] = 0
            views.env_ids[row], views.messages[row] = env_id, 1
            worker.autoreset[i] = 1 if result[3] else 0
            if how != "rewrite":
                self.ring.publish(slot)
            message: dict[str, Any] = {"row": (slot, row), "infos": [(row, result[4])]}
            if spill:
                message["spills"] = [(row, spill)]
            if pickled:
                message["obs"] = obs_target
            worker.send(message)
        for i, env_id in enumerate(worker.rows):
            self.restarted[i] = env_id not in plan.lost
