"""Soak test of the rollout layer over a Ray cluster: nodes killed, replaced, added and
drained under a trainer loop that must see none of it.

    python dev/cluster_soak.py --seconds 180 --out cluster-soak.json

Ray's ``cluster_utils.Cluster`` simulates ``--nodes`` nodes of one CPU on this machine
(the head has none). ``ClusterVectorEnv`` runs ``--nodes + 1`` agents of
``--envs-per-agent`` text envs (``dev/rollout_soak.py``'s ``ToolTextEnv``: each step waits
a lognormal ``--median-ms``, raises with probability ``--fault``, hangs with ``--hang``,
ended by ``step_deadline``), with ``min_agents=--nodes``: the last agent waits for a node.
From a thread of its own, every ``--kill-every`` seconds one node is removed with everything
on it (raylet, agent, workers) and a fresh node added in its place (an autoscaler's
replacement: the lost agent starts again there); at ``--join-at`` seconds one more node
joins (the waiting agent starts); at ``--drain-at`` one agent is drained. The trainer takes
``--groups-per-batch`` groups per ``get_batch`` in async mode with ``max_lag``, bumping the
version each time.

Checks, each printed as PASS or FAIL: the trainer saw no exception; no task lost (handed
over + dropped + pending == submitted) and none handed over twice; every attempt accounted
for; the attempts of killed nodes counted as ``node_lost``; every kill's agent started
again; the waiting agent joined and the drained one left; the first batch after each kill
within ``step_deadline + 5`` s; every trajectory within ``max_lag``; ``--replay`` sampled
trajectories (retried ones first) replay bit for bit. Exit status 0 only if all pass.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import threading
import time
from pathlib import Path

import ray
from ray import cluster_utils

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_soak import ToolTextEnv, policy  # noqa: E402

from shmvec.ray import ClusterVectorEnv  # noqa: E402
from shmvec.rollouts import Rollouts, Task, replay  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
FAST_HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


class Chaos:
    """Removes a node (and adds its replacement) every ``kill_s``; adds a node at
    ``join_s``; drains one agent at ``drain_s``; until ``stop``. Records when each
    happened. Runs in the main thread (Ray starts nodes from there only)."""

    def __init__(self, cluster, envs, nodes, kill_s: float, join_s: float, drain_s: float):
        self.cluster, self.envs, self.nodes = cluster, envs, nodes
        self.kill_s, self.join_s, self.drain_s = kill_s, join_s, drain_s
        self.kills: list[float] = []  # time.monotonic() of each removal
        self.recovery_s: list[float] = []  # from a removal to its agent live again
        self._recovering: list[tuple[int, float]] = []  # (agent, removal time)
        self.joined_at = self.drained_at = None
        self.drained_agent: int | None = None
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            chooser = random.Random(3)
            start = time.monotonic()
            due = {"kill": start + self.kill_s, "join": start + self.join_s,
                   "drain": start + self.drain_s}  # fmt: skip
            while not self.stop.is_set():
                kind = min(due, key=due.get)
                if self.stop.wait(min(max(due[kind] - time.monotonic(), 0.0), 0.1)):
                    return
                self.note_recoveries()
                if time.monotonic() < due[kind]:
                    continue
                if kind == "kill":
                    due[kind] += self.kill_s
                    agents, states = self.envs.agent_node_ids, self.envs.agent_states
                    live = {agents[k] for k, state in enumerate(states) if state == "live"}
                    victims = [n for n in self.nodes if n.node_id in live]
                    node = chooser.choice(victims)
                    self.kills.append(time.monotonic())
                    self._recovering.append((agents.index(node.node_id), self.kills[-1]))
                    self.cluster.remove_node(node, allow_graceful=False)
                    self.nodes.remove(node)
                    self.nodes.append(self.cluster.add_node(**NODE))
                elif kind == "join":
                    due[kind] = float("inf")
                    self.nodes.append(self.cluster.add_node(**NODE))
                    self.joined_at = time.monotonic()
                else:
                    due[kind] = float("inf")
                    states = self.envs.agent_states
                    self.drained_agent = states.index("live")
                    self.envs.drain(self.drained_agent, timeout_s=10.0)
                    self.drained_at = time.monotonic()
        except Exception as error:  # noqa: BLE001 - reported as a failed check
            self.error = repr(error)

    def note_recoveries(self) -> None:
        states = self.envs.agent_states
        for agent, killed in list(self._recovering):
            if states[agent] == "live":
                self.recovery_s.append(time.monotonic() - killed)
                self._recovering.remove((agent, killed))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--envs-per-agent", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-batch", type=int, default=8)
    parser.add_argument("--median-ms", type=float, default=20.0)
    parser.add_argument("--fault", type=float, default=0.01)
    parser.add_argument("--hang", type=float, default=0.002)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--join-at", type=float, default=45.0)
    parser.add_argument("--drain-at", type=float, default=100.0)
    parser.add_argument("--max-lag", type=int, default=1)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--replay", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    head = {"num_cpus": 0, "object_store_memory": NODE["object_store_memory"],
            "_system_config": FAST_HEALTH_CHECK, "include_dashboard": False}  # fmt: skip
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(**NODE) for _ in range(args.nodes)]
    root = Path(__file__).resolve().parents[1]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{root}:{root / 'dev'}"}})  # fmt: skip
    cluster.wait_for_nodes()
    env_fn = functools.partial(
        ToolTextEnv, median_s=args.median_ms / 1e3, fault=args.fault, hang=args.hang
    )
    agents = args.nodes + 1
    envs = ClusterVectorEnv(
        [env_fn] * (agents * args.envs_per_agent),
        num_agents=agents,
        min_agents=args.nodes,
        agent_restarts=100,
        batch_size=args.envs_per_agent // 2,
        env_concurrency=args.envs_per_agent,
        vector_kwargs={"step_deadline": args.deadline, "env_timeout": args.deadline * 5},
    )
    n, g = args.groups_per_batch, args.group_size
    tasks = (Task(seed=s) for s in range(10**9))
    rollouts = Rollouts(envs, policy, group_size=g, tasks=tasks, max_lag=args.max_lag,
                        groups_per_batch=n, max_retries=args.max_retries)  # fmt: skip
    chaos = Chaos(cluster, envs, nodes, args.kill_every, args.join_at, args.drain_at)
    handed, seen, batch_times, errors = [], set(), [], []
    counts = {"duplicates": 0, "lag_violations": 0, "joined_live": False}
    started = time.monotonic()

    def train() -> None:
        """The trainer's loop (its own thread: Ray adds nodes from the main thread only)."""
        while time.monotonic() - started < args.seconds:
            try:
                batch = rollouts.get_batch(n, timeout=600)
            except Exception as error:  # noqa: BLE001 - a check: the trainer must see none
                errors.append(repr(error))
                break
            batch_times.append(time.monotonic())
            for group in batch:
                counts["duplicates"] += group.task.seed in seen
                seen.add(group.task.seed)
                for traj in group.trajectories:
                    oldest = min(traj.versions, default=group.version)
                    counts["lag_violations"] += group.version - oldest > args.max_lag
            handed.extend(batch)
            rollouts.set_version(rollouts.version + 1)
            if envs.agent_states.count("starting") == 0:
                counts["joined_live"] = True
        chaos.stop.set()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        chaos.run()
        trainer.join()
    finally:
        chaos.stop.set()
        trainer.join()
        wall = time.monotonic() - started
        stats = rollouts.stats()
        rollouts.close()
        deadline = time.monotonic() + 60  # a node killed near the end: its agent's restart
        while chaos._recovering and time.monotonic() < deadline:
            envs.update_agents(0.1)
            chaos.note_recoveries()
        cluster_stats = envs.stats()
        envs.close()
        ray.shutdown()
        cluster.shutdown()
    duplicates, lag_violations = counts["duplicates"], counts["lag_violations"]
    joined_live = counts["joined_live"]
    trajectories = [t for group in handed for t in group.trajectories]
    retried = [t for t in trajectories if t.attempt > 0]
    rest = [t for t in trajectories if t.attempt == 0]
    random.Random(2).shuffle(rest)
    sample = (retried[: args.replay // 2] + rest)[: args.replay]
    replay_failures = []
    for traj in sample:
        try:
            replay(traj, ToolTextEnv)
        except AssertionError as error:
            replay_failures.append(str(error))
    after_kill = [
        min((t for t in batch_times if t > kill), default=float("inf")) - kill
        for kill in chaos.kills
    ]
    accounted = (
        stats["groups_delivered"] + sum(stats["groups_dropped"].values()) + stats["groups_pending"]
        == stats["groups_submitted"]
    )
    states = cluster_stats["agent_states"]
    bound = args.deadline + 5
    checks = {
        "trainer saw no exception": not errors and chaos.error is None,
        "no task lost (handed over + dropped + pending == submitted)": accounted,
        "no task handed over twice": duplicates == 0,
        "attempts: launched == completed + dropped + in flight": stats["launched"]
        == stats["completed"] + sum(stats["dropped"].values()) + stats["in_flight"],
        f"{len(chaos.kills)} node kills, their attempts counted as node_lost": bool(chaos.kills)
        and stats["dropped"].get("node_lost", 0) > 0,
        "every killed node's agent started again, all but the drained one live": sum(
            cluster_stats["agent_restarts"]
        )
        >= len(chaos.kills)
        and len(chaos.recovery_s) == len(chaos.kills)
        and states.count("live") == agents - 1,
        "the waiting agent joined": joined_live,
        "the drained agent left": chaos.drained_agent is not None
        and states[chaos.drained_agent] == "vacant",
        f"first batch after each kill within step_deadline + 5 = {bound:.0f} s": all(
            d <= bound for d in after_kill
        ),
        f"every trajectory within max_lag={args.max_lag}": lag_violations == 0,
        f"{len(sample)} sampled trajectories ({len(retried[: args.replay // 2])} retried) "
        "replay bit for bit": not replay_failures
        and len(sample) >= min(args.replay, len(trajectories)),
    }
    result = {
        "args": vars(args),
        "wall_s": wall,
        "trajectories_handed_over": len(trajectories),
        "retried_handed_over": len(retried),
        "kills": len(chaos.kills),
        "first_batch_after_kill_s": after_kill,
        "recovery_s": chaos.recovery_s,
        "stats": stats,
        "cluster": cluster_stats,
        "checks": checks,
        "errors": errors + ([chaos.error] if chaos.error else []),
        "replay_failures": replay_failures[:5],
    }
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    print(
        f"{len(trajectories)} trajectories in {wall:.1f} s; {len(chaos.kills)} nodes killed, "
        f"first batch after each {[round(d, 2) for d in after_kill]} s, agent live again after "
        f"{[round(d, 1) for d in chaos.recovery_s]} s; agents {states}; "
        f"dropped attempts {stats['dropped']}; groups dropped {stats['groups_dropped']}; "
        f"retries {stats['retries']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
