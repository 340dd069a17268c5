"""The worker's pieces, driven directly in this process: the typed ``Block``
that crosses into the Cython loops (its round end, its step rounds, one env
alone, async rows) and the recovery plans. The end-to-end behaviour of the
same code is tested through ShmVectorEnv elsewhere (test_equivalence,
test_async, test_restart)."""

from __future__ import annotations

import os
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete

from shmvec import _core
from shmvec.in_process import LoopbackPipe
from shmvec.layout import RESULT_COLUMNS, make_layout
from shmvec.protocol import AUTORESET_NEXT_STEP, CALL, CLOSE, ENV_IDLE, ENV_STEP, STEP
from shmvec.spin import NO_SPIN
from shmvec.wires import EnvRecovery, RoundRecovery, recovery_plan
from shmvec.worker import Worker, WorkerSpec, make_envs


class CountingEnv(gym.Env):
    """Observes (its index, steps taken); the reward is the action; raises on a
    step while ``fail`` is set."""

    observation_space = Box(-1e6, 1e6, (2,), np.float64)
    action_space = Discrete(3)

    def __init__(self, index: int) -> None:
        self.index, self.t, self.fail = index, 0, False

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.array([self.index, 0.0]), {}

    def step(self, action):
        if self.fail:
            raise RuntimeError(f"env {self.index} failed")
        self.t += 1
        return np.array([self.index, float(self.t)]), float(action), False, False, {}


# A wait's limit that only a hung worker reaches (not a timing assumption).
HUNG_NS = 60_000_000_000


def make_worker(num_envs=4, first_env=0, num_workers=1, batch_size=None):
    """A worker over envs ``first_env ..`` of ``num_envs``, in this process, and
    the main process's side of its segment."""
    block_size = num_envs // num_workers
    spec = WorkerSpec(
        index=first_env // block_size, first_env=first_env,
        env_fns=[lambda i=i: CountingEnv(i) for i in range(first_env, first_env + block_size)],
        num_envs=num_envs, num_workers=num_workers, num_slots=2,
        batch_size=batch_size or num_envs, observation_space=CountingEnv.observation_space,
        action_space=CountingEnv.action_space, observation_mode="same", shared_memory=True,
        autoreset_mode=AUTORESET_NEXT_STEP, spin=NO_SPIN, main_pid=os.getpid(),
        use_death_signal=False, env_concurrency=1,
    )  # fmt: skip
    layout = make_layout(spec)
    segment = _core.Segment.create_private(layout.total_bytes)
    main_end, worker_end = LoopbackPipe.pair()
    worker = Worker(spec, segment, worker_end, make_envs(spec))
    barrier = _core.StepBarrier(segment, layout.barrier_offset, num_workers)
    return worker, barrier, segment, layout


def test_finish_round_publishes_and_arrives_before_it_sends():
    worker, barrier, _segment, _layout = make_worker()
    block = worker.block
    barrier.post(CALL, 0)
    block.generation = block.barrier.wait_command(block.generation, 0)[0]
    seen = []

    def send(message):  # what the main process can see when the message goes out
        seen.append((message, barrier.arrived(), barrier.messages(), block.flag[0]))

    block.send = send
    block.current_env[0] = 3
    block.finish_round({"results": [1]}, time.perf_counter_ns() - 1_000_000)
    assert seen == [({"results": [1]}, 1, 1, 1)]
    assert block.finished[0] == block.generation == barrier.generation
    assert block.current_env[0] == 0
    assert block.busy_ns[0] >= 1_000_000
    assert barrier.wait_done(0)

    block.flag[0] = 0
    barrier.post(CALL, 0)
    block.generation = block.barrier.wait_command(block.generation, 0)[0]
    block.finish_round({}, time.perf_counter_ns())  # nothing to send
    assert len(seen) == 1 and block.flag[0] == 0
    assert barrier.wait_done(0) and barrier.messages() == 0


def test_serve_rounds_runs_step_rounds_and_hands_back_other_commands():
    worker, barrier, _segment, layout = make_worker()
    block = worker.block
    slot = worker.slot_views[1]
    worker.action_views[0][:] = [2, 0, 1, 2]
    barrier.post(STEP, 1)  # ring slot 1
    assert block.serve_rounds(0, 10) == (1, None)  # then the next wait times out
    assert barrier.wait_done(0)
    assert slot.rewards.tolist() == [2.0, 0.0, 1.0, 2.0]
    assert slot.obs[0].tolist() == [[i, 1.0] for i in range(4)]

    barrier.post(STEP, 1)
    assert block.serve_rounds(-1, 1) == (1, None)  # max_rounds, no wait after
    assert barrier.wait_done(0)
    assert slot.obs[0][:, 1].tolist() == [2.0] * 4

    before = block.generation
    barrier.post(CALL, 0)
    ran, command = block.serve_rounds(0, 10)
    assert (ran, command) == (0, (barrier.generation, CALL, 0))
    assert block.generation == before  # the caller runs that command


def test_a_part_is_one_env_counted_from_the_worker_block():
    # The second of two workers: envs 3, 4, 5 of 6.
    worker, _barrier, _segment, _layout = make_worker(num_envs=6, first_env=3, num_workers=2)
    block = worker.block
    errors = []

    def on_error(i, exc):
        errors.append((i, str(exc)))
        return np.array([-1.0, -1.0]), 0.0, False, True, None

    block.on_error = on_error
    worker.envs[2].fail = True
    scratch = np.zeros(1, np.uint32)
    part = block.part(2, scratch)
    assert (part.first_row, part.first_index, len(part.envs)) == (5, 2, 1)
    slot = worker.slot_views[0]
    infos, errors_out, announced, spills = part.step_block(worker.action_views, slot.obs, 0)
    assert (infos, errors_out, announced, spills) == ([], [], [], [])
    assert errors == [(2, "env 5 failed")]  # i counts from the worker's first env
    assert slot.obs[0][5].tolist() == [-1.0, -1.0] and slot.truncations[5] == 1
    assert worker.autoreset.tolist() == [0, 0, 1]  # the part's flag is the block's
    assert slot.obs[0][3:5].tolist() == [[0.0, 0.0]] * 2  # the other rows untouched
    assert worker.current_env[0] == 0 and scratch[0] == 0


def test_step_pending_publishes_each_commanded_env_in_a_claimed_row():
    worker, _barrier, segment, layout = make_worker(num_envs=4, batch_size=2)
    block = worker.block
    commands = layout.env_commands(memoryview(segment))
    ring = _core.ResultRing(segment, layout.ring_offset, layout.num_slots, 2)
    worker.action_views[0][:] = [0, 1, 2, 1]
    commands[[1, 3]] = ENV_STEP
    block.step_pending()
    assert commands.tolist() == [ENV_IDLE] * 4
    assert ring.filled(0) == 2
    slot = worker.slot_views[0]
    assert slot.env_ids.tolist() == [1, 3]  # env order, rows in claim order
    assert slot.rewards.tolist() == [1.0, 1.0]
    assert slot.obs[0].tolist() == [[1.0, 1.0], [3.0, 1.0]]
    assert slot.messages.tolist() == [0, 0]
    assert block.current_env[0] == 0


def test_slot_views_name_the_result_columns():
    worker, _barrier, _segment, _layout = make_worker()
    views = worker.slot_views[0]
    for name, spec in RESULT_COLUMNS.items():
        column = getattr(views, name)
        assert (column.dtype, column.shape) == (spec.dtype, (4, *spec.shape))
    assert views.obs[0].shape == (4, 2)


def test_recovery_plans_are_typed_by_mode():
    assert recovery_plan(None) is None
    assert recovery_plan((STEP, 5)) == RoundRecovery(STEP, 5)
    lost = {2: ("claim", 0, 0, ENV_STEP)}
    assert recovery_plan(("async", lost)) == EnvRecovery(lost)
    with pytest.raises(ValueError):
        recovery_plan(("async",))
    sync_worker = make_worker()[0]
    with pytest.raises(TypeError):
        sync_worker.recover(EnvRecovery(lost))
    async_worker = make_worker(batch_size=2)[0]
    with pytest.raises(TypeError):
        async_worker.recover(RoundRecovery(STEP, 0))


def serving(worker) -> threading.Thread:
    """``worker.serve()`` in a thread, as a worker process runs it."""
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    return thread


def test_one_serve_loop_runs_sync_rounds_until_close():
    worker, barrier, _segment, _layout = make_worker()
    thread = serving(worker)
    worker.action_views[0][:] = 1
    for _ in range(3):
        barrier.post(STEP, 0)
        assert barrier.wait_done(HUNG_NS)
    assert worker.slot_views[0].obs[0].tolist() == [[i, 3.0] for i in range(4)]
    barrier.post(CLOSE, 0)
    assert barrier.wait_done(HUNG_NS)
    thread.join(HUNG_NS / 1e9)
    assert not thread.is_alive()


def test_one_serve_loop_runs_async_envs_until_close():
    worker, barrier, segment, layout = make_worker(num_envs=4, batch_size=2)
    ring = _core.ResultRing(segment, layout.ring_offset, layout.num_slots, 2)
    doorbell = _core.Doorbell(segment, layout.doorbell_offsets[0])
    commands = layout.env_commands(memoryview(segment))
    thread = serving(worker)
    worker.action_views[0][:] = [2, 0, 1, 0]
    commands[[0, 2]] = ENV_STEP  # the command, then the ring (shmvec/protocol.py)
    doorbell.ring()
    assert ring.wait_full(0, HUNG_NS)
    slot = worker.slot_views[0]
    assert sorted(zip(slot.env_ids.tolist(), slot.rewards.tolist())) == [(0, 2.0), (2, 1.0)]
    barrier.post(CLOSE, 0)
    doorbell.ring()
    assert barrier.wait_done(HUNG_NS)
    thread.join(HUNG_NS / 1e9)
    assert not thread.is_alive()
