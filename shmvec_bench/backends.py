"""Backends: every vector env the benchmark can time, one opener each, registered by name.

``opened`` is the way in: it always closes.

Example:
    >>> from shmvec_bench.backends import opened
    >>> with opened("sync", "noop", 2) as stepper:
    ...     _ = stepper.step(stepper.actions[0])
    ...     stepper.num_envs
    2
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import sys
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym

from shmvec.spin import available_cpus
from shmvec_bench.registry import (
    REGISTRY,
    OpenArgs,
    Stepper,
    async_stepper,
    opened_or_closed,
    register,
    sample_actions,
    stacked_actions,
    vector_stepper,
    with_policy,
)
from shmvec_bench.workloads import ENVPOOL_TASKS, WAIT_S, WORKLOADS

# --------------------------------------------------------------------- backends


def _shmvec(args: OpenArgs, **kwargs: Any):
    import shmvec

    workers = None if args.num_workers is None else min(args.num_workers, args.num_envs)
    if args.workload in WAIT_S:  # envs that wait: as a user says so, every env at once
        kwargs.setdefault("env_concurrency", args.num_envs)
    return shmvec.ShmVectorEnv(args.fns, context=args.context, num_workers=workers, **kwargs)


@register("shmvec", takes_workers=True)
def _open_shmvec(args: OpenArgs) -> Stepper:
    """ShmVectorEnv, its defaults: one worker per core, copies of the results."""
    env = _shmvec(args)
    return vector_stepper(env, env.num_workers, args, env.stats)


@register("shmvec-main", takes_workers=True)
def _open_shmvec_main(args: OpenArgs) -> Stepper:
    """ShmVectorEnv(step_in_main=True): the main process steps a block of envs itself."""
    env = _shmvec(args, step_in_main=True)
    return vector_stepper(env, env.num_workers, args, env.stats)


@register("shmvec-nocopy", takes_workers=True)
def _open_shmvec_nocopy(args: OpenArgs) -> Stepper:
    """ShmVectorEnv(copy=False): views of the result ring."""
    env = _shmvec(args, copy=False)
    return vector_stepper(env, env.num_workers, args, env.stats)


@register("shmvec-async", takes_workers=True, is_async=True)
def _open_shmvec_async(args: OpenArgs) -> Stepper:
    """ShmVectorEnv(batch_size=...): the async engine's recv/send loop."""
    env = _shmvec(args, batch_size=args.batch)
    return async_stepper(env, env.num_workers, args, args.seed, env.stats)


@register("shmvec-sb3", takes_workers=True, requires="stable_baselines3")
def _open_shmvec_sb3(args: OpenArgs) -> Stepper:
    """shmvec behind SB3's VecEnv API (``shmvec.sb3.ShmSB3VecEnv``): SB3's infos,
    ``terminal_observation`` and all, as SB3 training sees it."""
    from shmvec.sb3 import ShmSB3VecEnv

    workers = None if args.num_workers is None else min(args.num_workers, args.num_envs)
    env = ShmSB3VecEnv(args.fns, num_workers=workers)

    def make() -> Stepper:
        env.seed(args.seed)
        env.reset()
        actions = stacked_actions(env.action_space, args.num_envs, args.seed)
        step = with_policy(env.step, args.think)
        shm = env.shm_env
        return Stepper(step, actions, args.num_envs, shm.num_workers, lambda t: env.close(),
                       stats=shm.stats)  # fmt: skip

    return opened_or_closed(lambda terminate: env.close(), make)


@register("sync")
def _open_sync(args: OpenArgs) -> Stepper:
    """gymnasium's SyncVectorEnv: every env in the calling process."""
    return vector_stepper(gym.vector.SyncVectorEnv(args.fns), 0, args)


def _gym_async(args: OpenArgs, copy: bool) -> Stepper:
    env = gym.vector.AsyncVectorEnv(args.fns, shared_memory=True, copy=copy, context=args.context)
    return vector_stepper(env, args.num_envs, args)


@register("async")
def _open_async(args: OpenArgs) -> Stepper:
    """gymnasium's AsyncVectorEnv: one process per env, shared-memory observations."""
    return _gym_async(args, copy=True)


@register("async-nocopy")
def _open_async_nocopy(args: OpenArgs) -> Stepper:
    """AsyncVectorEnv(copy=False): the fair peer of ``shmvec-nocopy``."""
    return _gym_async(args, copy=False)


@register("sb3", requires="stable_baselines3")
def _open_sb3(args: OpenArgs) -> Stepper:
    """Stable-Baselines3's ``SubprocVecEnv``: one process per env, pipes and pickles.

    With ``context=None`` it uses Python's default start method, as the other
    backends do, rather than SB3's own default, forkserver, under which every
    worker imports torch: 64 envs then take over two minutes to start on 2 cores.
    """
    from stable_baselines3.common.vec_env import SubprocVecEnv

    start_method = args.context or multiprocessing.get_start_method()
    env = SubprocVecEnv(args.fns, start_method=start_method)

    def close(terminate: bool) -> None:
        if terminate:
            for process in env.processes:
                process.terminate()
            env.closed = True
        else:
            env.close()

    def make() -> Stepper:
        env.seed(args.seed)
        env.reset()
        # SB3 exposes the single-env space.
        actions = stacked_actions(env.action_space, args.num_envs, args.seed)
        return Stepper(with_policy(env.step, args.think), actions, args.num_envs,
                       args.num_envs, close)  # fmt: skip

    return opened_or_closed(close, make)


def _envpool(args: OpenArgs, batch: int) -> Stepper:
    """EnvPool: the envs run in C++ threads, one per core."""
    import envpool

    env = envpool.make_gymnasium(
        ENVPOOL_TASKS[args.workload], num_envs=args.num_envs, batch_size=batch,
        num_threads=min(available_cpus(), args.num_envs), seed=args.seed,
    )  # fmt: skip
    if batch < args.num_envs:
        return async_stepper(env, available_cpus(), args, None)

    def make() -> Stepper:
        env.reset()
        actions = stacked_actions(env.action_space, args.num_envs, args.seed)
        return Stepper(with_policy(env.step, args.think), actions, args.num_envs,
                       available_cpus(), lambda t: env.close())  # fmt: skip

    return opened_or_closed(lambda terminate: env.close(), make)


_ENVPOOL_WORKLOADS = frozenset(ENVPOOL_TASKS)


@register("envpool", requires="envpool", workloads=_ENVPOOL_WORKLOADS)
def _open_envpool(args: OpenArgs) -> Stepper:
    """EnvPool's sync mode (``batch_size = num_envs``)."""
    return _envpool(args, args.num_envs)


@register("envpool-async", requires="envpool", is_async=True, workloads=_ENVPOOL_WORKLOADS)
def _open_envpool_async(args: OpenArgs) -> Stepper:
    """EnvPool's recv/send loop with the async batch."""
    return _envpool(args, args.batch)


@register("pufferlib", requires="pufferlib")
def _open_pufferlib(args: OpenArgs) -> Stepper:
    """PufferLib 2.0's ``Multiprocessing`` backend, each env behind its
    ``GymnasiumPufferEnv``. Its workers and its main process spin on shared
    flags, so it gets one core fewer than there are: with as many workers as
    cores, the spinners starve each other (CartPole, 32 envs, 2 workers on 2
    cores: ~4k steps/s, against ~90k with 1). num_workers must divide num_envs."""
    import pufferlib.emulation
    import pufferlib.vector

    num_envs = args.num_envs
    workers = max(1, min(num_envs, available_cpus() - 1))
    while num_envs % workers:
        workers -= 1
    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=args.factory)
    env = pufferlib.vector.make(
        creator, backend=pufferlib.vector.Multiprocessing, num_envs=num_envs, num_workers=workers
    )

    def make() -> Stepper:
        env.reset(seed=args.seed)
        actions = stacked_actions(env.single_action_space, num_envs, args.seed)
        return Stepper(with_policy(env.step, args.think), actions, num_envs, workers,
                       lambda terminate: env.close())  # fmt: skip

    return opened_or_closed(lambda terminate: env.close(), make)


@register("single")
def _open_single(args: OpenArgs) -> Stepper:
    """One plain env stepped in a loop, reset when an episode ends (ignores num_envs)."""
    env = args.factory()

    def step(action):
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    def make() -> Stepper:
        env.reset(seed=args.seed)
        actions = sample_actions(env.action_space, args.seed)
        return Stepper(with_policy(step, args.think), actions, 1, 0, lambda t: env.close())

    return opened_or_closed(lambda terminate: env.close(), make)


@register("policy")
def _open_policy(args: OpenArgs) -> Stepper:
    """No env at all: the policy stand-in alone, once per batch of ``num_envs``.

    Its steps/s (``num_envs / policy wait``) is the bound that the policy puts
    on any loop with that batch; ``--policy-us`` adds it to the run.
    """
    think = args.think or (lambda: None)
    return Stepper(lambda actions: think(), [None], args.num_envs, 0, lambda t: None)


# ----------------------------------------------------------------------- opening

#: Every registered backend name.
BACKENDS = tuple(REGISTRY)
#: The backends a plain ``shmvec-bench`` times.
DEFAULT_BACKENDS = ("shmvec", "shmvec-main", "shmvec-nocopy", "sync", "async", "sb3", "single")


def open_backend(
    backend: str,
    workload: str,
    num_envs: int,
    *,
    num_workers: int | None = None,
    context: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    think: Callable[[], Any] | None = None,
) -> Stepper:
    """Opens ``num_envs`` copies of ``workload`` on ``backend``; the caller must close it.

    Prefer ``opened(...)``, which closes it for you. ``single`` ignores
    ``num_envs`` (it is always one env); ``num_workers`` applies to shmvec only
    and is capped at ``num_envs``, so that one value can serve a whole sweep.
    """
    if backend not in REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {tuple(WORKLOADS)}")
    entry = REGISTRY[backend]
    if not entry.runs(workload):
        raise ValueError(f"{backend} has no {workload!r} workload")
    args = OpenArgs(workload, num_envs, num_workers, context, seed, batch_size, think)
    return entry.open(args)


@contextlib.contextmanager
def opened(backend: str, workload: str, num_envs: int, **kwargs: Any) -> Iterator[Stepper]:
    """``open_backend`` as a context manager: the backend is always closed.

    After an exception (a crash, a timeout) it is closed with ``terminate=True``
    so that a stuck worker cannot hang the close.
    """
    stepper = open_backend(backend, workload, num_envs, **kwargs)
    try:
        yield stepper
    except BaseException:
        _terminate(stepper)
        raise
    try:
        stepper.close(False)
    except BaseException:  # a close that fails or times out still must not leak workers
        _terminate(stepper)
        raise


def _terminate(stepper: Stepper) -> None:
    """Closes with ``terminate=True``, keeping the exception that got us here."""
    try:
        stepper.close(True)
    except Exception as exc:
        print(f"note: terminating the backend failed too: {exc!r}", file=sys.stderr)
