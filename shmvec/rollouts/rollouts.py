"""Rollouts: complete groups of trajectories from an async vector env.

Data flow: the trainer submits tasks (``submit`` or a task source); each task
becomes a group of ``group_size`` (+ ``redundancy``) trajectory attempts,
queued until an env is free. A loop in a thread of its own owns the vector env
(``ShmVectorEnv``, ``make_mix`` or ``RayVectorEnv`` in async mode, through its
public ``async_reset``/``send``/``recv`` only): it starts each queued attempt
on a free env with ``async_reset(seed, options, env_ids)``, receives results,
records them, asks the policy for the rows that await an action and sends the
answers. An env whose trajectory ends starts its next one at once; there is no
turn barrier. Finished and failed attempts go to their ``GroupState``, which
retries, cancels, completes or drops the group; ``get_batch`` hands complete
groups to the trainer, oldest policy version first.

Who may call what: ``submit``, ``get_batch``, ``set_version``, ``stats`` and
``close`` from the trainer's threads; everything else runs in the loop thread.
"""

from __future__ import annotations

import inspect
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.batching import unbatch_info
from shmvec.rollouts.groups import Decision, GroupPolicy, GroupState, Ledger
from shmvec.rollouts.policies import (
    AsyncPolicy,
    AsyncPolicyRunner,
    BatchedPolicyRunner,
    PolicyRunner,
    split_row_output,
)
from shmvec.rollouts.records import (
    Group,
    PolicyBatch,
    PolicyError,
    PolicyRow,
    Status,
    Task,
    Trajectory,
)
from shmvec.rollouts.rows import rows_of, take_rows

#: Infos with which the vector env reports that an env lost its state, and the
#: failure each one is (``on_env_error="reset"``, ``on_worker_death="restart"``,
#: RayVectorEnv's ``on_actor_death="restart"``, ``step_deadline``).
FAILURE_INFOS = {
    "env_error": Status.ENV_ERROR,
    "worker_restarted": Status.WORKER_DIED,
    "actor_restarted": Status.WORKER_DIED,
    "step_deadline": Status.DEADLINE,
}
#: How long one ``recv`` blocks before the loop looks at its stop flag again.
RECV_SLICE_S = 0.25
#: How long ``recv`` blocks while policy answers may come in: an answer waits
#: at most this long to be sent (small beside a policy call).
POLL_S = 0.002
STALE_POLICIES = ("wait", "drop", "rerun")


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
        groups_per_batch: the ``n`` of ``get_batch(n)``; needed with
            ``max_lag`` and ``on_stale="wait"``, to bound launches.
        max_lag: no trajectory is handed over whose oldest action's policy
            version is more than ``max_lag`` behind the version at hand-over.
        on_stale: what keeps that bound. ``"wait"``: launches are admitted only
            while every group can still be handed over in time, and
            ``get_batch`` waits for the groups it must hand over now; nothing
            is discarded. ``"drop"``: a trajectory that falls behind fails as
            ``stale`` and is not retried (its group's ``min_survivors``
            decides). ``"rerun"``: it fails as ``stale`` and is run again from
            its task (a retry, within ``max_retries``).
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
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 0):
            raise ValueError(f"max_lag must be None or an int >= 0, got {max_lag!r}")
        if on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {STALE_POLICIES}, got {on_stale!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
        if groups_per_batch is not None and (
            not isinstance(groups_per_batch, int) or groups_per_batch < 1
        ):
            raise ValueError(f"groups_per_batch must be an int >= 1, got {groups_per_batch!r}")
        if max_lag is not None and on_stale == "wait" and mode == "async" and not groups_per_batch:
            raise ValueError(
                "max_lag with on_stale='wait' admits groups by the batches that will take them: "
                "pass groups_per_batch (the n of get_batch(n))"
            )
        self.mode, self.max_lag, self.on_stale = mode, max_lag, on_stale
        self.groups_per_batch, self.max_steps = groups_per_batch, max_steps
        self.info_keys = tuple(info_keys)
        if inspect.iscoroutinefunction(policy):
            policy = AsyncPolicy(policy)
        if not callable(policy) and not isinstance(policy, AsyncPolicy):
            raise TypeError(f"policy must be a callable or an AsyncPolicy, got {policy!r}")
        self.env_tags: list[str | None] = list(
            getattr(envs, "env_tags", None) or [None] * self.num_envs
        )
        self._action_space = envs.single_action_space

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # anything the waiters wait for
        self.version = 0
        self.ledger = Ledger()
        self._tasks: deque[Task] = deque()
        self._source: Iterator[Task] | None = iter(tasks) if tasks is not None else None
        self._groups: dict[int, GroupState] = {}  # unresolved, and complete not yet handed over
        self._complete: list[int] = []  # group ids, in order of completion
        self._next_group = 0
        self._queue: deque[Trajectory] = deque()  # attempts awaiting an env, retries first
        self._active: set[int] = set()  # ids of launched attempts that have not ended
        self._want = 0  # sync mode: groups get_batch still needs launched
        self._free: dict[str | None, deque[int]] = {}
        for env, tag in enumerate(self.env_tags):
            self._free.setdefault(tag, deque()).append(env)
        self._on_env: list[Trajectory | None] = [None] * self.num_envs
        self._busy: set[int] = set()  # envs with a command the engine has not returned
        self._expect_reset = np.zeros(self.num_envs, dtype=bool)
        self._sent_s = np.zeros(self.num_envs)
        self._resolved: list[
            tuple[bool, float, Any, bool]
        ] = []  # failed?, wall s, label, handed over?
        self._labels_launched: dict[Any, int] = {}
        self.steps = 0
        self._active_s = 0.0
        self._tick_s = time.monotonic()
        self._error: BaseException | None = None
        self._stopping = False

        self._runner: PolicyRunner = (
            AsyncPolicyRunner(policy, self._policy_version, self._wake)
            if isinstance(policy, AsyncPolicy)
            else BatchedPolicyRunner(policy, self._policy_version, self._wake)
        )
        self._thread = threading.Thread(target=self._run, name="shmvec-rollouts", daemon=True)
        self._thread.start()

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
        from shmvec.vector_env import ShmVectorEnv

        envs = ShmVectorEnv(
            env_fns,
            batch_size=batch_size or max(1, len(env_fns) // 16),
            env_concurrency=env_concurrency,
            on_env_error="reset",
            on_worker_death="restart",
            **(vector_kwargs or {}),
        )
        try:
            rollouts = cls(envs, policy, **kwargs)
        except BaseException:
            envs.close(terminate=True)
            raise
        rollouts._owns_envs = True
        return rollouts

    _owns_envs = False

    # ------------------------------------------------------------- trainer side

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
            self._check_task(task, f"tasks[{i}]")
        with self._changed:
            self._raise_error()
            self._tasks.extend(tasks)
            self._changed.notify_all()

    def _check_task(self, task: Any, where: str) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"{where} must be a shmvec.rollouts.Task, got {task!r}")
        if task.tag is not None and task.tag not in self._free:
            raise ValueError(
                f"{where} needs env tag {task.tag!r}; the envs' tags are "
                f"{sorted(map(str, self._free))}"
            )

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
        with self._changed:
            while True:
                self._raise_error()
                if self.on_stale == "drop" or self.on_stale == "rerun":
                    self._drop_stale_complete()
                must = self._must_hand_over()
                ready = [g for g in self._complete if g in self._groups]
                unresolved = len(self._groups) - len(ready)
                if self.mode == "sync":
                    self._want = max(0, n - len(ready) - unresolved)
                if len(ready) >= n and not any(not self._groups[g].complete for g in must):
                    return self._hand_over(ready, must, n)
                if len(ready) + unresolved < n and not self._tasks_left():
                    raise RuntimeError(
                        f"get_batch({n}) can never be complete: {len(ready)} groups are "
                        f"complete and {unresolved} running, and no task is left; submit() more"
                    )
                self._changed.notify_all()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"get_batch({n}) timed out after {timeout} s with {len(ready)} groups "
                        f"complete and {unresolved} running"
                    )
                self._changed.wait(left if left is not None else 1.0)

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
        if self.groups_per_batch and n_groups != self.groups_per_batch and self._waits_for_lag:
            raise ValueError(
                f"get_batch({n_groups}) with groups_per_batch={self.groups_per_batch}: the lag "
                "bound admits groups for batches of that size"
            )
        return n_groups

    @property
    def _waits_for_lag(self) -> bool:
        return self.max_lag is not None and self.on_stale == "wait"

    def set_version(self, version: int) -> None:
        """The policy's new version (after an update): the actions chosen from
        now on are stamped with it. With ``max_lag`` and ``on_stale`` "drop" or
        "rerun", trajectories now too far behind fail as ``stale``."""
        if not isinstance(version, int) or version < self.version:
            raise ValueError(
                f"version must be an int >= the current {self.version}, got {version!r}"
            )
        with self._changed:
            self.version = version
            self._runner.set_version(version)
            if self.max_lag is not None and self.on_stale != "wait":
                now = time.monotonic()
                for group in list(self._groups.values()):
                    for traj in group.running():
                        oldest = traj.oldest_version
                        if traj.status is not Status.RUNNING or group.resolved:
                            continue  # cancelled by a failure of its group's just now
                        if oldest is not None and version - oldest > self.max_lag:
                            self._fail(
                                group,
                                traj,
                                Status.STALE,
                                now,
                                f"version {oldest} < {version} - {self.max_lag}",
                            )
            self._changed.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counts and shares since construction (see the rollouts guide)."""
        with self._changed:
            ledger = self.ledger
            policy_busy = self._runner.clock.busy_s()
            delivered = [r for r in self._resolved if r[3]]
            walls = [r[1] for r in self._resolved]
            slow_cut = float(np.percentile(walls, 90)) if walls else 0.0
            launched_labels = sum(self._labels_launched.values())
            return {
                "version": self.version,
                "launched": ledger.launched,
                "completed": ledger.completed,
                "in_flight": len(self._active),
                "dropped": dict(ledger.dropped),
                "retries": ledger.retries,
                "groups_submitted": ledger.submitted,
                "groups_delivered": ledger.delivered,
                "groups_dropped": dict(ledger.groups_dropped),
                "groups_pending": len(self._groups),
                "steps": self.steps,
                "policy_calls": self._runner.calls,
                "awaiting_policy": self._runner.outstanding,
                "policy_busy_s": policy_busy,
                "active_s": self._active_s,
                "policy_idle_share": 1.0 - policy_busy / self._active_s if self._active_s else 0.0,
                "failed_share": {
                    "resolved": _share(self._resolved, lambda r: r[0]),
                    "delivered": _share(delivered, lambda r: r[0]),
                },
                "slow_share": {
                    "resolved": _share(self._resolved, lambda r: r[1] > slow_cut),
                    "delivered": _share(delivered, lambda r: r[1] > slow_cut),
                },
                "label_share": {
                    label: {
                        "launched": count / launched_labels,
                        "delivered": _share(delivered, _has_label(label)),
                    }
                    for label, count in self._labels_launched.items()
                },
            }

    def close(self) -> None:
        """Stops the loop (the vector env stays open unless ``from_env_fns`` made it)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._runner.close()
        if self._owns_envs and not self.envs.closed:
            self.envs.close(terminate=True)

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------- bookkeeping

    def _raise_error(self) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, PolicyError):
                raise PolicyError(str(error)) from error.__cause__
            raise RuntimeError(f"the rollout loop stopped: {error!r}") from error

    def _tasks_left(self) -> bool:
        return bool(self._tasks) or self._source is not None

    def _next_task(self) -> Task | None:
        if self._tasks:
            return self._tasks.popleft()
        if self._source is not None:
            try:
                task = next(self._source)
            except StopIteration:
                self._source = None
                return None
            self._check_task(task, "a task from tasks=")
            return task
        return None

    def _may_launch_group(self) -> bool:
        """Whether a new group may start now (mode, free envs, the lag bound)."""
        if self.mode == "sync":
            return self._want > 0
        if sum(len(free) for free in self._free.values()) <= len(self._queue):
            return False  # groups start as envs free up: nothing waits in a queue for long
        if self._waits_for_lag:
            assert self.groups_per_batch is not None and self.max_lag is not None
            taken = self.ledger.submitted - sum(self.ledger.groups_dropped.values())
            return taken < (self.version + self.max_lag + 1) * self.groups_per_batch
        return True

    def _launch_groups(self, now: float) -> None:
        while self._may_launch_group():
            task = self._next_task()
            if task is None:
                return
            group = GroupState(self._next_group, task, self.group_policy, now)
            self._next_group += 1
            self._groups[group.group_id] = group
            self.ledger.submitted += 1
            self._labels_launched[task.label] = self._labels_launched.get(task.label, 0) + 1
            self._queue.extend(group.current)
            if self.mode == "sync":
                self._want -= 1

    def _assign(self, now: float) -> list[tuple[int, Trajectory]]:
        """Queued attempts paired with free envs of their tag."""
        starts: list[tuple[int, Trajectory]] = []
        waiting: deque[Trajectory] = deque()
        while self._queue:
            traj = self._queue.popleft()
            if traj.status is not Status.RUNNING:
                continue  # cancelled while queued: it never launched
            env = self._free_env(traj.task.tag)
            if env is None:
                waiting.append(traj)
                if traj.task.tag is None:
                    break
                continue
            traj.env_id, traj.env_tag, traj.started_s = env, self.env_tags[env], now
            self._on_env[env] = traj
            self._active.add(id(traj))
            self.ledger.launch(traj)
            starts.append((env, traj))
        waiting.extend(self._queue)
        self._queue = waiting
        return starts

    def _free_env(self, tag: str | None) -> int | None:
        if tag is not None:
            free = self._free.get(tag)
            return free.popleft() if free else None
        for free in self._free.values():
            if free:
                return free.popleft()
        return None

    def _release(self, env: int) -> None:
        self._on_env[env] = None
        self._free[self.env_tags[env]].append(env)

    def _end(self, traj: Trajectory, status: Status, now: float) -> None:
        """Counts an attempt's end; frees its env unless a result is still due."""
        if id(traj) in self._active:
            self._active.discard(id(traj))
            self.ledger.end(status)
        traj.ended_s = traj.ended_s or now
        env = traj.env_id
        if env >= 0 and self._on_env[env] is traj and env not in self._busy:
            self._release(env)

    def _finish(self, group: GroupState, traj: Trajectory, status: Status, now: float) -> None:
        traj.status = status
        self._end(traj, status, now)
        self._apply(group, group.finish(traj, now), now)

    def _fail(
        self, group: GroupState, traj: Trajectory, status: Status, now: float, reason: str
    ) -> None:
        traj.reason = reason
        retry = not (status is Status.STALE and self.on_stale == "drop")
        decision = group.fail(traj, status, retry, now)
        self._end(traj, status, now)
        self._apply(group, decision, now)

    def _apply(self, group: GroupState, decision: Decision, now: float) -> None:
        self._queue.extendleft(reversed(decision.launch))  # retries before new groups
        for traj, status in decision.cancel:
            group.cancel(traj, status, now)
            self._end(traj, status, now)
        if decision.resolved:
            if group.complete:
                self._complete.append(group.group_id)
            else:
                assert group.dropped is not None
                self._drop_group(group, group.dropped.value)
            self._changed.notify_all()

    def _drop_group(self, group: GroupState, reason: str) -> None:
        del self._groups[group.group_id]
        self.ledger.groups_dropped[reason] += 1
        self._resolved.append(
            (group.any_failure, group.completed_s - group.launched_s, group.task.label, False)
        )

    def _must_hand_over(self) -> list[int]:
        """Groups that the next batch must take to keep the lag bound ("wait")."""
        if not self._waits_for_lag:
            return []
        assert self.max_lag is not None
        limit = self.version - self.max_lag
        return sorted(
            (
                g
                for g, group in self._groups.items()
                if (v := group.oldest_version()) is not None and v <= limit
            ),
            key=lambda g: self._groups[g].oldest_version() or 0,
        )

    def _drop_stale_complete(self) -> None:
        if self.max_lag is None:
            return
        for g in [g for g in self._complete if g in self._groups]:
            oldest = self._groups[g].oldest_version()
            if oldest is not None and self.version - oldest > self.max_lag:
                self._drop_group(self._groups[g], Status.STALE.value)

    def _hand_over(self, ready: list[int], must: list[int], n: int) -> list[Group]:
        order = {g: i for i, g in enumerate(ready)}
        chosen = [g for g in must if g in order][:n]
        rest = sorted(
            (g for g in ready if g not in set(chosen)),
            key=lambda g: (_version_or(self._groups[g].oldest_version(), self.version), order[g]),
        )
        chosen += rest[: n - len(chosen)]
        batch = []
        for g in chosen:
            group = self._groups.pop(g)
            self._resolved.append(
                (group.any_failure, group.completed_s - group.launched_s, group.task.label, True)
            )
            batch.append(group.to_group(self.version))
        taken = set(chosen)
        self._complete = [g for g in self._complete if g not in taken and g in self._groups]
        self.ledger.delivered += len(batch)
        self.ledger.check(len(self._active), len(self._groups))
        self._changed.notify_all()
        return batch

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _policy_version(self) -> int:
        return self.version

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _turn(self) -> bool:
        """One pass: start attempts, send answers, receive one batch, ask the policy."""
        with self._changed:
            if self._stopping:
                return False
            now = time.monotonic()
            if self._active:
                self._active_s += now - self._tick_s
            self._tick_s = now
            self._launch_groups(now)
            starts = self._assign(now)
            # Busy from now on, so that an attempt failed meanwhile (set_version, a
            # policy failure among the answers) leaves its env to the result's arrival
            # instead of freeing it.
            self._busy.update(env for env, _ in starts)
            answers = self._take_answers()
            self._busy.update(env for env, _ in answers)
            if not starts and not answers and not self._busy:
                self._changed.wait(POLL_S if self._runner.outstanding else RECV_SLICE_S)
                return True
        if starts:
            self._start(starts)
        if answers:
            self._send(answers)
        if self._busy:
            self._receive()
        return True

    def _start(self, starts: list[tuple[int, Trajectory]]) -> None:
        seeds: list[int | None] = [None] * self.num_envs
        options: list[dict[str, Any] | None] = [None] * self.num_envs
        for env, traj in starts:
            seeds[env], options[env] = traj.task.seed, traj.task.options
        ids = np.array([env for env, _ in starts], dtype=np.int64)
        self._expect_reset[ids] = True
        self._sent_s[ids] = time.monotonic()
        self.envs.async_reset(seed=seeds, options=options, env_ids=ids)

    def _send(self, answers: list[tuple[int, Any]]) -> None:
        env_ids = [env for env, _ in answers]
        space = self._action_space
        out: Any = create_empty_array(space, len(answers))
        actions = concatenate(space, [a for _, a in answers], out)
        ids = np.array(env_ids, dtype=np.int64)
        self._expect_reset[ids] = False
        self._sent_s[ids] = time.monotonic()
        self.envs.send(actions, ids)

    def _receive(self) -> None:
        """Receives a batch (fewer rows when fewer envs run), records it and hands
        the rows that await an action to the policy's runner."""
        running = len(self._busy)
        timeout = POLL_S if self._runner.outstanding else RECV_SLICE_S
        try:
            result = self.envs.recv(timeout=timeout, partial=running < self.batch_size)
        except (multiprocessing.TimeoutError, TimeoutError):
            return
        with self._changed:
            # A row recorded early may belong to an attempt that a later row's
            # outcome cancelled (its group completed or was dropped): its env is
            # free already.
            rows = [(i, env) for i, env in self._record(result) if self._on_env[env]]
            if rows:
                self._ask(rows, result[0])

    def _record(self, result: tuple) -> list[tuple[int, int]]:
        """Records a received batch; returns the rows (row, env) that await an action."""
        obs, rewards, terminations, truncations, infos = result
        env_ids = infos["env_id"].tolist()
        now = time.monotonic()
        observations = rows_of(obs)
        failures = [
            (infos[f"_{key}"], infos[key], status)
            for key, status in FAILURE_INFOS.items()
            if f"_{key}" in infos
        ]
        needs = []
        for i, env in enumerate(env_ids):
            self._busy.discard(env)
            traj = self._on_env[env]
            if traj is None or traj.status is not Status.RUNNING:
                self._release(env)  # a cancelled attempt's last result
                continue
            traj.env_s += now - self._sent_s[env]
            group = self._groups[traj.group_id]
            failure = next(((values, status) for mask, values, status in failures if mask[i]), None)
            if failure is not None:
                self._fail(group, traj, failure[1], now, str(failure[0][i]))
                continue
            info = self._chosen_infos(infos, i)
            if self._expect_reset[env]:
                traj.observations.append(observations[i])
                traj.reset_info = info
            else:
                self.steps += 1
                traj.rewards.append(float(rewards[i]))
                traj.observations.append(observations[i])
                traj.infos.append(info)
                status = None
                if terminations[i]:
                    status = Status.TERMINATED
                elif truncations[i]:
                    status = Status.TRUNCATED
                elif self.max_steps is not None and len(traj.actions) >= self.max_steps:
                    status = Status.MAX_STEPS
                if status is not None:
                    self._finish(group, traj, status, now)
                    continue
            needs.append((i, env))
        return needs

    def _chosen_infos(self, infos: dict, row: int) -> dict[str, Any]:
        if not self.info_keys:
            return {}
        keys = [k for k in self.info_keys if k in infos]
        if not keys:
            return {}
        info = unbatch_info(
            {k: infos[k] for k in keys}
            | {f"_{k}": infos[f"_{k}"] for k in keys if f"_{k}" in infos},
            row,
        )
        return info

    def _ask(self, rows: list[tuple[int, int]], obs: Any) -> None:
        """Hands the policy's runner the rows ``(row, env)`` of the received
        observations ``obs``: each row's observation as its trajectory recorded
        it, and their batch (copied: the runner keeps it)."""
        trajs: list[Trajectory] = [self._on_env[env] for _, env in rows]  # type: ignore[misc]
        self._runner.submit(
            [PolicyRow(traj.observations[-1], traj, env) for traj, (_, env) in zip(trajs, rows)],
            take_rows(obs, [i for i, _ in rows]),
        )

    def _take_answers(self) -> list[tuple[int, Any]]:
        """The policy's answers for attempts still running, recorded, as (env, action)."""
        answers = []
        taken = self._runner.take()
        # Failures first: one may cancel its group's other attempts, whose answers are then
        # not sent (their envs are freed at once, not left to a result).
        for answer in taken:
            traj = answer.key[0]
            if answer.failure is not None and traj.status is Status.RUNNING:
                group = self._groups[traj.group_id]
                self._fail(group, traj, Status.POLICY_ERROR, time.monotonic(), answer.failure)
        for answer in taken:
            traj, version = answer.key
            if answer.error is not None:
                raise answer.error
            if traj.status is not Status.RUNNING or answer.failure is not None:
                continue  # cancelled or failed meanwhile; its env was freed then
            action, extra = split_row_output(answer.output)
            traj.actions.append(action)
            traj.extras.append(extra)
            traj.versions.append(version)
            traj.policy_s += answer.ended_s - answer.started_s
            answers.append((traj.env_id, action))
        return answers


def _version_or(version: int | None, default: int) -> int:
    return default if version is None else version


def _has_label(label: Any) -> Callable[[tuple], bool]:
    return lambda resolved: resolved[2] == label


def _share(items: list, predicate: Callable[[Any], bool]) -> float:
    return sum(1 for item in items if predicate(item)) / len(items) if items else 0.0


def check_envs(envs: Any) -> None:
    """Raises ValueError unless ``envs`` can run rollouts (async mode, failures as results)."""
    if not getattr(envs, "is_async", False):
        raise ValueError(
            "Rollouts needs a vector env in async mode (batch_size < num_envs), so that each "
            f"env steps on its own; got batch_size={getattr(envs, 'batch_size', None)} of "
            f"num_envs={getattr(envs, 'num_envs', None)}"
        )
    if getattr(envs, "on_env_error", "reset") != "reset":
        raise ValueError(
            "Rollouts turns env errors into trajectory outcomes: make the vector env with "
            "on_env_error='reset'"
        )
    death = getattr(envs, "on_worker_death", getattr(envs, "on_actor_death", "restart"))
    if death != "restart":
        raise ValueError(
            "Rollouts turns dead workers into trajectory outcomes: make the vector env with "
            "on_worker_death='restart' (RayVectorEnv: on_actor_death='restart')"
        )
    mode = getattr(envs, "autoreset_mode", AutoresetMode.NEXT_STEP)
    if AutoresetMode(mode) is AutoresetMode.SAME_STEP:
        raise ValueError(
            "Rollouts records each episode's last observation: use autoreset_mode NEXT_STEP "
            "or DISABLED, not SAME_STEP"
        )
