"""Steps/s of ShmVectorEnv variants, alternated in one run (medians of repeats).

    python tools/ab.py [--variants default unpinned ...] [--cases NAME ...]
                       [--seconds S] [--repeats R]

Sync cases step every env each call; async cases (``batch``) run the
``recv``/``send`` loop on batches of that many envs. Session 9 ran
``--variants default unpinned`` (docs/device-session9/run6-pin-ab.log, where
``default`` pinned every mode) and the spin variants on 16 cores. Lent
observations (session 10) against copies and plain views:
``--variants default copied views --cases pong-64 pong-64-async``. Whether more
worker processes than CPUs even out a sync round's ends (session 11, for the 16-core
machine): ``--variants default workers2x workers4x --cases pong-64 cpu100us-64``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from shmvec import ShmVectorEnv, layout, spin
from shmvec_bench.workloads import WORKLOADS

CASES = {  # name: (workload, num_envs, batch (None: sync))
    "cartpole-16": ("cartpole", 16, None),
    "cartpole-64": ("cartpole", 64, None),
    "cartpole-256": ("cartpole", 256, None),
    "cpu100us-16": ("cpu100us", 16, None),
    "cpu100us-64": ("cpu100us", 64, None),
    "cartpole-16-async": ("cartpole", 16, 8),
    "cartpole-64-async": ("cartpole", 64, 32),
    "cartpole-256-async": ("cartpole", 256, 128),
    "cpu100us-64-async": ("cpu100us", 64, 32),
    "pong-64": ("pong", 64, None),
    "pong-64-async": ("pong", 64, 32),
    "largeobs-16": ("largeobs", 16, None),
    "largeobs-16-async": ("largeobs", 16, 8),
}
VARIANTS = {
    "default": {},
    "pinned": {"pin_workers": True},
    "unpinned": {"pin_workers": False},
    "spin100us": {"spin_ns": 100_000},
    "spin500us": {"spin_ns": 500_000},
    "cap200us": {"_many_cores_cap": 200_000},  # the cap before session 9
    "copied": {"_no_leases": True},  # observations copied, as before session 10
    "views": {"copy": False},  # no copy and no lease: what lending can approach
    # More worker processes than CPUs, unpinned: the scheduler then moves the work of
    # a slow vCPU to the others (fewer envs per worker), at the price of more switches.
    "workers2x": {"_workers_per_cpu": 2, "pin_workers": False},
    "workers4x": {"_workers_per_cpu": 4, "pin_workers": False},
}


def rate(workload: str, n: int, batch: int | None, seconds: float, **kwargs) -> float:
    cap = kwargs.pop("_many_cores_cap", None)
    per_cpu = kwargs.pop("_workers_per_cpu", None)
    if per_cpu is not None:
        kwargs["num_workers"] = min(n, per_cpu * spin.available_cpus())
    saved = spin.MANY_CORES_SPIN_CAP_NS, layout.LEASE_MIN_BYTES
    spin.MANY_CORES_SPIN_CAP_NS = saved[0] if cap is None else cap
    if kwargs.pop("_no_leases", False):
        layout.LEASE_MIN_BYTES = 1 << 62
    try:
        env = ShmVectorEnv([WORKLOADS[workload]] * n, batch_size=batch, **kwargs)
    finally:
        spin.MANY_CORES_SPIN_CAP_NS, layout.LEASE_MIN_BYTES = saved
    try:
        actions = np.zeros(n, dtype=np.int64)
        if batch is None:
            env.reset(seed=0)
            step = lambda: env.step(actions) and n  # noqa: E731
        else:
            env.async_reset(seed=0)

            def step():
                ids = env.recv()[-1]["env_id"]
                env.send(actions[: len(ids)], ids)
                return len(ids)

            for _ in range(3 * n // batch):  # every env back once
                step()
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            step()
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            steps += step()
        return steps / (time.perf_counter() - start)
    finally:
        env.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=["default", "unpinned"])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for case in args.cases:
        workload, n, batch = CASES[case]
        got: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.repeats):
            for variant in args.variants:
                got[variant].append(rate(workload, n, batch, args.seconds, **VARIANTS[variant]))
        base = statistics.median(got[args.variants[0]])
        cells = "  ".join(
            f"{v} {statistics.median(r):>11,.0f} ({statistics.median(r) / base:.2f})"
            for v, r in got.items()
        )
        print(f"{case:20s} {cells}  runs: {got}", flush=True)
