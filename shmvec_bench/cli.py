"""``shmvec-bench``: steps/s of shmvec against its peers, as a table, a CSV and a plot.

Run ``shmvec-bench --quick`` (or ``python -m shmvec_bench``) for the README's
headline figures in well under a minute: CartPole-v1 with 32 envs, a 100 us
CPU-bound step with 8 envs and a no-op env's round trip, each against
gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv`` measured in the same run.
Without ``--quick`` it sweeps ``--workloads`` x ``--backends`` x
``--num-envs`` (x ``--num-workers`` x ``--policy-us``); ``--workloads handoff``
times the GPU hand-off instead (``shmvec_bench.handoff``).

Ratios against ``sync`` and ``async`` use the rows of the same workload,
``num_envs`` and policy wait from the same run; parallel efficiency is
``steps/s / (cores * single-env steps/s)``. Results go to ``--out``
(``results.csv`` and ``throughput.png``) and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shmvec.spin import available_cpus
from shmvec_bench.backends import BACKENDS, DEFAULT_BACKENDS, REGISTRY
from shmvec_bench.report import (
    Progress,
    machine_summary,
    markdown_table,
    warn_if_busy,
    write_csv,
    write_plot,
)
from shmvec_bench.runner import QUICK_BACKENDS, QUICK_CASES, add_ratios, measure, plan_cases
from shmvec_bench.workloads import WORKLOADS

#: The workloads a plain run sweeps; the waiting ones and ``pongsize`` are asked for by name.
DEFAULT_WORKLOADS = ("cartpole", "cpu100us", "varstep", "noop", "largeobs", "pong")
#: Not an env: ``--workloads handoff`` runs the GPU hand-off benchmark.
HANDOFF = "handoff"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shmvec-bench",
        description="Steps/s of shmvec against gymnasium Sync/AsyncVectorEnv, SB3 and one env.",
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=[*WORKLOADS, HANDOFF], default=list(DEFAULT_WORKLOADS),
        help=f"default: {' '.join(DEFAULT_WORKLOADS)}; '{HANDOFF}': the GPU hand-off per step",
    )  # fmt: skip
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=None,
        help=f"default: {' '.join(DEFAULT_BACKENDS)} (with --quick: {' '.join(QUICK_BACKENDS)})",
    )  # fmt: skip
    parser.add_argument(
        "--num-envs", nargs="+", type=int, default=[1, 4, 16, 64], help="a sweep of num_envs"
    )
    parser.add_argument(
        "--num-workers", type=int, nargs="+", default=[None],
        help="shmvec workers, a sweep (default: its own, min(num_envs, cores))",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help="async backends' batch (shmvec-async, envpool-async; default: num_envs // 2)",
    )  # fmt: skip
    parser.add_argument(
        "--policy-us", type=float, nargs="+", default=[0.0],
        help="the main process waits this long per batch received, standing in for the "
        "policy (a sweep; adds the rows without it and a 'policy' row: the policy alone)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=1.0, help="timed window per measurement")
    parser.add_argument("--warmup", type=float, default=0.25, help="warm-up seconds before it")
    parser.add_argument(
        "--quick", action="store_true",
        help="CartPole 32 envs, cpu100us 8 envs, noop 1 env against sync and async, in "
        "about 20 s; replaces --workloads and --num-envs",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument(
        "--context", choices=["fork", "spawn", "forkserver"], default=None,
        help="multiprocessing start method for shmvec, async and sb3 (default: Python's)",
    )  # fmt: skip
    parser.add_argument(
        "--cores", type=int, default=None, help="cores for parallel efficiency (default: usable)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0,
        help="give up on one measurement after this many seconds (a hang is reported, not waited)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default=None,
        help=f"a torch device ('cuda', 'cpu'): runs the '{HANDOFF}' benchmark on it",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.backends is None:
        args.backends = list(QUICK_BACKENDS if args.quick else DEFAULT_BACKENDS)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if any(p < 0 for p in args.policy_us):
        parser.error(f"--policy-us must be >= 0, got {args.policy_us}")
    return args


def importable_backends(backends: Sequence[str]) -> list[str]:
    """``backends`` less those whose package is not installed (saying so on stderr)."""
    missing = [b for b in backends if not REGISTRY[b].is_importable()]
    for module in dict.fromkeys(REGISTRY[b].requires for b in missing):
        skipped = [b for b in missing if REGISTRY[b].requires == module]
        print(f"note: {module} is not installed; skipping {skipped}", file=sys.stderr)
    return [b for b in backends if b not in missing]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if any measurement failed, else 0."""
    args = parse_args(argv)
    if args.device is not None or HANDOFF in args.workloads:
        from shmvec_bench.handoff import run_handoff

        return run_handoff(args.device, args.seconds, args.warmup, args.out)
    cores = args.cores or available_cpus()
    backends = importable_backends(args.backends)
    if args.quick:
        pairs = list(QUICK_CASES)
    else:
        pairs = [(w, n) for w in args.workloads for n in args.num_envs]
    cases = plan_cases(pairs, backends, args.num_workers, args.policy_us, args.batch_size)

    load_before = warn_if_busy(cores)
    started = time.perf_counter()
    measurements = []
    progress = Progress(len(cases))
    try:
        for case in cases:
            progress.start(case)
            m = measure(
                case.workload, case.backend, case.num_envs,
                seconds=args.seconds, warmup_s=args.warmup, num_workers=case.num_workers,
                context=args.context, timeout_s=args.timeout, batch_size=args.batch_size,
                policy_us=case.policy_us,
            )  # fmt: skip
            measurements.append(m)
            progress.finish(m)
    finally:
        progress.close()
    add_ratios(measurements, cores)

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(measurements, args.out / "results.csv")
    summary = machine_summary(cores, load_before)
    plotted = write_plot(measurements, args.out / "throughput.png", cores, title=summary)
    print(summary)
    print(
        f"efficiency (of {cores} x single) = steps/s / ({cores} cores x the 'single' row's "
        "steps/s: one env stepped in this process, same run); CPU-bound workloads only"
    )
    if any(args.policy_us):
        print(
            "vs min(envs, policy) = steps/s / min(the same row without the policy, "
            "the 'policy' row of its batch: batch / policy wait)"
        )
    print()
    print(markdown_table(measurements, cores))
    written = ["results.csv"] + (["throughput.png"] if plotted else [])
    print(
        f"\n{len(measurements)} measurements in {time.perf_counter() - started:.1f} s; "
        f"wrote {', '.join(str(args.out / name) for name in written)}"
    )
    return 1 if any(m.error for m in measurements) else 0
