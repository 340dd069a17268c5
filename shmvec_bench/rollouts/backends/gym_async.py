"""gymnasium's ``AsyncVectorEnv`` (one process per env) driven by a hand-written
lock-step trajectory loop: the way a trainer uses a gymnasium vector env for
multi-turn episodes.

The loop is ``lockstep.rollout``: reset every env to its group's task
(``reset(seed=[...])``), then each turn the policy on the unfinished rows and one
``step`` of every env (the vector API steps all of them; finished ones are given
any action and their results ignored), until every trajectory has ended. An env's
exception is re-raised by ``step``; a dead env process makes ``step`` raise.

Text observations rule out shared memory, and without it gymnasium 1.4's ``reset``
leaves a finished env's pending next-step autoreset in place (its worker clears the
flag only when it writes to shared memory): the next batch's first step would reset
the env again instead of stepping it. So the envs autoreset in the same step
(``autoreset_mode=SAME_STEP``); a finished env stepped on is already in a new episode
whose results the loop ignores, and ``reset`` starts the next batch's.
"""

from __future__ import annotations

import gymnasium as gym

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.lockstep import Lockstep
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import env_fns


@register(
    "gym-async",
    summary="B5 gymnasium AsyncVectorEnv (a process per env), a lock-step trajectory loop",
    mirrors="gymnasium/vector/async_vector_env.py",
    lockstep=True,
)
class GymAsync(Lockstep):
    ROLLOUT = {"step_finished": True}

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.envs = gym.vector.AsyncVectorEnv(
            env_fns(ctx.workload, ctx.num_envs),
            context=ctx.context,
            shared_memory=False,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )

    def _reset(self, seeds):
        obs, _ = self.envs.reset(seed=list(seeds))
        return list(obs)

    def _step(self, ids, actions):
        obs, rewards, terms, truncs, _ = self.envs.step(tuple(actions))
        return list(zip(obs, rewards.tolist(), terms.tolist(), truncs.tolist()))

    def env_pids(self):
        return [p.pid for p in self.envs.processes if p.is_alive()]

    def close(self, terminate: bool = False) -> None:
        self.envs.close(terminate=terminate)
