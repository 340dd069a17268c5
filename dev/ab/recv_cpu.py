"""The main process's own CPU time per async turn (``recv`` then ``send``), two builds alternated.

Wall-clock steps/s on a shared host swing by 2-3x from one second to the next;
the CPU time the main thread spends in a turn (``time.thread_time``) is its own
work only: checks, the futex wait's syscalls, decoding the slot. With
``spin_ns=0`` main never spins, so nothing else is counted. Each measurement is
a fresh process whose ``shmvec`` comes from the side's tree (each built with
``python setup.py build_ext --inplace``); pairs alternate AB, BA, ...::

    python dev/ab/recv_cpu.py --a /tmp/shmvec-old --b . --pairs 8

Prints per pair the median microseconds of main's CPU time per turn, then the
medians and the pairwise ratio B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import numpy as np
from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS

n, batch, turns = (int(v) for v in sys.argv[1:4])
env = ShmVectorEnv([WORKLOADS["cartpole"]] * n, batch_size=batch, spin_ns=0, context="fork")
actions = np.zeros(batch, dtype=np.int64)
env.async_reset(seed=0)
try:
    for _ in range(3 * n // batch):
        ids = env.recv()[-1]["env_id"]
        env.send(actions, ids)
    cpu = []
    for _ in range(turns):
        before = time.thread_time()
        ids = env.recv()[-1]["env_id"]
        env.send(actions, ids)
        cpu.append(time.thread_time() - before)
finally:
    env.close()
print(json.dumps({"median_cpu_us": statistics.median(cpu) * 1e6}))
"""


def measure(tree: Path, n: int, batch: int, turns: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), str(batch), str(turns)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"measurement in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["median_cpu_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, default=Path("."))
    parser.add_argument("--b", type=Path, default=Path("."))
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3000)
    args = parser.parse_args()
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    got: dict[str, list[float]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        for side in "AB" if pair % 2 == 0 else "BA":
            got[side].append(measure(trees[side], args.num_envs, args.batch_size, args.turns))
        print(f"pair {pair + 1}: A {got['A'][-1]:.2f} us  B {got['B'][-1]:.2f} us", flush=True)
    a, b = statistics.median(got["A"]), statistics.median(got["B"])
    ratios = [y / x for x, y in zip(got["A"], got["B"])]
    print(
        f"# main's CPU per turn, CartPole x{args.num_envs} batch_size={args.batch_size}: "
        f"A {a:.2f} us  B {b:.2f} us  B/A {b / a:.3f}  pairwise median "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})",
        flush=True,
    )


if __name__ == "__main__":
    main()
