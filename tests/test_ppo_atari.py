"""Tests of examples/ppo_atari.py: its per-env rollout storage against per-env GAE,
its episode statistics against gymnasium's, and short runs of the script."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from helpers import example_module, example_path

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = example_path("ppo_atari")
HAS_ALE = importlib.util.find_spec("ale_py") is not None and importlib.util.find_spec("cv2")
needs_ale = pytest.mark.skipif(not HAS_ALE, reason="needs ale-py and opencv (shmvec[atari])")
FINAL = re.compile(
    r"^final: mean_return_last20=(?P<ret>\S+) steps_per_s=(?P<sps>\d+) "
    r"steady_steps_per_s=(?P<steady>\d+|nan) total_steps=(?P<steps>\d+) "
    r"rollout_steps_per_s=(?P<rollout_sps>\d+) "
    r"vector=(?P<vector>\S+) async_envs=(?P<async>True|False)$"
)


@pytest.fixture(scope="module")
def ppo():
    with example_module("ppo_atari") as module:
        yield module


# ------------------------------------------------------------ rollout storage


def _reference_advantages(rewards, values, dones, gamma, lam):
    """CleanRL's GAE over one env's entries: ``values``/``dones`` have one more
    entry (the open one) than ``rewards``."""
    advantages = np.zeros(len(rewards))
    last = 0.0
    for t in reversed(range(len(rewards))):
        nonterminal = 1.0 - dones[t + 1]
        delta = rewards[t] + gamma * values[t + 1] * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        advantages[t] = last
    return advantages


@pytest.mark.parametrize(
    "num_envs,batch,num_steps,seed",
    [(4, 4, 5, 0), (4, 2, 5, 1), (8, 4, 3, 2), (6, 3, 4, 3)],
)
def test_rollout_keeps_each_env_in_order(ppo, num_envs, batch, num_steps, seed):
    """Envs come back in random batches (as with --async-envs); each env's entries
    must be its own trajectory in order, and the advantages those of GAE run on
    that trajectory alone, across rollouts (the open entry carried over)."""
    rng = np.random.default_rng(seed)
    horizon = 200  # results per env the simulation can hand out
    result_rewards = rng.integers(-1, 2, size=(num_envs, horizon)).astype(np.float32)
    result_dones = rng.random((num_envs, horizon)) < 0.15
    result_dones[:, 0] = False  # result 0 is the reset
    result_rewards[:, 0] = 0.0
    result_values = rng.normal(size=(num_envs, horizon)).astype(np.float32)
    gamma, lam = 0.9, 0.8

    batch_size = num_envs * num_steps
    rows = (batch_size + num_envs) // batch + 3
    rollout = ppo.Rollout(rows, num_envs, (2,), torch.device("cpu"))
    returned = np.zeros(num_envs, dtype=np.int64)  # results each env has handed out
    first_entry = np.zeros(num_envs, dtype=np.int64)  # result index of entry 0
    total_completed = 0
    for _iteration in range(4):
        while rollout.completed < batch_size:
            ids = np.sort(rng.choice(num_envs, size=batch, replace=False))
            rng.shuffle(ids)
            k = returned[ids]
            assert k.max() < horizon
            rollout.close_entries(ids, torch.as_tensor(result_rewards[ids, k]))
            obs = torch.as_tensor(np.stack([ids, k], axis=1), dtype=torch.uint8)
            rollout.open_entries(
                ids,
                obs,
                torch.as_tensor(result_dones[ids, k]),
                torch.as_tensor(k),
                torch.zeros(batch),
                torch.as_tensor(result_values[ids, k]),
            )
            returned[ids] += 1
        completed = rollout.completed
        total_completed += completed
        assert completed >= batch_size
        advantages, returns = rollout.advantages(gamma, lam)
        indices = rollout.complete_indices()
        assert len(indices) == completed

        complete_per_env = 0
        for env in range(num_envs):
            count = int(rollout.count[env])
            flat = np.arange(count) * num_envs + env
            entries = rollout.obs[flat].numpy()
            assert (entries[:, 0] == env).all()
            steps = entries[:, 1].astype(np.int64)
            # Consecutive results of this env, from the carried one to its latest.
            np.testing.assert_array_equal(steps, np.arange(first_entry[env], returned[env]))
            np.testing.assert_array_equal(rollout.actions[flat].numpy(), steps)
            # Entry j's reward is the one that came with result j + 1.
            np.testing.assert_array_equal(
                rollout.rewards[flat[:-1]].numpy(), result_rewards[env, steps[1:]]
            )
            expected = _reference_advantages(
                result_rewards[env, steps[1:]],
                result_values[env, steps],
                result_dones[env, steps].astype(np.float64),
                gamma,
                lam,
            )
            np.testing.assert_allclose(
                advantages[flat[:-1]].numpy(), expected, rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(
                returns[flat[:-1]].numpy(), expected + result_values[env, steps[:-1]], rtol=1e-5
            )
            assert set(flat[:-1].tolist()) <= set(indices.tolist())
            complete_per_env += count - 1
        assert complete_per_env == completed

        rollout.carry_open_entries()
        first_entry = returned - 1
        assert (rollout.count == 1).all() and rollout.completed == 0
        np.testing.assert_array_equal(rollout.obs[:num_envs, 1].numpy(), first_entry)
    assert total_completed == (returned - 1).sum()  # every result but the resets


# -------------------------------------------------------- episode statistics


def _cartpole(max_episode_steps: int) -> gym.Env:
    return gym.wrappers.RecordEpisodeStatistics(
        gym.make("CartPole-v1", max_episode_steps=max_episode_steps)
    )


def test_episode_returns_and_truncations_match_gymnasium(ppo):
    """The returns and truncated final observations the loop reads from a
    SAME_STEP ShmVectorEnv are those of gymnasium's SyncVectorEnv."""
    import shmvec

    fns = [functools.partial(_cartpole, 12)] * 4
    mode = gym.vector.AutoresetMode.SAME_STEP
    reference = gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)
    envs = shmvec.ShmVectorEnv(fns, autoreset_mode=mode, num_workers=2)
    try:
        reference.reset(seed=5)
        envs.reset(seed=5)
        rng = np.random.default_rng(0)
        seen_returns, seen_truncated = 0, 0
        for _ in range(60):
            actions = rng.integers(0, 2, size=4)
            expected = reference.step(actions)
            got = envs.step(actions)
            assert ppo._episode_returns(got[4]) == ppo._episode_returns(expected[4])
            seen_returns += len(ppo._episode_returns(got[4]))
            truncated = ppo._truncated_rows(got[4], got[2], got[3])
            truncated_ref = ppo._truncated_rows(expected[4], expected[2], expected[3])
            assert (truncated is None) == (truncated_ref is None)
            if truncated is not None:
                np.testing.assert_array_equal(truncated[0], truncated_ref[0])
                np.testing.assert_array_equal(truncated[1], truncated_ref[1])
                assert not got[2][truncated[0]].any() and got[3][truncated[0]].all()
                seen_truncated += len(truncated[0])
        assert seen_returns > 4 and seen_truncated > 0
    finally:
        envs.close()
        reference.close()


# ------------------------------------------------------------------ arguments


def test_parse_and_check_args(ppo):
    args = ppo.parse_args(
        ["--num-envs", "6", "--async-envs", "--vector", "shmvec,envpool", "--target-kl", "None"]
    )
    assert args.num_envs == 6 and args.async_envs and args.env_batch_size == 3
    assert args.target_kl is None and args.env_id == "ALE/Pong-v5"
    assert ppo.check_args(args) == ["shmvec", "envpool"]
    assert ppo.parse_args([]) == ppo.Args()
    from dataclass_args import field_docs  # examples/ is on sys.path while ppo is loaded

    docs = field_docs(ppo.Args)
    assert set(docs) == {f.name for f in dataclasses.fields(ppo.Args)}  # a docstring per field
    with pytest.raises(ValueError, match="gymnasium's AsyncVectorEnv"):
        ppo.check_args(ppo.Args(vector="gymnasium-async", async_envs=True))
    with pytest.raises(ValueError, match="each must be one of"):
        ppo.check_args(ppo.Args(vector="shmvec,subproc"))
    with pytest.raises(ValueError, match="drop --no-torch-env"):
        ppo.check_args(ppo.Args(async_envs=True, torch_env=False))
    with pytest.raises(ValueError, match="even num_envs"):
        ppo.check_args(ppo.Args(num_envs=5, async_envs=True))
    with pytest.raises(ValueError, match="less than one rollout"):
        ppo.check_args(ppo.Args(num_envs=4, num_steps=16, total_timesteps=32))


@needs_ale
def test_env_matches_the_bench_pong(ppo):
    """The example's env steps as the benchmark's Pong (same seed and actions)."""
    from shmvec_bench.workloads import make_pong

    ours, theirs = ppo.make_atari_env("ALE/Pong-v5"), make_pong()
    try:
        obs, _ = ours.reset(seed=3)
        expected, _ = theirs.reset(seed=3)
        np.testing.assert_array_equal(obs, expected)
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        rng = np.random.default_rng(3)
        for _ in range(50):
            action = int(rng.integers(0, 6))
            step, expected_step = ours.step(action), theirs.step(action)
            np.testing.assert_array_equal(step[0], expected_step[0])
            assert step[1:4] == expected_step[1:4]
    finally:
        ours.close()
        theirs.close()


# ---------------------------------------------------------------- short runs


def _run(*argv: str) -> list[str]:
    command = [sys.executable, EXAMPLE, "--num-envs", "4", "--num-steps", "16"]
    command += ["--total-timesteps", "128", "--torch-threads", "1", "--device", "cpu", *argv]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()


def _finals(lines: list[str]) -> list[re.Match]:
    finals = [FINAL.match(line) for line in lines if line.startswith("final:")]
    assert all(finals), lines
    return finals


@needs_ale
@pytest.mark.parametrize("torch_env", [[], ["--no-torch-env"]], ids=["torch-env", "numpy"])
def test_sync_shmvec_and_gymnasium_train_alike(torch_env):
    """Both vectors in one run: same seed, same envs, so the same losses (shmvec's results
    through TorchVectorEnv or as numpy arrays)."""
    lines = _run("--vector", "shmvec,gymnasium-async", *torch_env)
    finals = _finals(lines)
    assert [m["vector"] for m in finals] == ["shmvec", "gymnasium-async"]
    for m in finals:
        assert int(m["steps"]) == 128 and int(m["sps"]) > 0 and m["async"] == "False"
        assert int(m["steady"]) > 0  # the second iteration's rate
    assert "pinned=False" in lines[0]  # shmvec's default below 8 cores
    assert f"torch_env={not torch_env}" in lines[0]
    assert lines[-2].startswith("compare steps_per_s: shmvec=")
    assert lines[-1].startswith("compare steady_steps_per_s: shmvec=")
    iters = [line for line in lines if line.startswith("iter ")]
    assert len(iters) == 4
    # The losses (after "mean_return_last20=") are the same on both vectors.
    tails = [line.split("mean_return_last20=")[1] for line in iters]
    assert tails[:2] == tails[2:]
    assert [line.split()[2] for line in iters] == ["step=64", "step=128"] * 2


@needs_ale
def test_async_envs_run():
    lines = _run("--async-envs", "--pin-workers")
    (final,) = _finals(lines)
    assert lines[-1] == final.group(0)
    assert int(final["sps"]) > 0 and final["async"] == "True"
    assert "batch_size=2 pinned=True" in lines[0]
    iters = [line.split()[2] for line in lines if line.startswith("iter ")]
    steps = [int(step.removeprefix("step=")) for step in iters]
    assert len(steps) == 2 and steps[-1] == int(final["steps"])
    # Each rollout completes 64 transitions (4 envs x 16 steps), or 65 when one of its
    # batches of 2 held an env's reset (which completes nothing) and another env's
    # step: under load one worker's resets can come back after the other worker's
    # envs have stepped (5 to 7 runs in 20 with a busy core). Every other row of a
    # batch completes one transition.
    assert steps[0] in (64, 65) and steps[1] - steps[0] in (64, 65)


def test_missing_envpool_is_said_clearly():
    if importlib.util.find_spec("envpool") is not None:
        pytest.skip("envpool is installed")
    command = [sys.executable, EXAMPLE, "--vector", "envpool", "--total-timesteps", "4096"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "envpool is not installed" in done.stderr
