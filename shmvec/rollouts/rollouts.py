"""The trainer's side of the rollout layer: tasks in (``submit`` or a task
source), complete groups of trajectories out (``get_batch``), policy versions
in (``set_version``), counts out (``stats``).

The parts: the :class:`~shmvec.rollouts.book.Book` (tasks, groups, attempts,
the group policy and the ledger), the :class:`~shmvec.rollouts.lag.LagRule`
(the lag bound), and the :class:`~shmvec.rollouts.loop.Loop`, a thread that
owns the vector env (``ShmVectorEnv``, ``make_mix`` or ``RayVectorEnv`` in
async mode, through its public async API only) and the policy's runner.
``Rollouts`` checks the trainer's arguments and waits on the loop.

Who may call what: ``submit``, ``get_batch``, ``set_version``, ``stats`` and
``close`` from the trainer's threads; the book is changed only under the
rollouts' lock.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from shmvec.rollouts.book import Book, Resolved
from shmvec.rollouts.groups import GroupPolicy
from shmvec.rollouts.lag import LagRule
from shmvec.rollouts.loop import Loop, check_envs
from shmvec.rollouts.policies import (
    AsyncPolicy,
    AsyncPolicyRunner,
    BatchedPolicyRunner,
    PolicyRunner,
)
from shmvec.rollouts.records import Group, PolicyBatch, PolicyError, Task

__all__ = ["Rollouts", "check_envs"]


class Rollouts:
    """Tasks in, complete groups of trajectories out, over an async vector env.

    Args:
        envs: a vector env in async mode (``batch_size < num_envs``):
            ``ShmVectorEnv``, ``make_mix``'s or ``RayVectorEnv``. Its
            ``on_env_error`` must be ``"reset"`` and its ``on_worker_death``
            (``on_actor_death``) ``"restart"``, so that failures come back as
            results; the rollouts own its async API while they run.
        policy: a batched callable, ``policy(PolicyBatch) -> actions`` (or a
            ``PolicyOutput`` with extras), or a per-row :class:`AsyncPolicy`
            (a bare coroutine function is wrapped in one).
        group_size: trajectories per group (default: ``envs.group_size``).
        tasks: an iterable of :class:`Task` that keeps groups flowing (drawn
            as envs free up), beside those given to ``submit``.
        mode: ``"async"``: envs keep stepping while the trainer trains;
            ``"sync"``: a group is launched only for the ``get_batch`` that
            needs it, so nothing runs between batches.
        groups_per_batch: the usual ``n`` of ``get_batch(n)``; needed with
            ``max_lag`` and ``on_stale="wait"`` in async mode, to admit groups
            by the batches that will take them.
        max_lag: no trajectory is handed over whose oldest action's policy
            version is more than ``max_lag`` behind the version at hand-over,
            whatever the trainer does with versions.
        on_stale: what happens to a trajectory that falls behind (finished or
            not, until its group is handed over). ``"wait"``: groups start only
            while the batches that will take them can do so in time (from the
            hand-over order and the version's rise per batch), and
            ``get_batch`` waits for the groups it must hand over now; a
            trajectory that falls behind all the same (a version jump larger
            than the rise per batch so far) runs again, as under ``"rerun"``.
            ``"drop"``: it fails as ``stale`` and is not retried (its group's
            ``min_survivors`` decides). ``"rerun"``: it fails as ``stale`` and
            runs again from its task (a retry, within ``max_retries``).
        max_retries, min_survivors, redundancy: the group policy
            (:class:`GroupPolicy`).
        max_steps: a trajectory that reaches this many actions ends as
            ``max_steps`` (the env is reset for its next task).
        info_keys: the info keys each step keeps in ``Trajectory.infos``.
    """

    def __init__(
        self,
        envs: Any,
        policy: Callable[[PolicyBatch], Any] | AsyncPolicy,
        *,
        group_size: int | None = None,
        tasks: Iterable[Task] | None = None,
        mode: str = "async",
        groups_per_batch: int | None = None,
        max_lag: int | None = None,
        on_stale: str = "wait",
        max_retries: int = 2,
        min_survivors: int | None = None,
        redundancy: int = 0,
        max_steps: int | None = None,
        info_keys: Iterable[str] = (),
    ) -> None:
        check_envs(envs)
        self.envs = envs
        self.num_envs, self.batch_size = envs.num_envs, envs.batch_size
        self.group_policy = GroupPolicy(
            group_size=envs.group_size if group_size is None else group_size,
            max_retries=max_retries,
            min_survivors=min_survivors,
            redundancy=redundancy,
        )
        self.group_size = self.group_policy.group_size
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
        lag = LagRule(max_lag=max_lag, on_stale=on_stale, groups_per_batch=groups_per_batch)
        if lag.waits and mode == "async" and not groups_per_batch:
            raise ValueError(
                "max_lag with on_stale='wait' admits groups by the batches that will take them: "
                "pass groups_per_batch (the n of get_batch(n))"
            )
        self.mode, self.max_lag, self.on_stale = mode, max_lag, on_stale
        self.groups_per_batch, self.max_steps = groups_per_batch, max_steps
        if inspect.iscoroutinefunction(policy):
            policy = AsyncPolicy(policy)
        if not callable(policy) and not isinstance(policy, AsyncPolicy):
            raise TypeError(f"policy must be a callable or an AsyncPolicy, got {policy!r}")
        self.env_tags: list[str | None] = list(
            getattr(envs, "env_tags", None) or [None] * self.num_envs
        )
        self._changed = threading.Condition(threading.Lock())  # what the waiters wait for
        self._book = Book(
            self.group_policy, lag, self.env_tags, mode=mode, max_steps=max_steps, tasks=tasks
        )
        self._lag = lag
        runner: PolicyRunner = (
            AsyncPolicyRunner(policy, self._policy_version, self._wake)
            if isinstance(policy, AsyncPolicy)
            else BatchedPolicyRunner(policy, self._policy_version, self._wake)
        )
        self._runner = runner
        self._loop = Loop(envs, self._book, runner, self._changed, tuple(info_keys))
        self._loop.start()

    @classmethod
    def from_env_fns(
        cls,
        env_fns: list[Callable[[], Any]],
        policy: Any,
        *,
        env_concurrency: int,
        batch_size: int | None = None,
        vector_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Rollouts:
        """A ``ShmVectorEnv`` set up for rollouts, and the rollouts over it.

        ``env_concurrency`` has no default: how many envs a worker steps at once
        is the one choice the envs' nature decides (envs that wait on tools:
        every env of a block, ``len(env_fns)``; envs that compute: ``1``).
        ``batch_size`` defaults to a sixteenth of the envs: each ``recv`` waits
        for a full batch, so small batches bring rows to the policy sooner (256
        envs waiting on tools, ``max_lag=1``: groups/s +10%, ``get_batch`` p99
        -21% and policy idle 8% against 24% with a quarter; docs: performance).
        ``close()`` closes the vector env too.
        """
        from shmvec.vector_env import client_vector_env

        envs = client_vector_env(env_fns, env_concurrency, batch_size, vector_kwargs or {})
        try:
            rollouts = cls(envs, policy, **kwargs)
        except BaseException:
            envs.close(terminate=True)
            raise
        rollouts._owns_envs = True
        return rollouts

    _owns_envs = False
    _closed = False

    @property
    def version(self) -> int:
        """The policy version now (``set_version``)."""
        return self._lag.version

    @property
    def steps(self) -> int:
        """Env steps recorded so far."""
        return self._book.steps

    def submit(
        self,
        tasks: Iterable[Task] | None = None,
        *,
        seeds: list[int | None] | None = None,
        options: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Queues tasks, one group each: a list of :class:`Task`, or ``seeds``
        (and ``options``, one per seed)."""
        if tasks is None:
            if seeds is None:
                raise ValueError("submit() needs tasks, or seeds (and options)")
            if options is not None and len(options) != len(seeds):
                raise ValueError(
                    f"submit(): {len(seeds)} seeds but {len(options)} options; give one each"
                )
            per_seed = options if options is not None else [None] * len(seeds)
            tasks = [Task(seed=s, options=o) for s, o in zip(seeds, per_seed)]
        elif seeds is not None or options is not None:
            raise ValueError("submit() takes tasks, or seeds and options, not both")
        tasks = list(tasks)
        for i, task in enumerate(tasks):
            self._book.check_task(task, f"tasks[{i}]")
        with self._changed:
            self._raise_error()
            self._book.tasks.extend(tasks)
            self._changed.notify_all()

    def get_batch(
        self,
        n_groups: int | None = None,
        *,
        num_trajectories: int | None = None,
        timeout: float | None = None,
    ) -> list[Group]:
        """Blocks until ``n_groups`` complete groups can be handed over and
        returns them (oldest policy version first); the envs keep stepping.

        ``num_trajectories`` instead: that many trajectories, a whole number of
        groups. Raises ``TimeoutError`` after ``timeout`` seconds, a
        ``PolicyError`` if the policy failed, and ``RuntimeError`` if the
        batch can never be complete (no tasks left).
        """
        n = self._batch_groups(n_groups, num_trajectories)
        deadline = None if timeout is None else time.monotonic() + timeout
        book = self._book
        with self._changed:
            try:
                while True:
                    self._raise_error()
                    book.wanted = n
                    if book.can_hand_over(n, time.monotonic()):
                        return book.hand_over(n, time.monotonic())
                    ready, unresolved = book.pending()
                    if ready + unresolved < n and not book.tasks_left():
                        raise RuntimeError(
                            f"get_batch({n}) can never be complete: {ready} groups are "
                            f"complete and {unresolved} running, and no task is left; "
                            "submit() more"
                        )
                    self._changed.notify_all()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"get_batch({n}) timed out after {timeout} s with {ready} groups "
                            f"complete and {unresolved} running"
                        )
                    self._changed.wait(left if left is not None else 1.0)
            finally:
                book.wanted = None

    def _batch_groups(self, n_groups: int | None, num_trajectories: int | None) -> int:
        if num_trajectories is not None:
            if n_groups is not None:
                raise ValueError("get_batch() takes n_groups or num_trajectories, not both")
            if not isinstance(num_trajectories, int) or num_trajectories < 1:
                raise ValueError(f"num_trajectories must be an int >= 1, got {num_trajectories!r}")
            if num_trajectories % self.group_size:
                raise ValueError(
                    f"num_trajectories={num_trajectories} is not a whole number of groups of "
                    f"group_size={self.group_size}"
                )
            n_groups = num_trajectories // self.group_size
        if n_groups is None:
            n_groups = self.groups_per_batch
        if not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"n_groups must be an int >= 1, got {n_groups!r}")
        return n_groups

    def set_version(self, version: int) -> None:
        """The policy's new version (after an update): the actions chosen from
        now on are stamped with it. With ``max_lag``, trajectories now too far
        behind fail as ``stale`` (see ``on_stale``)."""
        with self._changed:
            self._book.set_version(version, time.monotonic())
            self._runner.set_version(version)
            self._changed.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counts and shares since construction (see the rollouts guide)."""
        with self._changed:
            book, ledger, loop = self._book, self._book.ledger, self._loop
            policy_busy = self._runner.clock.busy_s()
            resolved = book.resolved
            delivered = [r for r in resolved if r.delivered]
            walls = [r.wall_s for r in resolved]
            slow_cut = float(np.percentile(walls, 90)) if walls else 0.0
            launched_labels = sum(book.labels_launched.values())
            return {
                "version": self.version,
                "launched": ledger.launched,
                "completed": ledger.completed,
                "in_flight": len(book.active),
                "dropped": {k: v for k, v in ledger.dropped.items() if v},
                "retries": ledger.retries,
                "groups_submitted": ledger.submitted,
                "groups_delivered": ledger.delivered,
                "groups_dropped": dict(ledger.groups_dropped),
                "groups_pending": len(book.groups),
                "steps": book.steps,
                "policy_calls": self._runner.calls,
                "awaiting_policy": self._runner.outstanding,
                "policy_busy_s": policy_busy,
                "active_s": loop.active_s,
                "policy_idle_share": 1.0 - policy_busy / loop.active_s if loop.active_s else 0.0,
                "lag_held_share": loop.held_s / max(time.monotonic() - loop.started_s, 1e-9),
                "failed_share": {
                    "resolved": _share(resolved, lambda r: r.failed),
                    "delivered": _share(delivered, lambda r: r.failed),
                },
                "slow_share": {
                    "resolved": _share(resolved, lambda r: r.wall_s > slow_cut),
                    "delivered": _share(delivered, lambda r: r.wall_s > slow_cut),
                },
                "label_share": {
                    label: {
                        "launched": count / launched_labels,
                        "delivered": _share(delivered, _has_label(label)),
                    }
                    for label, count in book.labels_launched.items()
                },
            }

    def close(self) -> None:
        """Stops the loop and the policy's runner (the vector env stays open unless
        ``from_env_fns`` made it). Closing again, or after the loop stopped on an error, is
        safe; ``submit`` and ``get_batch`` then raise."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.stop()
            self._runner.close()
        finally:
            if self._owns_envs and not self.envs.closed:
                self.envs.close(terminate=True)

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _raise_error(self) -> None:
        if self._closed:
            raise RuntimeError("these rollouts are closed")
        error = self._loop.error
        if error is not None:
            if isinstance(error, PolicyError):
                raise PolicyError(str(error)) from error.__cause__
            raise RuntimeError(f"the rollout loop stopped: {error!r}") from error

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _policy_version(self) -> int:
        return self._lag.version


def _has_label(label: Any) -> Callable[[Resolved], bool]:
    return lambda resolved: resolved.label == label


def _share(items: list[Resolved], predicate: Callable[[Resolved], bool]) -> float:
    return sum(1 for item in items if predicate(item)) / len(items) if items else 0.0
