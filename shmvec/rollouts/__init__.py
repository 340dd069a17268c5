"""Trajectories, not steps: complete groups of rollouts over an async vector env.

    >>> import gymnasium as gym
    >>> import numpy as np
    >>> import shmvec
    >>> from shmvec.rollouts import Rollouts, Task
    >>> envs = shmvec.ShmVectorEnv(
    ...     [lambda: gym.make("CartPole-v1")] * 8, num_workers=2, batch_size=4,
    ...     on_env_error="reset", on_worker_death="restart",
    ... )
    >>> policy = lambda batch: np.zeros(len(batch), dtype=np.int64)  # always push left
    >>> with Rollouts(envs, policy, group_size=4) as rollouts:
    ...     rollouts.submit([Task(seed=s) for s in range(3)])
    ...     groups = rollouts.get_batch(2)
    >>> [len(g.trajectories) for g in groups]
    [4, 4]
    >>> envs.close()

See the rollouts guide (docs/guides/rollouts.md).
"""

from shmvec.rollouts.groups import GroupPolicy
from shmvec.rollouts.policies import AsyncPolicy
from shmvec.rollouts.records import (
    EndTrajectory,
    Group,
    PolicyBatch,
    PolicyError,
    PolicyFailure,
    PolicyOutput,
    PolicyRow,
    RowOutput,
    Status,
    Task,
    Trajectory,
)
from shmvec.rollouts.replay import ReplayMismatch, ReplayReport, replay
from shmvec.rollouts.rollouts import Rollouts

__all__ = [
    "AsyncPolicy",
    "EndTrajectory",
    "Group",
    "GroupPolicy",
    "PolicyBatch",
    "PolicyError",
    "PolicyFailure",
    "PolicyOutput",
    "PolicyRow",
    "ReplayMismatch",
    "ReplayReport",
    "Rollouts",
    "RowOutput",
    "Status",
    "Task",
    "Trajectory",
    "replay",
]
