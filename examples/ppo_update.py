"""The PPO update (CleanRL's clipped objective) and layer init, shared by ppo.py and ppo_atari.py.

``ppo_update`` runs ``update_epochs`` passes of minibatches over one rollout's
transitions, given flat tensors indexed by ``indices``; the scripts differ only
in how they collect the rollout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn


def ppo_update(
    agent: nn.Module,
    optimizer: torch.optim.Optimizer,
    args: Any,
    indices: np.ndarray,
    minibatch_size: int,
    obs: torch.Tensor,
    actions: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    """Updates ``agent`` on the transitions at ``indices`` (shuffled in place);
    ``args`` has the PPO hyperparameters of the scripts' ``Args``. Returns the
    last minibatch's (v_loss, pg_loss, approx_kl) and the clip fractions."""
    device = obs.device
    clipfracs: list[float] = []
    for _epoch in range(args.update_epochs):
        np.random.shuffle(indices)
        for start in range(0, len(indices), minibatch_size):
            mb_inds = torch.as_tensor(indices[start : start + minibatch_size], device=device)
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                obs[mb_inds], actions[mb_inds]
            )
            logratio = newlogprob - logprobs[mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

            mb_advantages = advantages[mb_inds]
            if args.norm_adv and len(mb_inds) > 1:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (
                    mb_advantages.std() + 1e-8
                )
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()

            newvalue = newvalue.view(-1)
            if args.clip_vloss:
                v_loss_unclipped = (newvalue - returns[mb_inds]) ** 2
                v_clipped = values[mb_inds] + torch.clamp(
                    newvalue - values[mb_inds], -args.clip_coef, args.clip_coef
                )
                v_loss_clipped = (v_clipped - returns[mb_inds]) ** 2
                v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
            else:
                v_loss = 0.5 * ((newvalue - returns[mb_inds]) ** 2).mean()

            loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()

        if args.target_kl is not None and approx_kl > args.target_kl:
            break
    return v_loss, pg_loss, approx_kl, clipfracs


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """CleanRL's init: orthogonal weights with gain ``std``, constant bias."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


if __name__ == "__main__":
    import sys

    sys.exit("ppo_update.py is a module of ppo.py and ppo_atari.py: run one of those")
