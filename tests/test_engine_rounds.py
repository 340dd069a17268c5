"""RoundDriver: barrier rounds posted, waited for and finished.

The barrier and the pool are stand-ins whose state the test sets (a worker
finished, flagged a message, died), so no case waits on another process.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from shmvec.engine.rounds import RoundDriver
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.engine.sync_wire import SyncWire
from shmvec.errors import WorkerDiedError
from shmvec.protocol import CALL, RESET, STEP


class BarrierStandIn:
    """A barrier whose round is done when the test says so."""

    def __init__(self) -> None:
        self.generation = 0
        self.posts: list[tuple[int, int]] = []
        self.done = True
        self.flagged = 0

    def post(self, kind: int, arg: int) -> None:
        self.generation += 1
        self.posts.append((kind, arg))

    def wait_done(self, budget_ns: int) -> bool:
        return self.done

    def messages(self) -> int:
        return self.flagged


class ProcessStandIn:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass


class PoolStandIn:
    """The workers of 6 envs in 3 blocks; ``dies`` is raised once by the next
    liveness check; ``replies`` are what each worker has sent."""

    def __init__(self, num_envs: int = 6, num_workers: int = 3, ring_depth: int = 3) -> None:
        size = num_envs // num_workers
        self.blocks = [range(i * size, (i + 1) * size) for i in range(num_workers)]
        self.num_workers = num_workers
        self.barrier = BarrierStandIn()
        self.main_worker = None
        self.slots = [object()] * ring_depth
        self.message_flags = np.zeros(num_workers, dtype=np.uint32)
        self.finished = np.zeros(num_workers, dtype=np.uint32)
        self.current_env = np.zeros(num_workers, dtype=np.uint32)
        self.workers = [ProcessStandIn(100 + i) for i in range(num_workers)]
        self.replies: dict[int, list[dict]] = {i: [] for i in range(num_workers)}
        self.sent: list[tuple] = []
        self.replaced: list[tuple] = []
        self.dies: WorkerDiedError | None = None

    def send(self, index: int, tag: str, payload) -> None:
        self.sent.append((index, tag, payload))

    def recv(self, index: int, timeout: float | None, row: bool = False) -> dict:
        return self.replies[index].pop(0)

    def run_main_worker(self) -> None:
        pass

    def dead_workers(self) -> set[int]:
        return {i for i, p in enumerate(self.workers) if p.exitcode is not None}

    def drain(self, index: int) -> None:
        pass

    def check_all_alive(self) -> None:
        error, self.dies = self.dies, None
        if error is not None:
            raise error

    def replace(self, index: int, **changes) -> None:
        self.replaced.append((index, changes["recover"]))

    def expect_ready(self, index: int, who: str) -> dict:
        return {"ready": 1, "recovered": {"infos": [(index, {"worker_restarted": True})]}}


class DecoderStandIn:
    leases = None
    copy = True

    def __init__(self, num_workers: int) -> None:
        self.schemas = [{} for _ in range(num_workers)]

    def remote_error(self, errors: list) -> BaseException:
        return errors[0][1]


def _rounds(restart: bool = False) -> tuple[RoundDriver, PoolStandIn, SyncWire]:
    pool = PoolStandIn()
    decoder = DecoderStandIn(pool.num_workers)
    wire = SyncWire(pool)
    supervisor = Supervisor(pool, decoder, Stats(), wire, None, restart)
    return RoundDriver(pool, supervisor, decoder, Stats(), wire), pool, wire


def test_post_reset_sends_each_worker_its_block_and_posts_into_the_next_slot():
    rounds, pool, wire = _rounds()
    mask = np.array([True, False, True, True, False, False])
    rounds.post_reset(list(range(10, 16)), [{"o": i} for i in range(6)], mask)
    assert [(index, tag) for index, tag, _ in pool.sent] == [(i, "reset") for i in range(3)]
    seeds, options, block_mask = pool.sent[1][2]
    assert (seeds, options, block_mask.tolist()) == ([12, 13], [{"o": 2}, {"o": 3}], [True, True])
    assert pool.barrier.posts == [(RESET, 1)] and rounds.slot == 1
    assert wire.recovery({0}, frozenset()) == {0: (RESET, 1)}
    assert rounds.reset_mask.tolist() == mask.tolist() and rounds.reset_mask is not mask


def test_slots_rotate_through_the_ring_and_each_reuse_is_announced():
    rounds, pool, _ = _rounds()
    reused = []
    rounds.before_slot_reuse = reused.append
    assert [rounds.next_slot() for _ in range(4)] == [1, 2, 0, 1]
    assert reused == [1, 2, 0, 1]


def test_a_clean_step_round_needs_no_finish():
    rounds, pool, wire = _rounds()
    assert rounds.step_round() is True
    assert pool.barrier.posts == [(STEP, 1)]
    assert wire.recovery({0}, frozenset()) == {0: (STEP, 1)}
    pool.barrier.flagged = 1  # a worker flagged a message: finish() reads it
    assert rounds.step_round() is False


def test_finish_reads_the_flagged_workers_messages_in_worker_order():
    rounds, pool, wire = _rounds()
    rounds.post(CALL)
    pool.barrier.flagged = 2
    pool.message_flags[:] = [1, 0, 1]
    pool.replies[0].append({"results": [0]})
    pool.replies[2].append({"results": [2]})
    assert rounds.finish(None, "call_wait") == {0: {"results": [0]}, 2: {"results": [2]}}
    assert pool.message_flags.tolist() == [0, 0, 0]
    assert rounds.kind is None and wire.kind is None


def test_finish_reraises_an_env_error():
    rounds, pool, _ = _rounds()
    rounds.post(STEP, rounds.next_slot())
    pool.barrier.flagged = 1
    pool.message_flags[1] = 1
    pool.replies[1].append({"errors": [(3, ValueError("env 3 broke"), "tb")]})
    with pytest.raises(ValueError, match="env 3 broke"):
        rounds.finish(None, "step_wait")


def test_a_worker_that_dies_in_a_reset_round_is_replaced_and_its_envs_are_new():
    rounds, pool, _ = _rounds(restart=True)
    rounds.post_reset([None] * 6, [None] * 6, np.array([True, False] * 3))
    pool.sent.clear()
    pool.barrier.done = False  # the round ends when the others have finished it
    pool.finished[:] = [pool.barrier.generation, 0, pool.barrier.generation]
    pool.dies = WorkerDiedError(1, pool.blocks[1], -9, 101)
    messages = rounds.finish(None, "reset_wait")
    assert pool.replaced == [(1, (RESET, 1))]
    [(index, tag, (seeds, options, block_mask))] = pool.sent  # its reset, again
    assert (index, tag, seeds, options) == (1, "reset", [None, None], [None, None])
    assert block_mask.tolist() == [True, False]
    assert messages == {1: {"infos": [(1, {"worker_restarted": True})]}}
    # Worker 1's envs (2, 3) were all reset: none keeps its old observation.
    assert rounds.reset_mask.tolist() == [True, False, True, True, True, False]


def test_a_worker_that_dies_in_a_call_is_replaced_and_the_call_raises():
    rounds, pool, _ = _rounds(restart=True)
    rounds.post(CALL)
    pool.barrier.done = False
    pool.finished[:] = pool.barrier.generation
    pool.dies = WorkerDiedError(2, pool.blocks[2], 1, 102)
    with pytest.raises(WorkerDiedError) as error:
        rounds.finish(None, "call_wait")
    assert pool.replaced == [(2, (CALL, 0))]
    assert "the worker was restarted and its envs reset" in "".join(error.value.__notes__)


def test_without_restart_a_death_in_a_round_propagates():
    rounds, pool, _ = _rounds(restart=False)
    rounds.post(STEP, rounds.next_slot())
    pool.barrier.done = False
    pool.dies = WorkerDiedError(0, pool.blocks[0], -9, 100)
    with pytest.raises(WorkerDiedError):
        rounds.finish(None, "step_wait")
    assert pool.replaced == []


def test_a_timed_out_round_names_the_late_workers_and_is_finished_first_next_time():
    rounds, pool, _ = _rounds()
    rounds.post(STEP, rounds.next_slot())
    pool.barrier.done = False
    pool.finished[:] = [pool.barrier.generation, 0, 0]
    pool.current_env[:] = [0, 4, 0]  # worker 1 is in env 3
    late = r"worker 1 \(envs 2\.\.3, in env 3\), worker 2 \(envs 4\.\.5\)"
    with pytest.raises(multiprocessing.TimeoutError, match=late):
        rounds.finish(0.0, "step_wait")
    assert rounds.unfinished
    pool.barrier.done = True
    rounds.finish_unfinished()
    assert not rounds.unfinished
