"""The engine behind ShmVectorEnv, in parts with one job each.

- ``pool.WorkerPool``: the segment, the worker processes, their pipes, liveness.
- ``rounds.RoundDriver``: barrier rounds: post, wait, finish, and step's short path.
- ``supervisor.Supervisor``: waits that notice deaths, ``env_timeout``, and one
  ``replace_worker`` for sync and async mode.
- ``async_engine.AsyncEngine``: the result ring, doorbells and env commands.
- ``decoder.ResultDecoder``: ring rows and messages to observations and infos.
- ``leases.ObsLeases``: large sync observations handed over without a copy.
- ``stats.Stats``: what ``stats()`` reports.

``build_engine`` wires them; ShmVectorEnv keeps only gymnasium's state machine
and the argument checks. What crosses process boundaries is shmvec/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmvec.engine.async_engine import AsyncEngine
from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.leases import ObsLeases
from shmvec.engine.pool import SetupError, WorkerPool
from shmvec.engine.rounds import RoundDriver
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.spin import SpinPolicy
from shmvec.worker import WorkerSpec

__all__ = ["Engine", "SetupError", "Stats", "build_engine"]


@dataclass
class Engine:
    """The wired parts of one vector env; ``async_engine`` only in async mode."""

    pool: WorkerPool
    decoder: ResultDecoder
    supervisor: Supervisor
    rounds: RoundDriver
    async_engine: AsyncEngine | None


def build_engine(
    spec: WorkerSpec,
    env_fns: list,
    blocks: list[range],
    obs_codec,
    stats: Stats,
    spin: SpinPolicy,
    *,
    copy: bool,
    context: str | None,
    daemon: bool,
    step_in_main: bool,
    in_process: bool,
    env_timeout: float | None,
    restart_on_death: bool,
) -> Engine:
    """Opens the segment, starts the workers and wires the parts; on any error
    the workers are stopped and the segment released before it propagates
    (``SetupError``: the kernel refused what workers need)."""
    pool = WorkerPool(
        spec, env_fns, blocks, context=context, daemon=daemon, step_in_main=step_in_main,
        private=in_process, restart_on_death=restart_on_death,
    )  # fmt: skip
    try:
        pool.open()
        leases = None
        if pool.layout.region_offsets:
            leases = ObsLeases(pool.segment, pool.layout, obs_codec)
        decoder = ResultDecoder(obs_codec, pool.slots, blocks, copy, leases)
        supervisor = Supervisor(pool, decoder, stats, spin.main_ns, env_timeout, restart_on_death)
        async_engine = None
        if spec.batch_size < spec.num_envs:  # before the workers: it marks ring rows unwritten
            async_engine = AsyncEngine(
                spec.batch_size, pool, supervisor, decoder, stats, handoff=spin.main_ns == 0
            )
        pool.spawn()
    except BaseException:
        pool.terminate()
        pool.release()
        raise
    doorbells = None if async_engine is None else async_engine.doorbells
    rounds = RoundDriver(pool, supervisor, decoder, stats, doorbells)
    if async_engine is not None:
        async_engine.rounds = rounds
    return Engine(pool, decoder, supervisor, rounds, async_engine)
