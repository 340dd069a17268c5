"""The rollout runner: opens a backend, times ``get_batch`` calls, fills a measurement.

One measurement: open the backend with a fresh policy and task stream; for runners
without a barrier per batch, take one batch untimed (every env starts at once, a
ramp-up no steady state has); then call ``get_batch()`` until ``seconds`` have
passed (at least one call). Everything is counted inside that window: complete
groups and env steps per second, the policy's busy time (its idle share is the rest
of the window: every window has unfinished trajectories throughout), each
``get_batch``'s latency, each trajectory's time from its reset to its end, the CPU
time of this process and every process below it per env step, and at the end the
total PSS of that process tree. A backend that raises, or gives no batch within
``timeout`` seconds, is a result (``outcome``), not a reason to stop.

W4 (``kill_every_s``) also kills one env process of the backend (SIGKILL) that often.
A cluster runner runs over simulated Ray nodes on this machine (``cluster.py``), started
before it opens and stopped after it closes; their processes count in the CPU and PSS.

Example:
    >>> m = measure("guess", "ragen-serial", "latency", num_envs=8, group_size=4, seconds=0.1)
    >>> m.outcome, m.groups >= 2
    ('ok', True)
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shmvec_bench.rollouts.backends import REGISTRY
from shmvec_bench.rollouts.policies import make_policy
from shmvec_bench.rollouts.records import GroupRecord, RunContext, TaskStream
from shmvec_bench.rollouts.server import ServerConfig, ServerRun
from shmvec_bench.rollouts.workloads import RELEASE_HANGS, WORKLOADS, is_straggler
from shmvec_bench.rss import descendants, tree_cpu_s, tree_pss_mib
from shmvec_bench.runner import MeasurementTimeout, deadline

#: Collection thresholds the collector's A/Bs set beside freezing (Python's default: 700, 10, 10).
RAISED_GC_THRESHOLD = (10_000, 20, 10)


@contextmanager
def frozen_heap(threshold: tuple[int, int, int] | None = None) -> Iterator[None]:
    """``gc.collect(); gc.freeze()`` for the block, every runner in it alike (and, given, the
    collection thresholds ``threshold``); the heap unfrozen and the thresholds restored after."""
    default = gc.get_threshold()
    gc.collect()
    gc.freeze()
    if threshold is not None:
        gc.set_threshold(*threshold)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*default)


@dataclass
class RolloutMeasurement:
    """One timed run of one backend (or the median of several: ``runs``)."""

    workload: str
    backend: str
    policy: str
    num_envs: int
    group_size: int
    #: ``get_batch`` calls timed, and the complete groups they returned.
    batches: int = 0
    groups: int = 0
    seconds: float = 0.0
    groups_per_s: float = float("nan")
    steps_per_s: float = float("nan")
    #: Share of the window the policy was not running (trajectories were unfinished throughout).
    policy_idle_share: float = float("nan")
    get_batch_p50_s: float = float("nan")
    get_batch_p99_s: float = float("nan")
    #: A trajectory's time from its reset to its last step.
    traj_p50_s: float = float("nan")
    traj_p99_s: float = float("nan")
    #: Total PSS of this process and every process below it, at the end of the window.
    pss_mib: float = float("nan")
    pss_mib_per_1k_envs: float = float("nan")
    #: CPU seconds (this process and its descendants) per env step, in the window.
    cpu_s_per_step: float = float("nan")
    #: Straggling tasks' share of the tasks launched / of the groups returned, in the window.
    straggler_launched_share: float = float("nan")
    straggler_trained_share: float = float("nan")
    #: With the server policy: requests per second in the window, their latency over the
    #: run, this process tree's CPU per request (the server's processes left out); the
    #: server in the window (``ServerMonitor``): its model executor's busy share, the mean
    #: requests it ran and queued, the cores its processes used; over the run, requests
    #: interrupted by a new version and the tokens they had produced (kept); and the
    #: handed-over completion tokens by lag in versions (``lag:tokens``).
    requests_per_s: float = float("nan")
    request_p50_s: float = float("nan")
    request_p99_s: float = float("nan")
    client_cpu_ms_per_request: float = float("nan")
    server_busy_share: float = float("nan")
    server_running_mean: float = float("nan")
    server_queued_mean: float = float("nan")
    server_cores: float = float("nan")
    interrupted: int = 0
    tokens_interrupted: int = 0
    #: Requests that failed and were asked again (``ServerPolicy`` retries; the other
    #: runners stop at the first), over the run.
    request_faults: int = 0
    #: ``kind:count`` of those failed requests (``ServerFault.kind``: timeout, connect, ...);
    #: in a median row, summed over its runs.
    request_fault_kinds: str = ""
    #: ``kind:count`` of the trajectories ``ServerPolicy`` failed as ``policy_error`` (past
    #: its retries, or a prompt that fills the model's context: ``context_length``), over
    #: the run; in a median row, summed over its runs.
    policy_failures: str = ""
    token_lags: str = ""
    #: Trajectories returned that did not end as the game ended them (errors, deaths).
    failed_trajectories: int = 0
    #: ``ok``, ``crash: <exception>`` or ``hang: <no batch within the timeout>``.
    outcome: str = "ok"
    #: Groups launched but neither returned nor still running (lost to a crash, dropped).
    lost_groups: int = 0
    #: Env processes killed by the fault injector.
    kills: int = 0
    #: The backend's own accounting (shmvec: ``Rollouts.stats()``), one line.
    accounting: str = ""
    #: The backend's settings, where it has any (shmvec: the vector env's and the layer's).
    config: str = ""
    #: Measurements this row is the median of.
    runs: int = 1
    #: What sets this row apart from the other rows of its backend (shmvec: its lag bound).
    variant: str = ""

    @property
    def label(self) -> str:
        """The backend, and its variant if any: ``shmvec (max_lag=1)``."""
        return f"{self.backend} ({self.variant})" if self.variant else self.backend


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Killer:
    """Kills one of ``pids()`` with SIGKILL every ``every_s`` seconds, in a thread."""

    def __init__(self, pids, every_s: float, seed: int) -> None:
        self.pids, self.every_s = pids, every_s
        self.rng = random.Random(seed)
        self.kills = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="killer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            alive = self.pids()
            if alive:
                try:
                    os.kill(self.rng.choice(alive), signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def measure(
    workload: str,
    backend: str,
    policy: str = "latency",
    *,
    num_envs: int,
    group_size: int = 8,
    seconds: float = 10.0,
    timeout: float = 120.0,
    seed: int = 0,
    batch_size: int | None = None,
    num_workers: int | None = None,
    env_concurrency: int | None = None,
    ring_depth: int | None = None,
    max_lag: int | None = 1,
    policy_mode: str = "batched",
    context: str = "forkserver",
    server: ServerConfig | None = None,
    interrupt: bool = False,
    nodes: int = 2,
    node_cpus: int = 1,
) -> RolloutMeasurement:
    """Opens ``backend``, times ``get_batch`` for ``seconds``, closes it (see the module).
    A cluster runner (``on_cluster``) runs over ``nodes`` simulated Ray nodes of
    ``node_cpus`` CPUs each, started before it opens and stopped after it closes."""
    if num_envs % group_size:
        raise ValueError(f"num_envs={num_envs} is not a multiple of group_size={group_size}")
    spec, entry = WORKLOADS[workload], REGISTRY[backend]
    row = RolloutMeasurement(workload, backend, policy, num_envs, group_size)
    if backend == "shmvec":  # the layer's settings that the benchmark varies
        row.variant = "no lag bound" if max_lag is None else f"max_lag={max_lag}"
        if policy_mode != "batched" and policy != "server":
            row.variant += f", {policy_mode}"
        if interrupt:
            row.variant += ", interrupt"
    RELEASE_HANGS.clear()
    pol = make_policy(policy, spec.actions, seed, server=server)
    server_run = pol if isinstance(pol, ServerRun) else None
    stream = TaskStream(seed)
    ctx = RunContext(
        workload, num_envs, group_size, num_envs // group_size, pol, seed,
        batch_size=batch_size, num_workers=num_workers, env_concurrency=env_concurrency,
        ring_depth=ring_depth, max_lag=max_lag, policy_mode=policy_mode, context=context,
        stream=stream, interrupt=interrupt,
    )  # fmt: skip
    runner = killer = cluster = None
    processes_before = set(descendants(os.getpid()))
    groups: list[GroupRecord] = []
    latencies: list[float] = []
    failed = False
    try:
        if getattr(entry.open, "on_cluster", False):
            from shmvec_bench.rollouts.cluster import SimulatedCluster

            cluster = SimulatedCluster(nodes, node_cpus)
            with deadline(timeout):
                cluster.start()
        with deadline(timeout):
            runner = entry.open(ctx)
            row.config = getattr(runner, "config", "")
            if spec.kill_every_s:
                killer = Killer(runner.env_pids, spec.kill_every_s, seed)
            if not entry.lockstep:
                runner.get_batch()
            if server_run is not None:
                server_run.window()
            else:
                busy0, _, _ = pol.clock.snapshot()
            steps0, launched0, stragglers0 = runner.env_steps, stream.launched, stream.stragglers
            cpu0 = tree_cpu_s()
            start = time.perf_counter()
            while True:
                before = time.perf_counter()
                groups += runner.get_batch()
                after = time.perf_counter()
                latencies.append(after - before)
                if after - start >= seconds:
                    break
            elapsed = after - start
            cpu1 = tree_cpu_s()
            skip = set(server.server_pids) if server is not None else set()
            cpu = sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1 if p not in skip)
            if server_run is not None:
                _server_figures(row, server_run.figures(), elapsed, cpu)
                row.token_lags = _pairs(getattr(runner, "token_lags", {}))
            else:
                busy1, _, _ = pol.clock.snapshot()
                row.policy_idle_share = max(0.0, 1.0 - (busy1 - busy0) / elapsed)
            row.pss_mib = tree_pss_mib()
            row.steps_per_s = (runner.env_steps - steps0) / elapsed
            row.cpu_s_per_step = cpu / max(1, runner.env_steps - steps0)
            launched = stream.launched - launched0
            if launched:
                row.straggler_launched_share = (stream.stragglers - stragglers0) / launched
            row.seconds = elapsed
    except MeasurementTimeout as exc:
        failed = True
        row.outcome = f"hang: {exc}"
    except Exception as exc:  # a crash is a result
        failed = True
        row.outcome = f"crash: {type(exc).__name__}: {exc}".splitlines()[0][:160]
    finally:
        try:
            if killer is not None:
                killer.stop()
                row.kills = killer.kills
            if runner is not None:
                stats = None
                try:
                    stats = runner.stats()
                except Exception:
                    pass
                if stats:
                    row.accounting = _accounting(stats)
                if stats and "groups_dropped" in stats:
                    row.lost_groups = sum((stats["groups_dropped"] or {}).values())
                elif failed:
                    # Everything launched and not returned went down with the runner.
                    row.lost_groups = max(0, stream.launched - len(groups))
                if server_run is not None:
                    # Also after a hang: why the policy failed trajectories (a context the
                    # workload's games outgrow drops every group).
                    row.policy_failures = _pairs(server_run.policy_failures())
                RELEASE_HANGS.set()
                with deadline(30.0):
                    runner.close(terminate=failed)
            if server_run is not None:
                server_run.close()
        finally:
            if cluster is not None:
                cluster.stop()
        if failed:
            # A backend that hung or crashed while opening left its processes behind
            # (nothing holds it to close): they would count in the next runs' PSS and CPU.
            _kill_new_processes(processes_before)
    row.batches, row.groups = len(latencies), len(groups)
    if row.seconds:
        row.groups_per_s = row.groups / row.seconds
    trajs = [t for g in groups for t in g.trajectories]
    walls = [t.finished - t.started for t in trajs]
    row.traj_p50_s, row.traj_p99_s = _percentile(walls, 50), _percentile(walls, 99)
    row.get_batch_p50_s = _percentile(latencies, 50)
    row.get_batch_p99_s = _percentile(latencies, 99)
    row.pss_mib_per_1k_envs = row.pss_mib / num_envs * 1000
    row.failed_trajectories = sum(t.status not in ("done", "truncated") for t in trajs)
    if groups:
        row.straggler_trained_share = sum(is_straggler(g.seed) for g in groups) / len(groups)
    return row


def _pairs(counts: Mapping[Any, int]) -> str:
    """Counts as ``key:count`` pairs, keys in order (``token_lags``, ``request_fault_kinds``)."""
    return " ".join(f"{k}:{n}" for k, n in sorted(counts.items()))


def _sum_counts(texts: Iterable[str], key: Callable[[str], Any] = str) -> str:
    """``_pairs`` texts summed over runs (``key`` reads a key back)."""
    total: Counter[Any] = Counter()
    for text in texts:
        total.update({key(k): int(n) for k, n in (pair.split(":") for pair in text.split())})
    return _pairs(total)


def _server_figures(row: RolloutMeasurement, figures: dict, elapsed: float, cpu: float) -> None:
    """The server policy's figures of the window (``ServerRun.figures()``) into ``row``."""
    requests = figures["requests"]
    row.requests_per_s = requests / elapsed
    row.request_p50_s, row.request_p99_s = figures["latency_p50_s"], figures["latency_p99_s"]
    row.client_cpu_ms_per_request = 1e3 * cpu / max(1, requests)
    row.server_busy_share = figures["busy_share"]
    row.server_running_mean, row.server_queued_mean = figures["running"], figures["queued"]
    row.server_cores = figures["server_cores"]
    row.policy_idle_share = max(0.0, 1.0 - figures["busy_share"])
    row.interrupted = figures["interrupted"]
    row.tokens_interrupted = figures["tokens_interrupted"]
    row.request_faults = sum(figures["faults"].values())
    row.request_fault_kinds = _pairs(figures["faults"])


def _kill_new_processes(before: set[int]) -> None:
    """SIGKILLs the processes below this one that were not there before the run."""
    for pid in set(descendants(os.getpid())) - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    multiprocessing.active_children()  # reaps those that were this process's children


def _accounting(stats: dict) -> str:
    """The backend's own counts, one line (shmvec's ``Rollouts.stats()`` and its env's)."""
    keys = (
        "launched", "completed", "in_flight", "dropped", "retries", "groups_delivered",
        "groups_dropped", "worker_restarts", "env_resets", "lag_held_share",
        "driver_cpu_ms_per_1k_steps",
    )  # fmt: skip
    parts = []
    for key in keys:
        value = stats.get(key)
        if value is None or value == {} or value == []:
            continue
        if isinstance(value, list):
            value = sum(value)
        if isinstance(value, float):
            value = f"{value:.3f}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def median_row(rows: Sequence[RolloutMeasurement]) -> RolloutMeasurement:
    """Each numeric field's median over ``rows`` (the successful ones, if any); the
    outcome of the first failure, if every run failed or any crashed or hung."""
    ok = [r for r in rows if r.outcome == "ok"] or list(rows)
    first = ok[0]
    merged = RolloutMeasurement(
        first.workload, first.backend, first.policy, first.num_envs, first.group_size
    )
    for f in fields(RolloutMeasurement):
        values = [getattr(r, f.name) for r in ok]
        if f.type in ("float", "int") and all(isinstance(v, (int, float)) for v in values):
            clean = [v for v in values if v == v]
            if clean:
                value = statistics.median(clean)
                setattr(merged, f.name, round(value) if f.type == "int" else value)
    bad = [r for r in rows if r.outcome != "ok"]
    merged.outcome = bad[0].outcome if bad else "ok"
    merged.accounting = (bad[0] if bad else first).accounting
    merged.config, merged.variant = first.config, first.variant
    merged.token_lags = _sum_counts((r.token_lags for r in ok), int)
    merged.request_fault_kinds = _sum_counts(r.request_fault_kinds for r in ok)
    merged.policy_failures = _sum_counts(r.policy_failures for r in ok)
    merged.runs = len(rows)
    return merged
