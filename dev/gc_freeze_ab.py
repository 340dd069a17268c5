"""What Python's garbage collector costs the rollouts of ``shmvec-bench rollouts --policy
server``, and what ``gc.freeze()`` after start-up buys, alternated::

    taskset -c 0 python dev/fake_llm_server.py --port 47123 &
    taskset -c 1 python dev/gc_freeze_ab.py --server-url http://127.0.0.1:47123/v1 --rounds 2
    python dev/gc_freeze_ab.py --rounds 2      # against vLLM-CPU (the tiny model) started here

A trainer's process holds every object its imports made (torch, transformers, openai: some
370,000 tracked objects here), and each full collection walks all of them while holding the
GIL, stalling the rollout loop and the policy's event loop alike. ``gc.freeze()`` moves the
objects alive now to a generation no collection walks. Each run: one backend
(``--backend``) measured as the benchmark measures it, with ``gc.collect(); gc.freeze()``
just before (``freeze``) or not (``plain``); printed: groups/s, requests/s, the process
tree's CPU per request in the window, and over the whole run (start and close included) this
process's CPU, the collector's share of it and its seconds and collections by generation
(``gc.callbacks``, the collecting thread's CPU time), request p50/p99.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections import defaultdict

from shmvec_bench.rollouts.runner import RAISED_GC_THRESHOLD, frozen_heap, measure
from shmvec_bench.rollouts.server import ServerConfig


class Collector:
    """The collector's CPU time and collections by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.cpu_s: dict[int, float] = defaultdict(float)
        self.count: dict[int, int] = defaultdict(int)
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.cpu_s[info["generation"]] += time.thread_time() - self._t0
            self.count[info["generation"]] += 1

    def reading(self) -> tuple[dict[int, float], dict[int, int]]:
        return dict(self.cpu_s), dict(self.count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url", default=None, help="a running server (default: start vLLM-CPU here)"
    )
    parser.add_argument("--backend", default="shmvec")
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--ways",
        nargs="+",
        default=["plain", "freeze"],
        choices=["plain", "freeze", "tuned"],
        help="tuned: freeze, and the raised collection thresholds (RAISED_GC_THRESHOLD)",
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from shmvec.testing.tiny_llm import tiny_llm

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llm()))
    if args.server_url is not None:
        run(args, ServerConfig(args.server_url, "tiny", tokenizer))
        return
    from shmvec.testing.vllm_server import VLLMServer

    server = VLLMServer(str(tiny_llm()), max_model_len=2048)
    server.start()
    try:
        server.wait_ready()
        pids = tuple(server.pids())
        run(args, ServerConfig(server.base_url, "tiny", tokenizer, server_pids=pids))
    finally:
        server.stop()


def run(args: argparse.Namespace, config: ServerConfig) -> None:
    """The alternated rounds against ``config``'s server, and their medians."""
    collector = Collector()
    results: dict[str, list[tuple[float, ...]]] = defaultdict(list)
    for r in range(args.rounds):
        for way in args.ways:
            heap = {
                "plain": contextlib.nullcontext(),
                "freeze": frozen_heap(),
                "tuned": frozen_heap(RAISED_GC_THRESHOLD),
            }[way]
            with heap:
                frozen = gc.get_freeze_count()
                tracked = len(gc.get_objects()) + frozen
                cpu0, n0 = collector.reading()
                process0 = time.process_time()
                m = measure(
                    "tool", args.backend, "server", num_envs=args.num_envs, group_size=8,
                    seconds=args.seconds, timeout=400, max_lag=None, server=config, seed=r,
                )  # fmt: skip
                process = time.process_time() - process0
                cpu1, n1 = collector.reading()
            gc_s = {g: cpu1.get(g, 0.0) - cpu0.get(g, 0.0) for g in (0, 1, 2)}
            counts = {g: n1.get(g, 0) - n0.get(g, 0) for g in (0, 1, 2)}
            share = sum(gc_s.values()) / process
            row = (
                m.groups_per_s, m.requests_per_s, m.client_cpu_ms_per_request,
                share, m.request_p50_s, m.request_p99_s,
            )  # fmt: skip
            results[way].append(row)
            print(
                f"round {r} {way:6s} ({tracked:,} objects tracked at the start, "
                f"{frozen:,} of them frozen): {m.outcome}: "
                f"{m.groups_per_s:.2f} groups/s, {m.requests_per_s:.1f} requests/s, client CPU "
                f"{m.client_cpu_ms_per_request:.3f} ms/request; over the run this process "
                f"{process:.1f} s CPU, the collector {share:.0%} of it (generations 0/1/2: "
                f"{gc_s[0]:.2f}/{gc_s[1]:.2f}/{gc_s[2]:.2f} s in {counts[0]}/{counts[1]}/"
                f"{counts[2]} collections), request p50/p99 "
                f"{m.request_p50_s:.2f}/{m.request_p99_s:.2f} s",
                flush=True,
            )
    names = ("groups/s", "requests/s", "client CPU ms/request", "collector share",
             "request p50 s", "request p99 s")  # fmt: skip
    print(f"medians of {args.rounds} rounds:")
    first = args.ways[0]
    for i, name in enumerate(names):
        base = statistics.median(row[i] for row in results[first])
        cells = [f"{first} {base:8.3f}"]
        for way in args.ways[1:]:
            value = statistics.median(row[i] for row in results[way])
            cells.append(f"{way} {value:8.3f} ({value / base:.2f}x)")
        print(f"  {name:24s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
