"""The async engine: send/recv with batch_size < num_envs, groups, per-env options, mixes."""

from __future__ import annotations

import os
import time

import envs as test_envs
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode
from helpers import assert_same

import shmvec
import shmvec.layout
from shmvec.layout import LEASE_REGIONS

#: Results each env must deliver in a trajectory check.
RESULTS_PER_ENV = 40
#: How long a result may take to arrive on a loaded machine before the test fails.
ARRIVAL_TIMEOUT_S = 120.0
#: How long a gated env waits for its gate before it fails its step.
GATE_WAIT_S = 60.0


class UnevenStep(gym.Wrapper):
    """CartPole whose steps burn ``k`` times 5 us of CPU: envs finish out of order."""

    def __init__(self, env: gym.Env, k: int) -> None:
        super().__init__(env)
        self.k = k

    def step(self, action):
        deadline = time.perf_counter() + 5e-6 * self.k
        while time.perf_counter() < deadline:
            pass
        return self.env.step(action)


class InfoCartPole(gym.Wrapper):
    """Adds numeric infos every step (columns) and a string now and then (pickled)."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info, lives=3, frame=np.int32(self.env.unwrapped.steps_beyond_terminated or 0))
        if obs[0] > 0.05:
            info["note"] = "right"
        return obs, reward, terminated, truncated, info


def uneven(k: int):
    # Step times differ by 20x between the fastest and the slowest env.
    return lambda: UnevenStep(gym.make("CartPole-v1"), 1 + (k % 4) * 19 // 3)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
@pytest.mark.parametrize("num_envs,num_workers,batch_size", [(8, 2, 3), (6, 3, 1), (9, 2, 5)])
@pytest.mark.parametrize(
    "step_in_main,lent",
    [(False, False), (True, False), (False, True)],
    ids=["workers", "main-too", "lent"],
)
def test_each_env_matches_stepping_it_alone(
    mode, num_envs, num_workers, batch_size, step_in_main, lent, monkeypatch
):
    if lent:  # observations in lease regions (shmvec/engine/leases.py), small as they are
        monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)
    envs = shmvec.ShmVectorEnv(
        [uneven(k) for k in range(num_envs)],
        num_workers=num_workers,
        batch_size=batch_size,
        autoreset_mode=mode,
        step_in_main=step_in_main,
    )
    assert (envs._decoder.leases is not None) == lent
    alone = [uneven(k)() for k in range(num_envs)]
    expected = {}
    for e, env in enumerate(alone):
        obs, info = env.reset(seed=100 + e)
        expected[e] = (obs, 0.0, False, False)
    ended = np.zeros(num_envs, dtype=bool)
    rng = np.random.default_rng(1)
    results = np.zeros(num_envs, dtype=int)
    # Until every env has RESULTS_PER_ENV results: the engine promises that each
    # sent env's result arrives, not in how many recv()s (a busy machine may leave
    # a worker unscheduled for a while), so only the wall clock bounds the loop.
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    envs.async_reset(seed=100)
    while results.min() < RESULTS_PER_ENV and time.monotonic() < deadline:
        obs, rewards, terminations, truncations, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
        ids = infos["env_id"]
        assert ids.shape == (batch_size,) and len(set(ids.tolist())) == batch_size
        for row, e in enumerate(ids.tolist()):
            want = expected[e]
            assert np.array_equal(obs[row], want[0]), f"env {e}"
            assert rewards[row] == want[1]
            assert terminations[row] == want[2] and truncations[row] == want[3]
            results[e] += 1
        actions = rng.integers(0, 2, batch_size)
        envs.send(actions, ids)
        for e, action in zip(ids.tolist(), actions.tolist()):
            *result, ended[e] = test_envs.reference_step(alone[e], mode, ended[e], action)
            expected[e] = tuple(result[:4])
    envs.close()
    assert results.min() >= RESULTS_PER_ENV, (
        f"results per env after {ARRIVAL_TIMEOUT_S} s: {results}"
    )


class GatedStep(gym.Wrapper):
    """CartPole whose steps wait until the file ``gate`` exists (at most GATE_WAIT_S)."""

    def __init__(self, env: gym.Env, gate: str | None) -> None:
        super().__init__(env)
        self.gate = gate

    def step(self, action):
        deadline = time.monotonic() + GATE_WAIT_S
        while self.gate is not None and not os.path.exists(self.gate):
            assert time.monotonic() < deadline, "the gate never opened"
            time.sleep(0.001)
        return self.env.step(action)


def test_recv_returns_the_envs_that_finished_first(tmp_path):
    """An env whose step cannot finish yet holds back no other env's results."""
    gate = str(tmp_path / "gate")
    fns = [lambda: GatedStep(gym.make("CartPole-v1"), gate)] + [
        lambda: GatedStep(gym.make("CartPole-v1"), None)
    ] * 3
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=1, env_concurrency=1)
    try:
        envs.async_reset(seed=0)
        # Every env's first result is its reset's, in whatever order the workers run;
        # each is answered with a step, so env 0 is at its gate once its reset is in.
        reset_done: set[int] = set()
        while 0 not in reset_done:
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
            reset_done.update(infos["env_id"].tolist())
            envs.send(np.zeros(1, dtype=np.int64), infos["env_id"])
        # Env 0 (worker 0) waits at the gate; env 1 shares its worker; envs 2 and 3
        # (worker 1) are the ones that can finish, again and again.
        arrivals = []
        for _ in range(20):
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
            arrivals += infos["env_id"].tolist()
            envs.send(np.zeros(1, dtype=np.int64), infos["env_id"])
        assert 0 not in arrivals and {2, 3} <= set(arrivals)
        open(gate, "w").close()
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while 0 not in arrivals and time.monotonic() < deadline:
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
            arrivals += infos["env_id"].tolist()
            envs.send(np.zeros(1, dtype=np.int64), infos["env_id"])
        assert 0 in arrivals, "env 0's result never arrived once its gate opened"
    finally:
        envs.close()


def test_infos_per_row_with_columns_and_pickles():
    fns = [lambda: InfoCartPole(gym.make("CartPole-v1"))] * 6
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=4)
    alone = [fn() for fn in fns]
    for e, env in enumerate(alone):
        env.reset(seed=e)
    envs.async_reset(seed=0)
    obs, *_, infos = envs.recv()
    last_info = {}
    rng = np.random.default_rng(0)
    for _ in range(100):
        actions = rng.integers(0, 2, 4)
        ids = infos["env_id"]
        envs.send(actions, ids)
        for e, a in zip(ids.tolist(), actions.tolist()):
            *_, info = alone[e].step(a)
            if _[1] or _[2]:
                alone[e].reset()
                info = {}  # NEXT_STEP: next result carries the reset info instead
            last_info[e] = info
        obs, rewards, terminations, truncations, infos = envs.recv()
        assert infos["env_id"].dtype.kind == "i"
        for row, e in enumerate(infos["env_id"].tolist()):
            if e not in last_info or not last_info[e]:
                continue
            assert infos["_lives"][row] and infos["lives"][row] == 3
            assert infos["lives"].dtype == np.int64 and infos["frame"].dtype == np.int32
            assert infos["lives"].shape == (4,)
            if "note" in last_info[e]:
                assert infos["note"][row] == "right" and infos["_note"][row]
            elif "note" in infos:
                assert not infos["_note"][row]
        last_info = {}
    envs.close()


class ResetInfo(gym.Wrapper):
    """CartPole whose reset info is ``{"x": 1}`` or, with ``bare``, empty."""

    def __init__(self, env: gym.Env, bare: bool) -> None:
        super().__init__(env)
        self.bare = bare

    def reset(self, **kwargs):
        obs, _ = self.env.reset(**kwargs)
        return obs, {} if self.bare else {"x": 1}


def test_a_row_carries_no_info_column_of_its_previous_writer():
    """Every ring row is rewritten by whichever worker claims it: a worker that
    has not yet seen an info key still clears the row's info columns, so that
    another worker's numeric info left there is not read as this row's."""
    fns = [lambda bare=bare: ResetInfo(gym.make("CartPole-v1"), bare)
           for bare in (False, False, True, False)]  # fmt: skip
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=2)
    try:
        # Worker 0 (envs 0, 1) writes column "x" into every row of the ring.
        envs.async_reset(seed=0, env_ids=[0, 1])
        *_, infos = envs.recv()
        for _ in range(2 * envs.ring_depth):
            envs.async_reset(env_ids=infos["env_id"])
            *_, infos = envs.recv()
            assert infos["x"].tolist() == [1, 1]
        # Worker 1 then writes env 2's row (no info, before it has seen "x") and
        # env 3's (which gives it "x") into one batch.
        envs.async_reset(seed=0, env_ids=[2, 3])
        *_, infos = envs.recv()
        rows = {e: row for row, e in enumerate(infos["env_id"].tolist())}
        assert set(rows) == {2, 3}
        assert infos["_x"][rows[3]] and infos["x"][rows[3]] == 1
        assert not infos["_x"][rows[2]], "env 2's row reports another env's info"
    finally:
        envs.close()


def test_disabled_mode_resets_single_envs():
    envs = shmvec.ShmVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 4,
        num_workers=2,
        batch_size=2,
        autoreset_mode="Disabled",
    )
    envs.async_reset(seed=0)
    resets = 0
    for _ in range(300):
        obs, rewards, terminations, truncations, infos = envs.recv()
        ids = infos["env_id"]
        done = terminations | truncations
        if done.any():
            envs.async_reset(env_ids=ids[done])
            resets += int(done.sum())
        if (~done).any():
            envs.send(np.ones(int((~done).sum()), dtype=np.int64), ids[~done])
    assert resets > 0
    envs.close()


@pytest.fixture
def async_envs():
    envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2, batch_size=2)
    yield envs
    envs.close()


def test_misuse_is_a_clear_error(async_envs):
    envs = async_envs
    with pytest.raises(RuntimeError, match="before async_reset"):
        envs.send(np.zeros(2, dtype=np.int64), [0, 1])
    with pytest.raises(RuntimeError, match="recv\\(\\) waits for batch_size=2"):
        envs.recv()
    envs.async_reset(seed=0)
    with pytest.raises(RuntimeError, match="still running"):
        envs.async_reset()
    with pytest.raises(RuntimeError, match="send\\(actions, env_ids\\)"):
        envs.step(np.zeros(4, dtype=np.int64))
    *_, infos = envs.recv()
    ids = infos["env_id"]
    with pytest.raises(ValueError, match="out of range"):
        envs.send(np.zeros(1, dtype=np.int64), [4])
    with pytest.raises(ValueError, match="more than once"):
        envs.send(np.zeros(2, dtype=np.int64), [ids[0], ids[0]])
    running = sorted(set(range(4)) - set(ids.tolist()))[0]
    with pytest.raises(ValueError, match="not awaiting an action"):
        envs.send(np.zeros(1, dtype=np.int64), [running])
    with pytest.raises(ValueError, match="shape"):
        envs.send(np.zeros(3, dtype=np.int64), ids)
    with pytest.raises(TypeError, match="cannot be cast"):
        envs.send(np.zeros(2, dtype=np.float32), ids)
    with pytest.raises(TypeError, match="1-D array of ints"):
        envs.send(np.zeros(2, dtype=np.int64), [0.5, 1.5])
    # int64 arrays, as recv() returns them, take a faster check: the same errors.
    for bad, error, match in [
        (np.array([4]), ValueError, "out of range"),
        (np.array([-1]), ValueError, "out of range"),
        (np.array([ids[1], ids[1]]), ValueError, "more than once"),
        (np.array([running]), ValueError, "not awaiting an action"),
        (np.array([ids[0], running]), ValueError, "not awaiting an action"),
        (np.array([[ids[0]]]), TypeError, "1-D array of ints"),
    ]:
        with pytest.raises(error, match=match):
            envs.send(np.zeros(len(bad), dtype=np.int64), bad)
    # Nothing above reached a worker: the envs still run.
    envs.send(np.zeros(2, dtype=np.int64), ids)
    obs, *_ = envs.recv()
    assert obs.shape == (2, 4)


def test_constructor_checks():
    fns = [lambda: gym.make("CartPole-v1")] * 4
    with pytest.raises(ValueError, match="batch_size must be between 1 and num_envs=4"):
        shmvec.ShmVectorEnv(fns, batch_size=5)
    with pytest.raises(ValueError, match="group_size must divide num_envs=4"):
        shmvec.ShmVectorEnv(fns, group_size=3)


def test_copy_false_batch_valid_until_next_recv():
    envs = shmvec.ShmVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 6, num_workers=2, batch_size=2, copy=False
    )
    envs.async_reset(seed=0)
    obs, *_, infos = envs.recv()
    kept = obs.copy()
    for _ in range(3):  # others keep running while we hold the batch
        envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
        assert np.array_equal(obs, kept)
        obs2, *_, infos = envs.recv()
        obs, kept = obs2, obs2.copy()
    envs.close()


def test_large_observations_are_lent_batch_by_batch():
    """Batches of 64 KiB of observations or more come in lease regions, one
    bound to each ring slot when main releases it: each batch stays what recv
    returned while it is held and the envs run on; once all regions are held,
    batches are copies; dropped batches free their regions."""
    fns = test_envs.class_fns(test_envs.CountingEnv, 6, obs_len=4096)  # 64 KiB a batch of 2
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=2)
    try:
        regions = len(envs._pool.layout.region_offsets)
        assert regions == envs.ring_depth + LEASE_REGIONS
        envs.async_reset(seed=0)
        held = []
        for _ in range(regions + 3):
            obs, *_, infos = envs.recv()
            held.append((obs, obs.copy(), infos["env_id"]))
            envs.send(infos["env_id"] % 4, infos["env_id"])
        lent = [type(obs.base).__name__ == "RegionLease" for obs, _, _ in held]
        assert lent == [True] * regions + [False] * 3
        for obs, kept, _ in held:
            assert_same(obs, kept)
        counts = {}
        for obs, _, ids in held:  # each env's count rises by one per batch it is in
            for row, e in enumerate(ids.tolist()):
                assert obs[row, 0] == counts.get(e, -1) + 1, e
                counts[e] = int(obs[row, 0])
        del held, obs, kept
        for _ in range(envs.ring_depth + 1):  # each slot rebinds as main releases it
            obs, *_, infos = envs.recv()
            envs.send(infos["env_id"] % 4, infos["env_id"])
        assert type(obs.base).__name__ == "RegionLease"
    finally:
        envs.close()


def test_sync_mode_send_recv_equals_step():
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVectorEnv(fns, num_workers=2)
    reference = gym.vector.SyncVectorEnv(fns)
    envs.async_reset(seed=3)
    obs, _, _, _, infos = envs.recv()
    expected, _ = reference.reset(seed=3)
    assert np.array_equal(obs, expected) and np.array_equal(infos["env_id"], np.arange(4))
    for t in range(50):
        actions = np.array([t % 2, 1, 0, (t // 3) % 2])
        order = np.array([2, 0, 3, 1])
        envs.send(actions[order], order)
        got = envs.recv()
        want = reference.step(actions)
        for a, b in zip(got[:4], want[:4]):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="must name each of the 4 envs"):
        envs.send(np.zeros(2, dtype=np.int64), [0, 1])
    envs.close()


class DictActionEnv(gym.Env):
    """Echoes its Dict action: obs = [a], reward = b[0] + b[1]."""

    observation_space = gym.spaces.Box(-10, 10, (1,), np.float32)
    action_space = gym.spaces.Dict(
        {"a": gym.spaces.Discrete(3), "b": gym.spaces.Box(-1, 1, (2,), np.float32)}
    )

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        obs = np.array([action["a"]], np.float32)
        return obs, float(action["b"][0] + action["b"][1]), False, False, {}


def test_sync_mode_send_reorders_dict_actions():
    envs = shmvec.ShmVectorEnv([DictActionEnv] * 3, num_workers=2)
    reference = gym.vector.SyncVectorEnv([DictActionEnv] * 3)
    envs.async_reset(seed=0)
    envs.recv()
    reference.reset(seed=0)
    actions = {"a": np.array([0, 1, 2]), "b": np.arange(6, dtype=np.float32).reshape(3, 2) / 10}
    order = np.array([2, 0, 1])
    envs.send({"a": actions["a"][order], "b": actions["b"][order]}, order)
    got, want = envs.recv(), reference.step(actions)
    for a, b in zip(got[:4], want[:4]):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match=r"actions\['a'\] has 2 rows, expected 3"):
        envs.send({"a": actions["a"][:2], "b": actions["b"]}, order)
    envs.close()


def test_groups_share_seed_and_options():
    fns = [lambda: gym.make("CartPole-v1")] * 6
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, group_size=3)
    obs, _ = envs.reset(seed=7)
    assert np.array_equal(obs[0], obs[1]) and np.array_equal(obs[1], obs[2])
    assert not np.array_equal(obs[0], obs[3])
    alone = gym.make("CartPole-v1")
    assert np.array_equal(obs[3], alone.reset(seed=8)[0])
    obs, _ = envs.reset(seed=[5, 6])  # one seed per group
    assert np.array_equal(obs[2], alone.reset(seed=5)[0])
    assert np.array_equal(obs[5], alone.reset(seed=6)[0])
    bounds = [{"low": -0.01, "high": 0.01}, {"low": 0.04, "high": 0.05}]
    obs, _ = envs.reset(seed=1, options=bounds)  # one options dict per group
    assert np.all(np.abs(obs[:3]) <= 0.01) and np.all((obs[3:] >= 0.04) & (obs[3:] <= 0.05))
    envs.close()


def test_per_env_options_and_reset_mask():
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVectorEnv(fns, num_workers=2)
    reference = gym.vector.SyncVectorEnv(fns)
    options = [{"low": -0.01 * (i + 1), "high": 0.01 * (i + 1)} for i in range(4)]
    obs, _ = envs.reset(seed=0, options=options)
    for i in range(4):
        assert np.all(np.abs(obs[i]) <= 0.01 * (i + 1))
        env = gym.make("CartPole-v1")
        assert np.array_equal(obs[i], env.reset(seed=i, options=options[i])[0])
    reference.reset(seed=0)
    before = obs.copy()
    mask = np.array([False, True, False, True])
    obs, infos = envs.reset(
        seed=10, options=[None, {"low": 0.3, "high": 0.4}, None, None], reset_mask=mask
    )
    assert np.array_equal(obs[~mask], before[~mask])
    assert np.all((obs[1] >= 0.3) & (obs[1] <= 0.4))
    assert np.array_equal(obs[3], gym.make("CartPole-v1").reset(seed=13)[0])
    with pytest.raises(ValueError, match="one entry per env: expected 4"):
        envs.reset(options=[{}, {}])
    with pytest.raises(TypeError, match=r"options\[1\] must be a dict or None"):
        envs.reset(options=[{}, 3, {}, {}])
    envs.close()


def test_make_mix_tags_and_space_errors():
    def short_pole():
        return gym.make("CartPole-v1", max_episode_steps=20)

    envs = shmvec.make_mix({"CartPole-v1": 2, short_pole: 2}, group_size=2, num_workers=2)
    assert envs.env_tags == ["CartPole-v1", "CartPole-v1", "short_pole", "short_pole"]
    assert [spec.max_episode_steps for spec in envs.get_attr("spec")] == [500, 500, 20, 20]
    envs.reset(seed=0)
    for _ in range(25):
        *_, truncations, _ = envs.step(np.zeros(4, dtype=np.int64) + _ % 2)
    envs.close()
    with pytest.raises(ValueError, match="'MountainCar-v0' has observation space .*'CartPole-v1'"):
        shmvec.make_mix({"CartPole-v1": 1, "MountainCar-v0": 1})
    with pytest.raises(ValueError, match="multiple of group_size=2"):
        shmvec.make_mix({"CartPole-v1": 3}, group_size=2)


def test_stats_count_steps_episodes_and_busy_time(async_envs):
    envs = async_envs
    envs.async_reset(seed=0)
    results = 0
    episodes = 0
    per_env = np.zeros(4, dtype=int)
    # Until every env (so both workers) has given results: one worker alone could fill
    # every batch, and an idle worker rightly reports no busy time.
    for _ in range(2000):
        obs, rewards, terminations, truncations, infos = envs.recv()
        results += len(rewards)
        episodes += int(np.count_nonzero(terminations | truncations))
        per_env[infos["env_id"]] += 1
        envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
        if results >= 400 and per_env.min() >= 20:
            break
    assert per_env.min() >= 20, per_env
    stats = envs.stats()
    assert stats["steps"] == results and stats["episodes"] == episodes > 0
    assert stats["steps_per_s"] > 0
    assert 0 < stats["main_wait_fraction"] < 1
    assert len(stats["worker_busy_fraction"]) == 2
    assert all(0 < f < 1 for f in stats["worker_busy_fraction"]), stats


def test_trajectories_do_not_depend_on_batch_size():
    def run(batch_size):
        envs = shmvec.ShmVectorEnv(
            [uneven(k) for k in range(6)], num_workers=2, batch_size=batch_size
        )
        per_env = {e: [] for e in range(6)}
        envs.async_reset(seed=5)
        counts = np.zeros(6, dtype=int)
        while counts.min() < 30:
            obs, rewards, *_, infos = envs.recv()
            ids = infos["env_id"]
            for row, e in enumerate(ids.tolist()):
                per_env[e].append((obs[row].copy(), rewards[row]))
            counts[ids] += 1
            envs.send((counts[ids] % 2).astype(np.int64), ids)
        envs.close()
        return {e: v[:30] for e, v in per_env.items()}

    assert data_equivalence(run(1), run(4), exact=True)


def test_call_set_attr_and_close_while_envs_run(async_envs):
    envs = async_envs
    envs.async_reset(seed=0)
    *_, infos = envs.recv()  # two envs' results are in, two may still run
    assert envs.get_attr("spec")[0].id == "CartPole-v1"
    envs.set_attr("marker", [1, 2, 3, 4])
    assert envs.get_attr("marker") == (1, 2, 3, 4)
    envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
    obs, *_ = envs.recv()
    assert obs.shape == (2, 4)


class UnpicklableInfo(gym.Wrapper):
    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {"lock": __import__("threading").Lock()}


def test_unpicklable_info_is_an_error_not_a_hang():
    envs = shmvec.ShmVectorEnv(
        [lambda: UnpicklableInfo(gym.make("CartPole-v1"))] * 4, num_workers=2, batch_size=2
    )
    envs.async_reset(seed=0)
    with pytest.raises(RuntimeError, match="cannot be sent to the main process"):
        for _ in range(3):  # two batches of reset results, then step results
            *_, infos = envs.recv(timeout=30)
            envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
    envs.close()


def _turns(envs, think, turns: int) -> bool:
    """``turns`` recv/think/send rounds; whether main then asks for its waker's core."""
    for _ in range(turns):
        *_, infos = envs.recv()
        think()
        envs.send(np.zeros(len(infos["env_id"]), dtype=np.int64), infos["env_id"])
    return envs._async.handoff


def _burn(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_main_asks_for_its_wakers_core_only_while_its_turns_wait():
    """A main that sleeps in recv (spin_ns=0) has the waking worker yield to it
    when it blocked between two recv()s and used under half the time (a policy
    on a GPU); not when it computed through its turn."""
    from shmvec.engine.async_engine import HANDOFF_SAMPLE

    envs = shmvec.ShmVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 4, batch_size=2, num_workers=2, spin_ns=0
    )
    try:
        envs.async_reset(seed=0)
        turns = 2 * HANDOFF_SAMPLE + 1
        assert _turns(envs, lambda: time.sleep(0.002), turns) is True
        assert _turns(envs, lambda: _burn(0.002), turns) is False
        assert _turns(envs, lambda: time.sleep(0.002), turns) is True
    finally:
        envs.close()
    spinning = shmvec.ShmVectorEnv(  # main spins: it is never asleep to be woken
        [lambda: gym.make("CartPole-v1")] * 4, batch_size=2, num_workers=2, spin_ns=50_000
    )
    try:
        spinning.async_reset(seed=0)
        assert _turns(spinning, lambda: time.sleep(0.002), 2 * HANDOFF_SAMPLE + 1) is False
    finally:
        spinning.close()
