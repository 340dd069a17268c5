"""What every backend hands back, and the bookkeeping they share.

A backend runs *tasks*: task ``k`` has seed ``base_seed + k`` and is run by
``group_size`` trajectories (its group), each from ``reset(seed=...)`` to the end
of its episode. ``get_batch()`` returns ``groups_per_batch`` complete groups.
``TaskStream`` hands out the tasks, in order; ``GroupAssembler`` is the shared
plumbing of the runners without a turn barrier: a queue of (task, member) slots
that env loops take, and the groups that complete, in the order they complete.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from shmvec_bench.rollouts.workloads import is_straggler


@dataclass
class TrajRecord:
    """One finished trajectory."""

    task: int
    seed: int
    member: int
    started: float
    finished: float
    steps: int
    reward: float
    #: ``"done"`` (terminated), ``"truncated"``, or how it failed.
    status: str = "done"


@dataclass
class GroupRecord:
    """``group_size`` trajectories of one task."""

    task: int
    seed: int
    trajectories: list[TrajRecord]

    @property
    def finished(self) -> float:
        return max(t.finished for t in self.trajectories)


@dataclass
class RunContext:
    """What a backend is opened with."""

    workload: str
    num_envs: int
    group_size: int
    #: Complete groups per ``get_batch``: ``num_envs // group_size``.
    groups_per_batch: int
    #: The policy: ``policy(list[str]) -> list[str]``, with a ``clock``; or a
    #: ``shmvec_bench.rollouts.server.ServerRun`` (``--policy server``).
    policy: object
    seed: int = 0
    #: shmvec's async batch (rows per policy call); None: its rule (a sixteenth of the envs).
    batch_size: int | None = None
    #: shmvec's worker processes (None: one per core).
    num_workers: int | None = None
    #: shmvec's env threads per worker (None: every env of a block for a workload that
    #: waits, one for one that computes).
    env_concurrency: int | None = None
    #: shmvec's result slots (None: the vector env's default).
    ring_depth: int | None = None
    #: The layer's lag bound (``Rollouts(max_lag=...)``); the benchmark's trainer bumps
    #: the policy version after every batch. None: unbounded.
    max_lag: int | None = 1
    #: How the layer calls the policy: ``"batched"`` (a batched callable, called on every
    #: row that waits whenever it is free) or ``"rows"`` (an ``AsyncPolicy`` per row over
    #: a ``Batcher``, as an inference server batches requests).
    policy_mode: str = "batched"
    #: With the server policy: the layer's ``ServerPolicy(interrupt=...)``.
    interrupt: bool = False
    #: multiprocessing start method for process-based backends.
    context: str = "forkserver"
    stream: TaskStream = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = TaskStream(self.seed)


class TaskStream:
    """Tasks ``0, 1, 2, ...`` with seeds ``base_seed + k``; counts what it launched."""

    def __init__(self, base_seed: int = 0) -> None:
        self.base_seed = base_seed
        self._next = 0
        self._lock = threading.Lock()
        self.stragglers = 0

    def take(self) -> tuple[int, int]:
        """The next (task, seed)."""
        with self._lock:
            task = self._next
            self._next += 1
            seed = self.base_seed + task
            self.stragglers += is_straggler(seed)
            return task, seed

    @property
    def launched(self) -> int:
        return self._next


class GroupAssembler:
    """Slots of (task, seed, member) for env loops to take, and complete groups out.

    ``take()`` launches a new task when the previous one's members are all handed out;
    ``finish(traj)`` files a trajectory and, when its group is complete, queues the
    group; ``wait_groups(n)`` takes ``n`` complete groups, waiting as needed. Any
    thread may call any method.
    """

    def __init__(self, stream: TaskStream, group_size: int) -> None:
        self.stream, self.group_size = stream, group_size
        self._cond = threading.Condition()
        self._slots: collections.deque[tuple[int, int, int]] = collections.deque()
        self._partial: dict[int, list[TrajRecord]] = {}
        self._complete: collections.deque[GroupRecord] = collections.deque()
        self.error: BaseException | None = None

    def take(self) -> tuple[int, int, int]:
        with self._cond:
            if not self._slots:
                task, seed = self.stream.take()
                self._slots.extend((task, seed, m) for m in range(self.group_size))
            return self._slots.popleft()

    def finish(self, traj: TrajRecord) -> None:
        with self._cond:
            members = self._partial.setdefault(traj.task, [])
            members.append(traj)
            if len(members) == self.group_size:
                del self._partial[traj.task]
                self._complete.append(GroupRecord(traj.task, traj.seed, members))
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """An env loop died: ``wait_groups`` re-raises ``error``."""
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait_groups(self, n: int) -> list[GroupRecord]:
        with self._cond:
            while len(self._complete) < n:
                if self.error is not None:
                    raise self.error
                self._cond.wait(0.5)
            return [self._complete.popleft() for _ in range(n)]

    @property
    def ready(self) -> int:
        """Complete groups not taken yet."""
        with self._cond:
            return len(self._complete)

    @property
    def in_flight(self) -> int:
        """Tasks launched whose group is not complete yet."""
        with self._cond:
            return len(self._partial) + (1 if self._slots else 0)


def now() -> float:
    return time.perf_counter()
