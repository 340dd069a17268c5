"""ClusterVectorEnv (shmvec.ray): one async vector env over node agents on a Ray cluster.

Ray's ``cluster_utils.Cluster`` simulates three nodes of one CPU each on this machine
(the head has none, so each node agent gets a node of its own). The tests check that
each env's trajectory equals one machine's, that ``Rollouts`` and ``AwaitableEnvs`` run
over it, and that a removed node's envs end as ``node_lost`` results that the rollouts
retry on the other nodes. Node removal comes last: it shrinks the module's cluster.
Skipped without Ray.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time

import envs as test_envs
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same
from rollout_envs import TaskEnv, obs_policy
from test_info_values import RandomInfoEnv, alone

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from shmvec import EnvNodeLostError, ShmVectorEnv  # noqa: E402
from shmvec.awaitable import AwaitableEnvs  # noqa: E402
from shmvec.ray import ClusterVectorEnv  # noqa: E402
from shmvec.rollouts import Rollouts, Status, replay  # noqa: E402

pytestmark = pytest.mark.timeout(240)

OBJECT_STORE_BYTES = 80 * 1024**2
#: Ray notices a node whose raylet is gone within period x threshold (default 3 s x 5).
FAST_HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


@pytest.fixture(scope="module")
def cluster():
    head = {"num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": FAST_HEALTH_CHECK}  # fmt: skip
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES) for _ in range(3)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    cluster.env_nodes = nodes
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_ids(cluster) -> list[str]:
    return [node.node_id for node in cluster.env_nodes]


def make_cluster_env(cluster, env_fn=TaskEnv, per_agent=2, agents=3, **kwargs):
    return ClusterVectorEnv(
        [env_fn] * (per_agent * agents),
        num_agents=agents,
        node_ids=node_ids(cluster)[:agents],
        batch_size=kwargs.pop("batch_size", 2),
        **kwargs,
    )


def drive(envs, steps: int) -> dict[int, list]:
    """Each env's results for ``steps`` actions chosen from its env id and step count."""
    seen: dict[int, list] = {env: [] for env in range(envs.num_envs)}
    envs.async_reset(seed=7)
    running = envs.num_envs
    while running:
        obs, rewards, terminations, truncations, infos = envs.recv(timeout=60, partial=True)
        ids, actions = [], []
        for i, env in enumerate(infos["env_id"].tolist()):
            seen[env].append((obs[i].tobytes(), rewards[i], terminations[i], truncations[i]))
            if len(seen[env]) <= steps:
                ids.append(env)
                actions.append((env + len(seen[env])) % 3)
            else:
                running -= 1
        if ids:
            envs.send(np.array(actions, np.int64), np.array(ids))
    return seen


def test_each_env_steps_as_on_one_machine(cluster):
    cluster_envs = make_cluster_env(cluster)
    local = ShmVectorEnv([TaskEnv] * 6, num_workers=2, batch_size=2)
    try:
        assert cluster_envs.agent_node_ids == node_ids(cluster)
        assert drive(cluster_envs, 30) == drive(local, 30)
    finally:
        cluster_envs.close()
        local.close()


def test_bad_commands_raise_in_the_driver_and_the_envs_go_on(cluster):
    """Each bad command raises in the main process naming what was wrong, before anything
    reaches an agent; the envs then step as if it had never been sent."""
    envs = make_cluster_env(cluster)
    try:
        with pytest.raises(RuntimeError, match=r"send\(\) before async_reset\(\): envs \[0, 1\]"):
            envs.send(np.zeros(2, np.int64), np.array([0, 1]))
        envs.async_reset(seed=3)
        ids = envs.recv(timeout=60)[4]["env_id"]
        with pytest.raises(ValueError, match=r"actions have rows of shape \(1,\)"):
            envs.send(np.zeros((2, 1), np.int64), ids)
        with pytest.raises(ValueError, match=r"env_ids \[99\] out of range \[0, 6\)"):
            envs.send(np.zeros(2, np.int64), np.array([ids[0], 99]))
        with pytest.raises(ValueError, match="has 1 rows, expected 2"):
            envs.send(np.zeros(1, np.int64), ids)
        envs.send(np.ones(2, np.int64), ids)
        with pytest.raises(ValueError, match=r"are not awaiting a command"):
            envs.send(np.ones(2, np.int64), ids)
        got = set()
        while len(got) < envs.num_envs:  # every env answers once: the resets and two steps
            got |= set(envs.recv(timeout=60, partial=True)[4]["env_id"].tolist())
        assert got == set(range(envs.num_envs))
    finally:
        envs.close()


MODES = [
    pytest.param(AutoresetMode.NEXT_STEP, id="next_step"),
    pytest.param(AutoresetMode.SAME_STEP, id="same_step"),
    pytest.param(AutoresetMode.DISABLED, id="disabled"),
]


@pytest.mark.parametrize("autoreset_mode", MODES)
@pytest.mark.parametrize("env_name", ["CartPole-v1", "CustomSpaceEnv"])
def test_the_step_api_equals_sync_vector_env(cluster, env_name, autoreset_mode):
    """``batch_size == num_envs``: ``reset``/``step`` give SyncVectorEnv's results over
    uneven agent blocks (3 + 2 envs), with a masked reset with per-env seeds and, with
    autoreset disabled, masked resets of the envs that ended."""
    num_envs = 5
    make_fns = test_envs.ENV_CASES[env_name]
    sync = SyncVectorEnv(make_fns(num_envs), autoreset_mode=autoreset_mode)
    envs = ClusterVectorEnv(
        make_fns(num_envs),
        num_agents=2,
        batch_size=num_envs,
        node_ids=node_ids(cluster)[:2],
        autoreset_mode=autoreset_mode,
    )
    try:
        assert not envs.is_async and envs.observation_space == sync.observation_space
        assert_same(envs.reset(seed=7), sync.reset(seed=7), "reset")
        action_space = copy.deepcopy(sync.action_space)
        action_space.seed(5)
        ended, crossed_ends = np.zeros(num_envs, dtype=bool), 0
        for t in range(40):
            mask, seeds = None, None
            if autoreset_mode == AutoresetMode.DISABLED and ended.any():
                mask = ended.copy()
            elif t == 11:  # agent 0 partly, agent 1 not at all
                mask = np.array([True, False, True, False, False])
                seeds = [100 + i for i in range(num_envs)]
            if mask is not None:
                options = {"reset_mask": mask, "level": t}
                result = envs.reset(seed=seeds, options=dict(options))
                assert_same(result, sync.reset(seed=seeds, options=dict(options)), f"reset {t}")
            actions = action_space.sample()
            result = envs.step(actions)
            assert_same(result, sync.step(actions), f"step {t}")
            ended = result[2] | result[3]
            crossed_ends += int(ended.sum())
        assert crossed_ends > 0
    finally:
        envs.close()
        sync.close()


def test_rollouts_give_complete_groups_that_replay(cluster):
    envs = make_cluster_env(cluster)
    try:
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit(seeds=list(range(6)))
            groups = [g for _ in range(3) for g in rollouts.get_batch(2)]
        assert sorted(g.task.seed for g in groups) == list(range(6))
        for traj in (t for g in groups for t in g.trajectories):
            assert traj.status.finished
            replay(traj, TaskEnv)
    finally:
        envs.close()


def test_awaitable_envs_over_the_cluster(cluster):
    envs = make_cluster_env(cluster, agents=2)

    async def episode(pool, seed):
        async with pool.env() as env:
            obs, _ = await env.reset(seed=seed)
            for _ in range(3):
                obs, *_ = await env.step(1)
            return env.trajectory

    async def main():
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(episode(pool, s) for s in range(6)))

    try:
        for traj in asyncio.run(main()):
            replay(traj, TaskEnv)
    finally:
        envs.close()


def test_awaited_infos_over_the_cluster_are_the_envs_own(cluster):
    """Python scalars stay Python scalars across Ray: each awaited step's info equals the
    env's own, stepped alone (``RandomInfoEnv`` draws numpy and Python values)."""
    envs = ClusterVectorEnv([RandomInfoEnv] * 4, num_agents=2, node_ids=node_ids(cluster)[:2],
                            batch_size=2)  # fmt: skip

    async def episode(pool, seed: int):
        async with pool.env() as env:
            _, reset_info = await env.reset(seed=seed)
            steps, actions, done = [], [], False
            while not done:
                actions.append(seed % 3)
                steps.append(await env.step(actions[-1]))
                done = steps[-1][2] or steps[-1][3]
            return reset_info, steps, actions

    async def main():
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(episode(pool, 300 + k) for k in range(8)))

    try:
        runs = asyncio.run(main())
    finally:
        envs.close()
    for k, (reset_info, steps, actions) in enumerate(runs):
        want_reset, want_steps = alone(300 + k, actions)
        assert_same(reset_info, want_reset, "reset info")
        for t, (got, want) in enumerate(zip(steps, want_steps)):
            assert_same(got[4], want[4], f"task {k} step {t} info")


def test_an_env_factory_that_fails_names_its_agent_and_node(cluster):
    def broken():
        raise OSError("no simulator on this node")

    with pytest.raises(RuntimeError, match=r"node agent 1 \(envs 2..3\).*on node .*simulator"):
        ClusterVectorEnv([TaskEnv] * 2 + [broken] * 2, num_agents=2,
                         node_ids=node_ids(cluster)[:2], batch_size=2)  # fmt: skip


def test_a_killed_agent_ends_its_running_envs_and_answers_more_work_with_node_lost(cluster):
    fast = functools.partial(TaskEnv, max_len=50)
    slow = functools.partial(TaskEnv, max_len=50, hang_rate=1.0, hang_s=5.0)  # steps hang
    envs = ClusterVectorEnv([fast, fast, slow, slow], num_agents=2, batch_size=2,
                            node_ids=node_ids(cluster)[:2], agent_restarts=0)  # fmt: skip
    try:
        envs.async_reset(seed=0)
        for _ in range(2):
            envs.recv(timeout=60)  # every env awaits an action
        envs.send(np.ones(2, np.int64), [2, 3])  # agent 1's envs run
        ray.kill(envs.agents[1])
        rows = {}
        while len(rows) < 2:
            _, _, _, truncations, infos = envs.recv(timeout=60, partial=True)
            for i, env in enumerate(infos["env_id"].tolist()):
                assert infos["_node_lost"][i] and truncations[i]
                rows[env] = infos["node_lost"][i]
        assert sorted(rows) == [2, 3] and envs.lost_env_ids == {2, 3}
        assert "node agent 1 (envs 2..3) on node" in rows[2]
        assert envs.agent_states == ["live", "vacant"] and envs.exhausted is False
        # Each further command to them is answered at once by a node_lost row, a reset too.
        envs.send(np.ones(1, np.int64), [2])
        envs.async_reset(seed=0, env_ids=[3])
        envs.send(np.ones(2, np.int64), [0, 1])  # the other node's envs go on
        seen: dict[int, bool] = {}
        while len(seen) < 4:
            _, _, _, _, infos = envs.recv(timeout=60, partial=True)
            for i, env in enumerate(infos["env_id"].tolist()):
                seen[env] = bool(infos.get("_node_lost", np.zeros(len(infos["env_id"])))[i])
        assert seen == {0: False, 1: False, 2: True, 3: True}
    finally:
        envs.close()


def test_awaitable_envs_lease_no_env_of_a_killed_agent(cluster):
    """Coroutines whose env was on a killed agent get ``EnvNodeLostError`` (at a step or a
    reset); every lease after it is an env of the live agent, and the episodes go on there."""
    envs = make_cluster_env(
        cluster, agents=2, env_fn=functools.partial(TaskEnv, max_len=50), agent_restarts=0
    )
    killed = asyncio.Event()

    async def episode(pool, seed):
        for _ in range(3):
            async with pool.env() as env:
                try:
                    await env.reset(seed=seed)
                    for _ in range(4):
                        await env.step(1)
                        if env.env_id in (2, 3) and not killed.is_set():
                            killed.set()
                            ray.kill(envs.agents[1])
                        await asyncio.sleep(0)
                except EnvNodeLostError:
                    assert env.env_id in (2, 3) and killed.is_set()
                    continue
                return env.env_id, env.trajectory
        raise AssertionError(f"task {seed} lost its env 3 times")

    async def main():
        async with AwaitableEnvs(envs) as pool:
            return await asyncio.gather(*(episode(pool, s) for s in range(6)))

    try:
        done = asyncio.run(main())
    finally:
        envs.close()
    assert killed.is_set() and envs.lost_env_ids == {2, 3}
    for env_id, traj in done:
        assert env_id not in envs.lost_env_ids or traj.status is not Status.WORKER_DIED
        replay(traj, functools.partial(TaskEnv, max_len=50))


def test_a_reset_on_a_killed_agent_raises_node_lost_and_the_pool_goes_on(cluster):
    """Whether the loss is seen before the reset is sent or while it runs, the coroutine's
    reset raises ``EnvNodeLostError``; the next lease is an env of the live agent."""
    envs = make_cluster_env(cluster, agents=2, agent_restarts=0)

    async def main():
        async with AwaitableEnvs(envs) as pool:
            leases = [pool.env() for _ in range(3)]
            held = [await lease.__aenter__() for lease in leases]
            assert [env.env_id for env in held] == [0, 1, 2]
            ray.kill(envs.agents[1])
            with pytest.raises(EnvNodeLostError, match="env 2: reset lost its node"):
                await held[2].reset(seed=1)
            for lease in leases:
                await lease.__aexit__(None, None, None)
            async with pool.env() as env:
                await env.reset(seed=2)
                await env.step(1)
                return env.env_id

    try:
        assert asyncio.run(main()) in (0, 1)
        assert envs.lost_env_ids == {2, 3}
    finally:
        envs.close()


def wait_for(condition, timeout_s: float) -> None:
    """Sleeps until ``condition()`` (another thread makes it true), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def agent_of_traj(envs, traj) -> int:
    return int(envs.agent_of[traj.env_id])


def test_a_killed_agent_is_started_again_and_its_envs_take_work(cluster):
    """Agent 1 is killed mid-run: its attempts end as node_lost and run again, the agent
    is re-created where Ray places it (the third node is free), and later attempts run on
    its envs again; every trajectory replays."""
    fn = functools.partial(TaskEnv, max_len=20, wait_s=0.005)
    envs = make_cluster_env(cluster, agents=2, env_fn=fn)
    try:
        with Rollouts(envs, obs_policy, group_size=2, max_retries=5) as rollouts:
            rollouts.submit(seeds=list(range(4)))
            groups = list(rollouts.get_batch(1))
            first = envs.agents[1]
            ray.kill(first)
            groups += [g for _ in range(3) for g in rollouts.get_batch(1)]
            wait_for(lambda: envs.agent_states == ["live", "live"], 60)  # the loop sees it
            assert envs.agent_states == ["live", "live"] and envs.lost_env_ids == frozenset()
            assert envs.agents[1] is not first and 1 in envs.lost_agents
            rollouts.submit(seeds=list(range(4, 16)))
            groups += [g for _ in range(12) for g in rollouts.get_batch(1)]
            stats = rollouts.stats()
        assert sorted(g.task.seed for g in groups) == list(range(16))
        assert stats["dropped"].get("node_lost", 0) >= 1
        trajs = [t for g in groups for t in g.trajectories]
        assert any(agent_of_traj(envs, t) == 1 for t in trajs if t.task.seed >= 4)
        for traj in trajs:
            assert traj.status.finished
            replay(traj, fn)
    finally:
        envs.close()


def test_after_its_node_lost_row_a_step_on_the_restarted_agent_resets_the_env(cluster):
    """Under an autoreset mode the step after a truncation is a reset: so is the step after
    a ``node_lost`` row, once the agent is back (the reset's info, no reward, no flags)."""
    envs = make_cluster_env(cluster, agents=2, env_fn=functools.partial(TaskEnv, max_len=50))
    try:
        envs.async_reset(seed=0)
        for _ in range(2):
            envs.recv(timeout=60)  # every env awaits an action
        first = envs.agents[1]
        ray.kill(first)
        wait_for(lambda: envs.update_agents(0.1) or envs.agent_states[1] != "live", 30)
        envs.send(np.ones(2, np.int64), [2, 3])  # to envs whose agent is gone
        _, _, _, truncations, infos = envs.recv(timeout=60)
        assert sorted(infos["env_id"].tolist()) == [2, 3] and infos["_node_lost"].all()
        assert truncations.all()
        wait_for(lambda: envs.update_agents(0.1) or envs.agent_states == ["live", "live"], 60)
        assert envs.agents[1] is not first
        envs.send(np.ones(2, np.int64), [2, 3])
        _, rewards, terminations, truncations, infos = envs.recv(timeout=60)
        assert sorted(infos["env_id"].tolist()) == [2, 3] and "node_lost" not in infos
        assert infos["_length"].all() and not (rewards.any() or terminations.any())
        assert not truncations.any()
        envs.send(np.ones(2, np.int64), [2, 3])  # and they step on
        _, _, _, _, infos = envs.recv(timeout=60)
        assert sorted(infos["env_id"].tolist()) == [2, 3] and "length" not in infos
    finally:
        envs.close()


def test_a_drained_agent_finishes_its_episodes_and_leaves(cluster):
    """``drain(1)`` mid-run: no attempt fails, none starts on its envs after it, the agent
    closes its envs and leaves (vacant); ``num_envs`` stays."""
    fn = functools.partial(TaskEnv, max_len=15, wait_s=0.005)
    envs = make_cluster_env(cluster, env_fn=fn)
    try:
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit(seeds=list(range(12)))
            groups = list(rollouts.get_batch(1))
            assert envs.drain(1) == [1]
            wait_for(lambda: envs.lost_env_ids == {2, 3}, 10)  # the loop's next turn
            drained_at = time.monotonic()
            groups += [g for _ in range(11) for g in rollouts.get_batch(1)]
            stats = rollouts.stats()
        assert envs.agent_states == ["live", "vacant", "live"] and envs.num_envs == 6
        assert sorted(g.task.seed for g in groups) == list(range(12))
        assert not stats["dropped"], stats["dropped"]
        for traj in (t for g in groups for t in g.trajectories):
            assert traj.status.finished and not traj.retried_after
            if traj.started_s > drained_at:
                assert traj.env_id not in (2, 3)
            replay(traj, fn)
    finally:
        envs.close()


def test_a_drain_past_its_timeout_hands_the_running_episode_back(cluster):
    envs = make_cluster_env(cluster, agents=2, env_fn=functools.partial(TaskEnv, max_len=50))
    try:
        envs.async_reset(seed=0)
        for _ in range(2):
            envs.recv(timeout=60)
        envs.send(np.ones(2, np.int64), [0, 2])
        assert envs.drain(node_id=envs.agent_node_ids[1], timeout_s=0.0) == [1]
        rows = {}
        while len(rows) < 2:
            _, _, _, truncations, infos = envs.recv(timeout=60, partial=True)
            for i, env in enumerate(infos["env_id"].tolist()):
                lost = "_node_lost" in infos and infos["_node_lost"][i]
                rows[env] = infos["node_lost"][i] if lost else None
        assert rows[0] is None and "was drained" in rows[2]
        envs.update_agents(timeout=5)
        assert envs.agent_states[1] in ("closing", "vacant")
    finally:
        envs.close()


def test_an_agent_that_ray_cannot_place_yet_joins_when_a_node_does(cluster):
    """Four agents of one CPU over three one-CPU nodes: the constructor waits for three
    (``min_agents``); the fourth starts when a node joins, and its envs then take work."""
    fn = functools.partial(TaskEnv, max_len=10, wait_s=0.005)
    envs = ClusterVectorEnv([fn] * 8, num_agents=4, min_agents=3, batch_size=2)
    joined = None
    try:
        pending = envs.agent_states.index("starting")
        late = set(envs.blocks[pending])
        assert envs.lost_env_ids == late and envs.num_envs == 8
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit(seeds=list(range(4)))
            groups = [g for _ in range(4) for g in rollouts.get_batch(1)]
            assert all(t.env_id not in late for g in groups for t in g.trajectories)
            joined = cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
            wait_for(lambda: not envs.lost_env_ids, 90)
            assert envs.agent_states == ["live"] * 4
            assert envs.agent_node_ids[pending] == joined.node_id
            rollouts.submit(seeds=list(range(4, 40)))
            groups += [g for _ in range(36) for g in rollouts.get_batch(1)]
        assert sorted(g.task.seed for g in groups) == list(range(40))
        assert any(t.env_id in late for g in groups for t in g.trajectories)
    finally:
        envs.close()
        if joined is not None:
            cluster.remove_node(joined)


def test_rollouts_and_awaitable_envs_raise_when_every_agent_is_gone(cluster):
    envs = make_cluster_env(cluster, agents=2, agent_restarts=0)
    try:
        for agent in envs.agents:
            ray.kill(agent)
        with Rollouts(envs, obs_policy, group_size=2) as rollouts:
            rollouts.submit(seeds=[0])
            with pytest.raises(RuntimeError, match="no env can take work"):
                rollouts.get_batch(1, timeout=60)
        assert envs.exhausted

        async def lease(pool):
            async with pool.env() as env:
                await env.reset(seed=0)

        async def main():
            async with AwaitableEnvs(envs) as pool:
                await asyncio.wait_for(lease(pool), 60)

        with pytest.raises(RuntimeError, match="no env can take work"):
            asyncio.run(main())
    finally:
        envs.close()


def test_agents_that_no_node_can_take_are_a_clear_error_and_leave_nothing_behind(cluster):
    with pytest.raises(RuntimeError, match=r"2 node agents did not start within 3 s \(agents"):
        ClusterVectorEnv([TaskEnv] * 4, num_agents=2, batch_size=2, startup_timeout_s=3,
                         agent_options={"resources": {"no_such_node": 1}})  # fmt: skip
    wait_for(lambda: not live_actors(), 30)
    assert live_actors() == []


def live_actors() -> list[str]:
    """The class names of the cluster's actors that are not dead, from the GCS's actor
    table (``ray.util.state`` needs the dashboard, which ``ray`` without extras lacks)."""
    actors = ray._private.state.actors().values()
    return [actor["ActorClassName"] for actor in actors if actor["State"] != "DEAD"]


def test_two_agents_killed_at_once_cost_only_retries(cluster):
    """Two of three agents killed in one instant mid-``get_batch``: every task is handed
    over once, the lost attempts ran again (on the third agent, or on the two restarted),
    and every trajectory replays."""
    fn = functools.partial(TaskEnv, max_len=20, wait_s=0.005)
    envs = make_cluster_env(cluster, env_fn=fn)
    try:
        with Rollouts(envs, obs_policy, group_size=2, max_retries=0) as rollouts:
            rollouts.submit(seeds=list(range(12)))
            groups = list(rollouts.get_batch(1))
            for agent in envs.agents[1:]:
                ray.kill(agent)
            groups += [g for _ in range(11) for g in rollouts.get_batch(1)]
            stats = rollouts.stats()
        assert sorted(g.task.seed for g in groups) == list(range(12))
        assert stats["dropped"].get("node_lost", 0) >= 2 and not stats["groups_dropped"]
        for traj in (t for g in groups for t in g.trajectories):
            assert traj.status.finished
            replay(traj, fn)
    finally:
        envs.close()


def test_a_removed_node_costs_only_retries_on_the_other_nodes(cluster):
    fn = functools.partial(TaskEnv, max_len=30, wait_s=0.01)
    envs = make_cluster_env(cluster, env_fn=fn)
    lost_node = cluster.env_nodes[1]
    try:
        with Rollouts(envs, obs_policy, group_size=2, max_retries=5) as rollouts:
            rollouts.submit(seeds=list(range(12)))
            groups = rollouts.get_batch(1)
            cluster.remove_node(lost_node, allow_graceful=False)
            groups += [g for _ in range(11) for g in rollouts.get_batch(1)]
            stats = rollouts.stats()
        assert envs.lost_env_ids == {2, 3}
        assert sorted(g.task.seed for g in groups) == list(range(12))  # each once
        assert len({g.group_id for g in groups}) == 12
        assert stats["dropped"].get("node_lost", 0) >= 1
        retried = 0
        for group in groups:
            for traj in group.trajectories:
                assert traj.status.finished
                replay(traj, fn)
                if Status.NODE_LOST in traj.retried_after:
                    retried += 1
                    assert traj.env_id not in envs.lost_env_ids
        assert retried >= 1
    finally:
        envs.close()
        cluster.env_nodes.remove(lost_node)
