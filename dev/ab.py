"""Steps/s of ShmVectorEnv variants, alternated in one run (medians of repeats).

    python dev/ab.py [--variants default unpinned ...] [--cases NAME ...]
                     [--seconds S] [--repeats R]

An A/B bench for one mechanism at a time: each repeat runs every variant once
per case, in turn, so that drift in the machine's speed hits them all alike,
and each cell prints a variant's median steps/s and its ratio to the first
variant's. Sync cases step every env each call; async cases (names ending in
``-async``) run the ``recv``/``send`` loop on batches of the given size.

Variants (``VARIANTS``): ``pinned``/``unpinned`` workers; the spin budget
(``spin100us``, ``spin500us``) and the many-core spin cap at 200 us
(``cap200us``); observations copied instead of lent (``copied``) and plain
``copy=False`` views (``views``, what lending can approach); 2x and 4x as many
unpinned worker processes as CPUs (``workers2x``, ``workers4x``). Examples:

    python dev/ab.py --variants default unpinned
    python dev/ab.py --variants default copied views --cases pong-64 pong-64-async
    python dev/ab.py --variants default workers2x workers4x --cases pong-64 cpu100us-64

The ``pong`` cases need ``shmvec[atari]``. Run it from the repository root with
shmvec built (``python setup.py build_ext --inplace``).
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
    # spin.MANY_CORES_SPIN_CAP_NS at 200 us instead of its default.
    "cap200us": {"_many_cores_cap": 200_000},
    # No lease regions (layout.LEASE_MIN_BYTES out of reach): observations copied.
    "copied": {"_no_leases": True},
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", nargs="+", default=["default", "unpinned"], choices=list(VARIANTS),
        help="the variants to alternate; ratios are to the first (default: default unpinned)",
    )  # fmt: skip
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=list(CASES),
        help="workload-num_envs[-async] cases (default: all)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=1.0, help="timed window per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant per case")
    args = parser.parse_args()
    for case in args.cases:
        workload, n, batch = CASES[case]
        got: dict[str, list[float]] = {v: [] for v in args.variants}
        try:
            for _ in range(args.repeats):
                for variant in args.variants:
                    got[variant].append(rate(workload, n, batch, args.seconds, **VARIANTS[variant]))
        except Exception as exc:  # e.g. pong without ale-py: say so, go on with the rest
            print(f"{case:20s} {type(exc).__name__}: {exc}", flush=True)
            continue
        base = statistics.median(got[args.variants[0]])
        cells = "  ".join(
            f"{v} {statistics.median(r):>11,.0f} ({statistics.median(r) / base:.2f})"
            for v, r in got.items()
        )
        print(f"{case:20s} {cells}  runs: {got}", flush=True)
