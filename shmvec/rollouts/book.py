"""The rollouts' book: every task, group and attempt from submission to
hand-over or drop, which env runs which attempt, and what to launch or hand
over next; plain state with no threads and no env calls, changed only under
the rollouts' lock by the trainer's calls and by the loop.

The loop tells the book what the envs returned (``reset_done``,
``step_done``, ``failed``, ``returned``) and what the policy answered
(``answered``); the book applies the group policy and the lag rule, keeps the
:class:`~shmvec.rollouts.groups.Ledger`, and says which attempts to start on
which envs (``launch``). ``get_batch`` asks it whether a batch can be handed
over (``can_hand_over``) and takes it (``hand_over``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shmvec.rollouts.groups import Decision, GroupPolicy, GroupState, Ledger
from shmvec.rollouts.lag import LagRule
from shmvec.rollouts.records import FINISHED, Group, Status, Task, Trajectory


@dataclass(frozen=True)
class Resolved:
    """A group's end, for the bias figures of ``stats()``."""

    failed: bool  # met any failure on the way
    wall_s: float  # from launch to completion or drop
    label: Any
    delivered: bool

    @classmethod
    def of(cls, group: GroupState, delivered: bool) -> Resolved:
        wall_s = group.completed_s - group.launched_s
        return cls(group.any_failure, wall_s, group.task.label, delivered)


class Book:
    """Tasks, groups and attempts of one ``Rollouts`` (see the module).

    Args:
        group_policy: what a group does with failures.
        lag: versions and the lag bound.
        env_tags: each env's tag (None: untagged).
        mode: ``"async"`` or ``"sync"`` (groups start only for a waiting
            ``get_batch``).
        max_steps: a trajectory that reaches this many actions ends as
            ``max_steps``.
        tasks: a task source drawn as envs free up.
    """

    def __init__(
        self,
        group_policy: GroupPolicy,
        lag: LagRule,
        env_tags: list[str | None],
        *,
        mode: str = "async",
        max_steps: int | None = None,
        tasks: Iterable[Task] | None = None,
    ) -> None:
        self.group_policy, self.lag, self.mode, self.max_steps = group_policy, lag, mode, max_steps
        self.env_tags = env_tags
        self.ledger = Ledger()
        self.tasks: deque[Task] = deque()
        self.source: Iterator[Task] | None = iter(tasks) if tasks is not None else None
        self.groups: dict[int, GroupState] = {}  # unresolved, and complete not yet handed over
        self.complete: dict[int, None] = {}  # group ids, in order of completion
        self.next_group = 0
        self.queue: deque[Trajectory] = deque()  # attempts awaiting an env, retries first
        self.active: set[int] = set()  # ids of launched attempts that have not ended
        self.wanted: int | None = None  # the n of a get_batch that waits now
        self.free: dict[str | None, deque[int]] = {}
        for env, tag in enumerate(env_tags):
            self.free.setdefault(tag, deque()).append(env)
        self.on_env: list[Trajectory | None] = [None] * len(env_tags)
        self.retired: set[int] = set()  # envs that take no new work (their node is not live)
        self.busy: set[int] = set()  # envs with a command the vector env has not returned
        self.resolved: list[Resolved] = []
        self.labels_launched: dict[Any, int] = {}
        self.steps = 0
        self.held = False  # the last launch: an env was free, a task waited, the bound said no
        self.resolutions = 0  # groups completed, dropped or reopened: what get_batch waits for

    # ------------------------------------------------------------------ tasks

    def check_task(self, task: Any, where: str) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"{where} must be a shmvec.rollouts.Task, got {task!r}")
        if task.tag is not None and task.tag not in self.free:
            raise ValueError(
                f"{where} needs env tag {task.tag!r}; the envs' tags are "
                f"{sorted(map(str, self.free))}"
            )

    def tasks_left(self) -> bool:
        return bool(self.tasks) or self.source is not None

    def _next_task(self) -> Task | None:
        if self.tasks:
            return self.tasks.popleft()
        if self.source is not None:
            try:
                task = next(self.source)
            except StopIteration:
                self.source = None
                return None
            self.check_task(task, "a task from tasks=")
            return task
        return None

    # -------------------------------------------------------------- launching

    def launch(self, now: float) -> list[tuple[int, Trajectory]]:
        """Starts the groups that may start, and pairs queued attempts with free
        envs of their tag: the (env, attempt) pairs to reset."""
        self.held = False
        while self._may_launch_group():
            task = self._next_task()
            if task is None:
                break
            group = GroupState(self.next_group, task, self.group_policy, now)
            self.next_group += 1
            self.groups[group.group_id] = group
            self.ledger.submitted += 1
            self.labels_launched[task.label] = self.labels_launched.get(task.label, 0) + 1
            self.queue.extend(group.current)
        return self._assign(now)

    def _may_launch_group(self) -> bool:
        """Whether a new group may start now (mode, free envs, the lag rule)."""
        if self.mode == "sync":
            return self.wanted is not None and len(self.groups) < self.wanted
        if sum(len(free) for free in self.free.values()) <= len(self.queue):
            return False  # groups start as envs free up: nothing waits in a queue for long
        admitted = self.lag.admits(len(self.groups), self.wanted)
        self.held = not admitted and self.tasks_left()
        return admitted

    def _assign(self, now: float) -> list[tuple[int, Trajectory]]:
        starts: list[tuple[int, Trajectory]] = []
        waiting: deque[Trajectory] = deque()
        while self.queue:
            traj = self.queue.popleft()
            if traj.status is not Status.RUNNING:
                continue  # cancelled while queued: it never launched
            env = self._free_env(traj.task.tag)
            if env is None:
                waiting.append(traj)
                if traj.task.tag is None:
                    break
                continue
            traj.env_id, traj.env_tag, traj.started_s = env, self.env_tags[env], now
            self.on_env[env] = traj
            self.active.add(id(traj))
            self.ledger.launch(traj)
            starts.append((env, traj))
        waiting.extend(self.queue)
        self.queue = waiting
        # Busy from now on, so that an attempt failed meanwhile (set_version)
        # leaves its env to the result's arrival instead of freeing it.
        self.busy.update(env for env, _ in starts)
        return starts

    def _free_env(self, tag: str | None) -> int | None:
        if tag is not None:
            free = self.free.get(tag)
            return free.popleft() if free else None
        for free in self.free.values():
            if free:
                return free.popleft()
        return None

    # ------------------------------------------------------- what envs return

    def returned(self, env: int) -> Trajectory | None:
        """A result of ``env`` came back: its running attempt, or None (the
        env is free again: its attempt was cancelled or failed meanwhile)."""
        self.busy.discard(env)
        traj = self.on_env[env]
        if traj is None or traj.status is not Status.RUNNING:
            self._release(env)
            return None
        return traj

    def reset_done(self, traj: Trajectory, observation: Any, info: dict[str, Any]) -> None:
        traj.observations.append(observation)
        traj.reset_info = info

    def step_done(
        self,
        traj: Trajectory,
        observation: Any,
        reward: float,
        terminated: bool,
        truncated: bool,
        info: dict[str, Any],
        now: float,
    ) -> bool:
        """Records a step; returns whether the trajectory awaits an action."""
        self.steps += 1
        traj.rewards.append(float(reward))
        traj.observations.append(observation)
        traj.infos.append(info)
        status = None
        if terminated:
            status = Status.TERMINATED
        elif truncated:
            status = Status.TRUNCATED
        elif self.max_steps is not None and len(traj.actions) >= self.max_steps:
            status = Status.MAX_STEPS
        if status is None:
            return True
        traj.status = status
        self._end(traj, status, now)
        group = self.groups[traj.group_id]
        self._apply(group, group.finish(traj, now), now)
        return False

    def policy_ended(self, traj: Trajectory, reason: str, now: float) -> None:
        """The policy ended a running attempt that awaited its action (``EndTrajectory``):
        it is finished, as ``POLICY_ENDED``."""
        traj.status, traj.reason = Status.POLICY_ENDED, reason
        self._end(traj, Status.POLICY_ENDED, now)
        group = self.groups[traj.group_id]
        self._apply(group, group.finish(traj, now), now)

    def failed(self, traj: Trajectory, status: Status, reason: str, now: float) -> None:
        """A running attempt failed (its env's state was lost, or it went stale)."""
        traj.reason = reason
        retry = status is not Status.STALE or self.lag.retries_stale
        group = self.groups[traj.group_id]
        decision = group.fail(traj, status, retry, now)
        self._end(traj, status, now)
        self._apply(group, decision, now)

    def answered(self, traj: Trajectory, action: Any, extra: Any, version: int, now: float) -> bool:
        """Records the policy's action for a running attempt; returns whether to
        send it (False: the attempt went stale, its env waits for the next)."""
        traj.actions.append(action)
        traj.extras.append(extra)
        traj.versions.append(version)
        if self.lag.stale(traj.oldest_version):
            self.failed(traj, Status.STALE, self._stale_reason(traj), now)
            return False
        self.busy.add(traj.env_id)
        return True

    # --------------------------------------------------------------- outcomes

    def _end(self, traj: Trajectory, status: Status, now: float) -> None:
        """Counts an attempt's end; frees its env unless a result is still due."""
        if id(traj) in self.active:
            self.active.discard(id(traj))
            self.ledger.end(status)
        traj.ended_s = traj.ended_s or now
        self._release_if_idle(traj.env_id, traj)

    def _release_if_idle(self, env: int, traj: Trajectory) -> None:
        if env >= 0 and env not in self.busy and self.on_env[env] is traj:
            self._release(env)

    def _release(self, env: int) -> None:
        self.on_env[env] = None
        if env not in self.retired:
            self.free[self.env_tags[env]].append(env)

    def set_lost(self, envs: Any) -> None:
        """``envs`` take no new work now (a vector env's ``lost_env_ids``): no attempt is
        launched on them; an env that left that set (its node agent is back) is free again
        once idle."""
        if len(envs) == len(self.retired) and self.retired.issuperset(envs):
            return
        back = self.retired.difference(envs)
        self.retired = set(envs)
        for tag, free in self.free.items():
            self.free[tag] = deque(env for env in free if env not in self.retired)
        for env in sorted(back):
            if self.on_env[env] is None and env not in self.busy:
                self.free[self.env_tags[env]].append(env)

    def _apply(self, group: GroupState, decision: Decision, now: float) -> None:
        self.queue.extendleft(reversed(decision.launch))  # retries before new groups
        for traj, status in decision.cancel:
            group.cancel(traj, status, now)
            self._end(traj, status, now)
        if decision.resolved:
            self.resolutions += 1
            if group.complete:
                self.complete[group.group_id] = None
            else:
                assert group.dropped is not None
                self._drop_group(group)

    def _drop_group(self, group: GroupState) -> None:
        assert group.dropped is not None
        del self.groups[group.group_id]
        self.complete.pop(group.group_id, None)
        self.ledger.groups_dropped[group.dropped.value] += 1
        self.resolved.append(Resolved.of(group, delivered=False))

    # --------------------------------------------------------------- versions

    def set_version(self, version: int, now: float) -> None:
        """The policy's new version; trajectories now past the bound go stale."""
        self.lag.set_version(version)
        for group in list(self.groups.values()):
            self._sweep(group, now)

    def _sweep(self, group: GroupState, now: float) -> None:
        """Fails the group's kept or running attempts that are past the bound (a
        finished one stops counting as completed) and lets the group decide
        again; every one of them is counted, even once the group is dropped."""
        if self.lag.max_lag is None:
            return
        stale = [t for t in group.live() if self.lag.stale(t.oldest_version)]
        for traj in stale:
            pending = group.group_id in self.groups
            if traj.status is Status.RUNNING and pending:
                self.failed(traj, Status.STALE, self._stale_reason(traj), now)
            elif traj.status in FINISHED:
                traj.reason = self._stale_reason(traj)
                self.ledger.unfinish()
                if not pending:
                    traj.status = Status.STALE  # its group was dropped just now
                    continue
                self.complete.pop(group.group_id, None)
                self.resolutions += 1
                self._apply(group, group.unfinish(traj, self.lag.retries_stale, now), now)

    def _stale_reason(self, traj: Trajectory) -> str:
        return f"version {traj.oldest_version} < {self.lag.version} - {self.lag.max_lag}"

    # --------------------------------------------------------------- hand-over

    def pending(self) -> tuple[int, int]:
        """Complete groups not yet handed over, and unresolved groups."""
        return len(self.complete), len(self.groups) - len(self.complete)

    def can_hand_over(self, n: int, now: float) -> bool:
        """Whether ``n`` complete groups can be handed over now (see
        :meth:`~shmvec.rollouts.lag.LagRule.choose`)."""
        return self._choose(n, now) is not None

    def _choose(self, n: int, now: float) -> list[int] | None:
        for g in list(self.complete):
            self._sweep(self.groups[g], now)
        complete = [(g, self.groups[g].oldest_version()) for g in self.complete]
        running = [
            group.oldest_version() for g, group in self.groups.items() if g not in self.complete
        ]
        return self.lag.choose(complete, running, n)

    def hand_over(self, n: int, now: float) -> list[Group]:
        """Hands over the ``n`` complete groups the lag rule chooses; checks the
        bound for each and both ledger identities."""
        chosen = self._choose(n, now)
        if chosen is None:
            raise AssertionError(f"rollouts: hand_over({n}) while the batch cannot be handed over")
        batch = []
        for g in chosen:
            group = self.groups.pop(g)
            del self.complete[g]
            self.resolved.append(Resolved.of(group, delivered=True))
            batch.append(group.to_group(self.lag.version))
        for handed in batch:
            if self.lag.max_lag is not None and handed.lag > self.lag.max_lag:
                raise AssertionError(
                    f"rollout lag bound: group {handed.group_id} handed over at version "
                    f"{handed.version} with lag {handed.lag} > max_lag {self.lag.max_lag}"
                )
        self.lag.handed_over()
        self.ledger.delivered += len(batch)
        self.check()
        return batch

    def check(self) -> None:
        """Raises AssertionError if an attempt or a group is unaccounted for."""
        self.ledger.check(len(self.active), len(self.groups))
