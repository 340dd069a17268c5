"""The policy's event loop in ``shmvec-bench rollouts --policy server``'s shmvec row, against a
running server (such as ``dev/fake_llm_server.py``), the ``tool`` workload::

    python dev/event_loop_probe.py --server-url http://127.0.0.1:47123/v1 loops --loops 1 4 8 0
    python dev/event_loop_probe.py --server-url http://127.0.0.1:47123/v1 passes
    python dev/event_loop_probe.py --server-url http://127.0.0.1:47123/v1 iterations

``loops``: ``ServerPolicy``'s rows dealt to N event loops, each in a thread of its own with its
own clients and an equal share of the in-flight cap (rows by env id; the runner patched here,
not an option of the layer), alternated over ``--rounds`` with ROLL's threads (``0``): groups/s,
requests/s, client CPU per request, requests at the server, request p50.

``passes``: every ``ServerPolicy.act`` driven through a wrapper that counts its suspensions
(each one a pass through the event loop) and the three innermost frames it waited in, and the
CPU of each resumption.

``iterations``: the policy thread's event-loop iterations timed (the select included), the
ready callbacks counted at each one's start, and Python's collector timed by generation.

``heap``: for shmvec and ROLL's threads alike, the start-up heap frozen (``--gc-freeze``): the
collector's runs over each run (its start and warm-up included) timed by generation, and about
halfway through the window what a full collection walks (the objects it tracks by type, and the
items of the lists and dicts among them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import gc
import threading
import time
from typing import Any

import numpy as np

from shmvec.rollouts import policies
from shmvec.rollouts import rollouts as rollouts_module
from shmvec.rollouts import server as server_module
from shmvec.rollouts.server_client import InFlightLimit
from shmvec.testing.tiny_llm import tiny_llm
from shmvec_bench.rollouts.runner import frozen_heap, measure
from shmvec_bench.rollouts.server import ServerConfig

Runner = policies.AsyncPolicyRunner
LOOPS = [1]  # event loops for the next run's ServerPolicy


class MultiLoopRunner(policies.PolicyRunner):
    """``LOOPS[0]`` runners of clones of one ``ServerPolicy``, sharing one answer queue."""

    per_row = True

    def __init__(self, policy: Any, version: Any, on_answer: Any) -> None:
        super().__init__(version, on_answer)
        n = LOOPS[0]
        clones = []
        for _ in range(n):
            clone = copy.copy(policy)  # shares the counters (under their lock), not the clients
            clone._clients, clone._check_lock, clone.fn = None, None, clone.act
            clone.limit = InFlightLimit(max(1, policy.limit.maximum // n))
            clones.append(clone)
        self.children = [Runner(clone, version, on_answer) for clone in clones]
        for child in self.children:
            child.answers = self.answers
        self.clock = self.children[0].clock

    def submit(self, rows: list[Any], observations: Any) -> None:
        self.outstanding += len(rows)
        parts: list[list[Any]] = [[] for _ in self.children]
        for row in rows:
            parts[row.env_id % len(parts)].append(row)
        for child, part in zip(self.children, parts):
            if part:
                child.loop.call_soon_threadsafe(child._start, part)

    def set_version(self, version: int) -> None:
        for child in self.children:
            child.set_version(version)

    def close(self) -> None:
        for child in self.children:
            child.close()


def runner_for(policy: Any, version: Any, on_answer: Any) -> Any:
    if isinstance(policy, server_module.ServerPolicy) and LOOPS[0] > 1:
        return MultiLoopRunner(policy, version, on_answer)
    return Runner(policy, version, on_answer)


def run(config: ServerConfig, backend: str, seconds: float, seed: int) -> Any:
    return measure(
        "tool", backend, "server", num_envs=256, group_size=8, seconds=seconds, timeout=400,
        max_lag=None, server=config, seed=seed, context="fork",
    )  # fmt: skip


def summary(m: Any) -> str:
    return (
        f"{m.outcome}: {m.groups_per_s:.2f} groups/s, {m.requests_per_s:.1f} requests/s, client "
        f"CPU {m.client_cpu_ms_per_request:.2f} ms/request, running {m.server_running_mean:.1f}, "
        f"req p50 {m.request_p50_s * 1e3:.1f}"
    )


def loops(config: ServerConfig, args: argparse.Namespace) -> None:
    rollouts_module.AsyncPolicyRunner = runner_for  # type: ignore[misc,assignment]
    for r in range(args.rounds):
        for n in args.loops:
            LOOPS[0] = max(n, 1)
            m = run(config, "shmvec" if n else "roll-threads", args.seconds, r)
            print(f"round {r} loops={n}: {summary(m)}", flush=True)


def passes(config: ServerConfig, args: argparse.Namespace) -> None:
    suspensions: list[int] = []
    runs: list[float] = []
    where: collections.Counter[str] = collections.Counter()

    class Counted:
        def __init__(self, coro: Any) -> None:
            self.coro = coro

        def __await__(self):  # type: ignore[no-untyped-def]
            coro, n, value, error = self.coro, 0, None, None
            while True:
                started = time.perf_counter()
                try:
                    yielded = coro.throw(error) if error is not None else coro.send(value)
                except StopIteration as stop:
                    runs.append(time.perf_counter() - started)
                    suspensions.append(n)
                    return stop.value
                runs.append(time.perf_counter() - started)
                n, error, value = n + 1, None, None
                frames, c = [], coro
                while c is not None:
                    frame = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
                    if frame is None:
                        break
                    frames.append(frame.f_code.co_name)
                    c = getattr(c, "cr_await", None) or getattr(c, "gi_yieldfrom", None)
                where[">".join(frames[-3:])] += 1
                try:
                    value = yield yielded
                except BaseException as raised:  # noqa: BLE001 - thrown into the coroutine
                    error = raised

    act = server_module.ServerPolicy.act

    async def counted_act(self: Any, row: Any) -> Any:
        return await Counted(act(self, row))

    server_module.ServerPolicy.act = counted_act  # type: ignore[method-assign]
    print(summary(run(config, "shmvec", args.seconds, 0)))
    s, r = np.array(suspensions), np.array(runs) * 1e3
    counts = collections.Counter(s.tolist()).most_common(5)
    print(f"suspensions per act: mean {s.mean():.3f}, {counts}")
    print(
        f"CPU per resumption: mean {r.mean():.3f} ms, p50 {np.percentile(r, 50):.3f}; "
        f"per act {r.sum() / len(s):.3f}"
    )
    for name, count in where.most_common(8):
        print(f"  {count:7d} waited in {name}")


class CollectorClock:
    """A ``gc.callbacks`` entry that times each collection by generation."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, float]] = []  # (generation, seconds) of each collection
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.spans.append((info["generation"], time.perf_counter() - self.started))

    def report(self, indent: str = "") -> None:
        for gen in (0, 1, 2):
            s = np.array([t for g, t in self.spans if g == gen]) * 1e3
            if len(s):
                print(f"{indent}collector generation {gen}: {len(s)} runs, mean {s.mean():.2f} "
                      f"ms, max {s.max():.2f}, total {s.sum() / 1e3:.2f} s")  # fmt: skip


def iterations(config: ServerConfig, args: argparse.Namespace) -> None:
    durations: list[float] = []
    ready: list[int] = []
    clock = CollectorClock()
    run_once = asyncio.BaseEventLoop._run_once  # type: ignore[attr-defined]

    def timed(self: Any) -> None:
        if threading.current_thread().name != "shmvec-policy":
            return run_once(self)
        ready.append(len(self._ready))
        started = time.perf_counter()
        run_once(self)
        durations.append(time.perf_counter() - started)

    asyncio.BaseEventLoop._run_once = timed  # type: ignore[attr-defined]
    gc.callbacks.append(clock)
    print(summary(run(config, "shmvec", args.seconds, 0)))
    d, k = np.array(durations) * 1e3, np.array(ready)
    print(f"iterations {len(d)}; ms (the select included): " + ", ".join(
        f"p{q} {np.percentile(d, q):.2f}" for q in (50, 90, 99, 99.9)))  # fmt: skip
    p99 = np.percentile(k, 99)
    print(f"ready callbacks at an iteration's start: mean {k.mean():.2f}, p99 {p99:.0f}")
    clock.report()


def heap(config: ServerConfig, args: argparse.Namespace) -> None:
    for backend in ("shmvec", "roll-threads"):
        heap_of(config, backend, args.seconds)


def heap_of(config: ServerConfig, backend: str, seconds: float) -> None:
    clock = CollectorClock()
    census: list[tuple[collections.Counter[str], int]] = []

    def take_census() -> None:
        objects = gc.get_objects()  # the generations, not the frozen heap
        types = collections.Counter(type(o).__name__ for o in objects)
        items = sum(len(o) for o in objects if type(o) in (list, dict))
        census.append((types, items))

    timer = threading.Timer(seconds / 2 + 10, take_census)  # the run's start takes ~10 s
    timer.start()
    gc.callbacks.append(clock)
    with frozen_heap():
        m = run(config, backend, seconds, 0)
    gc.callbacks.remove(clock)
    timer.cancel()
    print(f"{backend}: {summary(m)}")
    clock.report("  ")
    for types, items in census:
        print(f"  tracked objects {sum(types.values())}, list and dict items {items}; "
              + ", ".join(f"{n} {c}" for n, c in types.most_common(12)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-url", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    sub = parser.add_subparsers(dest="what", required=True)
    loops_parser = sub.add_parser("loops")
    loops_parser.add_argument("--loops", type=int, nargs="+", default=[1, 4, 8, 0])
    loops_parser.add_argument("--rounds", type=int, default=3)
    sub.add_parser("passes")
    sub.add_parser("iterations")
    sub.add_parser("heap")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llm()))
    config = ServerConfig(args.server_url, "tiny", tokenizer, 16)
    what = {"loops": loops, "passes": passes, "iterations": iterations, "heap": heap}
    what[args.what](config, args)


if __name__ == "__main__":
    main()
