"""RayVectorEnv (shmvec.ray): ShmVectorEnvs in Ray actors, against SyncVectorEnv.

One local Ray session (2 CPUs) serves every test but the last, which starts
Ray's ``cluster_utils.Cluster`` with two simulated nodes to check that actors
spread over nodes and can be pinned to one. Actors reserve half a CPU each so
that two fit on this 2-core machine and their envs run in the actor process
(``num_workers=0``) unless a test says otherwise. Skipped without Ray.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import time

import envs as test_envs
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from shmvec import WorkerDiedError  # noqa: E402
from shmvec.ray import ActorDiedError, RayVectorEnv  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: Ray's shared-memory object store; its default (30% of RAM) is far more than needed.
OBJECT_STORE_BYTES = 100 * 1024**2
RAY_ARGS = dict(include_dashboard=False, log_to_driver=False)

MODES = [
    pytest.param(AutoresetMode.NEXT_STEP, id="next_step"),
    pytest.param(AutoresetMode.SAME_STEP, id="same_step"),
    pytest.param(AutoresetMode.DISABLED, id="disabled"),
]


class RaySession:
    """The Ray session of this module: local by default, a two-node cluster on demand."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.cluster = None

    def local(self) -> None:
        if self.kind != "local":
            self.stop()
            ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, **RAY_ARGS)
            self.kind = "local"

    def two_nodes(self):
        self.stop()
        node = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
        self.cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=node)
        self.cluster.add_node(**node, resources={"env_node": 2})
        ray.init(address=self.cluster.address, **RAY_ARGS)
        self.cluster.wait_for_nodes()
        self.kind = "cluster"
        return self.cluster

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None


@pytest.fixture(scope="module")
def session():
    session = RaySession()
    yield session
    session.stop()


@pytest.fixture
def local_ray(session):
    session.local()


def make_ray_env(env_fns, **kwargs) -> RayVectorEnv:
    kwargs.setdefault("num_actors", 2)
    kwargs.setdefault("num_cpus_per_actor", 0.5)
    return RayVectorEnv(env_fns, **kwargs)


# ------------------------------------------------------------- equivalence


@pytest.mark.parametrize("autoreset_mode", MODES)
@pytest.mark.parametrize(
    "env_name,num_workers",
    [("CartPole-v1", 1), ("CustomSpaceEnv", 0)],
    ids=["cartpole-1worker", "custom-inprocess"],
)
def test_equals_sync_vector_env(local_ray, env_name, num_workers, autoreset_mode):
    """Same seeds and actions: same obs, rewards, flags and infos as SyncVectorEnv, with
    uneven actor blocks (3 + 2 envs), a masked reset with per-env seeds, and, with
    autoreset disabled, masked resets of the envs that ended."""
    num_envs = 5
    make_fns = test_envs.ENV_CASES[env_name]
    sync = SyncVectorEnv(make_fns(num_envs), autoreset_mode=autoreset_mode)
    envs = make_ray_env(
        make_fns(num_envs),
        autoreset_mode=autoreset_mode,
        vector_kwargs={"num_workers": num_workers},
    )
    try:
        assert envs.actor_env_ids == [range(0, 3), range(3, 5)]
        assert envs.observation_space == sync.observation_space
        assert envs.action_space == sync.action_space
        assert envs.metadata["autoreset_mode"] is autoreset_mode
        assert_same(envs.reset(seed=7), sync.reset(seed=7), "reset")
        action_space = copy.deepcopy(sync.action_space)
        action_space.seed(5)
        ended, crossed_ends, had_infos = np.zeros(num_envs, dtype=bool), 0, 0
        for t in range(40):
            mask, seeds = None, None
            if autoreset_mode == AutoresetMode.DISABLED and ended.any():
                mask = ended.copy()
            elif t == 11:  # actor 0 partly, actor 1 not at all
                mask = np.array([True, False, True, False, False])
                seeds = [100 + i for i in range(num_envs)]
            if mask is not None:
                options = {"reset_mask": mask, "level": t}
                result = envs.reset(seed=seeds, options=dict(options))
                assert_same(result, sync.reset(seed=seeds, options=dict(options)), f"reset {t}")
            actions = action_space.sample()
            result = envs.step(actions)
            assert_same(result, sync.step(actions), f"step {t}")
            assert all(a.flags.writeable for a in result[1:4])
            ended = result[2] | result[3]
            crossed_ends += int(ended.sum())
            had_infos += bool(result[4])
        assert crossed_ends > 0
        assert had_infos > 0 or env_name == "CartPole-v1"
    finally:
        envs.close()
        sync.close()


# ------------------------------------------------------------------- async


def test_async_recv_returns_ready_actors_first(local_ray):
    """recv() hands back whole actor batches as they are ready, with global env ids;
    the fast actor is not held back by the slow one."""
    slow = functools.partial(test_envs.CountingEnv, delay=0.3)
    env_fns = [test_envs.CountingEnv] * 2 + [slow] * 2
    envs = make_ray_env(env_fns, batch_size=2)
    try:
        with pytest.raises(RuntimeError, match="before async_reset"):
            envs.send(np.zeros(2, dtype=np.int64), [0, 1])
        envs.async_reset(seed=0)
        steps = np.zeros(4, dtype=np.int64)
        first = envs.recv()
        second = envs.recv()
        seen = sorted(first[4]["env_id"].tolist() + second[4]["env_id"].tolist())
        assert seen == [0, 1, 2, 3]
        for obs, _, _, _, infos in (first, second):
            assert obs.shape == (2, 2) and (obs[:, 0] == 0).all()
            envs.send(infos["env_id"], infos["env_id"])  # CountingEnv echoes the action
        with pytest.raises(ValueError, match="not awaiting an action"):
            envs.send(np.zeros(2, dtype=np.int64), [2, 3])
        obs, rewards, terminations, truncations, infos = envs.recv()
        assert infos["env_id"].tolist() == [0, 1], "the slow actor came back first"
        steps[infos["env_id"]] += 1
        assert obs[:, 0].tolist() == steps[[0, 1]].tolist()
        assert obs[:, 1].tolist() == [0, 1]
        with pytest.raises(ValueError, match="whole actor blocks"):
            envs.send(np.zeros(1, dtype=np.int64), [0])
        envs.send(np.array([3, 2]), infos["env_id"][::-1])  # env 1 gets 3, env 0 gets 2
        obs, *_, infos = envs.recv()
        assert infos["env_id"].tolist() == [0, 1]
        assert obs[:, 1].tolist() == [2, 3]
        obs, *_, infos = envs.recv()
        assert infos["env_id"].tolist() == [2, 3]
        assert obs[:, 1].tolist() == [2, 3]
        with pytest.raises(RuntimeError, match="send\\(\\) actions first"):
            envs.recv()
    finally:
        envs.close()


def test_async_take_ready_returns_the_ready_actors_batches(local_ray):
    """recv(take_ready=True) past its timeout returns the actor batches that are
    ready (the fast actor's), not the slow one's; a later recv returns that."""
    slow = functools.partial(test_envs.CountingEnv, delay=1.0)
    fast = test_envs.CountingEnv
    envs = make_ray_env([fast] * 2 + [slow] * 2 + [fast] * 2, num_actors=3, batch_size=4)
    try:
        envs.async_reset(seed=0)
        first = envs.recv()[4]["env_id"].tolist()
        first += envs.recv(partial=True)[4]["env_id"].tolist()
        assert sorted(first) == list(range(6))
        envs.send(np.zeros(4, dtype=np.int64), [0, 1, 2, 3])
        obs, *_, infos = envs.recv(timeout=0.5, take_ready=True)
        assert infos["env_id"].tolist() == [0, 1] and obs.shape == (2, 2)
        *_, infos = envs.recv(timeout=120.0, partial=True, take_ready=True)
        assert infos["env_id"].tolist() == [2, 3]
    finally:
        envs.close()


def test_async_partial_recv_returns_every_running_actor(local_ray):
    """recv(partial=True) with fewer than batch_size envs running waits for every
    running actor's batch and returns those rows; the plain recv still refuses."""
    envs = make_ray_env([test_envs.CountingEnv] * 6, num_actors=3, batch_size=4)
    try:
        with pytest.raises(RuntimeError, match="only 0 envs are running"):
            envs.recv(partial=True)
        envs.async_reset(seed=0)
        first = envs.recv()[4]["env_id"].tolist()
        obs, rewards, terminations, truncations, infos = envs.recv(partial=True)
        assert sorted(first + infos["env_id"].tolist()) == list(range(6))
        assert obs.shape == (2, 2) and rewards.shape == terminations.shape == (2,)
        envs.send(np.array([1, 2]), [4, 5])
        with pytest.raises(RuntimeError, match="only 2 envs are running"):
            envs.recv()
        obs, rewards, terminations, truncations, infos = envs.recv(partial=True)
        assert infos["env_id"].tolist() == [4, 5]
        assert obs.tolist() == [[1, 1], [1, 2]] and truncations.shape == (2,)
        envs.send(np.array([3, 3, 3, 3, 3, 3]), [0, 1, 2, 3, 4, 5])
        rows = [envs.recv(partial=True)[4]["env_id"] for _ in range(2)]
        assert [len(r) for r in rows] == [4, 2]
        assert sorted(np.concatenate(rows).tolist()) == list(range(6))
    finally:
        envs.close()


# ------------------------------------------------------------- call & co


def test_call_get_attr_set_attr(local_ray):
    envs = make_ray_env(test_envs.class_fns(test_envs.CountingEnv, 3))
    try:
        envs.set_attr("offset", [10, 20, 30])
        assert envs.get_attr("offset") == (10, 20, 30)
        assert envs.call("double", 1) == (12, 22, 32)
        envs.set_attr("tag", "same")
        assert envs.get_attr("tag") == ("same",) * 3
        obs, _ = envs.reset(seed=0)
        assert obs[:, 0].tolist() == [10, 20, 30]
        with pytest.raises(ValueError, match="length equal to the number"):
            envs.set_attr("offset", [1, 2])
        stats = envs.stats()
        assert stats["actor_restarts"] == [0, 0] and len(stats["actors"]) == 2
    finally:
        envs.close()


def test_groups_share_seed_and_options_across_actors(local_ray):
    """Group 1 is envs 2..3, split over actors 0 and 1: both get seed s + 1."""
    fns = test_envs.gym_fns("CartPole-v1", 6)
    envs = make_ray_env(fns, num_actors=3, group_size=2)
    try:
        obs, _ = envs.reset(seed=7)
        want, _ = SyncVectorEnv(fns).reset(seed=[7, 7, 8, 8, 9, 9])
        assert np.array_equal(obs, want)
        obs, _ = envs.reset(seed=[1, 2, 3])  # one seed per group
        assert np.array_equal(obs, SyncVectorEnv(fns).reset(seed=[1, 1, 2, 2, 3, 3])[0])
        with pytest.raises(ValueError, match="num_envs / group_size = 3"):
            envs.reset(seed=[1, 2])
        with pytest.raises(ValueError, match="group_size must divide num_envs=6"):
            make_ray_env(fns, num_actors=3, group_size=4)
    finally:
        envs.close()


def test_env_error_names_its_actor(local_ray):
    envs = make_ray_env(test_envs.indexed_fns(test_envs.FailingEnv, 4, fail_index=3))
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(test_envs.EnvBoom, match="step boom in env 3") as info:
            envs.step(np.zeros(4, dtype=np.int64))
        assert "shmvec Ray actor 1 (envs 2..3)" in "\n".join(info.value.__notes__)
        obs, _ = envs.reset(seed=0)  # usable again
        assert obs.shape == (4, 2)
    finally:
        envs.close()


def test_step_wait_timeout_names_the_late_actor(local_ray):
    slow = functools.partial(test_envs.CountingEnv, delay=0.3)
    envs = make_ray_env([test_envs.CountingEnv, slow])
    try:
        envs.reset(seed=0)
        envs.step_async(np.zeros(2, dtype=np.int64))
        with pytest.raises(multiprocessing.TimeoutError, match="actor 1 \\(envs 1..1\\)"):
            envs.step_wait(timeout=0.05)
        obs, *_ = envs.step(np.ones(2, dtype=np.int64))  # the late results are dropped
        assert obs.tolist() == [[2, 1], [2, 1]]
    finally:
        envs.close()


# ------------------------------------------------------------------ faults


def test_env_id_and_killed_actor(local_ray):
    """Built from an env id; an actor killed with ray.kill is an error naming it."""
    envs = RayVectorEnv("CartPole-v1", num_actors=2, envs_per_actor=2, num_cpus_per_actor=0.5)
    try:
        assert envs.num_envs == 4
        assert envs.single_observation_space.shape == (4,)
        envs.reset(seed=0)
        kill_for_good(envs.actors[1])
        with pytest.raises(ActorDiedError, match="actor 1 \\(envs 2..3\\) died") as info:
            envs.step(np.zeros(4, dtype=np.int64))
        assert isinstance(info.value, WorkerDiedError)
        assert info.value.env_ids == range(2, 4)
    finally:
        envs.close()


def test_dead_worker_inside_actor(local_ray):
    """A worker process of an actor's ShmVectorEnv dies: an ActorDiedError naming the
    actor, with the worker's own error as its cause."""
    env_fns = test_envs.indexed_fns(test_envs.SelfKillingEnv, 4, kill_index=1)
    envs = make_ray_env(env_fns, vector_kwargs={"num_workers": 1})
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(ActorDiedError, match="actor 0 \\(envs 0..1\\).*SIGKILL"):
            envs.step(np.zeros(4, dtype=np.int64))
    finally:
        envs.close()


def test_restarted_actor_reports_truncated(local_ray):
    """on_actor_death="restart": a killed actor comes back; its envs report truncated
    with infos["actor_restarted"], the other actor's envs go on. Killed between calls
    (the restarted actor notices) and during a step (the driver notices)."""
    slow = functools.partial(test_envs.CountingEnv, delay=0.2)
    env_fns = [test_envs.CountingEnv] * 2 + [slow] * 2
    envs = make_ray_env(env_fns, on_actor_death="restart")
    actions = np.ones(4, dtype=np.int64)
    try:
        envs.reset(seed=0)
        envs.step(actions)
        kill_and_wait(envs.actors[1])  # the restarted actor notices: it was not reset
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        assert truncations.tolist() == [False, False, True, True]
        assert not terminations.any()
        assert obs[:, 0].tolist() == [2, 2, 0, 0]  # steps since reset
        assert rewards.tolist() == [2.0, 2.0, 0.0, 0.0]
        assert infos["_actor_restarted"].tolist() == [False, False, True, True]
        assert infos["actor_restarted"][2:].all()
        obs, _, _, truncations, infos = envs.step(actions)
        assert obs[:, 0].tolist() == [3, 3, 1, 1] and not truncations.any() and not infos

        envs.step_async(actions)
        time.sleep(0.1)  # actor 1 is inside its 0.4 s step
        ray.kill(envs.actors[1], no_restart=False)
        obs, _, _, truncations, infos = envs.step_wait()  # the driver notices
        assert truncations.tolist() == [False, False, True, True]
        assert obs[:, 0].tolist() == [4, 4, 0, 0]
        assert infos["_actor_restarted"].tolist() == [False, False, True, True]
        assert envs.stats()["actor_restarts"] == [0, 2]
    finally:
        envs.close()


def test_restarted_actor_in_async_mode(local_ray):
    """recv() after an actor died in async mode: its batch comes back, truncated."""
    slow = functools.partial(test_envs.CountingEnv, delay=0.2)
    env_fns = [test_envs.CountingEnv] * 2 + [slow] * 2
    envs = make_ray_env(env_fns, batch_size=2, on_actor_death="restart")
    try:
        envs.async_reset(seed=0)
        # Both actors' reset batches first: sending on the first one could let
        # actor 0's quick step come back before actor 1's reset.
        reset_batches = [envs.recv()[-1]["env_id"] for _ in range(2)]
        for env_ids in reset_batches:
            envs.send(np.zeros(2, dtype=np.int64), env_ids)
        time.sleep(0.1)  # actor 1 is inside its 0.4 s step
        ray.kill(envs.actors[1], no_restart=False)
        batches = {}
        for _ in range(2):
            obs, _, _, truncations, infos = envs.recv()
            batches[infos["env_id"][0]] = (obs, truncations, infos)
        obs, truncations, infos = batches[2]
        assert truncations.all() and infos["actor_restarted"].all()
        assert obs[:, 0].tolist() == [0, 0]
        obs, truncations, infos = batches[0]
        assert (
            not truncations.any() and obs[:, 0].tolist() == [1, 1] and not infos.keys() - {"env_id"}
        )
    finally:
        envs.close()


def kill_for_good(actor) -> None:
    """ray.kill, returning once the actor is dead (a call sent at once may still run)."""
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.describe.remote())
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers after 30 s")


def kill_and_wait(actor) -> None:
    """ray.kill with a restart, returning once Ray has restarted the actor."""
    pid = ray.get(actor.describe.remote())["pid"]
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.describe.remote())["pid"] != pid:
                return
        except ray.exceptions.RayActorError:
            time.sleep(0.05)
    raise AssertionError("the killed actor did not come back within 30 s")


# --------------------------------------------------------------- placement


def test_actors_spread_over_nodes_or_pinned(session):
    """Two simulated nodes: SPREAD puts one actor on each; node_ids, or a custom
    resource only one node has, puts both on that one. Batches cross nodes through
    Ray's object store."""
    cluster = session.two_nodes()
    nodes = [node.node_id for node in cluster.list_all_nodes()]
    assert len(nodes) == 2
    envs = RayVectorEnv(test_envs.gym_fns("CartPole-v1", 4), num_actors=2)
    try:
        assert sorted(envs.actor_node_ids) == sorted(nodes)
        sync = SyncVectorEnv(test_envs.gym_fns("CartPole-v1", 4))
        assert_same(envs.reset(seed=1), sync.reset(seed=1))
        actions = np.array([0, 1, 1, 0])
        assert_same(envs.step(actions), sync.step(actions))
    finally:
        envs.close()
    pinned = RayVectorEnv(
        test_envs.gym_fns("CartPole-v1", 2),
        num_actors=2,
        num_cpus_per_actor=0.5,
        node_ids=[nodes[1], nodes[1]],
    )
    try:
        assert pinned.actor_node_ids == [nodes[1], nodes[1]]
        obs, _ = pinned.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        pinned.close()
    env_nodes = RayVectorEnv(
        test_envs.gym_fns("CartPole-v1", 2),
        num_actors=2,
        num_cpus_per_actor=0.5,
        actor_options={"resources": {"env_node": 1}},
    )
    try:
        assert env_nodes.actor_node_ids == [nodes[1], nodes[1]]
    finally:
        env_nodes.close()
    started = time.monotonic()
    session.stop()
    assert time.monotonic() - started < 30


def test_unbounded_text_equals_sync_vector_env(local_ray):
    """Text of any length (shmvec.UnboundedText) each way through Ray's object
    store, spilled in the actors' ShmVectorEnvs (a 64-byte inline capacity)."""
    num_envs = 4
    fns = test_envs.class_fns(test_envs.ChatEnv, num_envs, longest=20_000)
    sync = SyncVectorEnv(test_envs.class_fns(test_envs.ChatEnv, num_envs, longest=20_000))
    envs = make_ray_env(fns, vector_kwargs={"num_workers": 1, "text_bytes": 64})
    try:
        assert envs.observation_space == sync.observation_space
        assert_same(envs.reset(seed=3), sync.reset(seed=3), "reset")
        for t in range(12):
            actions = test_envs.random_texts(np.random.default_rng(t), num_envs, 20_000)
            assert_same(envs.step(actions), sync.step(actions), f"step {t}")
    finally:
        envs.close()
        sync.close()


def test_step_deadline_through_vector_kwargs(local_ray, tmp_path):
    """step_deadline in vector_kwargs reaches each actor's ShmVectorEnv: the stuck
    env's row comes back truncated with infos["step_deadline"], the actor lives on."""
    marker = str(tmp_path / "stuck")
    fns = [functools.partial(test_envs.StuckEnv, i, 2 if i == 1 else -1, "sleep", marker)
           for i in range(4)]  # fmt: skip
    envs = make_ray_env(fns, batch_size=2, vector_kwargs={"num_workers": 1, "step_deadline": 0.5})
    try:
        envs.async_reset(seed=0)
        seen = 0
        started = time.monotonic()
        while not seen:
            assert time.monotonic() - started < 60, "no step_deadline row"
            _, _, _, truncations, infos = envs.recv()
            if "step_deadline" in infos:
                rows = infos["_step_deadline"]
                assert infos["env_id"][rows].tolist() == [1]
                assert truncations[rows].all() and infos["step_deadline"][rows][0] == 0.5
                seen += 1
            envs.send(np.ones(2, np.int64), infos["env_id"])
        assert envs.actor_restarts == [0, 0]
    finally:
        envs.close()


def test_rollouts_give_the_trajectories_of_one_machine(local_ray):
    """shmvec.rollouts over RayVectorEnv (an env per actor, so each env steps on
    its own): for the same tasks and policy, the same trajectories as over a
    ShmVectorEnv, each equal to its env replayed alone."""
    from rollout_envs import TaskEnv, obs_policy

    from shmvec import ShmVectorEnv
    from shmvec.rollouts import Rollouts, replay

    backends = {
        "ray": make_ray_env([TaskEnv] * 4, num_actors=4, batch_size=2,
                            on_actor_death="restart", vector_kwargs={"on_env_error": "reset"}),
        "one machine": ShmVectorEnv([TaskEnv] * 4, num_workers=2, batch_size=2,
                                    on_env_error="reset", on_worker_death="restart"),
    }  # fmt: skip
    seen = {}
    try:
        for name, envs in backends.items():
            with Rollouts(envs, obs_policy, group_size=2) as rollouts:
                rollouts.submit(seeds=list(range(6)))
                groups = [g for _ in range(3) for g in rollouts.get_batch(2)]
            for traj in (t for g in groups for t in g.trajectories):
                replay(traj, TaskEnv)
            seen[name] = {
                g.task.seed: sorted(
                    (np.concatenate(t.observations).tobytes(), tuple(t.actions), tuple(t.rewards))
                    for t in g.trajectories
                )
                for g in groups
            }
        assert sorted(seen["ray"]) == list(range(6))
        assert seen["ray"] == seen["one machine"]
    finally:
        for envs in backends.values():
            envs.close()
