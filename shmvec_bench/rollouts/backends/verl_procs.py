"""verl-agent's lock-step rollouts: one process per env, a gather after every turn.

Mirrors verl-agent ``agent_system/environments/env_package/*/envs.py`` (e.g.
``sokoban/envs.py``: one ``ray.remote`` worker per env, ``ray.get`` over all of
them each step) driven by ``agent_system/multi_turn_rollout/rollout_loop.py``
``vanilla_multi_turn_loop``: each turn generates for the *whole* batch and steps
*every* env; finished envs are only masked. multiprocessing processes and pipes
stand in for Ray actors (one interpreter per env, as a Ray worker is). An env's
exception reaches the trainer as one (``ray.get`` re-raises it).
"""

from __future__ import annotations

import multiprocessing

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.lockstep import Lockstep
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import make_env


class RemoteEnvError(RuntimeError):
    """An env's exception, raised again in the trainer."""


def serve(workload: str, index: int, conn) -> None:
    """An env process: reset/step on request until told to close."""
    env = make_env(workload, index)
    while True:
        command, data = conn.recv()
        if command == "close":
            return
        try:
            if command == "reset":
                result = env.reset(seed=data)[0]
            else:
                result = env.step(data)[:4]
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


@register(
    "verl-procs",
    summary="B2 verl-agent: lock-step, one process per env, a gather each turn",
    mirrors="agent_system/environments/env_package/*/envs.py, rollout_loop.py",
    lockstep=True,
)
class VerlProcs(Lockstep):
    ROLLOUT = {"generate_for_finished": True, "step_finished": True}

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        mp = multiprocessing.get_context(ctx.context)
        self.conns, self.procs = [], []
        for i in range(ctx.num_envs):
            parent, child = mp.Pipe()
            proc = mp.Process(target=serve, args=(ctx.workload, i, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        # Every env built and answering before the first turn (a Ray actor's __init__).
        self._gather(range(ctx.num_envs), "reset", [None] * ctx.num_envs)

    def _gather(self, ids, command, payloads):
        for i, data in zip(ids, payloads):
            self.conns[i].send((command, data))
        results = []
        for i in ids:
            if not self.conns[i].poll(None):
                raise RemoteEnvError(f"env {i}'s process gave no answer")
            try:
                status, value = self.conns[i].recv()
            except EOFError:
                raise RemoteEnvError(
                    f"env {i}'s process died (exit code {self.procs[i].exitcode})"
                ) from None
            if status == "error":
                raise RemoteEnvError(f"env {i}: {value}")
            results.append(value)
        return results

    def _reset(self, seeds):
        return self._gather(range(self.ctx.num_envs), "reset", seeds)

    def _step(self, ids, actions):
        return self._gather(ids, "step", actions)

    def env_pids(self):
        return [p.pid for p in self.procs if p.is_alive()]

    def close(self, terminate: bool = False) -> None:
        for conn in self.conns:
            if not terminate:
                try:
                    conn.send(("close", None))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(0 if terminate else 2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
