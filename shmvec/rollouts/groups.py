"""What happens to a group when its trajectories finish or fail, and the counts
that make every outcome visible.

``GroupState`` decides for one group (retry a failed trajectory, keep the
survivors, drop the group, cancel surplus ones); ``Ledger`` counts attempts and
groups so that, at every moment,

    launched == completed + sum(dropped.values()) + in_flight        (attempts)
    submitted == delivered + sum(groups_dropped.values()) + pending   (groups)

A finished trajectory that falls behind ``max_lag`` before its group is handed
over stops counting as completed and counts as ``stale``. Both are plain
objects, driven under the rollouts' lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shmvec.rollouts.records import INFRASTRUCTURE, RETRYABLE, Group, Status, Task, Trajectory


@dataclass(frozen=True)
class GroupPolicy:
    """What a group does with failures.

    Attributes:
        group_size: trajectories a complete group holds.
        max_retries: a failed trajectory is run again from the same seed and
            options up to this many times; a lost node (``node_lost``) is the
            infrastructure's failure and is retried without counting.
        min_survivors: when a trajectory fails past its retries, the group is
            kept if at least this many of its trajectories finished; None: the
            group is dropped (it needs all ``group_size``).
        redundancy: run ``group_size + redundancy`` trajectories and keep the
            first ``group_size`` to finish; the rest are cancelled.
    """

    group_size: int
    max_retries: int = 2
    min_survivors: int | None = None
    redundancy: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {self.group_size!r}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not isinstance(self.redundancy, int) or self.redundancy < 0:
            raise ValueError(f"redundancy must be an int >= 0, got {self.redundancy!r}")
        if self.min_survivors is not None and not (
            isinstance(self.min_survivors, int) and 1 <= self.min_survivors <= self.group_size
        ):
            raise ValueError(
                f"min_survivors must be None or an int in 1..group_size={self.group_size}, "
                f"got {self.min_survivors!r}"
            )

    @property
    def width(self) -> int:
        """Trajectories launched per group."""
        return self.group_size + self.redundancy


@dataclass
class Decision:
    """What the loop must do after an outcome: launch these attempts, cancel
    these (with the status to give them), and whether the group is resolved."""

    launch: list[Trajectory] = field(default_factory=list)
    cancel: list[tuple[Trajectory, Status]] = field(default_factory=list)
    resolved: bool = False


class GroupState:
    """One group from its launch to its hand-over or drop."""

    def __init__(self, group_id: int, task: Task, policy: GroupPolicy, now: float) -> None:
        self.group_id, self.task, self.policy = group_id, task, policy
        self.launched_s = now
        self.completed_s = 0.0
        self.current = [Trajectory(task, group_id, i, 0) for i in range(policy.width)]
        self.finished: list[Trajectory] = []  # in finishing order
        self.failed: list[Trajectory] = []
        self.lost = 0  # slots that failed past their retries
        self.complete = False
        self.dropped: Status | None = None
        self.any_failure = False
        self.first_loss: Status | None = None  # the failure that cost the group a trajectory

    @property
    def resolved(self) -> bool:
        return self.complete or self.dropped is not None

    def running(self) -> list[Trajectory]:
        """Attempts not yet ended (queued or on an env)."""
        return [t for t in self.current if t.status is Status.RUNNING]

    def live(self) -> list[Trajectory]:
        """The attempts it would hand over or still waits for: the kept
        finished ones and those running."""
        return [*self.finished[: self.policy.group_size], *self.running()]

    def finish(self, traj: Trajectory, now: float) -> Decision:
        """``traj`` finished (its status already one of ``FINISHED``)."""
        self.finished.append(traj)
        return self._settle(traj.status, now)

    def fail(self, traj: Trajectory, status: Status, retry: bool, now: float) -> Decision:
        """``traj`` failed with ``status``; ``retry``: whether this kind of failure
        may be retried at all (a stale one under ``on_stale="drop"`` may not)."""
        traj.status, traj.ended_s = status, traj.ended_s or now
        self.failed.append(traj)
        self.any_failure = True
        # A lost node is the infrastructure's failure: it spends none of max_retries.
        spent = traj.attempt - sum(s in INFRASTRUCTURE for s in traj.retried_after)
        may = status in INFRASTRUCTURE or spent < self.policy.max_retries
        if retry and status in RETRYABLE and may:
            again = Trajectory(self.task, self.group_id, traj.index, traj.attempt + 1)
            again.retried_after = [*traj.retried_after, status]
            self.current[traj.index] = again
            return Decision(launch=[again])
        self.lost += 1
        self.first_loss = self.first_loss or status
        return self._settle(status, now)

    def unfinish(self, traj: Trajectory, retry: bool, now: float) -> Decision:
        """A finished ``traj`` (of this group, not yet handed over) fell behind
        the lag bound: it fails as ``stale`` and the group, complete or not,
        decides again (a retry, its survivors, a drop)."""
        self.finished.remove(traj)
        self.complete = False
        traj.status = Status.RUNNING  # fail() gives it its failure
        return self.fail(traj, Status.STALE, retry, now)

    def _settle(self, status: Status, now: float) -> Decision:
        """Completes or drops the group once its outcome is decided."""
        if len(self.finished) >= self.policy.group_size:
            self.complete, self.completed_s = True, now
            return Decision(cancel=[(t, Status.REDUNDANT) for t in self.running()], resolved=True)
        if self.lost <= self.policy.redundancy and self.running():
            return Decision()  # a surplus trajectory can still take a lost one's place
        survivors = self.policy.min_survivors
        if survivors is not None and self.running():
            return Decision()  # those still running may yet make enough survivors
        if survivors is not None and len(self.finished) >= survivors:
            self.complete, self.completed_s = True, now
            return Decision(resolved=True)
        self.dropped, self.completed_s = self.first_loss or status, now
        return Decision(cancel=[(t, Status.GROUP_DROPPED) for t in self.running()], resolved=True)

    def cancel(self, traj: Trajectory, status: Status, now: float) -> None:
        """Ends a running attempt that the group no longer needs."""
        traj.status, traj.ended_s = status, now
        self.failed.append(traj)

    def oldest_version(self) -> int | None:
        """The oldest action version among the attempts it would hand over or
        still waits for (:meth:`live`)."""
        versions = [v for t in self.live() if (v := t.oldest_version) is not None]
        return min(versions) if versions else None

    def to_group(self, version: int) -> Group:
        kept = sorted(self.finished[: self.policy.group_size], key=lambda t: t.index)
        surplus = self.finished[self.policy.group_size :]
        return Group(
            group_id=self.group_id,
            task=self.task,
            trajectories=kept,
            failed=[*self.failed, *surplus],
            version=version,
            launched_s=self.launched_s,
            completed_s=self.completed_s,
        )


class Ledger:
    """Counts of attempts and groups, by outcome."""

    def __init__(self) -> None:
        self.launched = 0  # attempts started on an env
        self.retries = 0  # of which retries
        self.completed = 0  # attempts that finished
        self.dropped: Counter[str] = Counter()  # attempts that ended otherwise, by status
        self.submitted = 0  # groups
        self.delivered = 0
        self.groups_dropped: Counter[str] = Counter()

    def launch(self, traj: Trajectory) -> None:
        self.launched += 1
        self.retries += traj.attempt > 0

    def end(self, status: Status) -> None:
        if status.finished:
            self.completed += 1
        else:
            self.dropped[status.value] += 1

    def unfinish(self) -> None:
        """A completed attempt went stale before its group was handed over."""
        self.completed -= 1
        self.dropped[Status.STALE.value] += 1

    def check(self, in_flight: int, pending_groups: int) -> None:
        """Raises AssertionError if an attempt or a group is unaccounted for."""
        ended = self.completed + sum(self.dropped.values())
        if self.launched != ended + in_flight:
            raise AssertionError(
                f"rollout accounting: launched {self.launched} != completed {self.completed} "
                f"+ dropped {dict(self.dropped)} + in flight {in_flight}"
            )
        resolved = self.delivered + sum(self.groups_dropped.values())
        if self.submitted != resolved + pending_groups:
            raise AssertionError(
                f"rollout accounting: groups submitted {self.submitted} != delivered "
                f"{self.delivered} + dropped {dict(self.groups_dropped)} + pending {pending_groups}"
            )
