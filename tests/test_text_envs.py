"""Text envs written elsewhere (GEM's games, gymnasium's FrozenLake) through the
adapters of shmvec.text_envs: gymnasium's env checker, trajectories that depend
only on their seed and actions (interleaved in one thread, and in threads),
the adapters' checks, and complete groups from ShmVectorEnv and Rollouts whose
every trajectory replays alone."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading

import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv
from gymnasium.utils.env_checker import check_env
from text_env_fns import ENV_FNS, RandomTextPolicy, frozen_lake, random_action

import shmvec
from shmvec import UnboundedText
from shmvec.rollouts import Rollouts, Status, Task, replay
from shmvec.text_envs import FrozenLakeText, GemEnv, text_space

pytestmark = pytest.mark.timeout(240)

GEM_GAMES = ["guess_the_number", "minesweeper", "sudoku"]


@pytest.fixture(scope="module")
def gem():
    return pytest.importorskip("gem")


def env_fn(name, request):
    if name in GEM_GAMES:
        request.getfixturevalue("gem")
    return ENV_FNS[name]


def run(env, seed, actions, episodes=3):
    """``episodes`` episodes: the first reset seeded, the next ones not (the env's
    generators go on); actions taken in turn from ``actions``. Returns the
    trajectory as a list of (obs, reward, terminated, truncated, info)."""
    record = []
    obs, info = env.reset(seed=seed)
    record.append((obs, info))
    it = iter(actions)
    for _ in range(episodes):
        done = False
        while not done:
            obs, reward, terminated, truncated, info = env.step(next(it))
            record.append((obs, reward, terminated, truncated, info))
            done = terminated or truncated
        record.append(env.reset())
    return record


def global_states():
    return random.getstate(), np.random.get_state(legacy=False)["state"]["key"].tobytes()


@pytest.mark.parametrize("name", [*GEM_GAMES, "frozen_lake"])
def test_adapters_pass_gymnasium_env_checker(name, request):
    env = env_fn(name, request)()
    check_env(env, skip_render_check=True)  # text envs: no render modes
    obs, _ = env.reset(seed=3)
    assert obs in env.observation_space and random_action(np.random.default_rng(0)) in (
        env.action_space
    )


@pytest.mark.parametrize("name", [*GEM_GAMES, "frozen_lake"])
def test_same_seed_and_actions_give_the_same_trajectory_interleaved(name, request):
    fn = env_fn(name, request)
    rng = np.random.default_rng(11)
    actions = [random_action(rng) for _ in range(2000)]
    alone = run(fn(), 7, actions)
    before = global_states()
    # Three envs stepped in turn: a and b share a seed, c has another and moves
    # in between (and resets, reseeding its generators) as often as they do.
    envs = {"a": fn(), "b": fn(), "c": fn()}
    seeds = {"a": 7, "b": 7, "c": 8}
    records = {k: [env.reset(seed=seeds[k])] for k, env in envs.items()}
    position = dict.fromkeys(envs, 0)
    episodes = dict.fromkeys(envs, 0)
    while min(episodes.values()) < 3:
        for key in ("a", "c", "c", "b"):
            if episodes[key] == 3:
                continue
            step = envs[key].step(actions[position[key]])
            position[key] += 1
            records[key].append(step)
            if step[2] or step[3]:
                episodes[key] += 1
                records[key].append(envs[key].reset())
    assert records["a"] == records["b"] == alone
    assert records["c"] != alone
    assert global_states() == before  # the adapters put the callers' generators back


@pytest.mark.parametrize("name", [*GEM_GAMES, "frozen_lake"])
def test_same_seed_and_actions_give_the_same_trajectory_in_threads(name, request):
    fn = env_fn(name, request)
    rng = np.random.default_rng(12)
    actions = [random_action(rng) for _ in range(2000)]
    expected = {seed: run(fn(), seed, actions) for seed in (7, 8)}
    envs = [(seed, fn()) for seed in (7, 8) * 4]
    results: list = [None] * len(envs)
    start = threading.Barrier(len(envs))

    def worker(i, seed, env):
        start.wait()
        results[i] = run(env, seed, actions)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [
            threading.Thread(target=worker, args=(i, seed, env))
            for i, (seed, env) in enumerate(envs)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    for (seed, _), result in zip(envs, results):
        assert result == expected[seed]


def test_gem_games_draw_from_the_global_generator(gem):
    # Why GemEnv swaps generator states: two of GEM's own Minesweepers in one
    # process. The first reveal places the mines with Python's global random,
    # which the other game's seeded reset has just reseeded.
    def first_board(interleave):
        game = gem.make("game:Minesweeper-v0-easy")
        game.reset(seed=1)
        if interleave:
            gem.make("game:Minesweeper-v0-easy").reset(seed=2)
        _, _, _, _, info = game.step("\\boxed{reveal 2 2}")
        return info["suffix"]

    state = random.getstate()
    try:
        assert first_board(interleave=False) != first_board(interleave=True)
    finally:
        random.setstate(state)
    # The adapter: the same first board either way.
    boards = []
    for interleave in (False, True):
        env = GemEnv("game:Minesweeper-v0-easy")
        env.reset(seed=1)
        if interleave:
            GemEnv("game:Minesweeper-v0-easy").reset(seed=2)
        boards.append(env.step("\\boxed{reveal 2 2}")[0])
    assert boards[0] == boards[1]


class ScriptedGame:
    """A GEM-style game (reset(seed) -> (obs, info); step(str) -> 5-tuple)
    whose rewards and observations are given by a script, one per step."""

    def __init__(self, rewards=(), observations=(), **_):
        self.rewards, self.observations, self.t = list(rewards), list(observations), 0

    def reset(self, seed=None):
        self.t = 0
        return "start", {"suffix": "board"}

    def step(self, action):
        self.t += 1
        obs = self.observations[self.t - 1] if self.observations else f"turn {self.t}"
        return obs, self.rewards[self.t - 1], self.t == len(self.rewards), False, {"k": 1}


@pytest.fixture(scope="module")
def scripted(gem):
    from gem.envs.registration import ENV_REGISTRY

    if "test:Scripted-v0" not in ENV_REGISTRY:
        gem.register("test:Scripted-v0", ScriptedGame)
    return "test:Scripted-v0"


def test_gem_rewards_become_floats_and_text_rewards_are_rejected(scripted):
    env = GemEnv(scripted, rewards=[np.float32(0.5), 1, np.array(2.0), True, "you win"])
    assert env.reset(seed=0) == ("start\nboard", {})
    rewards = [env.step("go")[1] for _ in range(4)]
    assert rewards == [0.5, 1.0, 2.0, 1.0]
    assert all(type(r) is float for r in rewards)
    with pytest.raises(TypeError, match=r"reward of step 5 of GemEnv.*str 'you win'.*not a number"):
        env.step("go")
    plain = GemEnv(scripted, append_suffix=False, rewards=[0.0])
    assert plain.reset() == ("start", {"suffix": "board"})
    assert plain.step("go") == ("turn 1", 0.0, True, False, {"k": 1})


def test_gem_env_made_by_a_callable_needs_no_registry():
    # A game class or a partial of it: made as it is, its draws swapped like any other.
    import functools

    env = GemEnv(functools.partial(ScriptedGame, rewards=[1.0]), observations=["won"])
    assert env.env_id == "ScriptedGame" and repr(env) == "GemEnv('ScriptedGame')"
    assert env.reset(seed=3) == ("start\nboard", {})
    assert env.step("go") == ("won", 1.0, True, False, {"k": 1})


def test_gem_text_checks(scripted):
    env = GemEnv(scripted, rewards=[0.0] * 3, observations=["ok ♠", "a ♞ b", "x" * 90_000])
    env.reset()
    assert env.step("go")[0] == "ok ♠"
    assert env.step("go")[0] == "a ♞ b"  # any character
    assert env.step("go")[0] == "x" * 90_000  # any length
    with pytest.raises(TypeError, match="text actions"):
        env.step(3)
    with pytest.raises(ValueError, match="no reset options"):
        env.reset(options={"level": 2})


def test_text_space():
    space = text_space()
    assert isinstance(space, UnboundedText)
    assert space.contains("") and space.contains("♞ ♠ €\n" * 10_000) and not space.contains(3)


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("left", 0),
        ("DOWN", 1),
        ("I go right.", 2),
        ("3", 3),
        ("\\boxed{1}", 1),
        ("up, no: left", 0),
        ("upward", None),
        ("10 or 22", None),
        ("", None),
        ("north", None),
    ],
)
def test_frozen_lake_text_parses_moves(text, move):
    assert FrozenLakeText.parse_action(text) == move


def test_frozen_lake_text_moves_as_frozen_lake_does():
    rng = np.random.default_rng(5)
    env, lake = FrozenLakeText(max_episode_steps=1000), FrozenLakeEnv()
    env.reset(seed=9)
    lake.reset(seed=9)
    invalid = 0
    for _ in range(300):
        text = random_action(rng)
        obs, reward, terminated, truncated, info = env.step(text)
        move = FrozenLakeText.parse_action(text)
        assert info["invalid_action"] is (move is None)
        if move is None:
            invalid += 1
            expected = (0.0, False)
        else:
            _, lake_reward, lake_terminated, _, _ = lake.step(move)
            expected = (float(lake_reward), lake_terminated)
        row, column = divmod(int(lake.s), 4)
        assert f"You are at row {row}, column {column}." in obs
        assert obs.splitlines()[1 + row][column] == "@"
        assert (reward, terminated, truncated) == (*expected, False)
        if terminated:
            env.reset()
            lake.reset()
    assert 0 < invalid < 300


def test_frozen_lake_text_counts_invalid_steps_toward_its_limit():
    env = FrozenLakeText(max_episode_steps=3)
    first, _ = env.reset(seed=0)
    steps = [env.step("wait") for _ in range(3)]
    assert [s[0] for s in steps] == [first] * 3
    assert [(s[2], s[3]) for s in steps] == [(False, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="render_mode"):
        FrozenLakeText(render_mode="human")


def test_groups_from_a_mix_of_text_envs_replay_alone(gem):
    """Four text envs in one ShmVectorEnv (env threads in each worker), with a
    worker killed on the way: every trajectory handed over replays alone."""
    fns = {ENV_FNS[name]: 2 for name in ("guess_the_number", "minesweeper", "sudoku")}
    fns[frozen_lake] = 2
    envs = shmvec.make_mix(
        fns, num_workers=2, batch_size=2, env_concurrency=4,
        on_env_error="reset", on_worker_death="restart",
    )  # fmt: skip
    tags = list(dict.fromkeys(envs.env_tags))
    try:
        with Rollouts(envs, RandomTextPolicy(0), group_size=2, max_retries=5) as rollouts:
            rollouts.submit([Task(seed=s, tag=tag) for s in range(6) for tag in tags])
            groups = rollouts.get_batch(4)
            os.kill(envs._pool.workers[0].pid, signal.SIGKILL)
            for _ in range(5):
                groups += rollouts.get_batch(4)
            stats = rollouts.stats()
    finally:
        envs.close()
    assert sorted((g.task.tag, g.task.seed) for g in groups) == sorted(
        (tag, s) for s in range(6) for tag in tags
    )
    assert stats["groups_dropped"] == {} and stats["completed"] >= 48
    steps = 0
    for group in groups:
        assert len(group.trajectories) == 2
        for traj in group.trajectories:
            assert traj.status in (Status.TERMINATED, Status.TRUNCATED)
            assert traj.env_tag == group.task.tag
            report = replay(traj, ENV_FNS[traj.env_tag])
            assert report.steps == traj.num_steps and not report.used_global_random
            steps += report.steps
    # FrozenLake's holes are two moves from its start: each of its 12 trajectories took 2+ steps.
    assert steps >= 48 + 12
