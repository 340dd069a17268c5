"""Where one synchronous round goes, from timestamps.

    python dev/round_trace.py [--seconds S] [--only NAME ...]

Every env is wrapped so that each step (or reset) stores CLOCK_MONOTONIC at
its start and end in a shared array; the main process stores the time it
called ``step`` and the time ``step`` returned. Per round, with each worker's
first env start and last env end, this prints medians (and p90) of: the delay
before each worker's first env starts (median worker, and the last worker),
the spread of the workers' ends, and how long after the last end ``step``
returned; and main's own time between rounds. Fork start method only.

Each configuration (``CONFIGS``) runs with the default pinning and unpinned;
the sizes (16 to 256 envs) are meant for a machine with many cores. The
``pong`` ones need ``shmvec[atari]``.
"""

from __future__ import annotations

import argparse
import functools
import time

import gymnasium as gym
import numpy as np

from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS

ROUNDS = 1 << 16


class Stamp(gym.Wrapper):
    def __init__(self, env, stamps, index):
        super().__init__(env)
        self.stamps, self.index, self.k = stamps, index, 0

    def _timed(self, fn, *args, **kwargs):
        t0 = time.monotonic_ns()
        out = fn(*args, **kwargs)
        row = self.stamps[self.k % ROUNDS, self.index]
        row[0], row[1] = t0, time.monotonic_ns()
        self.k += 1
        return out

    def step(self, action):
        return self._timed(self.env.step, action)

    def reset(self, **kwargs):
        return self._timed(self.env.reset, **kwargs)


def _make(workload, stamps, index):
    return Stamp(WORKLOADS[workload](), stamps, index)


def trace(name, workload, n, seconds, **kwargs):
    import mmap

    buf = mmap.mmap(-1, ROUNDS * n * 16)  # shared with forked workers
    stamps = np.frombuffer(buf, dtype=np.int64).reshape(ROUNDS, n, 2)
    env = ShmVectorEnv(
        [functools.partial(_make, workload, stamps, i) for i in range(n)], context="fork", **kwargs
    )
    try:
        post, back = [], []
        env.reset(seed=0)
        actions = env.action_space.sample()
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            env.step(actions)
        first = int(stamps[:, 0, 0].argmax()) + 1  # rounds so far (incl. reset)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds and len(post) < ROUNDS - first - 2:
            post.append(time.monotonic_ns())
            env.step(actions)
            back.append(time.monotonic_ns())
        blocks = [range(b.start, b.stop) for b in env._pool.blocks]
        workers = env.num_workers
    finally:
        env.close()
    r = np.arange(first, first + len(post)) % ROUNDS
    s = stamps[r]  # rounds x envs x 2
    starts = np.stack([s[:, b.start : b.stop, 0].min(1) for b in blocks], 1)
    ends = np.stack([s[:, b.start : b.stop, 1].max(1) for b in blocks], 1)
    post, back = np.array(post), np.array(back)
    ok = (starts >= post[:, None]).all(1) & (ends <= back[:, None]).all(1)
    post, back, starts, ends = post[ok], back[ok], starts[ok], ends[ok]
    delay = (starts - post[:, None]) / 1e3
    span = (ends - starts) / 1e3
    last_end = ends.max(1)
    med = lambda x: float(np.median(x))  # noqa: E731
    p90 = lambda x: float(np.percentile(x, 90))  # noqa: E731
    print(
        f"{name:26s} w={workers:2d} rounds={len(post):5d} (kept {ok.mean():.0%})  round med "
        f"{med((back - post) / 1e3):6.0f} us | start delay: median worker "
        f"{med(np.median(delay, 1)):5.0f} "
        f"last worker {med(delay.max(1)):5.0f} (p90 {p90(delay.max(1)):5.0f}) | work span med "
        f"{med(span):5.0f} max-worker {med(span.max(1)):5.0f} | ends spread "
        f"{med((last_end - ends.min(1)) / 1e3):5.0f} | back after last end "
        f"{med((back - last_end) / 1e3):5.0f} (p90 {p90((back - last_end) / 1e3):5.0f}) | "
        f"main between rounds {med((post[1:] - back[:-1]) / 1e3):4.0f}",
        flush=True,
    )


CONFIGS = [  # default (pinned where shmvec.spin.default_pinning says so), then unpinned
    ("cpu100us x16", "cpu100us", 16, {}),
    ("cpu100us x16 unpinned", "cpu100us", 16, {"pin_workers": False}),
    ("cpu100us x64", "cpu100us", 64, {}),
    ("cpu100us x64 unpinned", "cpu100us", 64, {"pin_workers": False}),
    ("cpu100us x256", "cpu100us", 256, {}),
    ("cpu100us x256 unpinned", "cpu100us", 256, {"pin_workers": False}),
    ("cartpole x64", "cartpole", 64, {}),
    ("cartpole x64 unpinned", "cartpole", 64, {"pin_workers": False}),
    ("cartpole x256", "cartpole", 256, {}),
    ("cartpole x256 unpinned", "cartpole", 256, {"pin_workers": False}),
    ("pong x64", "pong", 64, {}),
    ("pong x64 unpinned", "pong", 64, {"pin_workers": False}),
]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="timed window per config")
    parser.add_argument(
        "--only", nargs="*", default=None, help="configurations by exact name (default: all)"
    )
    args = parser.parse_args()
    for name, workload, n, kwargs in CONFIGS:
        if args.only is None or any(o == name for o in args.only):
            try:
                trace(name, workload, n, args.seconds, **kwargs)
            except Exception as exc:
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
