"""Short runs of examples/grpo.py (GRPO with a byte-level GRU on text envs
through shmvec.rollouts)."""

from __future__ import annotations

import math

import pytest
from helpers import example_module

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def grpo():
    with example_module("grpo") as module:
        yield module


def short_args(grpo, **kwargs):
    defaults = dict(
        iterations=3, num_envs=6, recv_batch=2, group_size=3, groups_per_batch=2,
        max_episode_steps=6, hidden=32, max_action_bytes=4, progress=False,
    )  # fmt: skip
    return grpo.Args(**(defaults | kwargs))


def test_short_run(grpo, capsys):
    result = grpo.main(short_args(grpo))
    assert result["iterations"] == 3
    assert result["trajectories"] == 3 * 2 * 3
    assert result["max_lag_seen"] <= 1
    assert math.isfinite(result["mean_return_last10"])
    stats = result["stats"]
    assert stats["groups_delivered"] == 6 and stats["version"] == 3
    assert stats["dropped"] == {} and stats["groups_dropped"] == {}
    for group in result["last_groups"]:
        for traj in group.trajectories:
            assert len(traj.extras) == traj.num_steps
            for extra, action, version in zip(traj.extras, traj.actions, traj.versions):
                assert set(extra) == {"tokens", "logprob", "version"}
                assert 1 <= len(extra["tokens"]) <= 4 and extra["logprob"] <= 0.0
                # the weights that wrote an action are never older than its stamp
                assert extra["version"] >= version
                written = bytes(t + grpo.FIRST_BYTE for t in extra["tokens"] if t != grpo.END)
                assert written.decode() == action
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("iter ") for line in out) == 3
    assert out[-1].startswith("final: mean_return_last10=")


def test_recomputed_logprobs_equal_the_sampled_ones(grpo):
    # With a learning rate of 0 every version has the initial weights: the
    # update's teacher-forced log-probabilities must equal those drawn.
    result = grpo.main(short_args(grpo, learning_rate=0.0, iterations=2))
    steps = [
        (traj.observations[t], extra)
        for group in result["last_groups"]
        for traj in group.trajectories
        for t, extra in enumerate(traj.extras)
    ]
    with torch.no_grad():
        recomputed = grpo.action_logprobs(
            result["learner"], [obs for obs, _ in steps], [e["tokens"] for _, e in steps]
        )
    sampled = torch.tensor([e["logprob"] for _, e in steps])
    assert torch.allclose(recomputed, sampled, atol=1e-4)


def test_group_advantages(grpo):
    class FakeGroup:
        def __init__(self, rewards):
            import numpy as np

            self.rewards = np.array(rewards, dtype=float)

    advantages = grpo.group_advantages([FakeGroup([1.0, 0.0]), FakeGroup([0.5, 0.5])], 1e-4)
    assert advantages[0] == pytest.approx(1.0, rel=1e-3)
    assert advantages[1] == pytest.approx(-1.0, rel=1e-3)
    assert advantages[2:] == [0.0, 0.0]


def test_a_gem_game(grpo):
    pytest.importorskip("gem")
    result = grpo.main(short_args(grpo, env="game:GuessTheNumber-v0-easy", iterations=2))
    assert result["trajectories"] == 2 * 2 * 3
    # A byte policy this short never writes \boxed{n}: every guess is a format error.
    assert result["mean_return_last10"] == pytest.approx(-0.1)


def test_parse_args(grpo):
    args = grpo.parse_args(["--group-size", "4", "--no-slippery", "--seconds", "None",
                            "--lake-map", "SF,FG", "--max_lag", "2"])  # fmt: skip
    assert (args.group_size, args.slippery, args.seconds) == (4, False, None)
    assert (args.lake_map, args.max_lag) == ("SF,FG", 2)
