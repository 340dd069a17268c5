"""Main's own turn in a sync round, split into its parts.

    python dev/main_turn.py [--seconds S] [--cases NAME ...]

A sync round waits for its slowest worker and then for the main process: what
main does between the last worker's arrival and the next round's start is on
every round's critical path. Per case (default mode, ``step`` with the space's
own dtype, so the short path), medians and p90 in microseconds of:

- ``before post``: from the call of ``step`` to the round's post (the actions
  written, the round and its lease region set up);
- ``post``: the post itself (with the futex wake of workers that slept);
- ``after wait``: from main's return from its wait to the return of ``step``;
- the parts of that: ``ended`` (counting the episodes that ended),
  ``read_obs`` (the observations: lent, or copied), ``outcomes`` (rewards and
  flags), ``batch_infos`` (the infos merged), and ``write_exact`` (the actions,
  part of ``before post``).

The parts are timed through instance-level wrappers, which add ~0.2 us each.
It reaches into ``ShmVectorEnv``'s private members (``_rounds``,
``_action_codec``, ``_decoder``), so it follows their names. ``pong-64`` needs
``shmvec[atari]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from shmvec import ShmVectorEnv
from shmvec_bench.workloads import WORKLOADS

CASES = {"cartpole-32": ("cartpole", 32), "pong-64": ("pong", 64), "largeobs-16": ("largeobs", 16)}


class TimedBarrier:
    """The round barrier, stamping main's post and its return from the wait."""

    def __init__(self, barrier, marks: dict) -> None:
        self.barrier, self.marks = barrier, marks

    def __getattr__(self, name):
        return getattr(self.barrier, name)

    def post(self, *args):
        self.marks["pre_post"] = time.perf_counter_ns()
        self.barrier.post(*args)
        self.marks["posted"] = time.perf_counter_ns()

    def wait_done(self, *args):
        done = self.barrier.wait_done(*args)
        self.marks["woke"] = time.perf_counter_ns()
        return done


def time_calls(obj, name: str, times: dict) -> None:
    """Wraps ``obj.name`` so that each call's duration (us) goes to ``times[name]``."""
    call = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            times.setdefault(name, []).append((time.perf_counter_ns() - start) / 1e3)

    setattr(obj, name, timed)


def measure(workload: str, num_envs: int, seconds: float) -> dict[str, list[float]]:
    env = ShmVectorEnv([WORKLOADS[workload]] * num_envs)
    try:
        marks: dict = {}
        times: dict[str, list[float]] = {}
        env._rounds.barrier = TimedBarrier(env._rounds.barrier, marks)
        time_calls(env._rounds, "read_obs", times)
        time_calls(env._action_codec, "write_exact", times)
        for name in ("ended", "outcomes", "batch_infos"):
            time_calls(env._decoder, name, times)
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        actions = [env.action_space.sample() for _ in range(64)]
        for k in range(20):
            env.step(actions[k % 64])
        times.clear()
        start = time.perf_counter()
        k = 0
        while time.perf_counter() - start < seconds:
            marks.clear()
            called = time.perf_counter_ns()
            env.step(actions[rng.integers(64)])
            back = time.perf_counter_ns()
            if "woke" in marks:  # the short path's one wait (not a fallback round)
                times.setdefault("before post", []).append((marks["pre_post"] - called) / 1e3)
                times.setdefault("post", []).append((marks["posted"] - marks["pre_post"]) / 1e3)
                times.setdefault("after wait", []).append((back - marks["woke"]) / 1e3)
            k += 1
        times["rounds"] = [k]
        return times
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per case")
    parser.add_argument(
        "--cases", nargs="*", default=list(CASES), choices=list(CASES), help="default: all"
    )
    args = parser.parse_args()
    order = ["before post", "write_exact", "post", "after wait", "ended", "read_obs",
             "outcomes", "batch_infos"]  # fmt: skip
    for case in args.cases:
        workload, num_envs = CASES[case]
        try:
            times = measure(workload, num_envs, args.seconds)
        except Exception as exc:  # e.g. pong without ale-py: say so, go on with the rest
            print(f"{case:12s} {type(exc).__name__}: {exc}", flush=True)
            continue
        parts = " | ".join(
            f"{name} {statistics.median(v):6.1f} (p90 {np.percentile(v, 90):6.1f})"
            for name in order
            if (v := times.get(name))
        )
        print(f"{case:12s} rounds {times['rounds'][0]:6d} | {parts}", flush=True)


if __name__ == "__main__":
    main()
