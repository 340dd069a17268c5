"""recv(partial=True): the results of every running env when fewer than batch_size run."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections.abc import Callable
from typing import Any

import envs as test_envs
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector.utils import batch_space, iterate
from helpers import open_pool

import shmvec
import shmvec.layout
from shmvec.codecs import make_codec
from shmvec.engine.async_wire import AsyncWire
from shmvec.engine.decoder import ResultDecoder
from shmvec.engine.supervisor import Supervisor
from shmvec.protocol import ENV_IDLE, ENV_STEP

#: How long a result may take to arrive on a loaded machine before the test fails.
ARRIVAL_TIMEOUT_S = 120.0
#: recv() calls of the mixed full and partial cycle in an equivalence check.
TURNS = 120


class Jitter(gym.Wrapper):
    """CartPole whose steps sleep 0-2 ms (its own generator, not the env's), so
    that rows arrive in any order, and report a numeric info every step and a
    pickled one now and then."""

    def __init__(self, env: gym.Env, sleep: bool = True) -> None:
        super().__init__(env)
        self.sleeps = random.Random(os.getpid() ^ id(self)) if sleep else None

    def step(self, action):
        if self.sleeps is not None:
            time.sleep(self.sleeps.random() * 0.002)
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info, x10=int(obs[0] * 1000))
        if obs[0] > 0.05:
            info["note"] = "right"
        return obs, reward, terminated, truncated, info


def jitter_fn(sleep: bool = True):
    return lambda: Jitter(gym.make("CartPole-v1"), sleep)


class Reference:
    """Each env stepped alone with the same seed and actions (NEXT_STEP autoreset):
    what its next result must be."""

    def __init__(self, num_envs: int, seed: int) -> None:
        self.envs = [jitter_fn(sleep=False)() for _ in range(num_envs)]
        self.expected: dict[int, tuple] = {}
        self.ended = np.zeros(num_envs, dtype=bool)
        for e, env in enumerate(self.envs):
            obs, info = env.reset(seed=seed + e)
            self.expected[e] = (obs, 0.0, False, False, info)

    def step(self, e: int, action: int) -> None:
        env = self.envs[e]
        if self.ended[e]:
            obs, info = env.reset()
            self.expected[e], self.ended[e] = (obs, 0.0, False, False, info), False
            return
        obs, reward, terminated, truncated, info = env.step(action)
        self.expected[e] = (obs, reward, terminated, truncated, info)
        self.ended[e] = terminated or truncated

    def check(self, result: tuple) -> None:
        """Every row of ``result`` is its env's expected result; every array has
        one row per env."""
        obs, rewards, terminations, truncations, infos = result
        ids = infos["env_id"].tolist()
        rows = len(ids)
        assert len(set(ids)) == rows
        for name, value in (("obs", obs), ("rewards", rewards), ("terminations", terminations)):
            assert len(value) == rows, name
        assert len(truncations) == rows
        assert_rows(infos, rows)
        for row, e in enumerate(ids):
            want_obs, want_reward, want_terminated, want_truncated, want_info = self.expected[e]
            assert np.array_equal(obs[row], want_obs), f"env {e}"
            assert rewards[row] == want_reward, f"env {e}"
            assert terminations[row] == want_terminated and truncations[row] == want_truncated
            if "x10" in want_info:
                assert infos["_x10"][row] and infos["x10"][row] == want_info["x10"], f"env {e}"
            else:
                assert "_x10" not in infos or not infos["_x10"][row], f"env {e}"
            if "note" in want_info:
                assert infos["note"][row] == "right" and infos["_note"][row], f"env {e}"
            else:
                assert "_note" not in infos or not infos["_note"][row], f"env {e}"


def assert_rows(infos: dict, rows: int, path: str = "infos") -> None:
    """Every array of ``infos``, nested dicts included, has ``rows`` rows."""
    for key, value in infos.items():
        if isinstance(value, dict):
            assert_rows(value, rows, f"{path}[{key!r}]")
        else:
            assert len(value) == rows, f"{path}[{key!r}]"


def run_mixed_cycle(envs: shmvec.ShmVectorEnv, seed: int, take_ready: bool = False) -> int:
    """Resets every env, receives them, sends 3 envs and receives exactly them
    with ``recv(partial=True)``, then runs a cycle where each turn sends a random
    subset of what came back, so that sometimes fewer than ``batch_size`` run:
    every row equals its env alone. With ``take_ready``, every other turn's
    ``recv`` takes the rows in after a random 0-3 ms. Returns the partial recvs
    made (with ``take_ready``: the batches cut short by it)."""
    n, batch = envs.num_envs, envs.batch_size
    reference = Reference(n, seed)
    rng = np.random.default_rng(seed)
    envs.async_reset(seed=seed)
    idle: list[int] = []
    for _ in range(n // batch):
        result = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
        reference.check(result)
        idle += result[4]["env_id"].tolist()
    assert sorted(idle) == list(range(n))

    def send(ids: list[int]) -> None:
        actions = rng.integers(0, 2, len(ids))
        envs.send(actions, np.array(ids, dtype=np.int64))
        for e, a in zip(ids, actions.tolist()):
            reference.step(e, a)
            idle.remove(e)

    first = [idle[0], idle[n - 1], idle[n // 2]]
    send(first)
    result = envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True)
    reference.check(result)
    assert sorted(result[4]["env_id"].tolist()) == sorted(first)
    idle += result[4]["env_id"].tolist()
    partials, running = 1, 0
    for _ in range(TURNS):
        # Keep between 1 and num_envs running: a random number of the idle envs go.
        go = int(rng.integers(1 if running == 0 else 0, len(idle) + 1))
        send([idle[i] for i in rng.permutation(len(idle))[:go].tolist()])
        running = n - len(idle)
        partial = running < batch
        due = min(running, batch)
        if take_ready and rng.random() < 0.5:
            timeout = float(rng.random()) * 0.003
            while True:
                try:
                    result = envs.recv(timeout=timeout, partial=partial, take_ready=True)
                    break
                except multiprocessing.TimeoutError:
                    continue  # no row came: nothing changed
            ids = result[4]["env_id"].tolist()
            assert 1 <= len(ids) <= due
            partials += len(ids) < due
        else:
            result = envs.recv(
                timeout=ARRIVAL_TIMEOUT_S, partial=bool(partial or rng.random() < 0.5)
            )
            ids = result[4]["env_id"].tolist()
            assert len(ids) == due
            partials += partial and not take_ready
        reference.check(result)
        idle += ids
        running -= len(ids)
    return partials


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 2},
        {"num_workers": 2, "step_in_main": True},
        {"num_workers": 0},
        {"num_workers": 2, "env_concurrency": 3},
        {"num_workers": 2, "copy": False},
        {"num_workers": 3, "ring_depth": 3},
        {"num_workers": 2, "lent": True},
    ],
    ids=["workers", "main-too", "in-process", "threads", "views", "depth3", "lent"],
)
def test_partial_rows_equal_each_env_alone(kwargs, monkeypatch):
    kwargs = dict(kwargs)
    if kwargs.pop("lent", False):  # observations in lease regions, small as they are
        monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)
    envs = shmvec.ShmVectorEnv([jitter_fn()] * 8, batch_size=4, **kwargs)
    try:
        assert run_mixed_cycle(envs, seed=10) >= 10
        assert envs.stats()["steps"] > 8
    finally:
        envs.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 2},
        {"num_workers": 0},
        {"num_workers": 2, "env_concurrency": 3},
        {"num_workers": 2, "copy": False},
        {"num_workers": 3, "ring_depth": 3},
    ],
    ids=["workers", "in-process", "threads", "views", "depth3"],
)
def test_rows_taken_ready_equal_each_env_alone(kwargs):
    """recv(take_ready=True) with timeouts too short for a full batch, among full
    and partial recvs: each row is its env's alone, each result comes once. The
    count of batches cut short is printed (it depends on the machine's pace)."""
    envs = shmvec.ShmVectorEnv([jitter_fn()] * 8, batch_size=4, **kwargs)
    try:
        print("batches cut short:", run_mixed_cycle(envs, seed=11, take_ready=True))
    finally:
        envs.close()


def test_take_ready_returns_the_rows_in_and_the_rest_come_next(tmp_path):
    """Env 0 waits at its gate: recv(take_ready=True) returns the three envs of the
    other worker (they come within the timeout; never env 0 before its gate opens),
    and once the gate opens a later recv returns env 0's, with envs sent meanwhile."""
    gate = str(tmp_path / "gate")
    envs = shmvec.ShmVectorEnv(
        [lambda: GatedStep(gym.make("CartPole-v1"), None)] * 6, num_workers=2, batch_size=4
    )
    try:
        envs.async_reset(seed=0)
        received = []
        while len(received) < 6:
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True)
            received += infos["env_id"].tolist()
        envs.set_attr("gate", [gate] + [None] * 5)
        envs.send(np.zeros(4, dtype=np.int64), [0, 3, 4, 5])  # 0-2 on worker 0, 3-5 on 1
        got: list[int] = []
        while len(got) < 3:  # each take waits 0.5 s: the slot never fills
            *_, infos = envs.recv(timeout=0.5, partial=True, take_ready=True)
            assert 1 <= len(infos["env_id"]) <= 3
            got += infos["env_id"].tolist()
        assert sorted(got) == [3, 4, 5]
        with pytest.raises(multiprocessing.TimeoutError, match=r"0 of 1 results arrived"):
            envs.recv(timeout=0.3, partial=True, take_ready=True)
        envs.send(np.zeros(3, dtype=np.int64), [1, 3, 5])
        open(gate, "w").close()
        got = []
        while len(got) < 4:
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True, take_ready=True)
            got += infos["env_id"].tolist()
        assert sorted(got) == [0, 1, 3, 5]
    finally:
        envs.close()


def test_take_ready_needs_async_mode_and_a_timeout():
    envs = shmvec.ShmVectorEnv([jitter_fn()] * 4, batch_size=2, num_workers=0)
    sync = shmvec.ShmVectorEnv([jitter_fn()] * 2, num_workers=0)
    try:
        with pytest.raises(ValueError, match=r"take_ready=True\) needs .* a timeout"):
            envs.recv(take_ready=True)
        with pytest.raises(ValueError, match=r"needs async mode"):
            sync.recv(timeout=1.0, take_ready=True)
    finally:
        envs.close()
        sync.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["columns", "pickled"])
def test_partial_rows_of_nested_spaces(shared_memory):
    """Dict/Tuple/Text observations, in columns or pickled, and infos that change
    from step to step: each row of a partial batch is its env's, alone."""
    n, batch = 6, 4
    envs = shmvec.ShmVectorEnv(
        [test_envs.CustomSpaceEnv] * n, shared_memory=shared_memory, num_workers=2,
        batch_size=batch,
    )  # fmt: skip
    space = envs.single_observation_space
    alone = [test_envs.CustomSpaceEnv() for _ in range(n)]
    expected = {e: env.reset(seed=7 + e)[0] for e, env in enumerate(alone)}
    ended = np.zeros(n, dtype=bool)
    rng = np.random.default_rng(7)

    def check(obs, infos) -> list[int]:
        ids = infos["env_id"].tolist()
        assert_rows(infos, len(ids))
        for row, (e, got) in enumerate(zip(ids, iterate(batch_space(space, len(ids)), obs))):
            want = gym.spaces.flatten(space, expected[e])
            assert np.array_equal(gym.spaces.flatten(space, got), want), f"env {e}, row {row}"
        return ids

    try:
        envs.async_reset(seed=7)
        idle = check(*envs.recv()[::4]) + check(*envs.recv(partial=True)[::4])
        assert sorted(idle) == list(range(n))
        for _ in range(40):
            go = [idle.pop(int(rng.integers(len(idle)))) for _ in range(int(rng.integers(1, 4)))]
            actions_space = batch_space(envs.single_action_space, len(go))
            actions_space.seed(int(rng.integers(1 << 30)))
            actions = actions_space.sample()
            envs.send(actions, go)
            for e, action in zip(go, iterate(actions_space, actions)):
                if ended[e]:
                    expected[e], ended[e] = alone[e].reset()[0], False
                else:
                    expected[e], _, terminated, truncated, _ = alone[e].step(action)
                    ended[e] = terminated or truncated
            obs, *_, infos = envs.recv(partial=True)
            ids = check(obs, infos)
            assert sorted(ids) == sorted(go)
            idle += ids
    finally:
        envs.close()


def test_partial_batch_of_views_is_the_slots_first_rows():
    """With copy=False a partial batch is views of the ring slot's first rows,
    valid until the next recv while the other envs run on."""
    envs = shmvec.ShmVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 6, num_workers=2, batch_size=4, copy=False
    )
    try:
        envs.async_reset(seed=0)
        idle = envs.recv()[4]["env_id"].tolist() + envs.recv(partial=True)[4]["env_id"].tolist()
        assert sorted(idle) == list(range(6))
        envs.send(np.zeros(2, dtype=np.int64), idle[:2])
        obs, rewards, _, _, infos = envs.recv(partial=True)
        slot = envs._async.held_slot
        views = envs._slots[slot]
        assert obs.shape == (2, 4) and np.shares_memory(obs, views.obs[0])
        assert np.shares_memory(rewards, views.rewards)
        assert obs.__array_interface__["data"][0] == views.obs[0].__array_interface__["data"][0]
        kept = obs.copy()
        envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
        envs.send(np.ones(2, dtype=np.int64), idle[2:4])
        assert np.array_equal(obs, kept)
        obs2, *_ = envs.recv()
        assert obs2.shape == (4, 4)
    finally:
        envs.close()


def test_large_partial_batches_are_lent():
    fns = test_envs.class_fns(test_envs.CountingEnv, 6, obs_len=8192)
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=2)
    try:
        envs.async_reset(seed=0)
        for _ in range(3):
            envs.recv()
        envs.send(np.array([3]), [4])
        obs, *_, infos = envs.recv(partial=True)
        assert infos["env_id"].tolist() == [4]
        assert obs.shape == (1, 8192) and obs[0, :2].tolist() == [1, 3]
        assert type(obs.base).__name__ == "RegionLease"
    finally:
        envs.close()


def test_misuse_keeps_its_clear_errors():
    envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 6, num_workers=2, batch_size=4)
    try:
        with pytest.raises(RuntimeError, match=r"recv\(\) waits for batch_size=4 .* only 0 envs"):
            envs.recv(partial=True)
        envs.async_reset(seed=0)
        envs.recv()
        with pytest.raises(RuntimeError, match=r"recv\(\) waits for batch_size=4 .* only 2 envs"):
            envs.recv()  # the plain recv with fewer running: as ever
        obs, *_, infos = envs.recv(partial=True)
        assert obs.shape == (2, 4) and len(infos["env_id"]) == 2
        with pytest.raises(RuntimeError, match=r"recv\(\) waits for batch_size=4 .* only 0 envs"):
            envs.recv(partial=True)
    finally:
        envs.close()


def test_sync_mode_takes_partial_and_changes_nothing():
    envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 3, num_workers=1)
    try:
        envs.async_reset(seed=0)
        obs, *_, infos = envs.recv(partial=True)
        assert obs.shape == (3, 4) and infos["env_id"].tolist() == [0, 1, 2]
    finally:
        envs.close()


class GatedStep(gym.Wrapper):
    """CartPole whose steps wait until the file ``gate`` exists."""

    def __init__(self, env: gym.Env, gate: str | None) -> None:
        super().__init__(env)
        self.gate = gate

    def step(self, action):
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while self.gate is not None and not os.path.exists(self.gate):
            assert time.monotonic() < deadline, "the gate never opened"
            time.sleep(0.001)
        return self.env.step(action)


def test_a_partial_recv_that_times_out_leaves_the_ring_as_it_was(tmp_path):
    """A timed-out partial recv takes its padding back: envs sent afterwards
    fill the slot, and a plain recv returns exactly batch_size of them."""
    gate = str(tmp_path / "gate")
    fns = [lambda: GatedStep(gym.make("CartPole-v1"), gate)] + [
        lambda: GatedStep(gym.make("CartPole-v1"), None)
    ] * 5
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, batch_size=4)
    try:
        envs.async_reset(seed=0)
        received = []
        while len(received) < 6:
            *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True)
            received += infos["env_id"].tolist()
        envs.send(np.zeros(2, dtype=np.int64), [0, 3])  # env 0 waits at its gate
        with pytest.raises(multiprocessing.TimeoutError, match=r"of 2 results arrived"):
            envs.recv(timeout=0.3, partial=True)
        envs.send(np.zeros(3, dtype=np.int64), [1, 4, 5])
        open(gate, "w").close()
        *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S)
        first = infos["env_id"].tolist()
        assert len(first) == 4
        *_, infos = envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True)
        assert sorted(first + infos["env_id"].tolist()) == [0, 1, 3, 4, 5]
    finally:
        envs.close()


# ---------------------------------------------------------------- dead workers


class Counts:
    """Checks CountingEnv results one by one: +1 a step, 0 after a reset or a
    restart (a truncation with ``worker_restarted``); counts each env's results."""

    def __init__(self, n: int) -> None:
        self.last: dict[int, tuple] = {}
        self.sent = np.zeros(n, dtype=np.int64)
        self.received = np.zeros(n, dtype=np.int64)
        self.restarted: set[int] = set()

    def check(self, result: tuple) -> list[int]:
        obs, rewards, terminations, truncations, infos = result
        ids = infos["env_id"].tolist()
        restarted = infos.get("_worker_restarted", np.zeros(len(ids), dtype=bool))
        for row, e in enumerate(ids):
            self.received[e] += 1
            if e not in self.last:
                assert obs[row, 0] == 0 and not truncations[row], (e, obs[row])
            elif restarted[row]:
                assert obs[row, 0] == 0 and truncations[row] and rewards[row] == 0, e
                self.restarted.add(e)
            elif self.last[e]:
                assert obs[row, 0] == 0 and rewards[row] == 0, (e, obs[row])
            else:
                assert obs[row, 1] == 1, e  # the action it was sent
            self.last[e] = bool(terminations[row] or truncations[row])
        return ids


def dying_envs(
    n: int, batch: int, monkeypatch, noting: Callable[[AsyncWire], Any]
) -> tuple[shmvec.ShmVectorEnv, Counts, list]:
    """``n`` DiesWhenTold envs on 4 workers, restarted when they die; their
    Counts; and a list that gets ``noting(wire)`` at each restart."""
    envs = shmvec.ShmVectorEnv(
        [test_envs.DiesWhenTold] * n, num_workers=4, batch_size=batch, on_worker_death="restart"
    )
    at_restart: list = []
    replace_dead = Supervisor.replace_dead

    def noting_restart(self, dead, read=frozenset()):
        at_restart.append(noting(envs._async.wire))
        return replace_dead(self, dead, read)

    monkeypatch.setattr(Supervisor, "replace_dead", noting_restart)
    return envs, Counts(n), at_restart


@pytest.mark.parametrize("where", ["step", "obs", "info"])
def test_a_worker_killed_while_a_padded_slot_is_pending(where, monkeypatch):
    """Three envs run, so recv(partial=True) pads the slot; the worker of one of
    them dies in its step (after a delay: main is waiting by then). Nothing
    hangs; every env's result comes back exactly once, the restarted env's as a
    truncation with ``worker_restarted``; the ordinary cycle then goes on."""
    n, batch = 8, 4
    envs, counts, padding_at_restart = dying_envs(n, batch, monkeypatch, lambda w: w.padding)
    one = np.ones(1, dtype=np.int64)
    try:
        envs.async_reset(seed=0)
        for _ in range(n // batch):
            counts.check(envs.recv(timeout=ARRIVAL_TIMEOUT_S))
        envs.set_attr("delay", [0.0] * 5 + [0.3] + [0.0] * 2)
        envs.set_attr("die", [""] * 5 + [where] + [""] * 2)
        running = [0, 5, 6]
        envs.send(np.repeat(one, 3), running)
        counts.sent[running] += 1
        ids = counts.check(envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True))
        assert sorted(ids) == running
        assert 5 in counts.restarted
        assert padding_at_restart == [(envs._async.held_slot, 1)]
        for _ in range(30):  # the ordinary cycle, partial batches among full ones
            idle = [e for e in range(n) if counts.received[e] == counts.sent[e] + 1]
            envs.send(np.repeat(one, len(idle)), idle)
            counts.sent[idle] += 1
            counts.check(envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True))
        while (counts.received < counts.sent + 1).any():
            counts.check(envs.recv(timeout=ARRIVAL_TIMEOUT_S, partial=True))
        assert np.array_equal(counts.received, counts.sent + 1)
        assert envs.stats()["worker_restarts"] == 1
    finally:
        envs.close()


def test_a_worker_killed_while_rows_are_taken_ready(monkeypatch):
    """Env 0's worker dies 1 s after claiming its row; env 2 comes at once, envs 4
    and 6 after 3 s, so recv(take_ready=True) closes a slot that holds env 0's
    claim, and the death comes while main waits for that row. Nothing hangs;
    every env's result comes back exactly once, env 0's as a truncation with
    ``worker_restarted``; the cycle then goes on with short takes."""
    n, batch = 8, 4
    envs, counts, closed_at_restart = dying_envs(n, batch, monkeypatch, lambda w: w.closed)
    one = np.ones(1, dtype=np.int64)

    def take(timeout: float) -> list[int]:
        try:
            return counts.check(envs.recv(timeout=timeout, partial=True, take_ready=True))
        except multiprocessing.TimeoutError:
            return []

    try:
        envs.async_reset(seed=0)
        for _ in range(n // batch):
            counts.check(envs.recv(timeout=ARRIVAL_TIMEOUT_S))
        envs.set_attr("delay", [0.0] * 4 + [3.0, 0.0, 3.0, 0.0])
        envs.set_attr("die", ["obs-late"] + [""] * 7)
        running = [0, 2, 4, 6]
        envs.send(np.repeat(one, 4), running)
        counts.sent[running] += 1
        got: list[int] = []
        while not {0, 2} <= set(got):
            got += take(0.2)
        assert 0 in counts.restarted
        # A take (every 0.2 s) closed the slot after env 0's claim, before its death:
        # its rows are env 0's and env 2's, or env 0's alone if env 2 came first.
        assert closed_at_restart in ([1], [2])
        envs.set_attr("delay", [0.0] * n)
        for _ in range(30):
            idle = [e for e in range(n) if counts.received[e] == counts.sent[e] + 1]
            envs.send(np.repeat(one, len(idle)), idle)
            counts.sent[idle] += 1
            take(0.002)
        while (counts.received < counts.sent + 1).any():
            take(1.0)
        assert np.array_equal(counts.received, counts.sent + 1)
        assert envs.stats()["worker_restarts"] == 1
    finally:
        envs.close()


# -------------------------------------------------------------- the wire alone


def _async_wire(num_envs: int, num_workers: int, batch_size: int) -> AsyncWire:
    space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    pool = open_pool(num_envs, num_workers, batch_size, space, 2)
    decoder = ResultDecoder(make_codec(space), pool.slots, pool.blocks, True, None)
    return AsyncWire(batch_size, pool, decoder)


def _deliver(wire: AsyncWire, env: int, publish: bool = True) -> tuple[int, int]:
    """A worker's part for ``env``: take its command, claim a row, write the
    env id, publish (or not)."""
    wire.env_commands[env] = ENV_IDLE
    slot, row = wire.ring.claim()
    wire.pool.slots[slot].env_ids[row] = env
    wire.pool.slots[slot].messages[row] = 0
    if publish:
        wire.ring.publish(slot)
    return slot, row


def test_padding_fills_the_slot_and_the_next_claim_is_the_next_slots():
    wire = _async_wire(6, 3, 4)
    wire.pool.slots[0].messages[:] = 1  # flags of an earlier lap
    wire.start(np.array([1, 4], dtype=np.int64), ENV_STEP)
    _deliver(wire, 4)
    wire.pad(0, 2)
    assert wire.published(0) == 1 and not wire.ring.wait_full(0, 0)
    _deliver(wire, 1)
    assert wire.ring.wait_full(0, 0) and wire.published(0) == 2
    assert wire.pool.slots[0].messages[2:].tolist() == [0, 0]
    assert wire.received(0, 2).tolist() == [4, 1]
    assert wire.ring.claimed() == 4 and wire.consumed_rows == 4
    wire.start(np.array([1], dtype=np.int64), ENV_STEP)
    assert _deliver(wire, 1) == (1, 0)


def test_unpad_gives_the_rows_back_to_later_envs():
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 2], dtype=np.int64), ENV_STEP)
    _deliver(wire, 2)
    wire.pad(0, 2)
    wire.unpad()
    assert wire.ring.filled(0) == 1 and wire.padding is None
    wire.start(np.array([3, 5], dtype=np.int64), ENV_STEP)
    for env in (0, 3):
        _deliver(wire, env)
    assert not wire.ring.wait_full(0, 0)
    _deliver(wire, 5)
    assert wire.ring.wait_full(0, 0)
    assert wire.received(0).tolist() == [2, 0, 3, 5]


def test_recovery_counts_no_padding_as_a_published_row():
    # Envs 0 (worker 0) and 2 (worker 1) run; main padded the slot's last two
    # rows. Worker 0 claimed env 0's row and died before publishing it: the
    # hole is env 0's, though filled counts the padding too.
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 2], dtype=np.int64), ENV_STEP)
    wire.pad(0, 2)
    _deliver(wire, 2)
    hole = _deliver(wire, 0, publish=False)
    assert wire.recovery_plans({0}, frozenset()) == {0: {0: ("hole", *hole, ENV_STEP)}}
    # With the hole filled, the slot is full with the two real rows.
    wire.ring.publish(hole[0])
    assert wire.ring.wait_full(0, 0)
    assert sorted(wire.received(0, 2).tolist()) == [0, 2]


# ------------------------------------------------------- take_ready: the wire


def test_close_makes_the_claimed_rows_the_batch_and_later_claims_the_next_slots():
    wire = _async_wire(6, 3, 4)
    wire.pool.slots[0].messages[:] = 1  # flags of an earlier lap
    wire.start(np.array([0, 2, 4, 5], dtype=np.int64), ENV_STEP)
    assert wire.close(0, 4) == 0 and wire.closed is None  # nothing claimed: nothing changed
    _deliver(wire, 4)
    hole = _deliver(wire, 2, publish=False)  # claimed, published after the close
    assert wire.close(0, 4) == 2 and wire.closed == 2
    assert wire.ring.claimed() == 4 and wire.padding == (0, 2)
    assert _deliver(wire, 0) == (1, 0)  # the next slot's first row
    assert not wire.ring.wait_full(0, 0)
    wire.ring.publish(hole[0])
    assert wire.ring.wait_full(0, 0) and wire.published(0) == 2
    assert wire.pool.slots[0].messages[2:].tolist() == [0, 0]
    assert wire.received(0, 2).tolist() == [4, 2]
    assert wire.ring.claimed() == 5 and wire.consumed_rows == 4  # no skip: the close moved it
    assert wire.padding is None and wire.closed is None
    _deliver(wire, 5)
    assert wire.close(1, 4) == 2 and wire.ring.wait_full(1, 0)
    assert wire.received(1, 2).tolist() == [0, 5]


def test_close_of_a_padded_slot():
    # Three envs run (a partial batch, one row padded); one is in: the close pads
    # two more rows. Then a padded slot whose due rows are all claimed: the close
    # moves the claim counter past the padding, and receiving does not move it again.
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 2, 4], dtype=np.int64), ENV_STEP)
    wire.pad(0, 3)
    _deliver(wire, 2)
    assert wire.close(0, 3) == 1 and wire.padding == (0, 3) and wire.ring.wait_full(0, 0)
    assert wire.received(0, 1).tolist() == [2] and wire.ring.claimed() == 4
    wire.pad(1, 2)  # envs 0 and 4 still run
    _deliver(wire, 0)
    _deliver(wire, 4)
    assert wire.close(1, 2) == 2 and wire.closed == 2 and wire.ring.claimed() == 8
    assert wire.ring.wait_full(1, 0)
    assert wire.received(1, 2).tolist() == [0, 4] and wire.ring.claimed() == 8


def test_a_full_slot_of_claims_is_not_closed():
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 1, 2, 3], dtype=np.int64), ENV_STEP)
    for env in (0, 1, 2):
        _deliver(wire, env)
    _deliver(wire, 3, publish=False)
    assert wire.close(0, 4) == 4 and wire.closed is None and wire.padding is None


def test_unpad_keeps_a_closed_slot_closed():
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 2, 4], dtype=np.int64), ENV_STEP)
    _deliver(wire, 0)
    assert wire.close(0, 4) == 1
    wire.unpad()  # its wait failed: no env may claim the padding now, it stays
    assert wire.padding == (0, 3) and wire.closed == 1 and wire.ring.wait_full(0, 0)
    assert wire.received(0, 1).tolist() == [0]


def test_recovery_reads_no_closed_padding_as_a_hole():
    # Worker 0 claimed env 0's row, then main closed the slot and worker 0 died
    # before publishing: the hole is env 0's, the padding no one's. Env 2 of
    # dead worker 1 had taken its command with no row: it claims one (the next slot).
    wire = _async_wire(6, 3, 4)
    wire.start(np.array([0, 2, 4], dtype=np.int64), ENV_STEP)
    hole = _deliver(wire, 0, publish=False)
    _deliver(wire, 4)
    assert wire.close(0, 4) == 2
    wire.env_commands[2] = ENV_IDLE  # taken
    plans = wire.recovery_plans({0, 1}, frozenset())
    assert plans == {0: {0: ("hole", *hole, ENV_STEP)}, 1: {2: ("claim", 0, 0, ENV_STEP)}}
