"""Throughput benchmark: shmvec against gymnasium's vector envs, SB3 and one plain env.

Run ``python -m shmvec.bench --quick`` (or the ``shmvec-bench`` console script)
for the README's headline figures in well under a minute: CartPole-v1 with 32
envs, a 100 us CPU-bound step with 8 envs and a no-op env's round trip, each
against gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv`` measured in the
same run. Without ``--quick`` it sweeps ``--workloads`` x ``--backends`` x
``--num-envs``.

Each measurement opens a backend, resets it, draws random valid actions
*before* the clock starts, steps for a warm-up, then steps for ``--seconds``
and reports ``steps/s = num_envs * steps / seconds``. Ratios against ``sync``
and ``async`` use the rows of the same workload and ``num_envs`` from the same
run; parallel efficiency is ``steps/s / (cores * single-env steps/s)``.

Results go to ``--out`` (``results.csv`` and ``throughput.png``) and a
markdown table is printed to stdout.

Example:
    >>> from shmvec.bench import measure
    >>> m = measure("noop", "sync", num_envs=1, seconds=0.05, warmup_s=0.01)
    >>> m.steps_per_s > 0
    True

The env factories live in this module (not in ``__main__``) so that spawn and
forkserver workers can import them by name.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import importlib.util
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec.spin import available_cpus

# --------------------------------------------------------------------- workloads

#: CPU time each ``cpu100us`` step burns, in seconds.
BURN_S = 100e-6
#: ``largeobs``: 512 x 2048 uint8 = 1 MiB per observation.
LARGE_OBS_SHAPE = (512, 2048)


def burn_cpu(seconds: float) -> None:
    """Spin on ``time.perf_counter`` for ``seconds`` of wall time (keeps one core busy)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class BusyStep(gym.Wrapper):
    """Burns ``burn_s`` seconds of CPU in every ``step`` before stepping the wrapped env.

    Stands in for an env whose step is expensive (a physics engine, an emulator):
    with it the benchmark measures how well a backend spreads work over cores.
    """

    def __init__(self, env: gym.Env, burn_s: float = BURN_S):
        super().__init__(env)
        self.burn_s = burn_s

    def step(self, action):
        burn_cpu(self.burn_s)
        return self.env.step(action)


class NoopEnv(gym.Env):
    """An env whose ``step`` does nothing: stepping it measures a backend's round trip."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._obs = np.zeros(1, dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


class LargeObsEnv(gym.Env):
    """An env with a 1 MiB uint8 observation; ``step`` returns a preallocated array.

    Measures the cost of moving observations: the env itself does no work.
    """

    metadata = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...] = LARGE_OBS_SHAPE):
        self.observation_space = gym.spaces.Box(0, 255, shape=shape, dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        # Random bytes rather than np.zeros: untouched zero pages all map to one
        # physical page, which would make every copy of them unrealistically cheap.
        self._obs = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


def make_cartpole() -> gym.Env:
    """``gym.make("CartPole-v1")``: a cheap, pure-Python env (~10 us a step)."""
    return gym.make("CartPole-v1")


def make_cpu100us() -> gym.Env:
    """CartPole-v1 whose every step also burns 100 us of CPU."""
    return BusyStep(gym.make("CartPole-v1"), BURN_S)


def make_noop() -> gym.Env:
    """A ``NoopEnv``: Box(1,) observations, a step that does nothing."""
    return NoopEnv()


def make_largeobs() -> gym.Env:
    """A ``LargeObsEnv``: 1 MiB uint8 observations, a step that does nothing else."""
    return LargeObsEnv()


class VariableStep(gym.Wrapper):
    """CartPole whose step burns 1 to 20 times 9.5 us of CPU, drawn anew each
    step (mean ~100 us): the workload where envs finish at different times."""

    def __init__(self, env: gym.Env, seed: int | None = None) -> None:
        super().__init__(env)
        self._rng = np.random.default_rng(seed)

    def step(self, action):
        burn_cpu(9.5e-6 * self._rng.integers(1, 21))
        return self.env.step(action)


def make_varstep() -> gym.Env:
    """A ``VariableStep`` CartPole-v1."""
    return VariableStep(gym.make("CartPole-v1"))


def make_pong() -> gym.Env:
    """ALE Pong with gymnasium's Atari preprocessing (84x84 gray, frame skip 4) and
    a stack of 4 frames: what Atari PPO steps. Needs ``shmvec[atari]``."""
    import ale_py
    import cv2
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    # One thread per env, as EnvPool's C++ preprocessing: OpenCV's own pool
    # would have every process's resize fight for all the cores.
    cv2.setNumThreads(1)
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    return FrameStackObservation(AtariPreprocessing(env, frame_skip=4), 4)


#: Workload name -> env factory (a module-level function, so workloads pickle by name).
WORKLOADS: dict[str, Callable[[], gym.Env]] = {
    "cartpole": make_cartpole,
    "cpu100us": make_cpu100us,
    "varstep": make_varstep,
    "noop": make_noop,
    "largeobs": make_largeobs,
    "pong": make_pong,
}
#: EnvPool's task for a workload, where it has one.
ENVPOOL_TASKS = {"cartpole": "CartPole-v1", "pong": "Pong-v5"}

# ---------------------------------------------------------------------- backends

#: Every backend this module can time. ``async-nocopy`` (AsyncVectorEnv with
#: copy=False) is not in the default set; it is the fair peer of ``shmvec-nocopy``.
BACKENDS = (
    "shmvec", "shmvec-main", "shmvec-nocopy", "shmvec-async", "shmvec-sb3", "sync",
    "async", "async-nocopy", "sb3", "envpool", "envpool-async", "pufferlib", "single",
)  # fmt: skip
DEFAULT_BACKENDS = ("shmvec", "shmvec-main", "shmvec-nocopy", "sync", "async", "sb3", "single")
#: Batches of random actions drawn before timing, then replayed in a cycle.
NUM_ACTION_BATCHES = 256


@dataclass
class Stepper:
    """One opened backend, reset and ready to time.

    ``step(actions[i])`` advances every env by one step, autoresetting finished
    ones. ``close(terminate)`` releases everything; ``terminate=True`` is for a
    backend that may be stuck mid-call.
    """

    step: Callable[[Any], Any]
    actions: list[Any]
    num_envs: int
    #: Processes stepping the envs; 0 when they run in the calling process.
    num_workers: int
    close: Callable[[bool], None]
    #: Env steps one ``step`` call makes: ``num_envs``, or the batch of an async backend.
    steps_per_call: int | None = None


def _sample_actions(space: gym.Space, seed: int) -> list[Any]:
    space.seed(seed)
    return [space.sample() for _ in range(NUM_ACTION_BATCHES)]


def _stacked_actions(space: gym.Space, batch: int, seed: int) -> list[np.ndarray]:
    """For backends that take one env's space: batches of ``batch`` actions, stacked."""
    space.seed(seed)
    return [np.stack([space.sample() for _ in range(batch)]) for _ in range(NUM_ACTION_BATCHES)]


def _vector_stepper(env: gym.vector.VectorEnv, num_workers: int, seed: int) -> Stepper:
    """Wraps an opened gymnasium-API vector env (shmvec, Sync, Async)."""

    def close(terminate: bool) -> None:
        env.close(terminate=terminate)

    try:
        env.reset(seed=seed)
        actions = _sample_actions(env.action_space, seed)
    except BaseException:
        close(terminate=True)
        raise
    return Stepper(env.step, actions, env.num_envs, num_workers, close)


def _single_stepper(factory: Callable[[], gym.Env], seed: int) -> Stepper:
    """One plain env stepped in a loop, reset when an episode ends."""
    env = factory()
    try:
        env.reset(seed=seed)
        actions = _sample_actions(env.action_space, seed)
    except BaseException:
        env.close()
        raise

    def step(action):
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    return Stepper(step, actions, 1, 0, lambda terminate: env.close())


def _sb3_adapter_stepper(
    factory: Callable[[], gym.Env], num_envs: int, num_workers: int | None, seed: int
) -> Stepper:
    """shmvec behind SB3's VecEnv API (``shmvec.sb3.ShmSB3VecEnv``): SB3's infos,
    ``terminal_observation`` and all, as SB3 training sees it."""
    from shmvec.sb3 import ShmSB3VecEnv

    workers = None if num_workers is None else min(num_workers, num_envs)
    env = ShmSB3VecEnv([factory] * num_envs, num_workers=workers)
    try:
        env.seed(seed)
        env.reset()
        actions = _stacked_actions(env.action_space, num_envs, seed)
    except BaseException:
        env.close()
        raise
    return Stepper(env.step, actions, num_envs, env.shm_env.num_workers, lambda t: env.close())


def _sb3_stepper(
    factory: Callable[[], gym.Env], num_envs: int, context: str | None, seed: int
) -> Stepper:
    """Stable-Baselines3's ``SubprocVecEnv``: one process per env, pipes and pickles.

    With ``context=None`` it uses Python's default start method, as the other
    backends do, rather than SB3's own default, forkserver, under which every
    worker imports torch: 64 envs then take over two minutes to start on 2 cores.
    """
    from stable_baselines3.common.vec_env import SubprocVecEnv

    start_method = context or multiprocessing.get_start_method()
    env = SubprocVecEnv([factory] * num_envs, start_method=start_method)

    def close(terminate: bool) -> None:
        if terminate:
            for process in env.processes:
                process.terminate()
            env.closed = True
        else:
            env.close()

    try:
        env.seed(seed)
        env.reset()
        # SB3 exposes the single-env space.
        actions = _stacked_actions(env.action_space, num_envs, seed)
    except BaseException:
        close(terminate=True)
        raise
    return Stepper(env.step, actions, num_envs, num_envs, close)


def _async_stepper(env, num_workers: int, batch_size: int, seed: int | None) -> Stepper:
    """An EnvPool-style loop (shmvec's or EnvPool's): each call is recv then send.

    ``seed`` goes to ``async_reset`` (None for EnvPool, seeded at construction).
    """

    def step(actions):
        *_, infos = env.recv()
        env.send(actions[:batch_size], infos["env_id"])

    try:
        env.async_reset() if seed is None else env.async_reset(seed=seed)
        space = getattr(env, "single_action_space", None) or env.action_space
        actions = _stacked_actions(space, batch_size, seed or 0)
    except BaseException:
        env.close()
        raise
    return Stepper(
        step, actions, env_count(env), num_workers, lambda terminate: env.close(), batch_size
    )


def env_count(env) -> int:
    return getattr(env, "num_envs", None) or env.config["num_envs"]


def _envpool_stepper(workload: str, num_envs: int, batch_size: int, seed: int) -> Stepper:
    """EnvPool: the envs run in C++ threads, one per core."""
    import envpool

    if workload not in ENVPOOL_TASKS:
        raise ValueError(f"EnvPool has no {workload!r} workload")
    env = envpool.make_gymnasium(
        ENVPOOL_TASKS[workload], num_envs=num_envs, batch_size=batch_size,
        num_threads=min(available_cpus(), num_envs), seed=seed,
    )  # fmt: skip
    if batch_size < num_envs:
        return _async_stepper(env, available_cpus(), batch_size, None)
    env.reset()
    actions = _stacked_actions(env.action_space, num_envs, seed)
    return Stepper(env.step, actions, num_envs, available_cpus(), lambda t: env.close())


def _pufferlib_stepper(factory: Callable[[], gym.Env], num_envs: int, seed: int) -> Stepper:
    """PufferLib 2.0's ``Multiprocessing`` backend, each env behind its
    ``GymnasiumPufferEnv``. Its workers and its main process spin on shared
    flags, so it gets one core fewer than there are: with as many workers as
    cores, the spinners starve each other (CartPole, 32 envs, 2 workers on 2
    cores: ~4k steps/s, against ~90k with 1). num_workers must divide num_envs."""
    import pufferlib.emulation
    import pufferlib.vector

    workers = max(1, min(num_envs, available_cpus() - 1))
    while num_envs % workers:
        workers -= 1
    creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=factory)
    env = pufferlib.vector.make(
        creator, backend=pufferlib.vector.Multiprocessing, num_envs=num_envs, num_workers=workers
    )
    try:
        env.reset(seed=seed)
        actions = _stacked_actions(env.single_action_space, num_envs, seed)
    except BaseException:
        env.close()
        raise
    return Stepper(env.step, actions, num_envs, workers, lambda terminate: env.close())


def open_backend(
    backend: str,
    workload: str,
    num_envs: int,
    *,
    num_workers: int | None = None,
    context: str | None = None,
    seed: int = 0,
) -> Stepper:
    """Opens ``num_envs`` copies of ``workload`` on ``backend``; the caller must close it.

    Prefer ``opened(...)``, which closes it for you. ``single`` ignores
    ``num_envs`` (it is always one env); ``num_workers`` applies to shmvec only
    and is capped at ``num_envs``, so that one value can serve a whole sweep.
    """
    factory = WORKLOADS[workload]
    fns = [factory] * num_envs
    if backend in ("shmvec", "shmvec-main", "shmvec-nocopy"):
        import shmvec

        if num_workers is not None:
            num_workers = min(num_workers, num_envs)
        env = shmvec.ShmVectorEnv(
            fns,
            copy=backend != "shmvec-nocopy",
            context=context,
            num_workers=num_workers,
            step_in_main=backend == "shmvec-main",
        )
        return _vector_stepper(env, env.num_workers, seed)
    if backend == "shmvec-async":
        import shmvec

        batch = max(1, num_envs // 2)
        workers = None if num_workers is None else min(num_workers, num_envs)
        env = shmvec.ShmVectorEnv(fns, context=context, num_workers=workers, batch_size=batch)
        return _async_stepper(env, env.num_workers, batch, seed)
    if backend in ("envpool", "envpool-async"):
        batch = num_envs if backend == "envpool" else max(1, num_envs // 2)
        return _envpool_stepper(workload, num_envs, batch, seed)
    if backend == "sync":
        return _vector_stepper(gym.vector.SyncVectorEnv(fns), 0, seed)
    if backend in ("async", "async-nocopy"):
        env = gym.vector.AsyncVectorEnv(
            fns, shared_memory=True, copy=backend == "async", context=context
        )
        return _vector_stepper(env, num_envs, seed)
    if backend == "sb3":
        return _sb3_stepper(factory, num_envs, context, seed)
    if backend == "shmvec-sb3":
        return _sb3_adapter_stepper(factory, num_envs, num_workers, seed)
    if backend == "pufferlib":
        return _pufferlib_stepper(factory, num_envs, seed)
    if backend == "single":
        return _single_stepper(factory, seed)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


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


# ------------------------------------------------------------------- measurement


@dataclass
class Measurement:
    """One timed run of one backend on one workload, plus ratios filled in afterwards."""

    workload: str
    backend: str
    num_envs: int
    #: Processes stepping the envs; 0 when they run in the measuring process.
    num_workers: int
    #: Batched ``step`` calls in the timed window.
    steps: int
    seconds: float
    #: Env steps per second: ``num_envs`` (an async backend: its batch) ``* steps / seconds``.
    steps_per_s: float
    #: Median wall time of one batched ``step`` call (the round trip), microseconds.
    median_step_us: float
    #: ``steps_per_s`` over ``sync``'s for the same workload and ``num_envs``.
    vs_sync: float | None = None
    #: ``steps_per_s`` over ``async``'s for the same workload and ``num_envs``.
    vs_async: float | None = None
    #: ``steps_per_s / (cores * single-env steps_per_s)``.
    efficiency: float | None = None
    #: Why the run failed (exception type and message), or None.
    error: str | None = None


def run_steps(stepper: Stepper, seconds: float) -> tuple[int, float, list[int]]:
    """Steps until ``seconds`` have passed; returns (steps, elapsed s, per-step ns)."""
    step, actions = stepper.step, stepper.actions
    num_actions = len(actions)
    durations: list[int] = []
    clock = time.perf_counter_ns
    start = now = clock()
    deadline = start + int(seconds * 1e9)
    count = 0
    while now < deadline:
        step(actions[count % num_actions])
        after = clock()
        durations.append(after - now)
        now = after
        count += 1
    return count, (now - start) / 1e9, durations


class MeasurementTimeout(Exception):
    """A measurement ran past its deadline: the backend is probably hung."""


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raises ``MeasurementTimeout`` in the body after ``seconds`` (main thread only).

    Uses SIGALRM, whose handler runs as soon as the main thread is back in
    Python: the backends here wait with timeouts or in interruptible syscalls.
    """
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise MeasurementTimeout(f"no result after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure(
    workload: str,
    backend: str,
    num_envs: int,
    *,
    seconds: float = 1.0,
    warmup_s: float = 0.25,
    num_workers: int | None = None,
    context: str | None = None,
    timeout_s: float | None = None,
) -> Measurement:
    """Opens, warms up, times and closes one backend; failures become ``error`` rows."""
    workers = 0
    try:
        with deadline(timeout_s):
            options = {"num_workers": num_workers, "context": context}
            with opened(backend, workload, num_envs, **options) as stepper:
                workers = stepper.num_workers
                num_envs = stepper.num_envs
                per_call = stepper.steps_per_call or num_envs
                run_steps(stepper, warmup_s)
                steps, elapsed, durations = run_steps(stepper, seconds)
    except Exception as exc:  # a crash or hang is a result to report, not a reason to stop
        return Measurement(
            workload, backend, num_envs, workers, 0, 0.0, float("nan"), float("nan"),
            error=f"{type(exc).__name__}: {exc}".splitlines()[0],
        )  # fmt: skip
    return Measurement(
        workload=workload,
        backend=backend,
        num_envs=num_envs,
        num_workers=workers,
        steps=steps,
        seconds=elapsed,
        steps_per_s=per_call * steps / elapsed,
        median_step_us=statistics.median(durations) / 1e3,
    )


def add_ratios(measurements: Sequence[Measurement], cores: int) -> None:
    """Fills ``vs_sync``, ``vs_async`` and ``efficiency`` from rows of the same run."""
    ok = [m for m in measurements if m.error is None]
    peers = {(m.workload, m.num_envs, m.backend): m.steps_per_s for m in ok}
    single = {m.workload: m.steps_per_s for m in ok if m.backend == "single"}
    for m in ok:
        if m.backend != "single":  # the baseline itself: no peer to compare with
            sync = peers.get((m.workload, m.num_envs, "sync"))
            asyn = peers.get((m.workload, m.num_envs, "async"))
            m.vs_sync = m.steps_per_s / sync if sync else None
            m.vs_async = m.steps_per_s / asyn if asyn else None
        base = single.get(m.workload)
        m.efficiency = m.steps_per_s / (cores * base) if base else None


# -------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Case:
    """One measurement to make."""

    workload: str
    backend: str
    num_envs: int
    #: shmvec's worker processes (None: its default; other backends ignore it).
    num_workers: int | None = None


#: ``--quick``: (workload, num_envs) pairs, each against these backends.
QUICK_CASES = (("cartpole", 32), ("cpu100us", 8), ("noop", 1))
QUICK_BACKENDS = ("shmvec", "shmvec-main", "sync", "async", "single")


def plan_cases(
    pairs: Sequence[tuple[str, int]],
    backends: Sequence[str],
    worker_counts: Sequence[int | None] = (None,),
) -> list[Case]:
    """Every backend for every (workload, num_envs); shmvec backends once per worker
    count (capped at num_envs); ``single`` once per workload."""
    cases: list[Case] = []
    for workload, num_envs in pairs:
        for backend in backends:
            if backend == "single":
                if Case(workload, backend, 1) not in cases:
                    cases.append(Case(workload, backend, 1))
            elif backend.startswith("envpool") and workload not in ENVPOOL_TASKS:
                continue
            elif backend.startswith("shmvec"):
                counts = {None if w is None else min(w, num_envs) for w in worker_counts}
                for workers in sorted(counts, key=lambda w: -1 if w is None else w):
                    cases.append(Case(workload, backend, num_envs, workers))
            else:
                cases.append(Case(workload, backend, num_envs))
    return cases


# ------------------------------------------------------------------------ output


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)


def markdown_table(measurements: Sequence[Measurement]) -> str:
    """The results as a GitHub markdown table."""
    lines = [
        "| workload | backend | envs | workers | steps/s | vs sync | vs async "
        "| efficiency | median step (µs) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        rate = f"**{m.error}**" if m.error else _fmt(m.steps_per_s, ",.0f")
        lines.append(
            f"| {m.workload} | {m.backend} | {m.num_envs} | {m.num_workers} | {rate} "
            f"| {_fmt(m.vs_sync, '.2f')}{'x' if m.vs_sync else ''} "
            f"| {_fmt(m.vs_async, '.2f')}{'x' if m.vs_async else ''} "
            f"| {_fmt(m.efficiency, '.0%')} | {_fmt(m.median_step_us, ',.1f')} |"
        )
    return "\n".join(lines)


def write_csv(measurements: Sequence[Measurement], path: Path) -> None:
    """One row per measurement, columns as in ``Measurement``."""
    fields = [f.name for f in dataclasses.fields(Measurement)]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for m in measurements:
            writer.writerow(dataclasses.asdict(m))


def write_plot(
    measurements: Sequence[Measurement], path: Path, cores: int, title: str = ""
) -> bool:
    """Steps/s against num_envs per backend, log y, one subplot per workload.

    Returns False (after saying why on stderr) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return False

    ok = [m for m in measurements if m.error is None]
    workloads = list(dict.fromkeys(m.workload for m in ok))
    if not workloads:
        return False
    ncols = min(2, len(workloads))
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(workloads) :]:
        ax.set_visible(False)
    for ax, workload in zip(axes.flat, workloads):
        rows = [m for m in ok if m.workload == workload]
        # With a --num-workers sweep a backend has several rows per num_envs: a line each.
        sweep = len({(m.backend, m.num_envs) for m in rows}) < len(rows)

        def line(m: Measurement, sweep: bool = sweep) -> str:
            if sweep and m.backend.startswith("shmvec"):
                return f"{m.backend} ({m.num_workers} workers)"
            return m.backend

        for label in dict.fromkeys(line(m) for m in rows):
            if label == "single":
                continue
            points = sorted((m.num_envs, m.steps_per_s) for m in rows if line(m) == label)
            ax.plot(*zip(*points), marker="o", label=label)
        single = next((m.steps_per_s for m in rows if m.backend == "single"), None)
        if single:
            ax.axhline(single, color="gray", linestyle="--", label="single env")
            ax.axhline(cores * single, color="gray", linestyle=":", label=f"{cores} x single")
        ax.set_xscale("log", base=2)
        sizes = sorted({m.num_envs for m in rows})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.set_title(workload)
        ax.set_xlabel("num_envs")
        ax.set_ylabel("steps/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def machine_summary(cores: int, load_before: float) -> str:
    """One line naming what the figures were measured on, and how busy it was."""
    import shmvec

    return (
        f"{platform.node()} | {platform.processor() or platform.machine()} | cores={cores} | "
        f"load {load_before:.2f} -> {load_average():.2f} | "
        f"python {platform.python_version()} | gymnasium {gym.__version__} | "
        f"numpy {np.__version__} | shmvec {shmvec.__version__}"
    )


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def warn_if_busy(cores: int) -> float:
    """Says on stderr when other processes already use a good part of the cores.

    Returns the load average it judged by.
    """
    load = load_average()
    if load > 0.25 * cores:
        print(
            f"note: load average is {load:.2f} on {cores} cores; other processes compete "
            "for the CPU and the figures will be low and noisy",
            file=sys.stderr,
        )
    return load


class _Progress:
    """tqdm's bar when tqdm is installed, else one line per measurement on stderr."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)

    def start(self, case: Case) -> None:
        if self.bar is not None:
            self.bar.set_description(f"{case.workload} {case.backend} x{case.num_envs}")

    def finish(self, m: Measurement) -> None:
        self.done += 1
        result = m.error or f"{m.steps_per_s:,.0f} steps/s"
        line = f"[{self.done}/{self.total}] {m.workload} {m.backend} envs={m.num_envs}: {result}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update()
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shmvec-bench",
        description="Steps/s of shmvec against gymnasium Sync/AsyncVectorEnv, SB3 and one env.",
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=None,
        help=f"default: {' '.join(DEFAULT_BACKENDS)} (with --quick: {' '.join(QUICK_BACKENDS)})",
    )  # fmt: skip
    parser.add_argument(
        "--num-envs", nargs="+", type=int, default=[1, 4, 16, 64], help="a sweep of num_envs"
    )
    parser.add_argument(
        "--num-workers", type=int, nargs="+", default=[None],
        help="shmvec workers, a sweep (default: its own, min(num_envs, cores))",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=1.0, help="timed window per measurement")
    parser.add_argument("--warmup", type=float, default=0.25, help="warm-up seconds before it")
    parser.add_argument(
        "--quick", action="store_true",
        help="CartPole 32 envs, cpu100us 8 envs, noop 1 env against sync and async, in "
        "about 20 s; replaces --workloads and --num-envs",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument(
        "--context", choices=["fork", "spawn", "forkserver"], default=None,
        help="multiprocessing start method for shmvec, async and sb3 (default: Python's)",
    )  # fmt: skip
    parser.add_argument(
        "--cores", type=int, default=None, help="cores for parallel efficiency (default: usable)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0,
        help="give up on one measurement after this many seconds (a hang is reported, not waited)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.backends is None:
        args.backends = list(QUICK_BACKENDS if args.quick else DEFAULT_BACKENDS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if any measurement failed, else 0."""
    args = parse_args(argv)
    cores = args.cores or available_cpus()
    backends = list(args.backends)
    for name, module in (
        ("sb3", "stable_baselines3"), ("envpool", "envpool"), ("pufferlib", "pufferlib")
    ):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            skipped = [b for b in backends if name in b]
            if skipped:
                print(f"note: {module} is not installed; skipping {skipped}", file=sys.stderr)
            backends = [b for b in backends if name not in b]
    if args.quick:
        pairs = list(QUICK_CASES)
    else:
        pairs = [(w, n) for w in args.workloads for n in args.num_envs]
    cases = plan_cases(pairs, backends, args.num_workers)

    load_before = warn_if_busy(cores)
    started = time.perf_counter()
    measurements = []
    progress = _Progress(len(cases))
    try:
        for case in cases:
            progress.start(case)
            m = measure(
                case.workload, case.backend, case.num_envs,
                seconds=args.seconds, warmup_s=args.warmup, num_workers=case.num_workers,
                context=args.context, timeout_s=args.timeout,
            )  # fmt: skip
            measurements.append(m)
            progress.finish(m)
    finally:
        progress.close()
    add_ratios(measurements, cores)

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(measurements, args.out / "results.csv")
    summary = machine_summary(cores, load_before)
    plotted = write_plot(measurements, args.out / "throughput.png", cores, title=summary)
    print(summary)
    print(f"efficiency = steps/s / ({cores} cores x single-env steps/s)\n")
    print(markdown_table(measurements))
    written = ["results.csv"] + (["throughput.png"] if plotted else [])
    print(
        f"\n{len(measurements)} measurements in {time.perf_counter() - started:.1f} s; "
        f"wrote {', '.join(str(args.out / name) for name in written)}"
    )
    return 1 if any(m.error for m in measurements) else 0


if __name__ == "__main__":
    # Run the importable copy, so that env factories pickle as shmvec.bench.*
    # (which spawn workers can import) rather than __main__.*.
    from shmvec import bench

    raise SystemExit(bench.main())
