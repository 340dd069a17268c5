"""What a ClusterVectorEnv costs the driver and each env step, on simulated nodes.

Starts Ray's ``cluster_utils.Cluster`` with N nodes on this machine (head with no CPUs,
one agent per node), steps ``--envs-per-agent`` envs per agent that each take
``--step-ms`` per step (sleeping: the envs' cost is not the driver's), and reports:

- driver CPU per 1,000 results (``time.process_time`` of the driver process, Ray's
  driver threads included), and
- each env's step latency from ``send`` to its row out of ``recv``, p50/p99, against
  a local async ShmVectorEnv over the same envs: the difference is what the cluster adds.

    python dev/cluster_overhead.py --nodes 1 2 4 --results 3000
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import ray
from ray import cluster_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rollout_envs import TaskEnv  # noqa: E402

from shmvec import ShmVectorEnv  # noqa: E402
from shmvec.ray import ClusterVectorEnv  # noqa: E402


def run(envs: gym.vector.VectorEnv, results: int) -> tuple[float, np.ndarray, float]:
    """Steps every env until ``results`` rows came back: (driver CPU s, latencies s,
    results per s)."""
    sent = np.full(envs.num_envs, np.nan)  # when each env's action left (NaN: a reset)
    latencies = []
    envs.async_reset(seed=0)
    envs.recv(timeout=60, partial=True)  # warm: some resets in
    cpu0, began = time.process_time(), time.perf_counter()
    while len(latencies) < results:
        _, _, _, _, infos = envs.recv(timeout=60, partial=True, take_ready=True)
        now = time.perf_counter()
        ids = infos["env_id"]
        latencies.extend((now - sent[ids][~np.isnan(sent[ids])]).tolist())
        sent[ids] = time.perf_counter()
        envs.send(np.ones(len(ids), np.int64), ids)
    cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - began
    return cpu, np.asarray(latencies[:results]), len(latencies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--envs-per-agent", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--results", type=int, default=2000)
    parser.add_argument(
        "--batch-size", type=int, help="rows a recv waits for (default: a quarter of the envs)"
    )
    args = parser.parse_args()
    fn = functools.partial(TaskEnv, max_len=10**6, wait_s=args.step_ms / 1000)
    print(f"envs/agent={args.envs_per_agent} step={args.step_ms} ms (lognormal median)")
    print("backend     nodes  results/s  driver CPU ms/1k results  latency p50 ms  p99 ms")
    for nodes in args.nodes:
        n = nodes * args.envs_per_agent
        batch = args.batch_size or max(1, n // 4)
        workers = min(nodes, 2)  # every env at once, as on the agents
        local = ShmVectorEnv([fn] * n, num_workers=workers, batch_size=batch,
                             env_concurrency=-(-n // workers))  # fmt: skip
        cpu, lat, rate = run(local, args.results)
        local.close()
        print(
            f"local       {nodes:5d}  {rate:9.0f}  {1000 * cpu / len(lat) * 1000:24.1f}  "
            f"{np.percentile(lat, 50) * 1e3:14.2f}  {np.percentile(lat, 99) * 1e3:6.2f}"
        )
        head = {"num_cpus": 0, "object_store_memory": 80 * 1024**2}
        cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2)
        root = Path(__file__).resolve().parents[1]  # the agents import this checkout
        path = os.pathsep.join((str(root), str(root / "tests")))
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})  # fmt: skip
        cluster.wait_for_nodes()
        try:
            envs = ClusterVectorEnv([fn] * n, num_agents=nodes, batch_size=batch,
                                    env_concurrency=args.envs_per_agent)  # fmt: skip
            cpu, lat, rate = run(envs, args.results)
            envs.close()
        finally:
            ray.shutdown()
            cluster.shutdown()
        print(
            f"cluster     {nodes:5d}  {rate:9.0f}  {1000 * cpu / len(lat) * 1000:24.1f}  "
            f"{np.percentile(lat, 50) * 1e3:14.2f}  {np.percentile(lat, 99) * 1e3:6.2f}"
        )


if __name__ == "__main__":
    main()
