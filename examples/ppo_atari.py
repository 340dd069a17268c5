"""PPO on Atari with a Nature CNN, in one file (in the style of CleanRL's ppo_atari_envpool.py).

    python examples/ppo_atari.py --env-id ALE/Pong-v5 --num-envs 64
    python examples/ppo_atari.py --num-envs 64 --async-envs
    python examples/ppo_atari.py --num-envs 64 --vector shmvec,gymnasium-async,envpool

Each env is ``gym.make(env_id, frameskip=1)`` -> ``AtariPreprocessing`` (noop reset
up to 30, frame skip 4 with a max over the last two frames, 84x84 gray) ->
``FrameStackObservation`` (4) -> ``RecordEpisodeStatistics``: the semantics of
shmvec's Pong benchmark. The policy trains on the sign of each reward; the
episode returns printed are the raw scores.

``--vector`` picks what steps the envs, running the same training loop:

- ``shmvec`` (default): ``shmvec.ShmVectorEnv`` behind ``shmvec.torch.TorchVectorEnv``,
  which hands observations to ``--device`` (on CUDA: by DMA from pinned shared memory);
  with ``--no-torch-env``, its numpy results moved with ``torch.as_tensor`` as gymnasium's.
- ``gymnasium-async``: ``gymnasium.vector.AsyncVectorEnv``, results moved with
  ``torch.as_tensor``.
- ``envpool``: ``envpool.make(..., env_type="gymnasium")`` with the same preprocessing
  (no episodic life, no reward clipping, no fire on reset, sticky actions 0.25).

A comma-separated list runs each in turn with the same seed; the last two lines
compare their steps/s over the whole run and past the first iteration
(``steady_steps_per_s``: the first holds each vector's start-up).

Both shmvec and gymnasium's envs use ``AutoresetMode.SAME_STEP``: the observation
that follows a done is the first of the next episode, and a truncated episode is
bootstrapped with the value of ``infos["final_obs"]``. EnvPool resets an env on the
step after its done (the transition from the last observation to the first, with
reward 0, is kept, as CleanRL does) and its truncations count as terminations.

Rollout storage, one scheme for both modes
------------------------------------------
Each iteration the loop repeats ``recv`` a batch (``obs`` of the envs in
``env_ids``), choose their actions, ``send`` them. In sync mode the batch is every
env and ``recv`` is ``step()``; with ``--async-envs`` the vector env has
``batch_size = num_envs / 2`` and ``recv`` returns whichever half of the envs is
ready first, so the policy runs on one half while the other half steps.

The buffers are indexed per env: ``obs[k, e]`` is the k-th observation env ``e``
was given an action for in this rollout (``count[e]`` of them so far), with its
action, log-prob, value and ``dones[k, e]`` (that observation begins an episode).
Its reward is written when env ``e`` next comes back: a row of a batch completes
the entry ``count[e] - 1`` of its env and opens entry ``count[e]``. So each env's
entries are its own trajectory in order, whatever order the envs come back in.
Every env always has exactly one open entry (its action is in flight). When
``num_envs * num_steps`` transitions are complete (in async mode up to a batch more,
when a batch held an env's reset next to other envs' steps), the update runs: each env's
open entry supplies the bootstrap value (and done) of the env's last complete
transition, and GAE runs down each env's own entries. Afterwards the open entry
moves to index 0 of the next rollout. In async mode its action was already sent
before the update, so the envs step while the network trains; the next update
weighs that entry with the log-prob of the policy that chose it. An env comes
back at most once per batch, so ``count[e]`` is at most the number of batches of
a rollout plus one (plus the reset batches in the first rollout), which sizes the
buffers: ``2 * num_steps + 5`` rows per env in async mode, ``num_steps + 4`` in sync
mode (uint8 frames: 64 envs x 261 rows x 28 KB = 470 MB on the device).

Each iteration prints its steps/s, its time collecting and updating, and the
returns of the episodes that ended; the last line is ``final: mean_return_last20=<x>
steps_per_s=<y> steady_steps_per_s=<s> total_steps=<z> rollout_steps_per_s=<r> ...``
(``s``: the median of the iterations' own rates past the first; ``r``: steps per second
of collecting alone; in async mode the envs also step during the update, which this
does not count).
"""

from __future__ import annotations

import functools
import importlib.util
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from dataclass_args import help_text, parse_dataclass
from gymnasium.vector import AutoresetMode
from ppo_update import layer_init, ppo_update
from torch.distributions.categorical import Categorical

VECTORS = ("shmvec", "gymnasium-async", "envpool")


class VectorUnavailableError(RuntimeError):
    """The library of a ``--vector`` choice is not installed."""


@dataclass
class Args:
    env_id: str = "ALE/Pong-v5"
    """the gymnasium id of the Atari game (EnvPool gets the name after "ALE/")"""
    seed: int = 1
    """seed of python, numpy, torch and the environments"""
    num_envs: int = 8
    """the number of parallel environments"""
    num_workers: int | None = None
    """shmvec worker processes (None: min(num_envs, cpus))"""
    pin_workers: bool | None = None
    """shmvec: keep each worker process on one CPU (None: shmvec's default, which pins
    in sync mode from 8 cores on when the workers fill the cores)"""
    torch_env: bool = True
    """shmvec: hand results to the device through TorchVectorEnv (False, sync mode only:
    the loop moves the numpy results with torch.as_tensor, as for gymnasium's vector env)"""
    vector: str = "shmvec"
    """what steps the envs: shmvec, gymnasium-async or envpool; a comma-separated
    list runs each in turn"""
    async_envs: bool = False
    """EnvPool-style async rollouts: batch_size = num_envs / 2, the policy runs on one
    half of the envs while the other half steps (shmvec and envpool)"""
    total_timesteps: int = 10_000_000
    """total environment steps of the experiment (agent steps, 4 frames each)"""
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
    clip_coef: float = 0.1
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
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device of the network and of the observations"""
    torch_threads: int = 0
    """torch's intra-op threads (0: torch's default); on a small CPU-only machine 1
    keeps the learner from fighting the env workers for the cores"""

    @property
    def batch_size(self) -> int:
        """env steps (complete transitions) per rollout"""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def env_batch_size(self) -> int:
        """envs per recv(): half of them in async mode"""
        return self.num_envs // 2 if self.async_envs else self.num_envs


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> Args:
    """``Args`` from the command line: ``--num-envs 8`` (or ``--num_envs``),
    ``--async-envs``/``--no-async-envs``, ``--target-kl None``."""
    return parse_dataclass(Args, argv, help_text(__doc__))


def check_args(args: Args) -> list[str]:
    """Raises ValueError on arguments that cannot run; returns the vector names."""
    vectors = [name.strip() for name in args.vector.split(",") if name.strip()]
    unknown = [name for name in vectors if name not in VECTORS]
    if not vectors or unknown:
        raise ValueError(f"--vector {args.vector!r}: each must be one of {', '.join(VECTORS)}")
    if args.async_envs and "gymnasium-async" in vectors:
        raise ValueError(
            "--async-envs needs send/recv of half the envs, which gymnasium's AsyncVectorEnv "
            "does not have: run gymnasium-async without --async-envs"
        )
    if args.async_envs and not args.torch_env:
        raise ValueError("--async-envs runs shmvec through TorchVectorEnv: drop --no-torch-env")
    if args.async_envs and (args.num_envs < 2 or args.num_envs % 2):
        raise ValueError(f"--async-envs needs an even num_envs >= 2, got {args.num_envs}")
    if args.num_iterations < 1:
        raise ValueError(
            f"total_timesteps={args.total_timesteps} is less than one rollout "
            f"(num_envs * num_steps = {args.batch_size})"
        )
    if args.minibatch_size < 1:
        raise ValueError(
            f"num_minibatches={args.num_minibatches} is more than the {args.batch_size} "
            "transitions of a rollout"
        )
    return vectors


# ---------------------------------------------------------------------- agent


class Agent(nn.Module):
    """The Nature DQN CNN over 4 stacked 84x84 frames, an actor and a critic head."""

    def __init__(self, in_channels: int, n_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(in_channels, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.network(x.float() / 255.0))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        hidden = self.network(x.float() / 255.0)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


# ----------------------------------------------------------------------- envs


def make_atari_env(env_id: str) -> gym.Env:
    """One Atari env with the preprocessing of shmvec's Pong benchmark."""
    import ale_py
    import cv2
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation
    from gymnasium.wrappers import RecordEpisodeStatistics as RecordEpisodeStatisticsEnv

    # One thread per env: OpenCV's own pool would have every worker's resize
    # fight for all the cores (measured on Pong in shmvec's benchmark).
    cv2.setNumThreads(1)
    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1)
    env = FrameStackObservation(AtariPreprocessing(env, frame_skip=4), 4)
    return RecordEpisodeStatisticsEnv(env)


@dataclass
class Batch:
    """What ``recv`` hands the loop: one row per env of ``env_ids``."""

    obs: torch.Tensor  # uint8, on the device
    rewards: torch.Tensor  # raw, float32, on the device
    dones: torch.Tensor  # terminated or truncated, on the device
    env_ids: np.ndarray  # int64
    #: Raw returns of the episodes that ended in this batch.
    episode_returns: list[float]
    #: Rows whose episode was truncated (not terminated) and their last observations,
    #: for bootstrapping; None when there are none.
    truncated: tuple[np.ndarray, np.ndarray] | None = None


def _episode_returns(infos: dict) -> list[float]:
    """``RecordEpisodeStatistics`` returns from a SAME_STEP batch's infos."""
    final = infos.get("final_info", {})
    if "episode" not in final:
        return []
    return [float(r) for r in final["episode"]["r"][final["_episode"]]]


def _truncated_rows(infos: dict, terminations, truncations):
    """(rows, final observations) of the truncated episodes of a SAME_STEP batch."""
    ended = infos.get("_final_obs")
    if ended is None or not ended.any():
        return None  # nothing ended: no device sync for the flags
    rows = np.flatnonzero(ended)
    truncated = (
        np.asarray(_to_numpy(truncations))[rows] & ~np.asarray(_to_numpy(terminations))[rows]
    )
    rows = rows[truncated]
    if not rows.size:
        return None
    return rows, np.stack([infos["final_obs"][i] for i in rows])


def _to_numpy(value):
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


class StepVector:
    """Sync mode over any vector env with tensor ``reset``/``step``: ``send``
    keeps the actions of every env, ``recv`` steps them (the first ``recv`` resets)."""

    def __init__(self, envs, num_envs: int, device: torch.device, to_tensor: bool) -> None:
        self.envs = envs
        self.num_envs = num_envs
        self.device = device
        self.to_tensor = to_tensor  # False: envs already return tensors on the device
        self.all_ids = np.arange(num_envs)
        self._seed: int | None = None
        self._actions: torch.Tensor | None = None

    def start(self, seed: int) -> None:
        self._seed = seed

    def send(self, actions: torch.Tensor, env_ids: np.ndarray) -> None:
        assert np.array_equal(env_ids, self.all_ids), "sync mode steps every env in order"
        self._actions = actions

    def recv(self) -> Batch:
        if self._actions is None:
            obs, infos = self.envs.reset(seed=self._seed)
            zeros = torch.zeros(self.num_envs, device=self.device)
            return Batch(self._tensor(obs), zeros, zeros.bool(), self.all_ids, [])
        actions = self._actions if not self.to_tensor else self._actions.cpu().numpy()
        obs, rewards, terminations, truncations, infos = self.envs.step(actions)
        return Batch(
            self._tensor(obs),
            self._tensor(rewards).float(),
            self._tensor(terminations | truncations),
            self.all_ids,
            _episode_returns(infos),
            _truncated_rows(infos, terminations, truncations),
        )

    def _tensor(self, value) -> torch.Tensor:
        if not self.to_tensor:
            return value
        return torch.as_tensor(value).to(self.device, non_blocking=True)

    def close(self) -> None:
        self.envs.close()


class ShmAsyncVector:
    """Async mode on shmvec: ``TorchVectorEnv`` send/recv over a ShmVectorEnv
    with ``batch_size = num_envs / 2``."""

    def __init__(self, envs) -> None:
        self.envs = envs  # a TorchVectorEnv

    def start(self, seed: int) -> None:
        # TorchVectorEnv has send/recv but no async_reset: call the ShmVectorEnv's.
        self.envs.shm.async_reset(seed=seed)

    def send(self, actions: torch.Tensor, env_ids: np.ndarray) -> None:
        self.envs.send(actions, env_ids)

    def recv(self) -> Batch:
        obs, rewards, terminations, truncations, infos = self.envs.recv()
        return Batch(
            obs,
            rewards,
            terminations | truncations,
            np.asarray(infos["env_id"], dtype=np.int64),
            _episode_returns(infos),
            _truncated_rows(infos, terminations, truncations),
        )

    def close(self) -> None:
        self.envs.close()


class EnvPoolVector:
    """EnvPool in either mode (``env.send``/``env.recv`` take and give env ids).
    Episode returns are summed here from the raw rewards (no reward clipping)."""

    def __init__(self, envs, num_envs: int, device: torch.device) -> None:
        self.envs = envs
        self.device = device
        self._returns = np.zeros(num_envs)

    def start(self, seed: int) -> None:
        self.envs.async_reset()  # EnvPool's seed was given to envpool.make

    def send(self, actions: torch.Tensor, env_ids: np.ndarray) -> None:
        self.envs.send(actions.cpu().numpy(), env_ids)

    def recv(self) -> Batch:
        obs, rewards, terminations, truncations, info = self.envs.recv()
        env_ids = np.asarray(info["env_id"], dtype=np.int64)
        dones = np.logical_or(terminations, truncations)
        self._returns[env_ids] += rewards
        ended = env_ids[dones]
        episode_returns = self._returns[ended].tolist()
        self._returns[ended] = 0.0
        return Batch(
            torch.as_tensor(obs).to(self.device, non_blocking=True),
            torch.as_tensor(rewards, dtype=torch.float32).to(self.device),
            torch.as_tensor(dones).to(self.device),
            env_ids,
            episode_returns,
        )

    def close(self) -> None:
        self.envs.close()


def make_vector(name: str, args: Args, device: torch.device):
    """The vector env ``name`` behind the loop's start/recv/send; and its description."""
    env_fns = [functools.partial(make_atari_env, args.env_id)] * args.num_envs
    if name == "shmvec":
        import shmvec
        from shmvec.torch import TorchVectorEnv

        shm = shmvec.ShmVectorEnv(
            env_fns,
            autoreset_mode=AutoresetMode.SAME_STEP,
            num_workers=args.num_workers,
            batch_size=args.env_batch_size,
            pin_workers=args.pin_workers,
        )
        about = (
            f"shmvec workers={shm.num_workers} batch_size={args.env_batch_size} "
            f"pinned={shm.pin_workers} torch_env={args.torch_env}"
        )
        if not args.torch_env:
            return StepVector(shm, args.num_envs, device, to_tensor=True), about
        envs = TorchVectorEnv(shm, device=device)
        if args.async_envs:
            return ShmAsyncVector(envs), about
        return StepVector(envs, args.num_envs, device, to_tensor=False), about
    if name == "gymnasium-async":
        # Forked after CUDA is initialized (an earlier --vector, the network), its
        # workers abort with "CUDA error: initialization error": gymnasium does not
        # choose the start method by itself, so this loop does, as shmvec does.
        context = "forkserver" if torch.cuda.is_initialized() else None
        envs = gym.vector.AsyncVectorEnv(
            env_fns, autoreset_mode=AutoresetMode.SAME_STEP, context=context
        )
        return StepVector(envs, args.num_envs, device, to_tensor=True), "gymnasium AsyncVectorEnv"
    if name == "envpool":
        if importlib.util.find_spec("envpool") is None:
            raise VectorUnavailableError(
                "--vector envpool: envpool is not installed (pip install envpool; it has "
                "wheels for Linux x86_64 and Python <= 3.11)"
            )
        import envpool

        envs = envpool.make(
            args.env_id.removeprefix("ALE/"),
            env_type="gymnasium",
            num_envs=args.num_envs,
            batch_size=args.env_batch_size,
            seed=args.seed,
            # gymnasium's AtariPreprocessing and ALE v5, as make_atari_env has them:
            episodic_life=False,
            reward_clip=False,
            use_fire_reset=False,
            frame_skip=4,
            stack_num=4,
            img_height=84,
            img_width=84,
            gray_scale=True,
            noop_max=30,
            repeat_action_probability=0.25,
            max_episode_steps=27_000,  # ALE v5: 108,000 frames
        )
        about = f"envpool batch_size={args.env_batch_size}"
        return EnvPoolVector(envs, args.num_envs, device), about
    raise ValueError(f"unknown vector {name!r}")


# ------------------------------------------------------------------- training


def main(args: Args) -> dict[str, Any]:
    """Trains on each vector of ``--vector``; returns the figures of the last one
    (each run prints its ``final:`` line)."""
    vectors = check_args(args)
    results = []
    for name in vectors:
        try:
            results.append(train(replace(args, vector=name)))
        except VectorUnavailableError as error:
            if len(vectors) == 1:
                raise
            print(f"skipped {name}: {error}", flush=True)
    if not results:
        raise VectorUnavailableError(f"none of --vector {args.vector!r} is installed")
    if len(results) > 1:
        for key in ("steps_per_s", "steady_steps_per_s"):
            base = results[0][key]
            print(
                f"compare {key}: "
                + " ".join(f"{r['vector']}={r[key]:.0f} ({r[key] / base:.2f}x)" for r in results),
                flush=True,
            )
    return results[-1]


def train(args: Args) -> dict[str, Any]:
    """One training run on ``args.vector``; returns the final figures."""
    check_args(args)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    envs, about = make_vector(args.vector, args, device)
    try:
        probe = make_atari_env(args.env_id)
        obs_shape, n_actions = probe.observation_space.shape, int(probe.action_space.n)
        probe.close()
        print(
            f"ppo_atari: {args.env_id} vector={args.vector} ({about}) num_envs={args.num_envs} "
            f"async_envs={args.async_envs} device={device} iterations={args.num_iterations}",
            flush=True,
        )
        return _train(args, envs, obs_shape, n_actions, device)
    finally:
        envs.close()


class Rollout:
    """Per-env rollout buffers (the scheme of the module docstring).

    Flat buffers of ``rows * num_envs`` entries; entry ``k`` of env ``e`` is at
    ``k * num_envs + e``. ``count[e]``: entries of env ``e`` in this rollout, the
    last of which is open (its action is in flight) once it has any.
    """

    def __init__(self, rows: int, num_envs: int, obs_shape: tuple, device) -> None:
        self.rows, self.num_envs, self.device = rows, num_envs, device
        size = rows * num_envs
        self.obs = torch.zeros((size, *obs_shape), dtype=torch.uint8, device=device)
        self.actions = torch.zeros(size, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(size, device=device)
        self.rewards = torch.zeros(size, device=device)
        self.dones = torch.zeros(size, device=device)
        self.values = torch.zeros(size, device=device)
        self.count = np.zeros(num_envs, dtype=np.int64)
        self.completed = 0  # complete transitions in this rollout

    def close_entries(self, env_ids: np.ndarray, rewards: torch.Tensor) -> np.ndarray:
        """Writes the rewards of the open entries of ``env_ids`` (rows whose env has
        none, just reset, are skipped); returns the flat index of each row's entry
        (-1 where none)."""
        has_open = self.count[env_ids] > 0
        at = np.where(has_open, (self.count[env_ids] - 1) * self.num_envs + env_ids, -1)
        if has_open.all():
            self.rewards[torch.as_tensor(at, device=self.device)] = rewards
        elif has_open.any():
            rows = torch.as_tensor(np.flatnonzero(has_open), device=self.device)
            self.rewards[torch.as_tensor(at[has_open], device=self.device)] = rewards[rows]
        self.completed += int(has_open.sum())
        return at

    def open_entries(self, env_ids: np.ndarray, obs, dones, actions, logprobs, values) -> None:
        """Appends an entry to each env of ``env_ids``."""
        at = torch.as_tensor(self.count[env_ids] * self.num_envs + env_ids, device=self.device)
        self.obs[at] = obs
        self.dones[at] = dones.float()
        self.actions[at] = actions
        self.logprobs[at] = logprobs
        self.values[at] = values
        self.count[env_ids] += 1

    def complete_indices(self) -> np.ndarray:
        """Flat indices of the complete transitions (all entries but the open ones)."""
        complete = np.arange(self.rows)[:, None] < (self.count - 1)[None, :]
        return np.flatnonzero(complete.reshape(-1))

    def advantages(self, gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE down each env's entries: ``(advantages, returns)``, flat. An env's
        open entry gives the value and done that follow its last complete one."""
        rows, n = self.rows, self.num_envs
        last_complete = torch.as_tensor(self.count - 2, device=self.device)
        rewards, values = self.rewards.view(rows, n), self.values.view(rows, n)
        dones = self.dones.view(rows, n)
        advantages = torch.zeros((rows, n), device=self.device)
        lastgaelam = torch.zeros(n, device=self.device)
        for t in reversed(range(int(self.count.max()) - 1)):
            nextnonterminal = 1.0 - dones[t + 1]
            delta = rewards[t] + gamma * values[t + 1] * nextnonterminal - values[t]
            lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
            # Entries past an env's last complete one carry nothing back.
            lastgaelam = torch.where(t <= last_complete, lastgaelam, 0.0)
            advantages[t] = lastgaelam
        advantages = advantages.view(-1)
        return advantages, advantages + self.values

    def carry_open_entries(self) -> None:
        """Starts the next rollout: each env's open entry becomes its entry 0
        (an env whose reset has not come back yet has none)."""
        envs = np.flatnonzero(self.count > 0)
        source = torch.as_tensor((self.count[envs] - 1) * self.num_envs + envs, device=self.device)
        target = torch.as_tensor(envs, device=self.device)
        for buffer in (self.obs, self.actions, self.logprobs, self.dones, self.values):
            buffer[target] = buffer[source]
        self.count[:] = 0
        self.count[envs] = 1
        self.completed = 0


def _train(args: Args, envs, obs_shape: tuple, n_actions: int, device) -> dict[str, Any]:
    agent = Agent(obs_shape[0], n_actions).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    n = args.num_envs
    # An env comes back at most once per recv: a rollout's recvs plus the carried
    # entry (and, in the first, the reset batches, which complete nothing) bound its
    # entries.
    rows = (args.batch_size + n) // args.env_batch_size + 3
    rollout = Rollout(rows, n, obs_shape, device)

    returns_last20: deque[float] = deque(maxlen=20)
    iteration_rates: list[float] = []  # each iteration's own steps/s
    episodes = 0
    global_step = 0
    rollouts_s = 0.0  # time spent collecting (the rest is the update)
    started = time.perf_counter()
    envs.start(args.seed)

    for iteration in range(1, args.num_iterations + 1):
        iteration_started = time.perf_counter()
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate
        iteration_returns: list[float] = []
        while rollout.completed < args.batch_size:
            got = envs.recv()
            ids = got.env_ids
            at = rollout.close_entries(ids, torch.sign(got.rewards))
            if got.truncated is not None:
                # A truncated episode did not end: bootstrap it with the value of its
                # last observation (the env was already reset).
                trunc_rows, final_obs = got.truncated
                with torch.no_grad():
                    final_values = agent.get_value(torch.as_tensor(final_obs, device=device))
                at_truncated = torch.as_tensor(at[trunc_rows], device=device)
                rollout.rewards[at_truncated] += args.gamma * final_values.flatten()
            if got.episode_returns:
                iteration_returns += got.episode_returns
                returns_last20.extend(got.episode_returns)
                episodes += len(got.episode_returns)

            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(got.obs)
            rollout.open_entries(ids, got.obs, got.dones, action, logprob, value.flatten())
            envs.send(action, ids)
        completed = rollout.completed
        global_step += completed
        rollout_s = time.perf_counter() - iteration_started
        rollouts_s += rollout_s

        with torch.no_grad():
            advantages, returns = rollout.advantages(args.gamma, args.gae_lambda)
        b_inds = rollout.complete_indices()
        assert len(b_inds) == completed, (len(b_inds), completed)
        obs, actions, logprobs, values = (
            rollout.obs, rollout.actions, rollout.logprobs, rollout.values
        )  # fmt: skip

        minibatch_size = max(1, len(b_inds) // args.num_minibatches)
        v_loss, pg_loss, approx_kl, clipfracs = ppo_update(
            agent, optimizer, args, b_inds, minibatch_size,
            obs, actions, logprobs, advantages, returns, values,
        )  # fmt: skip

        rollout.carry_open_entries()

        now = time.perf_counter()
        iteration_rates.append(completed / (now - iteration_started))
        mean_return = float(np.mean(returns_last20)) if returns_last20 else float("nan")
        shown = " ".join(f"{r:g}" for r in iteration_returns[:8])
        more = f" +{len(iteration_returns) - 8}" if len(iteration_returns) > 8 else ""
        print(
            f"iter {iteration}/{args.num_iterations} step={global_step} "
            f"sps={int(global_step / (now - started))} "
            f"iter_sps={int(iteration_rates[-1])} "
            f"rollout_s={rollout_s:.2f} update_s={now - iteration_started - rollout_s:.2f} "
            f"episodes={episodes} returns=[{shown}{more}] "
            f"mean_return_last20={mean_return:.1f} "
            f"v_loss={v_loss.item():.3f} pg_loss={pg_loss.item():.4f} "
            f"approx_kl={approx_kl.item():.4f} clipfrac={np.mean(clipfracs):.3f}",
            flush=True,
        )

    wall = time.perf_counter() - started
    result = {
        "mean_return_last20": float(np.mean(returns_last20)) if returns_last20 else float("nan"),
        "steps_per_s": global_step / wall,
        # Past the first iteration, which holds the start-up (workers, CUDA's first
        # kernels): the rate to compare vectors by.
        "steady_steps_per_s": (
            float(np.median(iteration_rates[1:])) if len(iteration_rates) > 1 else float("nan")
        ),
        "rollout_steps_per_s": global_step / rollouts_s,
        "total_steps": global_step,
        "num_envs": n,
        "iterations": args.num_iterations,
        "episodes": episodes,
        "wall_s": wall,
        "vector": args.vector,
        "async_envs": args.async_envs,
    }
    print(
        f"final: mean_return_last20={result['mean_return_last20']:.2f} "
        f"steps_per_s={result['steps_per_s']:.0f} "
        f"steady_steps_per_s={result['steady_steps_per_s']:.0f} total_steps={global_step} "
        f"rollout_steps_per_s={result['rollout_steps_per_s']:.0f} "
        f"vector={args.vector} async_envs={args.async_envs}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    try:
        main(parse_args())
    except (ValueError, VectorUnavailableError) as error:
        sys.exit(f"ppo_atari.py: {error}")
    sys.exit(0)
