"""Smoke test of examples/ppo.py (a CleanRL-style PPO on ShmVectorEnv)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import example_module

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ppo():
    with example_module("ppo") as module:
        yield module


@pytest.mark.parametrize("torch_bridge", [True, False])
def test_short_run(ppo, capsys, torch_bridge):
    args = ppo.Args(
        total_timesteps=2048,
        num_envs=4,
        num_steps=128,
        num_workers=2,
        seed=3,
        torch_bridge=torch_bridge,
    )
    result = ppo.main(args)
    assert result["num_envs"] == 4
    assert result["iterations"] == 2048 // (4 * 128) == 4
    assert result["total_steps"] == result["iterations"] * 4 * 128 == 2048
    assert math.isfinite(result["steps_per_s"]) and result["steps_per_s"] > 0
    assert math.isfinite(result["mean_return_last20"])
    # CartPole pays 1 per step and a random policy's episodes are short: some ended.
    assert result["episodes"] > 4
    assert 8 <= result["mean_return_last20"] <= 500
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("iter ") for line in out) == 4
    assert out[-1].startswith("final: mean_return_last20=")
    assert f"total_steps={result['total_steps']}" in out[-1]


def test_parse_args(ppo):
    args = ppo.parse_args(
        [
            "--num-envs",
            "4",
            "--no-anneal-lr",
            "--target-kl",
            "0.02",
            "--num_workers",
            "None",
            "--learning-rate",
            "1e-3",
            "--env-id",
            "Acrobot-v1",
        ]
    )
    assert args.num_envs == 4 and args.anneal_lr is False
    assert args.target_kl == 0.02 and args.num_workers is None
    assert args.learning_rate == 1e-3 and args.env_id == "Acrobot-v1"
    assert ppo.parse_args([]) == ppo.Args()
    from dataclass_args import field_docs  # examples/ is on sys.path while ppo is loaded

    docs = field_docs(ppo.Args)
    assert set(docs) == {f.name for f in dataclasses.fields(ppo.Args)}  # a docstring per field
    assert ppo.parse_args(["--no-anneal_lr", "--num_envs=6"]) == ppo.Args(
        anneal_lr=False, num_envs=6
    )


def test_help_lists_each_option_once_with_its_docstring_and_default(ppo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ppo.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # The script's docstring, with its example command, before the options.
    assert out.index("python examples/ppo.py --env-id") < out.index("options:")
    assert "``" not in out
    # Only the dashed spelling is listed (the underscored one is accepted all the same).
    assert "--num-envs INT" in out and "--num_envs" not in out
    flat = " ".join(out.split())
    assert "--num-envs INT the number of parallel environments (default: 8)" in flat
    assert "training (default: True)" in flat  # --anneal-lr, a boolean
    # A None default is said by the docstring, not repeated.
    assert "(None: never) (default" not in flat
