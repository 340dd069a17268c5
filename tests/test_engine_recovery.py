"""What a dead worker's replacement must deliver, read from the wire's state.

The workers' side of the ring (claim a row, write its env id, publish) is
played by the test, in the main process, so each case is one exact state:
no process runs and nothing depends on the scheduler.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from gymnasium import spaces
from helpers import open_pool

from shmvec.codecs import make_codec
from shmvec.engine.async_wire import AsyncWire
from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.pool import WorkerPool
from shmvec.engine.sync_wire import SyncWire
from shmvec.protocol import CALL, ENV_IDLE, ENV_RESET, ENV_STEP, RESET, SET_ATTR, STEP

OBS_SPACE = spaces.Box(-1.0, 1.0, (3,), np.float32)


def _pool(num_envs: int, num_workers: int, batch_size: int, num_slots: int = 2) -> WorkerPool:
    """A pool with its segment open and no worker started."""
    return open_pool(num_envs, num_workers, batch_size, OBS_SPACE, num_slots)


def _async_wire(num_envs: int = 4, num_workers: int = 2, batch_size: int = 2) -> AsyncWire:
    pool = _pool(num_envs, num_workers, batch_size)
    decoder = ResultDecoder(make_codec(OBS_SPACE), pool.slots, pool.blocks, True, None)
    return AsyncWire(batch_size, pool, decoder)


class WorkerStandIn:
    """Plays a worker's part of the async wire: take an env's command, claim a
    row, write the env id (and message flag), publish."""

    def __init__(self, wire: AsyncWire) -> None:
        self.wire = wire

    def take(self, env: int) -> None:
        self.wire.env_commands[env] = ENV_IDLE

    def claim(self, env: int | None = None) -> tuple[int, int]:
        slot, row = self.wire.ring.claim()
        if env is not None:
            self.wire.pool.slots[slot].env_ids[row] = env
        return slot, row

    def deliver(self, env: int, message: bool = False) -> tuple[int, int]:
        self.take(env)
        slot, row = self.claim(env)
        self.wire.pool.slots[slot].messages[row] = int(message)
        self.wire.ring.publish(slot)
        return slot, row


def test_a_claimed_unwritten_row_is_filled_by_the_env_that_lost_its_result():
    # Worker 0 (envs 0, 1) took env 0's command, claimed a row and died before
    # writing it; env 1's command is still queued. Worker 1 delivered both its envs.
    wire = _async_wire()
    wire.start(np.arange(4, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(2)
    worker.take(0)
    hole = worker.claim()  # env id never written
    worker.deliver(3)
    assert hole == (0, 1)
    plan = wire.recovery_plans({0}, frozenset())[0]
    # env 0 fills the hole; env 1 is left to its queued command.
    assert plan == {0: ("hole", 0, 1, ENV_STEP)}


def test_a_written_unpublished_row_is_filled_by_its_own_env():
    wire = _async_wire()
    wire.start(np.arange(4, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(2)
    worker.take(1)
    worker.claim(1)  # env id written, row never published
    assert wire.recovery_plans({0}, frozenset())[0] == {1: ("hole", 0, 1, ENV_STEP)}


def test_an_env_whose_command_was_taken_but_no_row_claimed_claims_one():
    wire = _async_wire()
    wire.start(np.array([0, 2], dtype=np.int64), ENV_RESET)
    worker = WorkerStandIn(wire)
    worker.deliver(2)
    worker.take(0)  # the dead worker took it, then died before claiming
    assert wire.recovery_plans({0}, frozenset())[0] == {0: ("claim", 0, 0, ENV_RESET)}


def test_published_rows_are_kept_unless_their_message_was_lost():
    wire = _async_wire(num_envs=6, num_workers=2, batch_size=3)
    wire.start(np.arange(6, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    plain = worker.deliver(0)  # no message: nothing to redo
    read = worker.deliver(1, message=True)  # main read its message already
    lost = worker.deliver(2, message=True)  # its message died with the worker
    assert (plain, read, lost) == ((0, 0), (0, 1), (0, 2))
    plan = wire.recovery_plans({0}, {read})[0]
    assert plan == {2: ("rewrite", 0, 2, ENV_STEP)}


def test_a_message_still_in_the_dead_workers_pipe_is_not_lost():
    wire = _async_wire(num_envs=6, num_workers=2, batch_size=3)
    wire.start(np.arange(6, dtype=np.int64), ENV_STEP)
    row = WorkerStandIn(wire).deliver(1, message=True)
    wire.pool.row_messages[0][row] = {"row": row, "infos": []}
    assert wire.recovery_plans({0}, frozenset())[0] == {}


def test_consumed_rows_are_done_with():
    # A batch main has received is not looked at again: its envs await commands.
    wire = _async_wire()
    wire.start(np.arange(4, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(0, message=True)
    worker.deliver(2, message=True)
    assert wire.received(0).tolist() == [0, 2]
    wire.start(np.array([0], dtype=np.int64), ENV_STEP)
    worker.take(0)  # running again, no row yet
    assert wire.recovery_plans({0}, frozenset())[0] == {0: ("claim", 0, 0, ENV_STEP)}


def test_more_unwritten_rows_than_envs_without_a_row_is_an_internal_error():
    # Env 0 of worker 0 has its row; nobody could have claimed the unwritten one.
    wire = _async_wire()
    wire.start(np.array([0, 2], dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(0)
    worker.claim()
    with pytest.raises(RuntimeError, match="1 unwritten rows, but only envs"):
        wire.recovery_plans({0}, frozenset())


def test_an_unpublished_row_of_a_live_worker_is_an_internal_error():
    wire = _async_wire()
    wire.start(np.arange(4, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.take(2)
    worker.claim(2)  # worker 1 lives: it would have published
    with pytest.raises(RuntimeError, match="slot 0 lacks 1 written rows, but 0 could be"):
        wire.recovery_plans({0}, frozenset())


# --------------------------------------------------- several deaths at once


def test_two_workers_dead_at_once_each_fill_what_they_left():
    # Worker 0 (envs 0-1) died between claiming env 0's row and writing it;
    # worker 1 (envs 2-3) after writing env 3's row, before publishing it;
    # worker 2 (envs 4-5, alive) delivered both. One plan for both dead ones.
    wire = _async_wire(num_envs=6, num_workers=3, batch_size=3)
    wire.start(np.arange(6, dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(4)
    worker.take(0)
    unwritten = worker.claim()
    worker.deliver(2)
    worker.take(3)
    written = worker.claim(3)
    worker.deliver(5)
    worker.take(1)  # taken, no row claimed
    plans = wire.recovery_plans({0, 1}, frozenset())
    assert plans == {
        0: {0: ("hole", *unwritten, ENV_STEP), 1: ("claim", 0, 0, ENV_STEP)},
        1: {3: ("hole", *written, ENV_STEP)},
    }


def test_an_unwritten_row_may_be_filled_by_another_dead_workers_env():
    # Both dead workers took an env's command; one row was claimed, never
    # written: whose it was cannot be told, and need not be. One env fills it,
    # the other claims a new row; each delivers one result.
    wire = _async_wire(num_envs=6, num_workers=3, batch_size=3)
    wire.start(np.array([0, 2, 4], dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.deliver(4)
    worker.take(0)
    worker.take(2)
    hole = worker.claim()
    plans = wire.recovery_plans({0, 1}, frozenset())
    assert plans == {0: {0: ("hole", *hole, ENV_STEP)}, 1: {2: ("claim", 0, 0, ENV_STEP)}}


def test_when_the_count_cannot_tell_which_row_is_in_both_are_written_again():
    # Dead workers 0 and 1 each wrote their last row in slot 0; the slot's count
    # says one of them is published, not which. Both rows are written again
    # (their messages, if any, replaced) and one of the rewrites publishes.
    wire = _async_wire(num_envs=6, num_workers=3, batch_size=3)
    wire.start(np.array([0, 2], dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    published = worker.deliver(0, message=True)
    wire.pool.row_messages[0][published] = {"row": published, "info_columns": {"x": 0}}
    worker.take(2)
    unpublished = worker.claim(2)
    plans = wire.recovery_plans({0, 1}, frozenset())
    assert plans == {
        0: {0: ("hole", *published, ENV_STEP)},
        1: {2: ("rewrite", *unpublished, ENV_STEP)},
    }
    assert wire.pool.row_messages[0] == {}  # replaced by the replacement's
    # Main waits for both rows' new messages before it reads the slot.
    assert wire.pool.slots[0].messages[:2].tolist() == [1, 1]
    assert wire.decoder.schemas[0] == {"x": 0}  # its columns learnt first
    # The slot fills once: one publish for the two rows.
    wire.ring.publish(0)
    wire.start(np.array([4], dtype=np.int64), ENV_STEP)
    worker.deliver(4)
    assert wire.ring.wait_full(0, 0)


def test_a_replacement_that_died_while_filling_an_earlier_row_is_read_right():
    # Worker 0 died with env 0's row unpublished; its replacement filled that
    # row (env id written) and died before publishing it, while env 1's later
    # row, published by the first worker, stands. The unpublished row is not
    # the last one worker 0 claimed: an unready replacement's plan says which
    # rows it may have left unpublished.
    wire = _async_wire(num_envs=6, num_workers=3, batch_size=3)
    wire.start(np.array([0, 1, 4], dtype=np.int64), ENV_STEP)
    worker = WorkerStandIn(wire)
    worker.take(0)
    hole = worker.claim()
    later = worker.deliver(1)
    worker.deliver(4)
    first = wire.recovery({0}, frozenset())
    assert first == {0: ("async", {0: ("hole", *hole, ENV_STEP)})}
    wire.pool.slots[hole[0]].env_ids[hole[1]] = 0  # the replacement's write; then it died
    plans = wire.recovery_plans({0}, frozenset())
    assert plans == {0: {0: ("hole", *hole, ENV_STEP)}}
    assert later not in [p[1:3] for p in plans[0].values()]
    wire.restarted(0)  # the next replacement is ready: its rows are ordinary again
    assert wire.unready == {}


def test_async_resend_gives_running_envs_their_last_reset():
    wire = _async_wire()
    sent = []
    wire.pool.send = lambda index, tag, payload: sent.append((index, tag, payload))
    wire.send_reset(0, {0: (7, None), 1: (8, {"a": 1})})
    wire.start(np.array([1], dtype=np.int64), ENV_RESET)  # env 0 stays idle
    sent.clear()
    wire.resend(0)
    assert sent == [(0, "reset", {1: (8, {"a": 1})})]


class PoolStandIn:
    """What SyncWire uses of a pool: sends, and the barrier's words."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.sent: list[tuple] = []
        self.finished = np.zeros(num_workers, dtype=np.uint32)
        self.barrier = type("Barrier", (), {"generation": 3})()

    def send(self, index: int, tag: str, payload) -> None:
        self.sent.append((index, tag, payload))


def test_sync_recovery_redoes_the_step_or_reset_round_pending():
    wire = SyncWire(PoolStandIn(3))
    assert wire.busy_workers({1}) == []  # the round's wait waits for the others
    wire.posted(STEP, 5)
    assert wire.recovery({1}, frozenset()) == {1: (STEP, 5)}
    wire.ended()
    assert wire.recovery({1}, frozenset()) == {1: (CALL, 5)}  # no round: its envs only reset
    wire.posted(RESET, 6 | 2 << 16)  # slot 6, a lease region
    assert wire.recovery({1}, frozenset()) == {1: (RESET, 6 | 2 << 16)}
    assert wire.recovery({0, 2}, frozenset()) == {0: (RESET, 6 | 2 << 16), 2: (RESET, 6 | 2 << 16)}
    wire.posted(SET_ATTR, 0)  # any other round: as a call into the last slot
    assert wire.recovery({1}, frozenset()) == {1: (CALL, 6)}


def test_sync_resend_repeats_a_pending_reset_only():
    pool = PoolStandIn(2)
    wire = SyncWire(pool)
    wire.send_reset(0, ("seeds 0", "options 0", None))
    wire.send_reset(1, ("seeds 1", "options 1", None))
    wire.posted(RESET, 0)
    pool.sent.clear()
    wire.resend(1)
    assert pool.sent == [(1, "reset", ("seeds 1", "options 1", None))]
    wire.posted(STEP, 1)
    wire.resend(1)
    assert len(pool.sent) == 1


def test_sync_stuck_workers_are_those_unfinished_past_the_timeout():
    pool = PoolStandIn(3)
    pool.finished[:] = [3, 2, 3]  # worker 1 has not finished generation 3
    wire = SyncWire(pool)
    assert wire.stuck_workers(round_started=0.0, env_timeout=1.0) == [1]
    assert wire.stuck_workers(round_started=time.monotonic(), env_timeout=60.0) == []


def test_a_replacement_is_not_taken_for_stuck_in_the_env_its_predecessor_died_in():
    """A worker killed inside env 3 leaves its words saying so; until the
    replacement steps, env_timeout must not read them as the replacement's."""
    wire = _async_wire(num_envs=4, num_workers=2)
    pool = wire.pool
    pool.current_env[1] = 3 + 1  # worker 1 died in env 3 ...
    pool.env_started_ns[1] = 1  # ... long ago
    assert wire.stuck_workers(round_started=0.0, env_timeout=0.5) == [1]

    class Dead:
        exitcode = -9

        def join(self, timeout=None):
            pass

    class PipeStandIn:
        def poll(self, timeout=0):
            return False

        def close(self):
            pass

    pool.workers, pool.pipes = [Dead(), Dead()], [PipeStandIn(), PipeStandIn()]
    pool.start_worker = lambda index, **changes: ("replacement", PipeStandIn())
    pool.replace(1)
    assert pool.workers[1] == "replacement"
    assert wire.stuck_workers(round_started=0.0, env_timeout=0.5) == []
