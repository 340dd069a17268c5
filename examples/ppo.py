"""PPO on a shmvec.ShmVectorEnv, in one file (in the style of CleanRL's ppo.py).

    python examples/ppo.py --env-id CartPole-v1 --num-envs 8 --seed 1

The envs run in shmvec worker processes with ``AutoresetMode.SAME_STEP``: a done
env is reset within the step, so the observation that follows a done is the first
of the next episode (what this PPO's bootstrapping assumes), and a time-limit
truncation is bootstrapped with the value of ``infos["final_obs"]``. Episode
returns come from ``gymnasium.wrappers.vector.RecordEpisodeStatistics``.

With ``--torch-bridge`` (default) and ``shmvec.torch.TorchVectorEnv`` available,
reset/step return torch tensors on ``--device`` and take torch actions; otherwise
numpy results are converted with ``torch.as_tensor``.

Each iteration prints its steps/s and the mean return of the last 20 episodes; the
last line is ``final: mean_return_last20=<x> steps_per_s=<y> total_steps=<z>``.
"""

from __future__ import annotations

import functools
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from dataclass_args import help_text, parse_dataclass
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from ppo_update import layer_init, ppo_update
from torch.distributions.categorical import Categorical

import shmvec

try:
    from shmvec.torch import TorchVectorEnv
except ImportError:  # an older shmvec without the torch bridge
    TorchVectorEnv = None


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the gymnasium id of the environment (discrete actions, flat observations)"""
    seed: int = 1
    """seed of python, numpy, torch and the environments"""
    num_envs: int = 8
    """the number of parallel environments"""
    num_workers: int | None = None
    """shmvec worker processes (None: min(num_envs, cpus))"""
    total_timesteps: int = 500_000
    """total environment steps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the Adam optimizer"""
    num_steps: int = 128
    """steps per env in each rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over the training"""
    gamma: float = 0.99
    """the discount factor"""
    gae_lambda: float = 0.95
    """lambda of the generalized advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches each rollout is split into"""
    update_epochs: int = 4
    """the number of passes over each rollout"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper's implementation"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum norm of the gradients"""
    target_kl: float | None = None
    """stop an update early once the approximate KL exceeds this (None: never)"""
    device: str = "cpu"
    """torch device of the networks (and of the env's tensors with the bridge)"""
    torch_bridge: bool = True
    """use shmvec.torch.TorchVectorEnv when it exists"""
    torch_threads: int = 1
    """torch's intra-op threads (0: torch's default). These networks are tiny: on a
    small machine more threads only contend with the env workers for the cores"""

    @property
    def batch_size(self) -> int:
        """env steps per rollout"""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> Args:
    """``Args`` from the command line: ``--num-envs 8`` (or ``--num_envs``),
    ``--anneal-lr``/``--no-anneal-lr``, ``--target-kl None``."""
    return parse_dataclass(Args, argv, help_text(__doc__))


# ---------------------------------------------------------------------- agent


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


# ----------------------------------------------------------------------- envs


class NumpyToTorch:
    """The fallback bridge: numpy results to tensors with ``torch.as_tensor``."""

    def __init__(self, env: gym.vector.VectorEnv, device: torch.device) -> None:
        self.env = env
        self.device = device

    def reset(self, *, seed=None, options=None):
        obs, infos = self.env.reset(seed=seed, options=options)
        return torch.as_tensor(obs, device=self.device), infos

    def step(self, actions: torch.Tensor):
        obs, rewards, terminations, truncations, infos = self.env.step(actions.cpu().numpy())
        device = self.device
        return (
            torch.as_tensor(obs, device=device),
            torch.as_tensor(rewards, dtype=torch.float32, device=device),
            torch.as_tensor(terminations, device=device),
            torch.as_tensor(truncations, device=device),
            infos,
        )

    def close(self) -> None:
        self.env.close()


def make_envs(args: Args, device: torch.device):
    """ShmVectorEnv (SAME_STEP) -> RecordEpisodeStatistics -> torch bridge.

    Returns ``(envs, stats, bridged)``: the env to step, the statistics wrapper,
    and whether shmvec's TorchVectorEnv is in use.
    """
    env_fn = functools.partial(gym.make, args.env_id)
    vec = shmvec.ShmVectorEnv(
        [env_fn] * args.num_envs,
        autoreset_mode=AutoresetMode.SAME_STEP,
        num_workers=args.num_workers,
    )
    stats = RecordEpisodeStatistics(vec, buffer_length=20)
    if args.torch_bridge and TorchVectorEnv is not None:
        return TorchVectorEnv(stats, device=device), stats, True
    return NumpyToTorch(stats, device), stats, False


# ------------------------------------------------------------------- training


def main(args: Args) -> dict[str, Any]:
    """Trains; returns the final figures (also printed as the last line)."""
    if args.num_iterations < 1:
        raise ValueError(
            f"total_timesteps={args.total_timesteps} is less than one rollout "
            f"(num_envs * num_steps = {args.batch_size})"
        )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)

    envs, stats, bridged = make_envs(args, device)
    try:
        return _train(args, envs, stats, bridged, device)
    finally:
        envs.close()


def _train(args: Args, envs, stats, bridged: bool, device: torch.device) -> dict[str, Any]:
    single_obs = stats.single_observation_space
    single_act = stats.single_action_space
    assert isinstance(single_act, gym.spaces.Discrete), "this PPO handles Discrete actions"
    obs_dim = int(np.prod(single_obs.shape))
    agent = Agent(obs_dim, int(single_act.n)).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    n, T = args.num_envs, args.num_steps
    obs = torch.zeros((T, n, obs_dim), device=device)
    actions = torch.zeros((T, n), dtype=torch.long, device=device)
    logprobs = torch.zeros((T, n), device=device)
    rewards = torch.zeros((T, n), device=device)
    dones = torch.zeros((T, n), device=device)
    values = torch.zeros((T, n), device=device)

    print(
        f"ppo: {args.env_id} num_envs={n} workers={stats.unwrapped.num_workers} "
        f"bridge={'shmvec.torch.TorchVectorEnv' if bridged else 'torch.as_tensor'} "
        f"device={device} iterations={args.num_iterations}",
        flush=True,
    )
    returns_last20: deque[float] = deque(maxlen=20)
    episodes = 0
    global_step = 0
    started = time.perf_counter()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = next_obs.float().reshape(n, obs_dim)
    next_done = torch.zeros(n, device=device)

    for iteration in range(1, args.num_iterations + 1):
        iteration_started = time.perf_counter()
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        for step in range(T):
            global_step += n
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            next_obs, reward, terminations, truncations, infos = envs.step(action)
            next_obs = next_obs.float().reshape(n, obs_dim)
            rewards[step] = reward.to(device, torch.float32).view(-1)
            done = terminations | truncations
            next_done = done.to(device, torch.float32).view(-1)
            # A truncated episode did not end: bootstrap it with the value of its
            # last observation (the envs were already reset: it is in final_obs).
            truncated = (truncations & ~terminations).cpu().numpy()
            if truncated.any():
                rows = np.flatnonzero(truncated)
                final = np.stack([infos["final_obs"][i] for i in rows]).reshape(len(rows), -1)
                with torch.no_grad():
                    final_values = agent.get_value(
                        torch.as_tensor(final, dtype=torch.float32, device=device)
                    ).flatten()
                rewards[step, torch.as_tensor(rows, device=device)] += args.gamma * final_values
            if "episode" in infos:
                ended = np.flatnonzero(infos["_episode"])
                returns_last20.extend(float(r) for r in infos["episode"]["r"][ended])
                episodes += len(ended)

        # Generalized advantage estimation (bootstrap from the value of next_obs).
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = torch.zeros(n, device=device)
            for t in reversed(range(T)):
                if t == T - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                advantages[t] = lastgaelam
            returns = advantages + values

        b_obs = obs.reshape(-1, obs_dim)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        v_loss, pg_loss, approx_kl, clipfracs = ppo_update(
            agent, optimizer, args, np.arange(args.batch_size), args.minibatch_size,
            b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values,
        )  # fmt: skip

        now = time.perf_counter()
        mean_return = float(np.mean(returns_last20)) if returns_last20 else float("nan")
        print(
            f"iter {iteration}/{args.num_iterations} step={global_step} "
            f"sps={int(global_step / (now - started))} "
            f"iter_sps={int(args.batch_size / (now - iteration_started))} "
            f"episodes={episodes} mean_return_last20={mean_return:.1f} "
            f"v_loss={v_loss.item():.3f} pg_loss={pg_loss.item():.4f} "
            f"approx_kl={approx_kl.item():.4f} clipfrac={np.mean(clipfracs):.3f}",
            flush=True,
        )

    wall = time.perf_counter() - started
    result = {
        "mean_return_last20": float(np.mean(returns_last20)) if returns_last20 else float("nan"),
        "steps_per_s": global_step / wall,
        "total_steps": global_step,
        "num_envs": n,
        "iterations": args.num_iterations,
        "episodes": episodes,
        "wall_s": wall,
        "torch_bridge": bridged,
    }
    print(
        f"final: mean_return_last20={result['mean_return_last20']:.2f} "
        f"steps_per_s={result['steps_per_s']:.0f} total_steps={global_step}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main(parse_args())
    sys.exit(0)
