"""ROLL's env threads: one thread per env runs whole trajectories, calling a shared
batching policy each turn; optionally one lock around every env step.

Mirrors alibaba/ROLL ``roll/pipeline/agentic/environment_worker.py`` (a
``ThreadPoolExecutor`` with one thread per env manager, "process + threads") and
``roll/pipeline/agentic/env_manager/traj_env_manager.py`` (``run_rollout_loop``:
take the group's next episode, reset, then generate and ``env.step`` until done;
``use_thread_lock`` puts the step behind one lock). The inference side is a
batcher thread that takes every pending request whenever the policy is free, as
an inference server's continuous batching does. Groups come out as they complete
(ROLL's ``GroupQueue``), and the env threads keep running between batches (its
async mode). An env's exception ends the rollout (no try/except around ``step``).
With ``--policy server`` each env thread makes its own blocking request per turn
(ROLL's env managers wait on their generate request), over one shared client.
"""

from __future__ import annotations

import threading

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.policies import Batcher, Stopped
from shmvec_bench.rollouts.records import GroupAssembler, RunContext, TrajRecord, now
from shmvec_bench.rollouts.server import ServerRun
from shmvec_bench.rollouts.server import Stopped as ServerStopped
from shmvec_bench.rollouts.workloads import RELEASE_HANGS, make_env


class RollThreads:
    def __init__(self, ctx: RunContext, use_thread_lock: bool) -> None:
        RELEASE_HANGS.clear()
        self.ctx = ctx
        self.assembler = GroupAssembler(ctx.stream, ctx.group_size)
        self.server = ctx.policy if isinstance(ctx.policy, ServerRun) else None
        self.batcher = None if self.server else Batcher(ctx.policy)
        self.lock = threading.Lock() if use_thread_lock else None
        self.env_steps = 0
        self._count = threading.Lock()
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"env-{i}", daemon=True)
            for i in range(ctx.num_envs)
        ]
        for thread in self.threads:
            thread.start()

    def _step(self, env, action):
        if self.lock is None:
            return env.step(action)
        with self.lock:
            return env.step(action)

    def _asker(self):
        """A new trajectory's ``ask(observation) -> action``."""
        if self.server is None:
            return self.batcher.ask
        conversation = self.server.conversation()

        def ask(observation: str) -> str:
            if self._stop.is_set():
                raise ServerStopped("the runner is closing")
            return conversation.ask(observation, self.ctx.num_envs)

        return ask

    def _loop(self, index: int) -> None:
        try:
            env = make_env(self.ctx.workload, index)
            while not self._stop.is_set():
                task, seed, member = self.assembler.take()
                started = now()
                obs, _ = env.reset(seed=seed)
                steps, total = 0, 0.0
                ask = self._asker()
                while True:
                    action = ask(obs)
                    obs, reward, terminated, truncated, _ = self._step(env, action)
                    steps += 1
                    total += reward
                    with self._count:
                        self.env_steps += 1
                    if terminated or truncated:
                        break
                status = "done" if terminated else "truncated"
                self.assembler.finish(
                    TrajRecord(task, seed, member, started, now(), steps, total, status)
                )
        except (Stopped, ServerStopped):
            return
        except BaseException as exc:
            self.assembler.fail(exc)

    def get_batch(self):
        return self.assembler.wait_groups(self.ctx.groups_per_batch)

    def env_pids(self):
        return []

    def stats(self):
        return None

    def close(self, terminate: bool = False) -> None:
        """Stops the env threads at their next policy request and waits for them (each ends
        its env step or server request first), unless ``terminate``."""
        self._stop.set()
        RELEASE_HANGS.set()
        if self.batcher is not None:
            self.batcher.close()
        if not terminate:
            for thread in self.threads:
                thread.join()


@register(
    "roll-threads",
    summary="B3 ROLL: a thread per env, a shared batching policy, groups as they complete",
    mirrors="roll/pipeline/agentic/environment_worker.py, env_manager/traj_env_manager.py",
)
class RollThreadsNoLock(RollThreads):
    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx, use_thread_lock=False)


@register(
    "roll-threads-lock",
    summary="B3 ROLL with use_thread_lock: the same, every env step behind one lock",
    mirrors="roll/pipeline/agentic/env_manager/traj_env_manager.py (use_thread_lock)",
)
class RollThreadsLock(RollThreads):
    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx, use_thread_lock=True)
