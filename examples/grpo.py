"""GRPO on text envs through shmvec.rollouts, in one file (in the style of CleanRL).

    python examples/grpo.py --iterations 200 --seed 1
    python examples/grpo.py --env game:GuessTheNumber-v0-easy   # needs shmvec[text]

The policy is a tiny byte-level GRU, initialized at random: it reads the last
``--max-obs-bytes`` bytes of an observation and writes an action of up to
``--max-action-bytes`` printable ASCII bytes (or fewer, if it emits its end
token). The envs are text envs of ``shmvec.text_envs`` (FrozenLake as text by
default, or a GEM game) in ``ShmVectorEnv`` worker processes, driven by
``shmvec.rollouts.Rollouts`` in async mode: the envs keep stepping while the
learner updates, and no trajectory is handed over whose oldest action is more
than ``--max-lag`` policy versions old.

Each iteration takes ``--groups-per-batch`` complete groups of
``--group-size`` trajectories (one task, i.e. one reset seed, per group),
gives each trajectory its group-relative advantage (its return minus the
group's mean, over the group's standard deviation plus ``--adv-eps``),
recomputes the log-probability of every stored action under the current
weights, takes one clipped policy-gradient step (the ratio to the
log-probability recorded when the action was sampled corrects for the lag),
then publishes the new weights to the rollout policy and stamps the new version.

Threads: the rollout loop calls the policy in a thread of its own while the
learner trains. The learner's model is never used for sampling; each
published version is a fresh copy, handed over by swapping one reference
under a lock, so that a forward pass uses one version from start to end.

A progress bar shows the mean return (tqdm, from ``pip install
"shmvec[bench]"``; without it, or with ``--no-progress``, a line per
iteration). The last lines are
``rollouts.stats()`` and ``final: mean_return_last10=<x> iterations=<n>
trajectories=<t> env_steps=<s> wall_s=<w>``.
"""

from __future__ import annotations

import copy
import functools
import itertools
import pprint
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from dataclass_args import help_text, parse_dataclass

import shmvec
from shmvec.rollouts import Group, PolicyBatch, PolicyOutput, Rollouts, Task
from shmvec.text_envs import FrozenLakeText, GemEnv

try:
    from tqdm import tqdm
except ImportError:  # tqdm comes with shmvec[bench]; the loop prints lines instead
    tqdm = None


@dataclass
class Args:
    env: str = "frozen_lake"
    """'frozen_lake' (FrozenLakeText) or a GEM env id such as game:GuessTheNumber-v0-easy"""
    seed: int = 1
    """seed of python, numpy and torch, and of the tasks' reset seeds"""
    iterations: int = 100
    """policy updates (each on one batch of groups)"""
    seconds: float | None = None
    """stop after the iteration that passes this wall time (None: run every iteration)"""
    num_envs: int = 16
    """envs in the vector env"""
    num_workers: int = 2
    """shmvec worker processes"""
    recv_batch: int = 8
    """rows the vector env hands the policy at once (its batch_size, < num_envs)"""
    env_concurrency: int = 1
    """envs a worker steps at once, in threads (GEM games and FrozenLake compute: 1)"""
    group_size: int = 8
    """trajectories per group: one reset seed, compared with each other"""
    groups_per_batch: int = 4
    """groups per update"""
    max_lag: int = 1
    """no trajectory is trained on whose oldest action is more than this many versions old"""
    lake_map: str | None = "SF,FG"
    """FrozenLake's map, its rows joined by commas (None: FrozenLake's 4x4). A random
    byte policy writes a move the env can read about once in a dozen actions, so
    only a small map gives GRPO's groups a difference in return to learn from"""
    max_episode_steps: int = 20
    """FrozenLake's step limit (invalid moves count)"""
    slippery: bool = False
    """FrozenLake's slippery ice (a move goes sideways two times in three)"""
    hidden: int = 128
    """the GRU's hidden size (and the byte embedding's)"""
    max_obs_bytes: int = 96
    """the policy reads the last this-many bytes of each observation"""
    max_action_bytes: int = 16
    """the policy writes at most this many bytes per action"""
    learning_rate: float = 3e-3
    """the learning rate of the Adam optimizer"""
    clip_coef: float = 0.2
    """the clipping of the ratio of new to sampled action probabilities"""
    adv_eps: float = 1e-4
    """added to each group's reward standard deviation before dividing"""
    max_grad_norm: float = 1.0
    """the maximum norm of the gradients"""
    torch_threads: int = 1
    """torch's intra-op threads; the model is tiny and the env workers need the cores"""
    progress: bool = True
    """a progress bar (tqdm, where installed); else a line per iteration"""


def parse_args(argv: list[str] | None = None) -> Args:
    """``Args`` from the command line: ``--group-size 8`` (or ``--group_size``),
    ``--slippery``/``--no-slippery``, ``--seconds None``."""
    return parse_dataclass(Args, argv, help_text(__doc__))


# ---------------------------------------------------------------------- policy

#: Output tokens: printable ASCII (bytes 32..126), then the end of the action.
FIRST_BYTE, NUM_BYTES = 32, 95
END = NUM_BYTES
#: Input tokens: any byte 0..255, then the start of the action.
START = 256


class BytePolicy(nn.Module):
    """A byte-level policy: it reads an observation's last ``max_obs_bytes``
    bytes in one step (the sum of each byte's embedding times its position's,
    counted from the end, so the same byte at another place reads differently)
    into the first state of a GRU, which then writes the action byte by byte.
    A recurrent pass over hundreds of observation bytes per row would cost a
    CPU far more than the envs do."""

    def __init__(self, hidden: int, max_obs_bytes: int) -> None:
        super().__init__()
        self.max_obs_bytes = max_obs_bytes
        self.byte = nn.Embedding(257, hidden)  # bytes 0..255, and START
        self.position = nn.Embedding(max_obs_bytes, hidden)
        self.first_state = nn.Linear(hidden, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, NUM_BYTES + 1)

    def read(self, observations: list[str]) -> torch.Tensor:
        """The GRU's first state for each observation: (1, rows, hidden)."""
        data = [obs.encode()[-self.max_obs_bytes :][::-1] for obs in observations]
        width = max(1, max(len(d) for d in data))
        padded = torch.zeros(len(data), width, dtype=torch.long)
        mask = torch.zeros(len(data), width, 1)
        for i, d in enumerate(data):
            if d:
                padded[i, : len(d)] = torch.frombuffer(bytearray(d), dtype=torch.uint8).long()
                mask[i, : len(d)] = 1.0
        features = (self.byte(padded) * self.position.weight[:width] * mask).sum(dim=1)
        return torch.tanh(self.first_state(features / width**0.5))[None]

    def token_logprobs(self, observations: list[str], tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t] | observation, tokens[:, :t]) for each row and t
        (teacher forcing: the input at t is the byte written at t - 1)."""
        written = (tokens.clamp(max=NUM_BYTES - 1) + FIRST_BYTE)[:, :-1]
        inputs = torch.cat([torch.full((len(tokens), 1), START), written], dim=1)
        out, _ = self.gru(self.byte(inputs), self.read(observations))
        logprobs = torch.log_softmax(self.head(out), dim=-1)
        return logprobs.gather(2, tokens.unsqueeze(2)).squeeze(2)

    @torch.no_grad()
    def sample(
        self, observations: list[str], max_tokens: int, generator: torch.Generator
    ) -> tuple[list[str], list[list[int]], list[float]]:
        """Actions for a batch of observations: texts, their tokens (with the end
        token when one was drawn) and the log-probability of each row's tokens."""
        state = self.read(observations)
        rows = len(observations)
        token_in = torch.full((rows, 1), START)
        done = torch.zeros(rows, dtype=torch.bool)
        tokens, logprob = [], torch.zeros(rows)
        for _ in range(max_tokens):
            out, state = self.gru(self.byte(token_in), state)
            logprobs = torch.log_softmax(self.head(out[:, 0]), dim=-1)
            token = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
            logprob += torch.where(done, 0.0, logprobs.gather(1, token[:, None])[:, 0])
            tokens.append(torch.where(done, -1, token))
            done |= token == END
            if bool(done.all()):
                break
            token_in = (token.clamp(max=NUM_BYTES - 1) + FIRST_BYTE)[:, None]
        drawn = torch.stack(tokens, dim=1).tolist()
        kept = [[t for t in row if t >= 0] for row in drawn]
        texts = [bytes(t + FIRST_BYTE for t in row if t != END).decode() for row in kept]
        return texts, kept, logprob.tolist()


class RolloutPolicy:
    """The rollout loop's batched policy: samples with the published weights.

    ``publish`` (the learner's thread) swaps in a fresh copy of the learner's
    model; ``__call__`` (the rollout loop's thread) takes the current copy once
    and uses it for the whole batch, so no forward pass sees weights change.
    """

    def __init__(self, learner: BytePolicy, args: Args) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(args.seed)
        self.model, self.version = self._copy(learner), 0

    @staticmethod
    def _copy(learner: BytePolicy) -> BytePolicy:
        model = copy.deepcopy(learner).eval()
        model.requires_grad_(False)
        return model

    def publish(self, learner: BytePolicy, version: int) -> None:
        model = self._copy(learner)  # copied outside the lock: sampling goes on meanwhile
        with self.lock:
            self.model, self.version = model, version

    def __call__(self, batch: PolicyBatch) -> PolicyOutput:
        with self.lock:
            model, version = self.model, self.version
        texts, tokens, logprobs = model.sample(
            list(batch.observations), self.args.max_action_bytes, self.generator
        )
        extras = [
            {"tokens": t, "logprob": lp, "version": version} for t, lp in zip(tokens, logprobs)
        ]
        return PolicyOutput(texts, extras)


# ---------------------------------------------------------------------- update


def group_advantages(groups: list[Group], eps: float) -> list[float]:
    """Each trajectory's return minus its group's mean, over the group's std + eps."""
    advantages = []
    for group in groups:
        rewards = group.rewards
        advantages.extend(((rewards - rewards.mean()) / (rewards.std() + eps)).tolist())
    return advantages


def action_logprobs(
    model: BytePolicy, observations: list[str], tokens: list[list[int]]
) -> torch.Tensor:
    """log p(action | observation) of each stored action under ``model``."""
    width = max(len(t) for t in tokens)
    padded = torch.zeros(len(tokens), width, dtype=torch.long)
    mask = torch.zeros(len(tokens), width)
    for i, t in enumerate(tokens):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, : len(t)] = 1.0
    return (model.token_logprobs(observations, padded) * mask).sum(dim=1)


def update(
    learner: BytePolicy, optimizer: torch.optim.Optimizer, groups: list[Group], args: Args
) -> dict[str, float]:
    """One clipped policy-gradient step on a batch of groups (GRPO's objective:
    each action weighted by its trajectory's advantage, each trajectory by
    1 / its length, the batch's trajectories averaged)."""
    trajectories = [t for g in groups for t in g.trajectories]
    advantages = group_advantages(groups, args.adv_eps)
    observations, tokens, sampled, weights, step_adv = [], [], [], [], []
    for traj, adv in zip(trajectories, advantages):
        for t, extra in enumerate(traj.extras):
            observations.append(traj.observations[t])
            tokens.append(extra["tokens"])
            sampled.append(extra["logprob"])
            step_adv.append(adv)
            weights.append(1.0 / (traj.num_steps * len(trajectories)))
    new = action_logprobs(learner, observations, tokens)
    ratio = torch.exp(new - torch.tensor(sampled))
    ratio_seen = ratio.detach()
    adv = torch.tensor(step_adv)
    clipped = torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    loss = -(torch.min(ratio * adv, clipped * adv) * torch.tensor(weights)).sum()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(learner.parameters(), args.max_grad_norm)
    optimizer.step()
    return {
        "loss": float(loss.detach()),
        "ratio_max": float(ratio_seen.max()),
        "clip_frac": float(((ratio_seen - 1).abs() > args.clip_coef).float().mean()),
        "steps": len(observations),
        "flat_groups": sum(float(g.rewards.std()) == 0.0 for g in groups),
    }


# ------------------------------------------------------------------------ envs


def make_env_fn(args: Args):
    if args.env == "frozen_lake":
        return functools.partial(
            FrozenLakeText,
            desc=args.lake_map.split(",") if args.lake_map else None,
            is_slippery=args.slippery,
            max_episode_steps=args.max_episode_steps,
        )
    import gem  # noqa: F401 - imported here once, so that forked workers inherit it

    return functools.partial(GemEnv, args.env)


# -------------------------------------------------------------------- training


class Lines:
    """tqdm's face for a run without a progress bar: a line per iteration."""

    def __init__(self, total: int) -> None:
        self.n, self.total = 0, total

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, values: dict[str, Any]) -> None:
        shown = " ".join(f"{k}={v}" for k, v in values.items())
        print(f"iter {self.n + 1}/{self.total} {shown}", flush=True)

    def close(self) -> None:
        pass


def main(args: Args) -> dict[str, Any]:
    """Trains; returns the final figures (also printed as the last line)."""
    if not 0 < args.recv_batch < args.num_envs:
        raise ValueError(f"recv_batch must be in 1..num_envs-1, got {args.recv_batch}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    envs = shmvec.ShmVectorEnv(
        [make_env_fn(args)] * args.num_envs,
        num_workers=args.num_workers,
        batch_size=args.recv_batch,
        env_concurrency=args.env_concurrency,
        on_env_error="reset",
        on_worker_death="restart",
    )
    try:
        return _train(args, envs)
    finally:
        envs.close()


def _train(args: Args, envs: shmvec.ShmVectorEnv) -> dict[str, Any]:
    learner = BytePolicy(args.hidden, args.max_obs_bytes)
    optimizer = torch.optim.Adam(learner.parameters(), lr=args.learning_rate)
    policy = RolloutPolicy(learner, args)
    tasks = (Task(seed=args.seed * 1_000_003 + i) for i in itertools.count())
    rollouts = Rollouts(
        envs,
        policy,
        group_size=args.group_size,
        tasks=tasks,
        mode="async",
        max_lag=args.max_lag,
        groups_per_batch=args.groups_per_batch,
    )
    print(
        f"grpo: {args.env} num_envs={args.num_envs} workers={args.num_workers} "
        f"group_size={args.group_size} groups_per_batch={args.groups_per_batch} "
        f"max_lag={args.max_lag} iterations={args.iterations}",
        flush=True,
    )
    returns: deque[float] = deque(maxlen=10)
    lags, trajectories, env_steps, iteration = [], 0, 0, 0
    started = time.perf_counter()
    bar = (
        tqdm(total=args.iterations)
        if tqdm is not None and args.progress
        else Lines(args.iterations)
    )
    try:
        for iteration in range(1, args.iterations + 1):
            groups = rollouts.get_batch(args.groups_per_batch)
            figures = update(learner, optimizer, groups, args)
            policy.publish(learner, iteration)  # the weights first, then their version:
            rollouts.set_version(iteration)  # an action's version is never newer than it
            batch_returns = [float(r) for g in groups for r in g.rewards]
            returns.append(float(np.mean(batch_returns)))
            lags.extend(g.lag for g in groups)
            trajectories += len(batch_returns)
            env_steps += figures["steps"]
            bar.set_postfix(
                {
                    "return": f"{returns[-1]:.3f}",
                    "loss": f"{figures['loss']:.4f}",
                    "flat_groups": figures["flat_groups"],
                    "lag": max(g.lag for g in groups),
                }
            )
            bar.update(1)
            if args.seconds is not None and time.perf_counter() - started > args.seconds:
                break
    finally:
        bar.close()
        stats = rollouts.stats()
        rollouts.close()
    wall = time.perf_counter() - started
    pprint.pprint(stats, sort_dicts=False)
    result = {
        "mean_return_last10": float(np.mean(returns)) if returns else float("nan"),
        "iterations": iteration,
        "trajectories": trajectories,
        "env_steps": env_steps,
        "max_lag_seen": max(lags, default=0),
        "wall_s": wall,
        "stats": stats,
        "learner": learner,
        "last_groups": groups if iteration else [],
    }
    print(
        f"final: mean_return_last10={result['mean_return_last10']:.3f} "
        f"iterations={iteration} trajectories={trajectories} env_steps={env_steps} "
        f"wall_s={wall:.1f}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main(parse_args())
    sys.exit(0)
