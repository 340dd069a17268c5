"""Alternated A/B of two shmvec builds (or two settings) on the workloads each
heuristic of the engine targets; see docs/design/heuristics.md.

Each measurement runs in a fresh Python process whose ``shmvec`` and
``shmvec_bench`` come from the side's tree, so that two checkouts (each built
with ``python setup.py build_ext --inplace``) can be compared in one run::

    git worktree add /tmp/shmvec-old <commit> && (cd /tmp/shmvec-old && \\
        python setup.py build_ext --inplace)
    nice -n -10 python dev/ab/heuristics.py --a /tmp/shmvec-old --b . --pairs 5

A side may also differ by environment variables (``--b-env NAME=VALUE``, read by
a switch the tree carries for the measurement) or by ``ShmVectorEnv`` options
for one case (``--b-kwargs 'wait5ms-16={"env_concurrency": 16}'``; the waiting
cases need ``env_concurrency`` to step their envs in threads; a side whose
options make it async, ``batch_size`` included, is driven by ``recv``/``send``).
Within each pair the order of A and B alternates (AB, then BA, ...), so that a
drift of the host's speed weighs on both sides alike.

Sides that differ only by environment variables or options are best compared
with ``--interleave``: one process per case holds both vector envs open and
steps them in alternate slices (of ``--seconds``, each after an untimed fifth
while the side's idle spins learn again), which cancels most of a busy host's
drift; 40 slices of 0.3 s gave medians of B/A within ~5% on a host with a
load average of 8 (an A/A run shows the spread)::

    nice -n -10 python dev/ab/heuristics.py --interleave --b-env SOME_SWITCH=1 \
        --pairs 40 --seconds 0.3 --cases cartpole-32 cpu100us-8 noop-1 Every pair is printed as it
comes, then per case the medians and the ratio B/A of the medians (for
``median_us`` cases a lower B/A is better, for steps/s a higher one). The peers
(``SyncVectorEnv``, gymnasium's ``AsyncVectorEnv``, one env stepped alone) are
measured once per pair with side A's tree, to put each side against the
figures the README quotes (``cpu100us-8``'s one env alone, measured once per
pair, divides both sides: its B/A is that of the steps/s).

Cases: ``cartpole-32`` (sync mode, default options), ``cpu100us-8`` (sync, as a
share of the cores: ``steps/s / (cores * one env alone)``), ``noop-1`` (one
no-op env: the median ``step`` time), ``wait5ms-16`` (16 envs whose step sleeps
5 ms), ``wait20ms-256`` (256 envs whose step sleeps 20 ms: at most 12,800 steps/s),
``cartpole-32-async`` (``batch_size=16``), ``cartpole-64-async`` (``batch_size=32``),
``cpu100us-8-async`` (``batch_size=4``)
and ``cpu100us-8-async-policy`` (the same with a 200 us policy stand-in between
``recv`` and ``send``). Needs nothing beyond the project's ``bench`` extra
(gymnasium).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: name: (workload, num_envs, batch_size or None for sync mode, metric, peer)
CASES = {
    "cartpole-32": ("cartpole", 32, None, "steps_per_s", "sync"),
    "cpu100us-8": ("cpu100us", 8, None, "steps_per_s", "single"),
    "noop-1": ("noop", 1, None, "median_us", "sync"),
    "wait5ms-16": ("wait5ms", 16, None, "steps_per_s", "async"),
    "wait20ms-256": ("wait20ms", 256, None, "steps_per_s", None),
    "cartpole-32-async": ("cartpole", 32, 16, "steps_per_s", None),
    "cartpole-64-async": ("cartpole", 64, 32, "steps_per_s", None),
    "cpu100us-8-async": ("cpu100us", 8, 4, "steps_per_s", None),
    "cpu100us-8-async-policy": ("cpu100us", 8, 4, "steps_per_s", None),
}
#: Cases whose loop runs a policy stand-in (shmvec_bench.policy.PolicyWait) of
#: this many microseconds on every batch, between recv and send.
POLICY_US = {"cpu100us-8-async-policy": 200}

# Runs in the measuring process. One backend: warm up, time `seconds`. With
# "sides" (interleaved mode): both sides' vector envs open at once, stepped in
# alternate slices of `seconds` (AB, BA, ...; each after an untimed fifth of
# that, while the side's idle spins learn again), `pairs` times.
CHILD = r"""
import json, os, statistics, sys, time
import numpy as np
import gymnasium as gym
from shmvec_bench.policy import PolicyWait
from shmvec_bench.workloads import WORKLOADS

spec = json.loads(sys.argv[1])
fn = WORKLOADS[spec["workload"]]
n, batch = spec["num_envs"], spec["batch"]
actions = np.random.default_rng(0).integers(0, 2, size=(64, n))
think = PolicyWait(spec["policy_us"]) if spec.get("policy_us") else (lambda: None)


def open_backend(backend, kwargs, env_vars):
    if backend == "single":
        env = fn()
        env.reset(seed=0)

        def step(k):
            _, _, terminated, truncated, _ = env.step(int(actions[k, 0]))
            if terminated or truncated:
                env.reset()
            return 1
        return env, step
    if backend in ("sync", "async"):
        cls = gym.vector.SyncVectorEnv if backend == "sync" else gym.vector.AsyncVectorEnv
        env = cls([fn] * n)
        env.reset(seed=0)
        return env, lambda k: env.step(actions[k]) and n
    from shmvec import ShmVectorEnv

    saved = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)  # read by the engine and its workers at start
    try:
        env = ShmVectorEnv([fn] * n, **{"batch_size": batch, "context": "fork", **kwargs})
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    if not env.is_async:
        env.reset(seed=0)
        return env, lambda k: env.step(actions[k]) and n
    env.async_reset(seed=0)

    def step(k):
        ids = env.recv()[-1]["env_id"]
        think()
        env.send(actions[k, : len(ids)], ids)
        return len(ids)

    for k in range(3 * n // env.batch_size):  # every env back once
        step(k)
    return env, step


def timed(step, seconds, k=0):
    clock = time.perf_counter_ns
    durations, rows = [], 0
    start = now = clock()
    deadline = start + int(seconds * 1e9)
    while now < deadline:
        rows += step(k % 64)
        k += 1
        after = clock()
        durations.append(after - now)
        now = after
    return {"steps_per_s": rows / ((now - start) / 1e9),
            "median_us": statistics.median(durations) / 1e3}


def threads_of(env):
    stats = getattr(env, "stats", None)
    return stats().get("worker_env_threads") if stats else None


if "sides" not in spec:
    env, step = open_backend(spec["backend"], spec.get("kwargs", {}), {})
    try:
        timed(step, spec["warmup_s"])
        result = timed(step, spec["seconds"])
        result["env_threads"] = threads_of(env)
    finally:
        env.close()
    print(json.dumps(result))
else:
    opened = {}
    try:
        for name, side in spec["sides"].items():
            opened[name] = open_backend("shmvec", side["kwargs"], side["env"])
        for env, step in opened.values():
            timed(step, spec["warmup_s"])
        pairs = []
        for pair in range(spec["pairs"]):
            got = {}
            for name in ("AB" if pair % 2 == 0 else "BA"):
                step = opened[name][1]
                timed(step, spec["seconds"] / 5)  # untimed: its spins learn again
                got[name] = timed(step, spec["seconds"])
            pairs.append(got)
        threads = {name: threads_of(env) for name, (env, _) in opened.items()}
    finally:
        for env, _ in opened.values():
            env.close()
    print(json.dumps({"pairs": pairs, "env_threads": threads}))
"""


def measure(tree: Path, env: dict, spec: dict) -> dict:
    """One measurement in a fresh process whose imports come from ``tree``."""
    child_env = {**os.environ, **env, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        cwd=tree, env=child_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pairs_of(options: list[str]) -> dict:
    """``NAME=VALUE`` strings -> dict."""
    return dict(option.split("=", 1) for option in options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, default=Path("."), help="side A's tree")
    parser.add_argument("--b", type=Path, default=Path("."), help="side B's tree")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--a-kwargs", action="append", default=[], metavar="CASE=JSON")
    parser.add_argument("--b-kwargs", action="append", default=[], metavar="CASE=JSON")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--interleave", action="store_true",
        help="one process per case holds both sides open and alternates slices of "
        "--seconds: for sides that differ by env vars or options only (one tree)",
    )  # fmt: skip
    args = parser.parse_args()
    sides = {
        "A": (args.a.resolve(), pairs_of(args.a_env),
              {k: json.loads(v) for k, v in pairs_of(args.a_kwargs).items()}),
        "B": (args.b.resolve(), pairs_of(args.b_env),
              {k: json.loads(v) for k, v in pairs_of(args.b_kwargs).items()}),
    }  # fmt: skip
    for name, (tree, env, kwargs) in sides.items():
        print(f"# side {name}: tree {tree}, env {env}, kwargs {kwargs}", flush=True)
    cores = len(os.sched_getaffinity(0))
    if args.interleave:
        interleaved(args, sides, cores)
        return
    got: dict[tuple[str, str], list[float]] = {}
    for pair in range(args.pairs):
        order = "AB" if pair % 2 == 0 else "BA"
        for case in args.cases:
            workload, n, batch, metric, peer = CASES[case]
            base = {"workload": workload, "num_envs": n, "batch": batch,
                    "seconds": args.seconds, "warmup_s": args.warmup,
                    "policy_us": POLICY_US.get(case, 0)}  # fmt: skip
            cells = []
            if peer == "single":  # the case's figure: a share of the cores
                single = measure(sides["A"][0], {}, {**base, "backend": "single"})
                per_core = single["steps_per_s"]
                cells.append(f"single {per_core:,.4g}")
            for side in order:
                tree, env, kwargs = sides[side]
                spec = {**base, "backend": "shmvec", "kwargs": kwargs.get(case, {})}
                result = measure(tree, env, spec)
                value = result[metric]
                if peer == "single":
                    value = value / (cores * per_core)
                got.setdefault((case, side), []).append(value)
                cells.append(f"{side} {value:,.4g} (env threads {result['env_threads']})")
            if peer in ("sync", "async") and not args.no_peers:
                value = measure(sides["A"][0], {}, {**base, "backend": peer})[metric]
                got.setdefault((case, peer), []).append(value)
                cells.append(f"{peer} {value:,.4g}")
            print(f"pair {pair + 1} {case:18s} {metric:11s} " + "  ".join(cells), flush=True)
    summary(args.cases, got)


def interleaved(args, sides: dict, cores: int) -> None:
    """Per case, one process with both sides open, stepped in alternate slices."""
    if sides["A"][0] != sides["B"][0]:
        raise SystemExit("--interleave compares two settings of one tree (--a == --b)")
    tree = sides["A"][0]
    got: dict[tuple[str, str], list[float]] = {}
    for case in args.cases:
        workload, n, batch, metric, peer = CASES[case]
        base = {"workload": workload, "num_envs": n, "batch": batch,
                "seconds": args.seconds, "warmup_s": args.warmup,
                "policy_us": POLICY_US.get(case, 0)}  # fmt: skip
        per_side = {
            name: {"env": env, "kwargs": kwargs.get(case, {})}
            for name, (_, env, kwargs) in sides.items()
        }
        result = measure(tree, {}, {**base, "sides": per_side, "pairs": args.pairs})
        scale = 1.0
        if peer == "single":  # a share of the cores: one env alone, median of 3
            alone = [measure(tree, {}, {**base, "backend": "single"}) for _ in range(3)]
            scale = 1 / (cores * statistics.median(r["steps_per_s"] for r in alone))
        for pair, cells in enumerate(result["pairs"]):
            for side in "AB":
                got.setdefault((case, side), []).append(cells[side][metric] * scale)
            a, b = got[(case, "A")][-1], got[(case, "B")][-1]
            print(f"pair {pair + 1} {case:18s} {metric:11s} A {a:,.4g}  B {b:,.4g}", flush=True)
        print(f"# {case}: env threads per worker {result['env_threads']}", flush=True)
        if peer in ("sync", "async") and not args.no_peers:
            for _ in range(3):
                value = measure(tree, {}, {**base, "backend": peer})[metric]
                got.setdefault((case, peer), []).append(value)
    summary(args.cases, got)


def pairwise(a: list[float], b: list[float]) -> str:
    """The median of B/A over the pairs, and its quartiles when there are 4+ pairs."""
    ratios = [y / x for x, y in zip(a, b)]
    text = f"{statistics.median(ratios):.3f}"
    if len(ratios) >= 4:
        low, _, high = statistics.quantiles(ratios, n=4)
        text += f" (quartiles {low:.3f}-{high:.3f}, {len(ratios)} pairs)"
    return text


def summary(cases: list[str], got: dict) -> None:
    print("\n# medians (B/A: ratio of the medians; pairwise: median of B/A per pair)")
    for case in cases:
        metric, peer = CASES[case][3], CASES[case][4]
        a, b = got[(case, "A")], got[(case, "B")]
        line = (
            f"{case:18s} {metric:11s} A {statistics.median(a):,.4g}  B {statistics.median(b):,.4g}"
            f"  B/A {statistics.median(b) / statistics.median(a):.3f}"
            f"  pairwise {pairwise(a, b)}"
        )
        if (case, peer) in got:
            p = statistics.median(got[(case, peer)])
            line += f"  {peer} {p:,.4g}  A/{peer} {statistics.median(a) / p:.2f}"
            line += f"  B/{peer} {statistics.median(b) / p:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
