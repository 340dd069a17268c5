"""The ``ShmVectorEnv`` both shmvec runners step: async mode, failures as results."""

from __future__ import annotations

import shmvec
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.workloads import WORKLOADS, env_fns

#: ``step_deadline`` where steps may hang (W4): a step past it ends as truncated and its
#: env is replaced; ``env_timeout`` (a worker stuck in code the deadline cannot end is
#: killed and restarted) is set above it, as docs/guides/reliability.md advises.
HANG_TIMEOUT_S = 2.0
ENV_TIMEOUT_S = 5 * HANG_TIMEOUT_S


def async_batch(ctx: RunContext) -> int:
    """Rows per policy call: ``ctx.batch_size``, or a sixteenth of the envs (the layer's rule,
    ``Rollouts.from_env_fns``)."""
    return ctx.batch_size or max(1, ctx.num_envs // 16)


def open_envs(ctx: RunContext, autoreset_mode: str = "NextStep") -> shmvec.ShmVectorEnv:
    """The vector env as ``docs/guides/rollouts.md`` sets it up, with the context's knobs."""
    spec = WORKLOADS[ctx.workload]
    # Envs that wait on tools: every env of a block at once; envs that compute: one.
    concurrency = ctx.env_concurrency or (ctx.num_envs if spec.waits else None)
    extra = {} if ctx.ring_depth is None else {"ring_depth": ctx.ring_depth}
    return shmvec.ShmVectorEnv(
        env_fns(ctx.workload, ctx.num_envs),
        context=ctx.context,
        num_workers=ctx.num_workers,
        batch_size=async_batch(ctx),
        env_concurrency=concurrency,
        on_env_error="reset",
        on_worker_death="restart",
        step_deadline=HANG_TIMEOUT_S if spec.hang_p else None,
        env_timeout=ENV_TIMEOUT_S if spec.hang_p else None,
        autoreset_mode=autoreset_mode,
        **extra,
    )


def worker_pids(envs: shmvec.ShmVectorEnv) -> list[int]:
    return [p.pid for p in envs._pool.workers if p.is_alive()]


def describe(envs: shmvec.ShmVectorEnv) -> str:
    """The vector env's settings that the benchmark varies, one line."""
    return (
        f"batch_size={envs.batch_size} env_concurrency={envs.env_concurrency} "
        f"num_workers={envs.num_workers} ring_depth={envs.ring_depth}"
    )
