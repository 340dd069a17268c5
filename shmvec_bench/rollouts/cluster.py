"""The Ray cluster the cluster runners run on: N simulated nodes on this machine.

- ``SimulatedCluster(nodes, node_cpus)``: ``start()`` starts ``ray.cluster_utils.Cluster``
  (a head with no CPUs, so that no env lands on it, and ``nodes`` nodes of ``node_cpus``
  CPUs, each with an 80 MiB object store) and connects this process to it, with the
  repository on every Ray worker's ``PYTHONPATH``; ``stop()`` disconnects and ends every
  process the cluster started. It is also a context manager.
- ``connect()``: for a runner: None where this process is connected to Ray already (the
  cluster is the caller's), else a ``SimulatedCluster`` of the defaults, started, for the
  runner to stop when it closes.
- ``cpu_nodes()``: the live nodes with CPUs, ``(node id, CPUs)`` each: where the runners
  place their envs.
- ``DriverClock``: this process's CPU time per 1,000 env steps over a runner's timed
  batches (``time.process_time``: every thread of the driver, Ray's own included).
- ``ClusterRunner``: what every cluster runner shares (its cluster, its driver clock, its
  ``stats``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

#: The defaults of ``--nodes`` and ``--node-cpus``.
NODES = 2
NODE_CPUS = 1
#: Each node's object store, bytes (Ray's smallest is 75 MiB).
OBJECT_STORE_BYTES = 80 * 1024**2
#: The repository root: Ray workers import shmvec and shmvec_bench from it.
ROOT = Path(__file__).resolve().parents[2]


class SimulatedCluster:
    """``nodes`` simulated Ray nodes of ``node_cpus`` CPUs each, and this process connected."""

    def __init__(self, nodes: int = NODES, node_cpus: int = NODE_CPUS) -> None:
        if nodes < 1 or node_cpus < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and node_cpus >= 1: {nodes}, {node_cpus}")
        self.nodes, self.node_cpus = nodes, node_cpus
        self.cluster: Any = None  # ray.cluster_utils.Cluster
        #: Seconds ``start()`` took.
        self.start_s = 0.0

    def start(self) -> SimulatedCluster:
        import ray
        from ray import cluster_utils

        if ray.is_initialized():
            raise RuntimeError("this process is connected to Ray already: stop that first")
        began = time.perf_counter()
        head = {
            "num_cpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        }
        self.cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(self.nodes):
                self.cluster.add_node(
                    num_cpus=self.node_cpus, object_store_memory=OBJECT_STORE_BYTES
                )
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
            ray.init(
                address=self.cluster.address,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
            self.cluster.wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - began
        return self

    def stop(self) -> None:
        """Disconnects and shuts every node down (their Ray workers with them)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown()

    def __enter__(self) -> SimulatedCluster:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def connect() -> SimulatedCluster | None:
    """None where Ray is initialized in this process; else a started ``SimulatedCluster``
    of the defaults, which the caller stops."""
    import ray

    if ray.is_initialized():
        return None
    return SimulatedCluster().start()


def cpu_nodes() -> list[tuple[str, float]]:
    """``(node id, CPUs)`` of each live node that has CPUs, in Ray's order."""
    import ray

    return [
        (node["NodeID"], float(node["Resources"]["CPU"]))
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("CPU", 0) > 0
    ]


class DriverClock:
    """This process's CPU time per env step over the timed ``get_batch`` calls.

    The benchmark times every ``get_batch`` of a lock-step runner, and all but the first
    of the others (their warm-up): ``begin(steps)`` and ``end(steps)`` around each call
    mark the window from the first timed call's start to the last one's end.
    """

    def __init__(self, lockstep: bool) -> None:
        self.lockstep = lockstep
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None
        self._calls = 0

    def begin(self, steps: int) -> None:
        if self._first is None and self.lockstep:
            self._first = (time.process_time(), steps)

    def end(self, steps: int) -> None:
        self._calls += 1
        mark = (time.process_time(), steps)
        if self._first is None:  # the end of the warm-up batch
            self._first = mark
        else:
            self._last = mark

    def ms_per_1k_steps(self) -> float | None:
        """Driver CPU milliseconds per 1,000 env steps in the window (None before one)."""
        if self._first is None or self._last is None or self._last[1] <= self._first[1]:
            return None
        cpu = self._last[0] - self._first[0]
        return 1e6 * cpu / (self._last[1] - self._first[1])


class ClusterRunner:
    """The part every cluster runner shares: it runs over a cluster (``on_cluster``);
    ``join`` connects to it (the caller's, or a ``SimulatedCluster`` of its own, which
    ``leave`` stops) and starts the driver's clock; ``timed`` runs one ``get_batch`` on that
    clock; ``stats`` reports the driver's CPU per 1,000 env steps. A runner counts its env
    steps in ``env_steps``."""

    #: The benchmark runs it over a simulated cluster.
    on_cluster = True
    env_steps: int
    clock: DriverClock
    cluster: SimulatedCluster | None = None

    def join(self, lockstep: bool = False) -> None:
        self.clock = DriverClock(lockstep)
        self.cluster = connect()

    def leave(self) -> None:
        """Stops the cluster if this runner started it."""
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.stop()

    def timed(self, get_batch: Callable[[], T]) -> T:
        self.clock.begin(self.env_steps)
        groups = get_batch()
        self.clock.end(self.env_steps)
        return groups

    def stats(self) -> dict[str, Any]:
        return {"driver_cpu_ms_per_1k_steps": self.clock.ms_per_1k_steps()}
