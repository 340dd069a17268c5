"""What the rollout layer hands across its boundaries: tasks in, trajectories and
groups out, and the objects a policy receives and returns.

Every record is a plain dataclass: it pickles, so a trainer may ship it to
another process (a learner, a replay buffer) as it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Task:
    """One group's task: every trajectory of the group starts from it.

    Attributes:
        seed: the seed of each trajectory's ``reset`` (None: the env's own).
        options: the ``options`` of each ``reset``.
        tag: run only on envs with this tag (``make_mix``'s ``env_tags``);
            None: any env.
        label: any value naming a kind of task (a difficulty, a data set);
            ``stats()`` compares each label's share of launched and of trained
            groups.
    """

    seed: int | None = None
    options: dict[str, Any] | None = None
    tag: str | None = None
    label: Any = None


class Status(str, enum.Enum):
    """How one attempt at a trajectory ended.

    ``TERMINATED``, ``TRUNCATED``, ``MAX_STEPS`` and ``POLICY_ENDED`` are
    finished trajectories; the others are failures and name their reason in
    ``stats()["dropped"]``.
    """

    RUNNING = "running"
    TERMINATED = "terminated"  # the env said so
    TRUNCATED = "truncated"  # the env (a TimeLimit) said so
    MAX_STEPS = "max_steps"  # the layer's per-trajectory step limit
    POLICY_ENDED = "policy_ended"  # the policy ended it (EndTrajectory), its context full
    ENV_ERROR = "env_error"  # the env raised; it was reset (on_env_error="reset")
    WORKER_DIED = "worker_died"  # its worker died and was restarted
    NODE_LOST = "node_lost"  # its node (ClusterVectorEnv's agent) was lost; it ran elsewhere
    DEADLINE = "deadline"  # one step ran past the vector env's step_deadline
    STALE = "stale"  # its oldest action fell more than max_lag versions behind
    POLICY_ERROR = "policy_error"  # the policy could not answer it (PolicyFailure)
    INVALID_ACTION = "invalid_action"  # the policy's action is outside the env's action space
    REDUNDANT = "redundant"  # its group already had group_size finished trajectories
    GROUP_DROPPED = "group_dropped"  # its group was dropped for another trajectory's failure

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({Status.TERMINATED, Status.TRUNCATED, Status.MAX_STEPS, Status.POLICY_ENDED})

#: Failures a retry may cure: the env's state was lost, or a policy that samples
#: may answer otherwise next time; not the task's fault alone. A cancelled attempt
#: (REDUNDANT, GROUP_DROPPED) is never retried.
RETRYABLE = frozenset(
    {
        Status.ENV_ERROR,
        Status.WORKER_DIED,
        Status.NODE_LOST,
        Status.DEADLINE,
        Status.STALE,
        Status.POLICY_ERROR,
        Status.INVALID_ACTION,
    }
)

#: Failures of the infrastructure, not of the task: retried without spending ``max_retries``
#: (each one ends a node agent's envs, so their number is bounded by the cluster's losses).
INFRASTRUCTURE = frozenset({Status.NODE_LOST})


@dataclass
class Trajectory:
    """One attempt at one trajectory of a group, step by step.

    ``observations[0]`` is the reset's observation and ``observations[t + 1]``
    the one after ``actions[t]``; ``rewards[t]``, ``infos[t]`` (the chosen
    keys only), ``versions[t]`` (the policy version that chose ``actions[t]``)
    and ``extras[t]`` (what the policy returned beside the action) belong to
    the same step. ``reset_info`` holds the reset's chosen info keys.

    Timings, in seconds: ``env_s`` from each command's send to its result's
    arrival, ``policy_s`` inside the policy calls that chose its actions,
    ``wait_s`` the rest of its life (waiting for a batch, a slot, the policy).
    """

    task: Task
    group_id: int
    index: int  # which of the group's trajectories (0 .. group_size + redundancy - 1)
    attempt: int  # 0, then 1 for its first retry, ...
    env_id: int = -1
    env_tag: str | None = None
    observations: list[Any] = field(default_factory=list)
    actions: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    reset_info: dict[str, Any] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)
    status: Status = Status.RUNNING
    reason: str = ""  # a failure's detail (the env's error message, the deadline), or why
    # the policy ended it (POLICY_ENDED)
    retried_after: list[Status] = field(default_factory=list)  # earlier attempts' failures
    started_s: float = 0.0  # time.monotonic()
    ended_s: float = 0.0
    env_s: float = 0.0
    policy_s: float = 0.0

    @property
    def seed(self) -> int | None:
        return self.task.seed

    @property
    def options(self) -> dict[str, Any] | None:
        return self.task.options

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def num_steps(self) -> int:
        return len(self.actions)

    @property
    def oldest_version(self) -> int | None:
        """The version of its oldest action (None before its first)."""
        return min(self.versions) if self.versions else None

    @property
    def wall_s(self) -> float:
        return self.ended_s - self.started_s

    @property
    def wait_s(self) -> float:
        return max(self.wall_s - self.env_s - self.policy_s, 0.0)


@dataclass
class Group:
    """A complete group: the trajectories a trainer compares (GRPO's group).

    ``trajectories`` are the kept ones, ``group_size`` of them (fewer only
    when ``min_survivors`` let the survivors stand), in order of ``index``;
    ``failed`` are the attempts that failed or were cancelled on the way,
    each with its status. ``version`` is the policy version when the group was
    handed over; ``lag`` is ``version`` minus its oldest action's version.
    """

    group_id: int
    task: Task
    trajectories: list[Trajectory]
    failed: list[Trajectory]
    version: int = 0
    launched_s: float = 0.0
    completed_s: float = 0.0

    @property
    def rewards(self) -> np.ndarray:
        """Each kept trajectory's total reward."""
        return np.array([t.total_reward for t in self.trajectories], dtype=np.float64)

    @property
    def retries(self) -> int:
        """Attempts launched as retries, kept or not."""
        return sum(1 for t in (*self.trajectories, *self.failed) if t.attempt > 0)

    @property
    def oldest_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.oldest_version) is not None]
        return min(versions) if versions else None

    @property
    def lag(self) -> int:
        oldest = self.oldest_version
        return 0 if oldest is None else self.version - oldest


@dataclass
class PolicyBatch:
    """What a batched policy receives: rows that each await an action.

    ``observations`` are batched as the vector env batches them (an array with
    one row each, a tuple of strings for text); ``trajectories[i]`` is row
    ``i``'s trajectory so far (its history: ``observations``, ``actions``),
    ``env_ids[i]`` its env.
    """

    observations: Any
    trajectories: list[Trajectory]
    env_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass
class PolicyOutput:
    """A batched policy's answer with extras: ``actions`` (one per row) and
    ``extras[i]``, any object the trajectory keeps beside ``actions[i]``
    (token ids, log-probabilities)."""

    actions: Any
    extras: list[Any] | None = None


@dataclass
class PolicyRow:
    """What a per-row (async) policy receives: one row awaiting an action."""

    observation: Any
    trajectory: Trajectory
    env_id: int


@dataclass
class RowOutput:
    """A per-row policy's answer with an extra kept beside the action, and the policy
    version that chose it where the policy knows it better than the call's start (a server
    policy whose tokens came from later weights); None: the version at the call's start."""

    action: Any
    extra: Any = None
    version: int | None = None


class PolicyError(RuntimeError):
    """The policy raised or answered wrongly; raised in the trainer's thread by
    ``get_batch`` with the rows (env ids) it was given."""


class PolicyFailure(Exception):
    """Raised by a per-row policy that cannot answer a row (an inference server down past
    its retries), or put by a batched policy in that row's place in its list of actions: the
    row's trajectory fails as ``policy_error`` with this message as its reason, and the group
    policy counts, retries or drops it; the rollouts go on. Any other exception from a policy
    is a :class:`PolicyError`, which stops them. An action outside the env's action space
    fails its trajectory the same way, as ``invalid_action``."""


class EndTrajectory(Exception):
    """Raised by a per-row policy that will not act on a row and ends its trajectory instead,
    as finished (an inference server's context that holds no more of the conversation), or
    put by a batched policy in that row's place in its list of actions: the trajectory ends
    as ``policy_ended`` with this message as its ``reason``, counts as completed and is
    handed over with its group like one the env truncated; its env starts its next task."""
