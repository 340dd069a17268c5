"""Steps/s with workers pinned and not, alternated in one run (shmvec.spin.pin_workers).

    python tools/pin_ab.py [--seconds S] [--repeats R]

Sync rows step every env each call; async rows (``batch``) run the
``recv``/``send`` loop on batches of that many envs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS

CASES = [  # workload, num_envs, batch (None: sync)
    ("cartpole", 16, None),
    ("cartpole", 64, None),
    ("cartpole", 256, None),
    ("cartpole", 16, 8),
    ("cartpole", 64, 32),
    ("cartpole", 256, 128),
    ("cpu100us", 64, 32),
]


def rate(workload: str, n: int, batch: int | None, pin: bool, seconds: float) -> float:
    env = ShmVectorEnv([WORKLOADS[workload]] * n, batch_size=batch, pin_workers=pin)
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
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for workload, n, batch in CASES:
        got: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for pin in (True, False):
                got[pin].append(rate(workload, n, batch, pin, args.seconds))
        on, off = statistics.median(got[True]), statistics.median(got[False])
        print(
            f"{workload} x{n} {'sync' if batch is None else f'async batch {batch}':15s} "
            f"pinned {on:>11,.0f}  unpinned {off:>11,.0f}  ratio {on / off:.2f}  "
            f"(runs: {[round(x) for x in got[True]]} / {[round(x) for x in got[False]]})",
            flush=True,
        )
