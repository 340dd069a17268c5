"""A policy's action outside the env's action space is its trajectory's outcome: it fails as
``invalid_action`` (counted, the action and the space in its reason, retried or dropped by the
group policy) and every other row, of its batch too, goes on; for a batched policy, a per-row
policy and ``ServerPolicy``. And ``Rollouts.close()`` may be called again, after an error too,
for every kind of policy."""

from __future__ import annotations

import functools
import itertools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from shmvec.rollouts import AsyncPolicy, PolicyError, Rollouts, Status, Task
from shmvec.rollouts.policies import action_problem

pytestmark = pytest.mark.timeout(120)

GROUPS = 3
SPACES = {
    "text": spaces.Text(5, min_length=1, charset="xyz"),
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-1.0, 1.0, (2,), np.float32),
}
#: Per space: an action in it, one outside it, and what the reason says of the latter.
ACTIONS = {
    "text": ("xy", "xq", "characters outside its charset: 'q'"),
    "discrete": (np.int64(2), 5, ""),
    # float64: valid as float32; past the bounds, valid (the env clips, as under gymnasium's
    # vector envs); of another shape, not
    "box": (np.array([0.5, -2.0]), np.zeros(3), "shape (3,), not (2,)"),
}


class SpaceEnv(gym.Env):
    """Observes its step count as text and takes any action of ``SPACES[kind]``; its
    episodes never end by themselves (``max_steps`` ends them)."""

    def __init__(self, kind: str) -> None:
        self.observation_space = spaces.Text(8, min_length=0, charset="0123456789")
        self.action_space = SPACES[kind]
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return "0", {}

    def step(self, action):
        if isinstance(self.action_space, spaces.Box):
            assert np.shape(action) == self.action_space.shape, f"the env received {action!r}"
        else:
            assert self.action_space.contains(action), f"the env received {action!r}"
        self.t += 1
        return str(self.t), 1.0, False, False, {}


def is_bad(trajectory) -> bool:
    """The first action of each group's second trajectory, first attempt, is the bad one."""
    return trajectory.index == 1 and trajectory.attempt == 0 and not trajectory.actions


def run(kind: str, policy, **kwargs):
    envs = [functools.partial(SpaceEnv, kind)] * 4
    with Rollouts.from_env_fns(
        envs, policy, env_concurrency=2, batch_size=2, group_size=2, max_steps=2, **kwargs
    ) as rollouts:
        rollouts.submit([Task(seed=s) for s in range(GROUPS)])
        groups = rollouts.get_batch(GROUPS, timeout=60)
        return groups, rollouts.stats()


def check_one_bad_action_per_group(kind: str, groups, stats, bad=None) -> None:
    space = SPACES[kind]
    bad = ACTIONS[kind][1] if bad is None else bad
    detail = ACTIONS[kind][2]
    assert stats["dropped"] == {"invalid_action": GROUPS} and stats["retries"] == GROUPS
    assert stats["groups_delivered"] == GROUPS and not stats["groups_dropped"]
    for group in groups:
        (failed,) = group.failed
        assert failed.status is Status.INVALID_ACTION, failed.status
        assert (failed.index, failed.attempt, failed.num_steps) == (1, 0, 0)
        reason = f"action {bad!r} is outside the env's action space {space!r}"
        assert failed.reason.startswith(reason), failed.reason
        assert detail in failed.reason
        # the other rows went on: the first attempt of index 0, and index 1's retry
        assert [t.attempt for t in group.trajectories] == [0, 1]
        assert all(t.status is Status.MAX_STEPS and t.num_steps == 2 for t in group.trajectories)
        assert group.trajectories[1].retried_after == [Status.INVALID_ACTION]


@pytest.mark.parametrize("kind", sorted(SPACES))
def test_a_batched_policys_bad_action_fails_its_trajectory_only(kind):
    good, bad, _ = ACTIONS[kind]

    def policy(batch):
        return [bad if is_bad(t) else good for t in batch.trajectories]

    groups, stats = run(kind, policy)
    check_one_bad_action_per_group(kind, groups, stats)


@pytest.mark.parametrize("kind", sorted(SPACES))
def test_a_per_row_policys_bad_action_fails_its_trajectory_only(kind):
    good, bad, _ = ACTIONS[kind]

    async def policy(row):
        return bad if is_bad(row.trajectory) else good

    groups, stats = run(kind, AsyncPolicy(policy, concurrency=4))
    check_one_bad_action_per_group(kind, groups, stats)


def test_a_bad_action_past_max_retries_drops_its_group_and_the_others_go_on():
    def policy(batch):  # group 0's second trajectory is always wrong
        return ["q" if t.task.seed == 0 and t.index == 1 else "xy" for t in batch.trajectories]

    groups, stats = run("text", policy, max_retries=1, tasks=iter([Task(seed=9)]))
    assert stats["groups_dropped"] == {"invalid_action": 1}
    assert stats["dropped"]["invalid_action"] == 2  # the attempt and its one retry
    assert sorted(g.task.seed for g in groups) == [1, 2, 9]  # a task took its place


def test_a_server_policys_reply_outside_the_charset_fails_its_trajectory(tiny_tokenizer):
    pytest.importorskip("openai", reason="ServerPolicy needs openai")
    pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
    from llm_servers import FakeServer

    from shmvec.rollouts.server import Sampling, ServerPolicy

    replies = itertools.count()
    sent = []

    def action(text):
        # The server writes random bytes: the first reply as it is, with a "q" (outside the
        # charset) in front; every later one a move of the charset.
        sent.append("q" + text if next(replies) == 0 else "xy")
        return sent[-1]

    def messages(row):
        return [{"role": "user", "content": row.observation}]

    with FakeServer(tiny_tokenizer) as server:
        policy = ServerPolicy(
            server.base_url, "tiny", tiny_tokenizer, messages,
            sampling=Sampling(max_tokens=4), action=action,
        )  # fmt: skip
        with Rollouts.from_env_fns(
            [functools.partial(SpaceEnv, "text")] * 4, policy, env_concurrency=4,
            batch_size=2, group_size=2, max_steps=2,
        ) as rollouts:  # fmt: skip
            rollouts.submit([Task(seed=s) for s in range(GROUPS)])
            groups = rollouts.get_batch(GROUPS, timeout=60)
            stats = rollouts.stats()
    assert stats["dropped"] == {"invalid_action": 1} and stats["retries"] == 1
    assert stats["groups_delivered"] == GROUPS
    (failed,) = [t for g in groups for t in g.failed]
    assert failed.status is Status.INVALID_ACTION and failed.num_steps == 0
    space = SPACES["text"]
    assert failed.reason.startswith(
        f"action {sent[0]!r:.200} is outside the env's action space {space!r}"
    )
    assert all(t.actions == ["xy", "xy"] for g in groups for t in g.trajectories)


def test_action_problem_checks_the_value_the_env_receives():
    box = SPACES["box"]
    assert action_problem(box, [0.5, 0.5]) is None  # a list, as the float32 array it becomes
    assert action_problem(box, np.array([0.5, 0.5], dtype=np.float64)) is None
    assert action_problem(box, np.array([5.0, -5.0])) is None  # the bounds are the env's
    assert action_problem(box, [[0.5], [0.5]]).startswith("action [[0.5], [0.5]] is outside")
    assert action_problem(box, np.zeros(3)).endswith(": shape (3,), not (2,)")
    # a float for a Discrete, which numpy's same-kind cast into the env's int64 refuses
    assert ": TypeError: Cannot cast" in action_problem(SPACES["discrete"], 2.5)
    assert action_problem(SPACES["discrete"], np.array(1)) is None
    assert action_problem(SPACES["discrete"], -1) is not None
    text = SPACES["text"]
    assert action_problem(text, "") == (
        f"action '' is outside the env's action space {text!r}: 0 characters, under min_length=1"
    )
    assert action_problem(text, "xyzxyz").endswith("6 characters, over max_length=5")
    assert action_problem(text, 5) == f"action 5 is outside the env's action space {text!r}"


# ------------------------------------------------------------------------- close twice


def test_close_twice_with_a_batched_policy(no_threads_left):
    rollouts = Rollouts.from_env_fns(
        [functools.partial(SpaceEnv, "discrete")] * 4, lambda batch: [1] * len(batch),
        env_concurrency=2, batch_size=2, group_size=2, max_steps=2,
    )  # fmt: skip
    rollouts.submit([Task(seed=0)])
    assert len(rollouts.get_batch(1, timeout=60)) == 1
    rollouts.close()
    rollouts.close()
    with pytest.raises(RuntimeError, match="these rollouts are closed"):
        rollouts.get_batch(1, timeout=1)
    with pytest.raises(RuntimeError, match="these rollouts are closed"):
        rollouts.submit([Task(seed=1)])


def test_close_twice_with_a_per_row_policy(no_threads_left):
    async def policy(row):
        return 1

    rollouts = Rollouts.from_env_fns(
        [functools.partial(SpaceEnv, "discrete")] * 4, policy,
        env_concurrency=2, batch_size=2, group_size=2, max_steps=2,
    )  # fmt: skip
    rollouts.submit([Task(seed=0)])
    assert len(rollouts.get_batch(1, timeout=60)) == 1
    rollouts.close()
    rollouts.close()
    with pytest.raises(RuntimeError, match="these rollouts are closed"):
        rollouts.get_batch(1, timeout=1)


@pytest.mark.parametrize("per_row", [False, True], ids=["batched", "per_row"])
def test_close_twice_after_the_policy_raised(per_row, no_threads_left):
    def broken(batch):
        raise KeyError("a bug in the policy")

    async def broken_row(row):
        raise KeyError("a bug in the policy")

    rollouts = Rollouts.from_env_fns(
        [functools.partial(SpaceEnv, "discrete")] * 4, broken_row if per_row else broken,
        env_concurrency=2, batch_size=2, group_size=2, max_steps=2,
    )  # fmt: skip
    rollouts.submit([Task(seed=0)])
    with pytest.raises(PolicyError, match="a bug in the policy"):
        rollouts.get_batch(1, timeout=60)
    rollouts.close()
    rollouts.close()


def test_close_twice_with_a_server_policy(tiny_tokenizer, no_threads_left):
    pytest.importorskip("openai", reason="ServerPolicy needs openai")
    pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
    from llm_servers import FakeServer

    from shmvec.rollouts.server import Sampling, ServerPolicy

    def messages(row):
        return [{"role": "user", "content": row.observation}]

    with FakeServer(tiny_tokenizer) as server:
        policy = ServerPolicy(
            server.base_url, "tiny", tiny_tokenizer, messages, sampling=Sampling(max_tokens=4),
            action=lambda text: 1,
        )  # fmt: skip
        rollouts = Rollouts.from_env_fns(
            [functools.partial(SpaceEnv, "discrete")] * 4, policy,
            env_concurrency=2, batch_size=2, group_size=2, max_steps=2,
        )  # fmt: skip
        try:
            rollouts.submit([Task(seed=0)])
            assert len(rollouts.get_batch(1, timeout=60)) == 1
        finally:
            rollouts.close()
        rollouts.close()
        with rollouts:  # and __exit__ closes once more
            pass
