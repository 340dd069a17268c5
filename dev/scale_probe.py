"""Where a round's time goes on a many-core machine.

    python dev/scale_probe.py [--seconds S] [--only NAME ...] [--ceiling WORKLOAD ...]

For each configuration: steps/s, the round's median, the workers' busy and CPU
fractions, their env threads, and from /proc (schedstat, status) the time each
process was runnable but not running and its involuntary switches, per round.
``ceiling`` rows step one env in each of ``cores`` processes at once: the
machine's all-core rate, next to the bench's ``cores x one env alone``.

Linux only (/proc); the ``pong`` configurations need ``shmvec[atari]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS


def sched(pid: int) -> tuple[int, int]:
    """(ns waiting on a run queue, involuntary switches) of process ``pid``."""
    with open(f"/proc/{pid}/schedstat") as f:
        wait_ns = int(f.read().split()[1])
    with open(f"/proc/{pid}/status") as f:
        key = "nonvoluntary_ctxt_switches"
        invol = next(int(line.split()[1]) for line in f if line.startswith(key))
    return wait_ns, invol


def probe(name: str, workload: str, num_envs: int, seconds: float, **kwargs) -> None:
    env = ShmVectorEnv([WORKLOADS[workload]] * num_envs, **kwargs)
    try:
        env.reset(seed=0)
        actions = env.action_space.sample()
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            env.step(actions)
        pids = [os.getpid()] + [w.pid for w in env._pool.workers if hasattr(w, "pid")]
        before = [sched(p) for p in pids]
        cpu0 = np.array(env._pool.cpu_seconds())
        busy0 = np.array(env._pool.busy_ns, dtype=np.int64)
        rounds, times = 0, []
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            env.step(actions)
            times.append(time.perf_counter() - now)
            rounds += 1
        elapsed = time.perf_counter() - start
        after = [sched(p) for p in pids]
        cpu = (np.array(env._pool.cpu_seconds()) - cpu0) / elapsed
        stats1 = env.stats()
        busy = (np.array(env._pool.busy_ns, dtype=np.int64) - busy0) / 1e9 / elapsed
        rq = [(a[0] - b[0]) / rounds / 1e3 for a, b in zip(after, before)]
        inv = [(a[1] - b[1]) / rounds for a, b in zip(after, before)]
        print(
            f"{name:28s} {num_envs * rounds / elapsed:>10,.0f} steps/s  round med "
            f"{statistics.median(times) * 1e6:7.0f} us mean {elapsed / rounds * 1e6:7.0f}  "
            f"busy {busy.mean():.2f} [{busy.min():.2f}-{busy.max():.2f}]  "
            f"cpu {cpu.mean():.2f}  threads {sorted(set(stats1['worker_env_threads']))}  "
            f"main wait {(stats1['main_wait_fraction']):.2f}  "
            f"runq us/round main {rq[0]:.1f} workers {np.mean(rq[1:]):.1f} "
            f"(max {max(rq[1:]):.1f})  "
            f"invol/round main {inv[0]:.2f} workers {np.mean(inv[1:]):.2f}",
            flush=True,
        )
    finally:
        env.close()


def _one(workload: str, seconds: float, out) -> None:
    env = WORKLOADS[workload]()
    env.reset(seed=0)
    action = env.action_space.sample()
    steps, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        _, _, term, trunc, _ = env.step(action)
        steps += 1
        if term or trunc:
            env.reset()
    out.put(steps / seconds)


def ceiling(workload: str, processes: int, seconds: float) -> None:
    """Steps/s of one env alone, and summed over ``processes`` envs stepped at once."""
    out = mp.get_context("fork").Queue()
    for count in (1, processes):
        procs = [
            mp.get_context("fork").Process(target=_one, args=(workload, seconds, out))
            for _ in range(count)
        ]
        for p in procs:
            p.start()
        rates = [out.get() for _ in procs]
        for p in procs:
            p.join()
        print(f"ceiling {workload:10s} {count:3d} processes: {sum(rates):>10,.0f} steps/s "
              f"({sum(rates) / count:,.0f} each)", flush=True)  # fmt: skip


CONFIGS = [
    ("cpu100us x256", "cpu100us", 256, {}),
    ("cpu100us x256 conc=1", "cpu100us", 256, {"env_concurrency": 1}),
    ("cpu100us x256 spin200us", "cpu100us", 256, {"spin_ns": 200_000}),
    ("cpu100us x256 spin0", "cpu100us", 256, {"spin_ns": 0}),
    ("cpu100us x64", "cpu100us", 64, {}),
    ("cpu100us x64 conc=1", "cpu100us", 64, {"env_concurrency": 1}),
    ("cpu100us x16", "cpu100us", 16, {}),
    ("cpu100us x16 conc=1", "cpu100us", 16, {"env_concurrency": 1}),
    ("cpu100us x64 w15", "cpu100us", 64, {"num_workers": 15}),
    ("cartpole x256", "cartpole", 256, {}),
    ("cartpole x256 conc=1", "cartpole", 256, {"env_concurrency": 1}),
    ("cartpole x256 main", "cartpole", 256, {"step_in_main": True}),
    ("cartpole x64", "cartpole", 64, {}),
    ("pong x64", "pong", 64, {}),
    ("pong x64 conc=1", "pong", 64, {"env_concurrency": 1}),
    ("pong x256", "pong", 256, {}),
]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="timed window per config")
    parser.add_argument(
        "--only", nargs="*", default=None,
        help="configurations whose name contains any of these (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--ceiling", nargs="*", default=["cpu100us", "cartpole", "pong"],
        help="workloads for the all-core ceiling rows (none: skip them)",
    )  # fmt: skip
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    for workload in args.ceiling:
        ceiling(workload, cores, args.seconds)
    for name, workload, n, kwargs in CONFIGS:
        if args.only is None or any(o in name for o in args.only):
            try:
                probe(name, workload, n, args.seconds, **kwargs)
            except Exception as exc:
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
