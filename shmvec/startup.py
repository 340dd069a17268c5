"""Starts a ShmVectorEnv's workers: where each env runs, then the engine that runs them.

``start_workers`` decides the placement (worker processes, the main process's
own block, envs stepped at once, CPU pinning, how waiters spin), fills it into
the workers' spec and builds the engine (shmvec/engine/). A ``SetupError``
(no memfd, no futexes, no new processes) is a ``RuntimeError`` that names the
fallback, or, under ``fallback="serial"``, a WARNING and a second start with
every env in this process.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from shmvec.batching import split_blocks
from shmvec.codecs import Codec
from shmvec.engine import Engine, EngineOptions, SetupError, Stats, build_engine
from shmvec.engine.waiting_check import WaitingCheck
from shmvec.options import TuningOptions
from shmvec.worker import WorkerSpec

logger = logging.getLogger("shmvec")


@dataclass(frozen=True)
class Started:
    """Where the envs of a vector env run, and the engine that runs them."""

    engine: Engine
    num_workers: int  # >= 1: with every env in this process, one worker here
    in_process: bool  # every env in this process (num_workers=0, or the fallback)
    step_in_main: bool  # this process steps the first block itself
    blocks: list[range]  # the env ids of each worker
    env_concurrency: int | None  # envs a worker steps at once (None: one after another)
    pin_workers: bool


def start_workers(
    spec: WorkerSpec,
    env_fns: list,
    tuning: TuningOptions,
    options: EngineOptions,
    obs_codec: Codec,
    stats: Stats,
    num_workers: int,
    max_concurrency: int | None,
) -> Started:
    """Starts ``num_workers`` workers (0: one, in this process) from ``spec``,
    whose placement fields (``num_workers``, ``spin``, ``env_concurrency``,
    ``pin_cpu``) are filled in here, and ``options`` (``step_in_main`` and
    ``in_process`` likewise). Falls back as the module says."""
    args = (spec, env_fns, tuning, options, obs_codec, stats, max_concurrency)
    try:
        return _start(*args, num_workers, tuning.step_in_main)
    except SetupError as error:
        if tuning.fallback != "serial":
            raise RuntimeError(
                f"{error}. Pass fallback='serial' to run every env in the main process instead."
            ) from error.__cause__
        logger.warning("%s: running every env in the main process (fallback='serial')", error)
        if tuning.step_deadline is not None:
            logger.warning("step_deadline is not kept for envs in the main process")
        return _start(*args, 0, True)


def _start(
    spec: WorkerSpec,
    env_fns: list,
    tuning: TuningOptions,
    options: EngineOptions,
    obs_codec: Codec,
    stats: Stats,
    max_concurrency: int | None,
    num_workers: int,
    step_in_main: bool,
) -> Started:
    in_process = num_workers == 0
    step_in_main = in_process or bool(step_in_main)
    num_workers = max(num_workers, 1)
    blocks = split_blocks(spec.num_envs, num_workers)
    env_concurrency = tuning.per_worker_concurrency(max_concurrency, num_workers)
    processes = num_workers - 1 if step_in_main else num_workers
    spin = tuning.spin(processes)
    pin = tuning.pinning(processes, spec.batch_size < spec.num_envs)
    spec = dataclasses.replace(
        spec, num_workers=num_workers, spin=spin.worker, env_concurrency=env_concurrency,
        pin_cpu=pin,
    )  # fmt: skip
    options = dataclasses.replace(options, step_in_main=step_in_main, in_process=in_process)
    engine = build_engine(spec, env_fns, blocks, obs_codec, stats, spin, options)
    if env_concurrency in (None, 1) and not in_process:
        stats.watch(WaitingCheck(engine.pool, max(len(block) for block in blocks)))
    return Started(engine, num_workers, in_process, step_in_main, blocks, env_concurrency, pin)
