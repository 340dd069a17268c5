"""The rollout benchmark's cluster runners (shmvec_bench.rollouts, ``on_cluster``) on two
simulated Ray nodes of one CPU each: each returns complete groups of the task stream's
tasks, each task once; the CLI starts a cluster for a cluster runner, reports the
driver's CPU, and leaves no Ray process behind. Skipped without Ray."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from shmvec_bench.rollouts.backends import REGISTRY  # noqa: E402
from shmvec_bench.rollouts.cli import CLUSTER_BACKENDS, main  # noqa: E402
from shmvec_bench.rollouts.cluster import SimulatedCluster, cpu_nodes  # noqa: E402
from shmvec_bench.rollouts.policies import make_policy  # noqa: E402
from shmvec_bench.rollouts.records import RunContext  # noqa: E402
from shmvec_bench.rollouts.workloads import WORKLOADS  # noqa: E402
from shmvec_bench.rss import descendants  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_threads_left")]

#: The tool workload (gem's guess game, each step a tool wait) where gem-llm is installed.
WORKLOAD = "tool"
NUM_ENVS, GROUP, BASE_SEED = 16, 4, 100
#: What Ray's processes have in their command lines.
RAY_NAMES = ("raylet", "gcs_server", "ray::", "default_worker.py", "runtime_env", "dashboard")


def ray_processes() -> list[int]:
    """This process's descendants that are Ray's (raylets, the GCS, Ray workers)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(name in cmdline for name in RAY_NAMES):
            found.append(pid)
    return found


def test_the_cluster_runners_are_registered_and_named_apart():
    assert CLUSTER_BACKENDS == [
        "shmvec-cluster",
        "ray-blocks",
        "roll-env-actors",
        "verl-agent-actors",
    ]
    assert all(REGISTRY[b].requires == "ray" for b in CLUSTER_BACKENDS)
    assert REGISTRY["verl-agent-actors"].lockstep
    assert not REGISTRY["shmvec"].requires


def test_the_cli_runs_a_cluster_runner_on_its_own_cluster_and_stops_it(tmp_path, capsys):
    pytest.importorskip("gem")
    assert not ray.is_initialized()
    code = main(
        ["--workloads", WORKLOAD, "--backends", "shmvec-cluster", "--nodes", "2",
         "--node-cpus", "1", "--num-envs", str(NUM_ENVS), "--group-size", str(GROUP),
         "--seconds", "0.5", "--repeats", "1", "--timeout", "200", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "| shmvec-cluster |" in line)
    assert row.startswith(f"| {WORKLOAD} | latency | shmvec-cluster | {NUM_ENVS} |")
    assert "| ok;" in row and "driver_cpu_ms_per_1k_steps=" in row
    assert "agents=2 num_cpus_per_agent=1 " in out  # one agent per simulated node
    assert "over 2 simulated Ray nodes on this machine (--node-cpus 1)" in out
    assert not ray.is_initialized()
    assert ray_processes() == []


@pytest.fixture(scope="module")
def cluster():
    with SimulatedCluster(nodes=2, node_cpus=1) as simulated:
        yield simulated


@pytest.mark.parametrize("backend", CLUSTER_BACKENDS)
def test_each_cluster_runner_returns_complete_groups_each_task_once(cluster, backend):
    pytest.importorskip("gem")
    assert [cpus for _, cpus in cpu_nodes()] == [1.0, 1.0]
    spec = WORKLOADS[WORKLOAD]
    policy = make_policy("latency", spec.actions, seed=1)
    ctx = RunContext(WORKLOAD, NUM_ENVS, GROUP, NUM_ENVS // GROUP, policy, seed=BASE_SEED)
    runner = REGISTRY[backend].open(ctx)
    try:
        batches = [runner.get_batch() for _ in range(2)]
        stats = runner.stats()
        env_steps = runner.env_steps
    finally:
        runner.close()
    assert ray.is_initialized()  # the runner used the cluster it found and left it up
    tasks = []
    for groups in batches:
        assert len(groups) == NUM_ENVS // GROUP
        for group in groups:
            tasks.append(group.task)
            assert group.seed == BASE_SEED + group.task
            assert len(group.trajectories) == GROUP
            assert sorted(t.member for t in group.trajectories) == list(range(GROUP))
            for traj in group.trajectories:
                assert (traj.task, traj.seed) == (group.task, group.seed)
                assert traj.status in ("done", "truncated")
                assert 1 <= traj.steps <= spec.max_turns
                assert traj.finished >= traj.started
    assert len(set(tasks)) == len(tasks) == 2 * NUM_ENVS // GROUP
    # Every task returned was launched by the run's task stream.
    assert max(tasks) < ctx.stream.launched
    assert env_steps >= sum(t.steps for g in batches[-1] for t in g.trajectories)
    # The run's policy chose the actions (its clock counts the calls), and the driver's
    # CPU over the timed batches was measured.
    busy_s, _, rows = policy.clock.snapshot()
    assert busy_s > 0 and rows >= sum(t.steps for g in batches[0] for t in g.trajectories)
    assert stats["driver_cpu_ms_per_1k_steps"] > 0
