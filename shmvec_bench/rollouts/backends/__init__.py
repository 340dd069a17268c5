"""The rollout runners, one module each, registered by name in ``REGISTRY``.

Each runner is opened with a ``RunContext`` and offers ``get_batch()`` (complete
groups), ``env_steps``, ``env_pids()`` (the processes that run its envs, for the
fault injector and the CPU account), ``stats()`` and ``close(terminate)``. The runners
with ``on_cluster = True`` run over a Ray cluster (``shmvec_bench.rollouts.cluster``).
"""

# Registration order is the order of the report's rows.
from shmvec_bench.rollouts.backends import (  # noqa: E402, F401, I001
    gem_vec,
    gym_async,
    ragen_serial,
    roll_threads,
    shmvec_layer,
    shmvec_loop,
    skyrl_asyncio,
    verl_procs,
    # The cluster runners (Ray): the benchmark runs them over a simulated cluster.
    shmvec_cluster,
    ray_blocks,
    roll_env_actors,
    verl_agent_actors,
)
from shmvec_bench.rollouts.backends.base import REGISTRY, Backend, register

__all__ = ["REGISTRY", "Backend", "register"]
