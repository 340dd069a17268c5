"""``shmvec-bench``: steps/s of shmvec against its peers, as a table, a CSV and a plot.

Run ``shmvec-bench --quick`` (or ``python -m shmvec_bench``) for the headline
comparison in well under a minute: CartPole-v1 with 32 envs, a 100 us
CPU-bound step with 8 envs and a no-op env's round trip, each against
gymnasium's ``SyncVectorEnv`` and ``AsyncVectorEnv`` measured in the same run.
Without ``--quick`` it sweeps ``--workloads`` x ``--backends`` x
``--num-envs`` (x ``--num-workers`` x ``--policy-us``); ``--workloads handoff``
times the GPU hand-off instead (``shmvec_bench.handoff``).

Ratios against ``sync`` and ``async`` use the rows of the same workload,
``num_envs`` and policy wait from the same run; parallel efficiency is
``steps/s / (cores * single-env steps/s)``, for CPU-bound workloads only
(``workloads.CPU_BOUND``). Results go to ``--out``: ``results.csv`` and
``throughput.png`` (grouped bars relative to ``sync`` when each workload has one
row per backend, as with ``--quick``; steps/s against num_envs for a sweep), and
a markdown table is printed.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
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


#: ``--help``'s text above the options: what the command does, with examples.
DESCRIPTION = """\
Steps/s of shmvec's vector envs against gymnasium's SyncVectorEnv and
AsyncVectorEnv (and SB3, EnvPool, PufferLib where installed), each measured in
the same run on this machine. Writes OUT/results.csv and OUT/throughput.png and
prints a markdown table with the machine it ran on.

examples:
  shmvec-bench --quick                        the headline comparison, ~25 s
  shmvec-bench --workloads cartpole cpu100us --num-envs 8 32 128
  shmvec-bench --workloads cpu100us --backends shmvec-async sync --policy-us 200
  shmvec-bench --workloads handoff --device cuda      the GPU hand-off per step
  shmvec-bench rollouts --help                complete groups of trajectories instead

columns: "vs sync" and "vs async" divide by gymnasium's Sync and Async rows of
the same workload and num_envs; "efficiency (of N x single)" is steps/s over
N cores x the 'single' row (one env stepped in a plain loop, same run), shown
for workloads whose step is CPU work."""


def _summary(fn: Callable) -> str:
    """The first sentence of ``fn``'s docstring, on one line, without RST quotes."""
    text = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split()).replace("``", "")
    return text.split(". ")[0].rstrip(".")


def _choices(title: str, names: Sequence[str], describe: Callable[[str], str]) -> str:
    """``title:`` and one wrapped line per name, the descriptions in one column."""
    indent = " " * (max(map(len, names)) + 4)
    lines = [
        textwrap.fill(describe(name), 79, initial_indent=f"  {name:<{len(indent) - 2}}",
                      subsequent_indent=indent)
        for name in names
    ]  # fmt: skip
    return f"{title}:\n" + "\n".join(lines)


def epilog() -> str:
    """``--help``'s text below the options: every workload and backend, one line each."""
    workloads = _choices(
        "workloads",
        [*WORKLOADS, HANDOFF],
        lambda w: _summary(WORKLOADS[w]) if w in WORKLOADS else HANDOFF_SUMMARY,
    )
    backends = _choices(
        "backends",
        BACKENDS,
        lambda b: (
            _summary(REGISTRY[b].open)
            + (f" (needs {REGISTRY[b].requires})" if REGISTRY[b].requires else "")
        ),
    )
    return f"{workloads}\n\n{backends}"


#: ``--workloads handoff`` in the list of workloads.
HANDOFF_SUMMARY = "not an env: the GPU hand-off of each step's results (torch; --device)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shmvec-bench",
        description=DESCRIPTION,
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=[*WORKLOADS, HANDOFF], default=list(DEFAULT_WORKLOADS),
        metavar="NAME",
        help=f"workloads to time, listed below (default: {' '.join(DEFAULT_WORKLOADS)})",
    )  # fmt: skip
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=None, metavar="NAME",
        help=f"vector envs to time, listed below (default: {' '.join(DEFAULT_BACKENDS)}; "
        f"with --quick: {' '.join(QUICK_BACKENDS)}); those not installed are skipped",
    )  # fmt: skip
    parser.add_argument(
        "--num-envs", nargs="+", type=int, default=[1, 4, 16, 64], metavar="N",
        help="a sweep of num_envs (default: 1 4 16 64)",
    )  # fmt: skip
    parser.add_argument(
        "--num-workers", type=int, nargs="+", default=[None], metavar="N",
        help="a sweep of shmvec's worker processes (default: its own, min(num_envs, cores))",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=None, metavar="N",
        help="the async backends' batch (shmvec-async, envpool-async; default: num_envs // 2)",
    )  # fmt: skip
    parser.add_argument(
        "--policy-us", type=float, nargs="+", default=[0.0], metavar="US",
        help="the main process waits this long per batch received, standing in for the "
        "policy (a sweep; adds the rows without it and a 'policy' row: the policy alone)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=1.0, metavar="S",
        help="timed window per measurement (default: 1.0)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=float, default=0.25, metavar="S",
        help="warm-up before each timed window (default: 0.25)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="the headline comparison: cartpole 32 envs, cpu100us 8 envs, noop 1 env against "
        "sync and async (~25 s); replaces --workloads and --num-envs",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), metavar="DIR",
        help="output folder (default: bench-results)",
    )  # fmt: skip
    parser.add_argument(
        "--context", choices=["fork", "spawn", "forkserver"], default=None,
        help="multiprocessing start method for shmvec, async and sb3 (default: Python's)",
    )  # fmt: skip
    parser.add_argument(
        "--cores", type=int, default=None, metavar="N",
        help="cores for the efficiency column (default: the CPUs this process may use)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="S",
        help="give up on one measurement after this many seconds and report it as hung "
        "(default: 120)",
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
    """Runs the benchmark; returns 1 if any measurement failed, else 0.

    ``shmvec-bench rollouts ...`` runs the rollout benchmark (``shmvec_bench.rollouts``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rollouts"]:
        from shmvec_bench.rollouts.cli import main as rollouts_main

        return rollouts_main(argv[1:])
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
    if any(m.efficiency is not None for m in measurements):
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
