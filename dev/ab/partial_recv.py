"""What ``recv(partial=True)`` costs against an ordinary ``recv`` of the same rows.

One process holds two vector envs of the same CartPole envs open: P, with
``batch_size=32``, runs ``k < 32`` envs a turn and receives them with
``recv(partial=True)`` (the slot padded, the claims skipped); F, with
``batch_size=k``, runs the same ``k`` envs and receives them with the plain
``recv``. A turn is ``send`` then ``recv``, so both wait for the same ``k`` env
steps on the same workers; the difference of the medians is what the partial
batch adds. Each pair opens both anew, in alternate order, and steps them
in alternate slices (PF, FP, ...), so that neither the host's drift nor which
env's processes came first weighs on one side::

    nice -n -10 python dev/ab/partial_recv.py --pairs 8 --seconds 0.5 --rows 1 16 31

Run it from the repository root with shmvec built.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS

NUM_ENVS, BATCH = 64, 32


def opened(batch: int, ids: np.ndarray, partial: bool):
    env = ShmVectorEnv([WORKLOADS["cartpole"]] * NUM_ENVS, batch_size=batch, context="fork")
    env.async_reset(seed=0)
    received = 0
    while received < NUM_ENVS:  # every env idle
        received += len(env.recv(partial=True)[4]["env_id"])
    actions = np.zeros(len(ids), dtype=np.int64)

    def turn() -> None:
        env.send(actions, ids)
        env.recv(partial=partial)

    return env, turn


def timed(turn, seconds: float) -> float:
    """The median time of a turn, in microseconds."""
    durations = []
    deadline = time.perf_counter() + seconds
    now = time.perf_counter()
    while now < deadline:
        turn()
        after = time.perf_counter()
        durations.append(after - now)
        now = after
    return statistics.median(durations) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 31])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    for k in args.rows:
        ids = np.unique(np.linspace(0, NUM_ENVS - 1, k).astype(np.int64))
        got: dict[str, list[float]] = {"P": [], "F": []}
        for pair in range(args.pairs):
            order = "PF" if pair % 2 == 0 else "FP"
            sides = {}
            try:
                for name in order:
                    partial = name == "P"
                    sides[name] = opened(BATCH if partial else len(ids), ids, partial)
                for name in order:
                    timed(sides[name][1], args.seconds)  # warm up: spins learn
                for name in order:
                    timed(sides[name][1], args.seconds / 5)  # untimed: spins learn again
                    got[name].append(timed(sides[name][1], args.seconds))
            finally:
                for env, _ in sides.values():
                    env.close()
            print(
                f"rows {k:2d} pair {pair + 1} ({order}): partial {got['P'][-1]:7.1f} us  "
                f"plain {got['F'][-1]:7.1f} us",
                flush=True,
            )
        p, f = statistics.median(got["P"]), statistics.median(got["F"])
        ratios = statistics.median(b / a for a, b in zip(got["F"], got["P"]))
        print(
            f"# rows {k:2d}: median turn partial {p:.1f} us, plain recv of batch_size={k} "
            f"{f:.1f} us, partial - plain {p - f:+.1f} us, pairwise partial/plain {ratios:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
