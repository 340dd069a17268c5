"""Env threads on one CPU per worker (``always``), on every CPU (``never``), or as shmvec places
them (``rule``: on one CPU until other processes crowd it): steps/s of waiting envs, and what
each worker's CPU shows meanwhile, alternated::

    python dev/placement_probe.py --pairs 5 --seconds 10 [--batch-size 16] [--hog] \
        [--modes always never rule]

256 envs whose step sleeps 20 ms (``shmvec_bench.workloads``' ``wait20ms``) on 2 workers,
``env_concurrency=256``; sync mode, or async mode driven by ``recv``/``send`` with
``--batch-size``. ``--hog`` runs a busy process bound to each CPU beside them (a neighbour that
computes, as an inference server does). Per run: steps/s, and from ``/proc`` (see
``CpuSample``) each CPU's busy share, the share of it the workers used, and the mean number
of the workers' threads waiting on a run queue. The workers fork, so that the placement
chosen here reaches them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from dataclasses import dataclass

import numpy as np

from shmvec import ShmVectorEnv, concurrent_envs, worker
from shmvec_bench.rss import cpu_s
from shmvec_bench.workloads import WORKLOADS


@dataclass
class CpuSample:
    at: float
    cpu_busy: list[int]  # per CPU, clock ticks not idle
    worker_cpu: dict[int, float]  # pid -> CPU seconds
    run_delay_ns: dict[int, int]  # pid -> sum over its threads


def sample(pids: list[int]) -> CpuSample:
    busy = []
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("cpu") and line[3].isdigit():
                f = [int(x) for x in line.split()[1:]]
                busy.append(sum(f[:8]) - f[3] - f[4])  # all but idle and iowait
    cpu, delay = {}, {}
    for pid in pids:
        cpu[pid] = cpu_s(pid)
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[1])
            except OSError:
                pass
        delay[pid] = total
    return CpuSample(time.monotonic(), busy, cpu, delay)


def describe(a: CpuSample, b: CpuSample) -> str:
    wall, tick = b.at - a.at, os.sysconf("SC_CLK_TCK")
    busy = [(y - x) / tick / wall for x, y in zip(a.cpu_busy, b.cpu_busy)]
    workers = [(b.worker_cpu[p] - a.worker_cpu[p]) / wall for p in a.worker_cpu]
    waiting = [(b.run_delay_ns[p] - a.run_delay_ns[p]) / 1e9 / wall for p in a.run_delay_ns]
    return (
        f"CPU busy {' '.join(f'{x:.0%}' for x in busy)}, workers' CPU "
        f"{' '.join(f'{x:.0%}' for x in workers)}, workers' threads waiting to run "
        f"{' '.join(f'{x:.2f}' for x in waiting)}"
    )


def hog(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def run(mode: str, seconds: float, batch_size: int | None) -> tuple[float, str]:
    worker._worker_cpu = PLACE_CPU if mode != "never" else lambda index: None
    concurrent_envs.NEIGHBOUR_SHARE = SHARE if mode == "rule" else float("inf")
    fns = [WORKLOADS["wait20ms"]] * 256
    envs = ShmVectorEnv(
        fns, context="fork", num_workers=2, env_concurrency=256, batch_size=batch_size
    )
    try:
        pids = [p.pid for p in envs._pool.workers]
        steps = 0
        if batch_size is None:
            envs.reset(seed=0)
            actions = envs.action_space.sample()
            step = envs.step
        else:
            envs.async_reset(seed=0)

        def one() -> int:
            if batch_size is None:
                step(actions)
                return 256
            _, _, _, _, infos = envs.recv()
            ids = infos["env_id"]
            envs.send(np.zeros(len(ids), dtype=np.int64), ids)
            return len(ids)

        end = time.monotonic() + seconds / 5
        while time.monotonic() < end:  # warm-up
            one()
        first = sample(pids)
        end = first.at + seconds
        while time.monotonic() < end:
            steps += one()
        last = sample(pids)
        return steps / (last.at - first.at), describe(first, last)
    finally:
        envs.close(terminate=True)


PLACE_CPU, SHARE = worker._worker_cpu, concurrent_envs.NEIGHBOUR_SHARE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--modes", nargs="+", choices=("always", "never", "rule"),
                        default=["always", "never", "rule"])  # fmt: skip
    args = parser.parse_args()
    hogs = []
    if args.hog:
        for cpu in sorted(os.sched_getaffinity(0)):
            hogs.append(
                multiprocessing.get_context("fork").Process(target=hog, args=(cpu,), daemon=True)
            )
            hogs[-1].start()
    rates: dict[str, list[float]] = {mode: [] for mode in args.modes}
    try:
        for pair in range(args.pairs):
            order = args.modes if pair % 2 == 0 else args.modes[::-1]
            for mode in order:
                rate, cpu = run(mode, args.seconds, args.batch_size)
                rates[mode].append(rate)
                print(f"pair {pair} {mode:6s}: {rate:8.0f} steps/s; {cpu}", flush=True)
    finally:
        for process in hogs:
            process.kill()
    first = float(np.median(rates[args.modes[0]]))
    for mode in args.modes:
        median = float(np.median(rates[mode]))
        print(f"median {mode:6s}: {median:8.0f} steps/s, {median / first:.3f}x {args.modes[0]}")


if __name__ == "__main__":
    main()
