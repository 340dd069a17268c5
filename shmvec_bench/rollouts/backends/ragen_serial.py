"""RAGEN's lock-step turns: every env in the trainer process, stepped one after another.

Mirrors mll-lab-nu/RAGEN ``ragen/llm_agent/es_manager.py`` (``EnvStateManager.reset``
and ``step``: a loop over the envs, ``env.step`` in turn) driven by
``ragen/llm_agent/agent_proxy.py`` ``LLMAgentProxy.rollout`` (each turn: generate for
the whole batch of active envs, then step them; finished envs leave the batch).
An env's exception ends the rollout, as in ``es_manager.py`` (no try/except).
"""

from __future__ import annotations

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.lockstep import Lockstep
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import make_env


@register(
    "ragen-serial",
    summary="B1 RAGEN: lock-step turns, envs in the trainer process, stepped serially",
    mirrors="ragen/llm_agent/es_manager.py, agent_proxy.py rollout",
    lockstep=True,
)
class RagenSerial(Lockstep):
    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.envs = [make_env(ctx.workload, i) for i in range(ctx.num_envs)]

    def _reset(self, seeds):
        return [env.reset(seed=s)[0] for env, s in zip(self.envs, seeds)]

    def _step(self, ids, actions):
        return [self.envs[i].step(a)[:4] for i, a in zip(ids, actions)]

    def close(self, terminate: bool = False) -> None:
        self.envs = []
