"""shmvec over a Ray cluster: vector envs whose envs run in Ray actors on other nodes.

Two faces. ``RayVectorEnv`` steps one node-local ``ShmVectorEnv`` per actor as whole
blocks (``step``, or ``recv`` of whole actor batches): for PPO-style loops.
``ClusterVectorEnv`` is one vector env over ``NodeAgent`` actors, one per
node, that serve each env's result as soon as it is in: for ``Rollouts`` and
``AwaitableEnvs``, which run on it by their constructor alone; a lost node's envs end
as ``node_lost`` results, its agent starts again where Ray can place it, and agents join
as nodes do and leave by ``drain`` (docs/guides/ray.md).

Example:
    >>> import numpy as np
    >>> import ray
    >>> from shmvec.ray import ClusterVectorEnv, RayVectorEnv
    >>> _ = ray.init(num_cpus=2, include_dashboard=False)  # doctest: +SKIP
    >>> envs = RayVectorEnv("CartPole-v1", num_actors=2, envs_per_actor=4)  # doctest: +SKIP
    >>> obs, infos = envs.reset(seed=0)  # doctest: +SKIP
    >>> obs.shape  # doctest: +SKIP
    (8, 4)
    >>> envs.close()  # doctest: +SKIP
    >>> envs = ClusterVectorEnv("CartPole-v1", num_agents=2, envs_per_agent=4)  # doctest: +SKIP
    >>> envs.async_reset(seed=0)  # doctest: +SKIP
    >>> obs, rewards, terminations, truncations, infos = envs.recv()  # doctest: +SKIP
    >>> envs.send(np.zeros(len(obs), np.int64), infos["env_id"])  # doctest: +SKIP
    >>> envs.close()  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shmvec.ray needs Ray: pip install 'shmvec[ray]' (or pip install 'ray>=2.9')"
    ) from exc

from shmvec.ray.actors import ActorDiedError, EnvActor
from shmvec.ray.agent import NODE_LOST as NODE_LOST
from shmvec.ray.agent import NodeAgent
from shmvec.ray.cluster import ClusterVectorEnv
from shmvec.ray.vector import RayVectorEnv

__all__ = [
    "ActorDiedError",
    "ClusterVectorEnv",
    "EnvActor",
    "NodeAgent",
    "RayVectorEnv",
]
