"""Envs that wait (issue 17): steps/s and memory of shmvec against gymnasium.

Each measurement runs in a fresh process (so that memory figures are its own),
alternating backends, ``--repeats`` times; medians are printed. Usage::

    python tools/bench_waiting.py                 # the three targets
    python tools/bench_waiting.py --repeats 5 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class SleepEnv(gym.Env):
    """A step that waits ``sleep`` seconds (a tool call's latency) and computes nothing."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        time.sleep(self.sleep)
        self.t += 1
        return np.full(4, (self.t % 100) / 100, np.float32), 1.0, False, self.t >= 200, {}


def make(backend: str, num_envs: int, sleep: float, concurrency: int | None):
    fns = [lambda: SleepEnv(sleep)] * num_envs
    if backend == "shmvec":
        import shmvec

        return shmvec.ShmVectorEnv(fns, env_concurrency=concurrency)
    if backend == "async":
        return gym.vector.AsyncVectorEnv(fns)
    return gym.vector.SyncVectorEnv(fns)


def tree_memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB, summed over ``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def measure(backend: str, num_envs: int, sleep: float, seconds: float, concurrency) -> dict:
    envs = make(backend, num_envs, sleep, concurrency)
    envs.reset(seed=0)
    actions = np.zeros(num_envs, dtype=np.int64)
    warm_until = time.perf_counter() + max(0.5, 10 * sleep)
    while time.perf_counter() < warm_until:
        envs.step(actions)
    steps, started = 0, time.perf_counter()
    cpu0 = os.times()
    while time.perf_counter() - started < seconds:
        envs.step(actions)
        steps += 1
    elapsed = time.perf_counter() - started
    result = {"steps_per_s": steps * num_envs / elapsed}
    result["rss_kib"], result["pss_kib"] = tree_memory_kib(os.getpid())
    if backend == "shmvec":
        stats = envs.stats()
        result["env_threads"] = stats["worker_env_threads"]
        result["cpu_fraction"] = [round(f, 2) for f in stats["worker_cpu_fraction"]]
    cpu1 = os.times()
    result["main_cpu_fraction"] = round(
        (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / elapsed, 2
    )
    envs.close()
    return result


CASES = {  # name: (num_envs, sleep s, backends)
    "16x5ms": (16, 0.005, ["shmvec", "async", "sync"]),
    "64x5ms-memory": (64, 0.005, ["shmvec", "async"]),
    "256x20ms": (256, 0.020, ["shmvec", "async"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--env-concurrency", type=int, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, case = args.child.split(":")
        num_envs, sleep, _ = CASES[case]
        print(json.dumps(measure(backend, num_envs, sleep, args.seconds, args.env_concurrency)))
        return
    print(f"cores: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()}")
    for case in args.cases:
        num_envs, sleep, backends = CASES[case]
        runs: dict[str, list[dict]] = {b: [] for b in backends}
        for _ in range(args.repeats):
            for backend in backends:
                command = [sys.executable, __file__, "--child", f"{backend}:{case}",
                           "--seconds", str(args.seconds)]  # fmt: skip
                if args.env_concurrency is not None:
                    command += ["--env-concurrency", str(args.env_concurrency)]
                out = subprocess.run(command, capture_output=True, text=True, timeout=600)
                if out.returncode:
                    raise RuntimeError(out.stderr)
                runs[backend].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ideal = num_envs / sleep
        print(f"\n{case}: {num_envs} envs, step waits {sleep * 1e3:.0f} ms "
              f"(ideal {ideal:,.0f} steps/s), medians of {args.repeats}")  # fmt: skip
        medians = {}
        for backend, results in runs.items():
            sps = statistics.median(r["steps_per_s"] for r in results)
            rss = statistics.median(r["rss_kib"] for r in results) / 1024
            pss = statistics.median(r["pss_kib"] for r in results) / 1024
            medians[backend] = (sps, rss, pss)
            extra = ""
            if backend == "shmvec":
                extra = f" threads/worker {results[-1]['env_threads']}" \
                        f" worker cpu {results[-1]['cpu_fraction']}"  # fmt: skip
            print(f"  {backend:7s} {sps:9,.0f} steps/s ({sps / ideal:5.1%} of ideal) "
                  f"RSS {rss:7.0f} MiB PSS {pss:6.0f} MiB  runs "
                  f"{[round(r['steps_per_s']) for r in results]}{extra}")  # fmt: skip
        if "async" in medians:
            ours, theirs = medians["shmvec"], medians["async"]
            print(f"  shmvec / async: steps/s {ours[0] / theirs[0]:.2f}x, "
                  f"RSS {ours[1] / theirs[1]:.2f}x, PSS {ours[2] / theirs[2]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
