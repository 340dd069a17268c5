"""The engine behind ShmVectorEnv, in parts with one job each.

- ``pool.WorkerPool``: the segment, the worker processes, their pipes, liveness.
- ``wire.Wire``: a wire protocol, and what a dead worker's replacement
  restores: ``sync_wire.SyncWire`` (barrier rounds carry every command) or
  ``async_wire.AsyncWire`` (env commands, doorbells, the result ring).
- ``supervisor.Supervisor``: waits that notice deaths, ``env_timeout``, and
  ``replace_dead``, which asks the wire what to restore (engine/lost_rows.py:
  what dead workers left in the async ring).
- ``rounds.RoundDriver``: barrier rounds: post, wait, finish, and step's short path.
- ``async_engine.AsyncEngine``: ``async_reset``/``send``/``recv`` over the async wire.
- ``decoder.ResultDecoder``: ring rows and messages to observations and infos.
- ``leases.ObsLeases``: large observations handed over without a copy.
- ``stats.Stats``: what ``stats()`` reports.

``build_engine`` builds them in that order, each from the parts before it;
ShmVectorEnv keeps only gymnasium's state machine and the argument checks.
What crosses process boundaries is shmvec/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmvec.engine.async_engine import AsyncEngine
from shmvec.engine.async_wire import AsyncWire
from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.leases import ObsLeases
from shmvec.engine.options import EngineOptions
from shmvec.engine.pool import SetupError, WorkerPool
from shmvec.engine.rounds import RoundDriver
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import Supervisor
from shmvec.engine.sync_wire import SyncWire
from shmvec.engine.wire import Wire
from shmvec.spin import SpinPolicy
from shmvec.worker import WorkerSpec

__all__ = ["Engine", "EngineOptions", "SetupError", "Stats", "build_engine"]


@dataclass
class Engine:
    """The parts of one vector env; ``async_engine`` only in async mode."""

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
    options: EngineOptions,
) -> Engine:
    """Opens the segment, starts the workers and builds the parts; on any error
    the workers are stopped and the segment released before it propagates
    (``SetupError``: the kernel refused what workers need)."""
    pool = WorkerPool(spec, env_fns, blocks, options)
    try:
        pool.open()
        regions = pool.layout.region_offsets
        leases = ObsLeases(pool.segment, pool.layout, obs_codec) if regions else None
        decoder = ResultDecoder(obs_codec, pool.slots, blocks, options.copy, leases)
        async_wire = None
        wire: Wire
        spin.main.apply(pool.barrier)
        if spec.batch_size < spec.num_envs:  # before the workers: it marks ring rows unwritten
            wire = async_wire = AsyncWire(spec.batch_size, pool, decoder)
            spin.main.apply(async_wire.ring)
        else:
            wire = SyncWire(pool)
        supervisor = Supervisor(
            pool, decoder, stats, wire, options.env_timeout, options.restart_on_death
        )
        pool.spawn()
    except BaseException:
        pool.terminate()
        pool.release()
        raise
    rounds = RoundDriver(pool, supervisor, decoder, stats, wire)
    async_engine = None
    if async_wire is not None:
        handoff = spin.main.cap_ns == 0
        async_engine = AsyncEngine(async_wire, pool, supervisor, decoder, stats, rounds, handoff)
    return Engine(pool, decoder, supervisor, rounds, async_engine)
