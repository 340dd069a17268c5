"""gem-llm's ``AsyncVectorEnv`` (what ``gem.make_vec(..., async_mode=True)`` builds: a
``ThreadPoolExecutor`` with a thread per env) driven by a hand-written lock-step
trajectory loop.

Mirrors axon-rl/gem ``gem/vector/async_vector_env.py`` (``step`` takes a dict of
actions for the envs named and returns when all of them are done) and
``gem/envs/registration.py`` ``make_vec``. The class is built directly from env
factories (``make_vec`` builds it from registered ids; importing gem's registry
imports reasoning-gym). Each turn steps only the unfinished envs; an env's
exception is re-raised by ``step``.
"""

from __future__ import annotations

from shmvec_bench.rollouts.backends.base import register
from shmvec_bench.rollouts.backends.lockstep import Lockstep
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import RELEASE_HANGS, env_fns, import_gem


@register(
    "gem-vec",
    summary="B6 gem-llm AsyncVectorEnv (a thread per env), a lock-step trajectory loop",
    mirrors="gem/vector/async_vector_env.py, gem/envs/registration.py make_vec",
    requires="gem",
    lockstep=True,
)
class GemVec(Lockstep):
    def __init__(self, ctx: RunContext) -> None:
        RELEASE_HANGS.clear()
        super().__init__(ctx)
        vector = import_gem("gem.vector.async_vector_env")
        fns = env_fns(ctx.workload, ctx.num_envs)
        self.envs = vector.AsyncVectorEnv(env_ids=[ctx.workload] * ctx.num_envs, env_fns=fns)

    def _reset(self, seeds):
        obs, _ = self.envs.reset(seed=list(seeds))
        return list(obs)

    def _step(self, ids, actions):
        obs, rewards, terms, truncs, _ = self.envs.step(dict(zip(ids, actions)))
        return list(zip(obs, rewards.tolist(), terms.tolist(), truncs.tolist()))

    def close(self, terminate: bool = False) -> None:
        RELEASE_HANGS.set()
        self.envs.thread_pool_executer.shutdown(wait=not terminate, cancel_futures=True)
