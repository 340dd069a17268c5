"""``shmvec-bench rollouts --awaitable``: completed trajectories per second of many
coroutines on one event loop, each running trajectories back to back, with the env
calls made three ways, on the same envs:

- ``awaitable``: ``shmvec.AwaitableEnvs`` over a ``ShmVectorEnv`` (set up as the rollout
  benchmark sets up shmvec: ``shmvec_common.open_envs``, one env per coroutine); each
  trajectory leases an env, ``await env.reset`` / ``await env.step``.
- ``rollouts``: ``shmvec.rollouts.Rollouts`` on the same vector env, groups of one,
  without a lag bound; the trainer's thread takes batches of 16 trajectories.
- ``threads``: the coroutines own in-process envs and call them through
  ``loop.run_in_executor(ThreadPoolExecutor(32))``, as SkyRL's and rLLM's generators
  do (``asyncio.to_thread``'s default pool has only ``min(32, cores + 4)`` threads).

The policy answers at once: each action is drawn from the workload's vocabulary by
the coroutine's own seeded generator (``rollouts``: by one seeded generator), so the
figure is the env side's alone. One measurement starts the coroutines, lets them run
``warmup_s`` untimed (every env starts at once, a ramp no steady state has), then
counts the trajectories that end within the next ``seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

WAYS = ("awaitable", "rollouts", "threads")
#: SkyRL's ``max_env_workers``.
POOL_THREADS = 32


@dataclass
class AwaitableMeasurement:
    """One timed run of one way (or the median of several: ``runs``)."""

    workload: str
    way: str
    coroutines: int
    trajectories: int = 0
    seconds: float = 0.0
    trajectories_per_s: float = float("nan")
    steps_per_s: float = float("nan")
    #: Python threads of this way while the coroutines ran: those it started, and the
    #: thread that called it.
    threads: int = 0
    runs: int = 1
    outcome: str = "ok"


class Counter:
    """Trajectories and steps that end inside the timed window (any thread)."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.trajectories = self.steps = 0
        self.stop = False
        self.threads_before = threading.active_count()

    def step(self) -> None:
        now = time.perf_counter()
        if self.start <= now < self.end:
            self.steps += 1
        self.stop = now >= self.end

    def trajectory(self) -> None:
        if self.start <= time.perf_counter() < self.end:
            self.trajectories += 1


def _vector_env(workload: str, num_envs: int, context: str):
    from shmvec_bench.rollouts.backends.shmvec_common import open_envs
    from shmvec_bench.rollouts.records import RunContext

    ctx = RunContext(workload, num_envs, 1, num_envs, None, context=context)
    return open_envs(ctx)


async def _awaitable(workload: str, coroutines: int, counter: Counter, context: str) -> int:
    import shmvec
    from shmvec_bench.rollouts.workloads import WORKLOADS

    actions = WORKLOADS[workload].actions
    envs = _vector_env(workload, coroutines, context)

    async def run(k: int) -> None:
        rng = np.random.default_rng([k])
        for seed in itertools.count(k * 1_000_000):
            async with pool.env() as env:
                await env.reset(seed=seed)
                done = False
                while not done:
                    action = actions[int(rng.integers(len(actions)))]
                    _, _, terminated, truncated, _ = await env.step(action)
                    counter.step()
                    done = terminated or truncated
            counter.trajectory()
            if counter.stop:
                return

    try:
        async with shmvec.AwaitableEnvs(envs, record=False) as pool:
            _start_window(counter)
            tasks = [asyncio.ensure_future(run(k)) for k in range(coroutines)]
            await asyncio.sleep(counter.end - time.perf_counter() - 0.5)
            threads = threading.active_count() - counter.threads_before + 1
            await asyncio.gather(*tasks)
    finally:
        envs.close(terminate=True)
    return threads


async def _threads(workload: str, coroutines: int, counter: Counter) -> int:
    from shmvec_bench.rollouts.workloads import RELEASE_HANGS, WORKLOADS, make_env

    actions = WORKLOADS[workload].actions
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="env")
    envs = list(await asyncio.gather(
        *(loop.run_in_executor(pool, make_env, workload, k) for k in range(coroutines))
    ))  # fmt: skip

    async def run(k: int) -> None:
        rng, env = np.random.default_rng([k]), envs[k]
        for seed in itertools.count(k * 1_000_000):
            await loop.run_in_executor(pool, functools.partial(env.reset, seed=seed))
            done = False
            while not done:
                action = actions[int(rng.integers(len(actions)))]
                _, _, terminated, truncated, _ = await loop.run_in_executor(pool, env.step, action)
                counter.step()
                done = terminated or truncated
            counter.trajectory()
            if counter.stop:
                return

    try:
        _start_window(counter)
        tasks = [asyncio.ensure_future(run(k)) for k in range(coroutines)]
        await asyncio.sleep(counter.end - time.perf_counter() - 0.5)
        threads = threading.active_count() - counter.threads_before + 1
        await asyncio.gather(*tasks)
    finally:
        RELEASE_HANGS.set()
        pool.shutdown(wait=True, cancel_futures=True)
    return threads


def _rollouts(workload: str, coroutines: int, counter: Counter, context: str) -> int:
    from shmvec.rollouts import Rollouts, Task
    from shmvec_bench.rollouts.workloads import WORKLOADS

    actions = WORKLOADS[workload].actions
    rng = np.random.default_rng([0])
    envs = _vector_env(workload, coroutines, context)

    def policy(batch):
        return [actions[int(i)] for i in rng.integers(len(actions), size=len(batch))]

    tasks = (Task(seed=s) for s in itertools.count())
    try:
        with Rollouts(envs, policy, group_size=1, tasks=tasks) as rollouts:
            _start_window(counter)
            while time.perf_counter() < counter.start:
                rollouts.get_batch(16)
            before = rollouts.stats()
            threads = threading.active_count() - counter.threads_before + 1
            while time.perf_counter() < counter.end:
                rollouts.get_batch(16)
            after = rollouts.stats()
            counter.trajectories = after["completed"] - before["completed"]
            counter.steps = after["steps"] - before["steps"]
    finally:
        envs.close(terminate=True)
    return threads


def _start_window(counter: Counter) -> None:
    """Starts the warm-up now: the window opens ``start`` seconds from now (the two
    fields hold the warm-up and the window length until then)."""
    now = time.perf_counter()
    warmup, seconds = counter.start, counter.end
    counter.start, counter.end = now + warmup, now + warmup + seconds


def measure(
    workload: str,
    way: str,
    *,
    coroutines: int = 1000,
    warmup_s: float = 3.0,
    seconds: float = 8.0,
    context: str = "forkserver",
) -> AwaitableMeasurement:
    """One run of ``way`` (see the module); a crash is a result (``outcome``)."""
    row = AwaitableMeasurement(workload, way, coroutines)
    counter = Counter(warmup_s, seconds)  # _start_window makes them times
    try:
        if way == "awaitable":
            row.threads = asyncio.run(_awaitable(workload, coroutines, counter, context))
        elif way == "threads":
            row.threads = asyncio.run(_threads(workload, coroutines, counter))
        elif way == "rollouts":
            row.threads = _rollouts(workload, coroutines, counter, context)
        else:
            raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    except Exception as exc:  # a crash is a result
        row.outcome = f"crash: {type(exc).__name__}: {exc}".splitlines()[0][:160]
        return row
    row.trajectories, row.seconds = counter.trajectories, seconds
    row.trajectories_per_s = counter.trajectories / seconds
    row.steps_per_s = counter.steps / seconds
    return row


def median_row(rows: Sequence[AwaitableMeasurement]) -> AwaitableMeasurement:
    ok = [r for r in rows if r.outcome == "ok"] or list(rows)
    merged = AwaitableMeasurement(ok[0].workload, ok[0].way, ok[0].coroutines, runs=len(rows))
    for name in ("trajectories", "seconds", "trajectories_per_s", "steps_per_s", "threads"):
        values = [getattr(r, name) for r in ok if getattr(r, name) == getattr(r, name)]
        if values:
            value = statistics.median(values)
            setattr(merged, name, round(value) if name in ("trajectories", "threads") else value)
    bad = [r for r in rows if r.outcome != "ok"]
    merged.outcome = bad[0].outcome if bad else "ok"
    return merged


def markdown_table(medians: Sequence[AwaitableMeasurement]) -> str:
    lines = [
        "| workload | way | trajectories/s | env steps/s | awaitable vs this | threads |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for m in medians:
        mine = next((x for x in medians if x.workload == m.workload and x.way == "awaitable"), None)
        ratio = (
            f"{mine.trajectories_per_s / m.trajectories_per_s:.2f}x"
            if mine is not None and m.way != "awaitable" and m.trajectories_per_s > 0
            else ""
        )
        figure = f"{m.trajectories_per_s:,.1f}" if m.outcome == "ok" else m.outcome
        lines.append(
            f"| {m.workload} | {m.way} | {figure} | {m.steps_per_s:,.0f} | {ratio} | {m.threads} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from shmvec.spin import available_cpus
    from shmvec_bench.report import machine_summary, warn_if_busy

    parser = argparse.ArgumentParser(
        prog="shmvec-bench rollouts --awaitable",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--workloads", nargs="+", default=["tool", "cpu200us"])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--coroutines", type=int, default=1000)
    parser.add_argument("--warmup", type=float, default=3.0, metavar="S")
    parser.add_argument("--seconds", type=float, default=8.0, metavar="S")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, in turns")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR")
    args = parser.parse_args(argv)
    cores = available_cpus()
    load = warn_if_busy(cores)
    runs, medians = [], []
    for workload in args.workloads:
        done: dict[str, list[AwaitableMeasurement]] = {way: [] for way in args.ways}
        for repeat in range(args.repeats):  # in turns: a change of load falls on every way
            for way in args.ways:
                m = measure(
                    workload, way, coroutines=args.coroutines, warmup_s=args.warmup,
                    seconds=args.seconds,
                )  # fmt: skip
                done[way].append(m)
                print(
                    f"[{workload} {way} run {repeat + 1}] {m.outcome}: "
                    f"{m.trajectories_per_s:.1f} trajectories/s, {m.steps_per_s:.0f} steps/s",
                    file=sys.stderr,
                    flush=True,
                )
        for rows in done.values():
            runs += rows
            medians.append(median_row(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "awaitable.csv", "w") as f:
        names = [f.name for f in fields(AwaitableMeasurement)]
        f.write(",".join(names) + "\n")
        for m in runs + medians:
            f.write(",".join(str(asdict(m)[n]) for n in names) + "\n")
    print(machine_summary(cores, load))
    print(
        f"medians of {args.repeats} runs in turns; {args.coroutines} coroutines, "
        f"{args.warmup:g} s warm-up, {args.seconds:g} s windows"
    )
    print()
    print(markdown_table(medians))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
