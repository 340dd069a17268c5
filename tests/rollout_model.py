"""Random schedules for the rollout layer's parts, with the promises checked
after every operation.

``BookModel`` drives a :class:`~shmvec.rollouts.book.Book` the way the loop
and the trainer do, with a simulated fleet (results in any order, env errors,
deadlines, any number of envs failing at once as their worker dies, policy
calls answered late) and a trainer that submits in bursts (or a task source), asks for batches of
varying sizes and moves the version by jumps and repeats. ``lag_rule_schedule``
drives a :class:`~shmvec.rollouts.lag.LagRule` alone against a trainer whose
version rises by a fixed amount per batch. Both raise AssertionError with the
operation that broke a promise; the tests print the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from shmvec.rollouts.book import Book
from shmvec.rollouts.groups import GroupPolicy
from shmvec.rollouts.lag import LagRule
from shmvec.rollouts.records import FINISHED, Group, Status, Task, Trajectory

VERSION_STEPS = (0, 1, 1, 1, 2, 3, 7, 1000)


@dataclass
class Config:
    on_stale: str
    mode: str
    max_lag: int | None
    group_size: int
    redundancy: int
    max_retries: int
    min_survivors: int | None
    num_envs: int
    groups_per_batch: int
    max_steps: int | None
    fault_rate: float
    end_rate: float  # rows whose trajectory the policy ends (EndTrajectory)

    @classmethod
    def draw(cls, rng: random.Random, on_stale: str, mode: str) -> Config:
        group_size = rng.randint(1, 4)
        return cls(
            on_stale=on_stale,
            mode=mode,
            max_lag=rng.choice([None, 0, 1, 1, 2, 3]),
            group_size=group_size,
            redundancy=rng.choice([0, 0, 1, 2]),
            max_retries=rng.choice([0, 1, 2, 5]),
            min_survivors=rng.choice([None, None, 1, group_size]),
            num_envs=rng.randint(1, 12),
            groups_per_batch=rng.randint(1, 4),
            max_steps=rng.choice([None, 1, 3]),
            fault_rate=rng.choice([0.0, 0.05, 0.2]),
            end_rate=rng.choice([0.0, 0.0, 0.05, 0.2]),
        )


@dataclass
class BookModel:
    """One random schedule over a Book (see the module)."""

    seed: int
    on_stale: str
    mode: str
    rng: random.Random = field(init=False)
    config: Config = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.config = c = Config.draw(self.rng, self.on_stale, self.mode)
        self.lag = LagRule(c.max_lag, c.on_stale, c.groups_per_batch)
        policy = GroupPolicy(c.group_size, c.max_retries, c.min_survivors, c.redundancy)
        tags: list[str | None] = [None] * c.num_envs
        self.book = Book(policy, self.lag, tags, mode=c.mode, max_steps=c.max_steps)
        self.now = 0.0
        self.inflight: dict[int, str] = {}  # env -> "reset" | "step"
        self.awaiting: list[tuple[Trajectory, int]] = []  # rows not yet in a policy call
        self.calls: list[tuple[int, list[tuple[Trajectory, int]]]] = []  # (stamp, rows)
        self.waiting: int | None = None  # the n of the trainer's get_batch
        self.next_seed = 0
        self.submitted: set[int] = set()
        self.delivered: list[int] = []
        self.dropped: set[int] = set()
        self.tasks_of: dict[int, int] = {}  # group id -> its task's seed
        self.handed: list[Group] = []
        self.ops: list[str] = []
        if self.rng.random() < 0.3:  # tasks drawn from a source as envs free up
            self.book.source = self._source(self.rng.randint(3, 40))

    def _source(self, count: int):
        for _ in range(count):
            seed, self.next_seed = self.next_seed, self.next_seed + 1
            self.submitted.add(seed)
            yield Task(seed=seed)

    # ---------------------------------------------------------- operations

    def run(self, ops: int) -> BookModel:
        actions = [
            (self.launch, 6),
            (self.result, 10),
            (self.worker_dies, 1),
            (self.policy_call, 4),
            (self.policy_answer, 4),
            (self.trainer, 4),
            (self.other_thread_set_version, 1),
        ]
        funcs, weights = zip(*actions)
        for _ in range(ops):
            op = self.rng.choices(funcs, weights)[0]
            self.now += 0.01
            self.ops.append(op.__name__)
            op()
            self.check()
        self.drain()
        return self

    def launch(self) -> None:
        groups = self.book.ledger.submitted
        starts = self.book.launch(self.now)
        if self.config.mode == "sync" and self.waiting is None:
            assert self.book.ledger.submitted == groups, "sync mode started a group unasked"
        for env, traj in starts:
            assert env not in self.inflight, f"env {env} started while a command is in flight"
            assert traj.status is Status.RUNNING
            self.inflight[env] = "reset"

    def result(self, failure: Status | None = None, env: int | None = None) -> None:
        if not self.inflight:
            return
        env = self.rng.choice(sorted(self.inflight)) if env is None else env
        kind = self.inflight.pop(env)
        traj = self.book.returned(env)
        if traj is None:
            return
        assert self.book.on_env[env] is traj
        if failure is None and self.rng.random() < self.config.fault_rate:
            failure = self.rng.choice([Status.ENV_ERROR, Status.DEADLINE])
        if failure is not None:
            self.book.failed(traj, failure, "a simulated failure", self.now)
            return
        obs = self.rng.random()
        if kind == "reset":
            self.book.reset_done(traj, obs, {})
        else:
            ended = self.rng.random() < 0.3
            truncated = not ended and self.rng.random() < 0.05
            reward = self.rng.random()
            if not self.book.step_done(traj, obs, reward, ended, truncated, {}, self.now):
                return
        self.awaiting.append((traj, env))

    def worker_dies(self) -> None:
        """Every in-flight env of one or more workers (blocks of envs) fails at once."""
        workers = self.rng.randint(1, 3)
        dead = self.rng.sample(range(workers + 1), self.rng.randint(1, workers + 1))
        for env in sorted(self.inflight):
            if env % (workers + 1) in dead:
                self.result(Status.WORKER_DIED, env)

    def policy_call(self) -> None:
        if self.awaiting:
            k = self.rng.randint(1, len(self.awaiting))
            rows, self.awaiting = self.awaiting[:k], self.awaiting[k:]
            self.calls.append((self.lag.version, rows))

    def policy_answer(self) -> None:
        if not self.calls:
            return
        stamp, rows = self.calls.pop(self.rng.randrange(len(self.calls)))
        # As the loop takes a call's answers: the rows the policy failed (PolicyFailure) or
        # ended (EndTrajectory) first, then the actions of those still running.
        outcomes = [self.rng.random() for _ in rows]
        c = self.config
        for (traj, env), u in zip(rows, outcomes):
            if traj.status is not Status.RUNNING:
                continue  # cancelled meanwhile
            assert self.book.on_env[env] is traj and env not in self.book.busy
            if u < c.fault_rate / 2:
                self.book.failed(traj, Status.POLICY_ERROR, "a simulated policy failure", self.now)
            elif u < c.fault_rate / 2 + c.end_rate:
                self.book.policy_ended(traj, "a simulated end", self.now)
                assert traj.status is Status.POLICY_ENDED and self.book.on_env[env] is not traj
        for traj, env in rows:
            if traj.status is not Status.RUNNING:
                continue  # cancelled, failed or ended meanwhile
            if self.book.answered(traj, self.rng.randint(0, 2), None, stamp, self.now):
                self.inflight[env] = "step"

    def trainer(self) -> None:
        if self.waiting is not None:
            self.try_hand_over()
            return
        choice = self.rng.random()
        if choice < 0.3:
            self.submit(self.rng.choice([1, 1, 2, 5, 20]))
        elif choice < 0.5:
            self.set_version()
        else:
            sizes = [self.config.groups_per_batch] * 3 + [1, 2, 3]
            self.waiting = self.book.wanted = self.rng.choice(sizes)
            self.try_hand_over()

    def other_thread_set_version(self) -> None:
        if self.rng.random() < 0.2:
            self.set_version()

    def submit(self, k: int) -> None:
        tasks = [Task(seed=self.next_seed + i) for i in range(k)]
        self.next_seed += k
        self.submitted.update(t.seed for t in tasks if t.seed is not None)
        self.book.tasks.extend(tasks)

    def set_version(self) -> None:
        self.book.set_version(self.lag.version + self.rng.choice(VERSION_STEPS), self.now)

    def try_hand_over(self) -> None:
        n = self.waiting
        assert n is not None
        if self.book.can_hand_over(n, self.now):
            batch = self.book.hand_over(n, self.now)
            assert len(batch) == n
            self.handed += batch
            self.delivered += [g.task.seed for g in batch if g.task.seed is not None]
            self.waiting = self.book.wanted = None
            return
        ready, unresolved = self.book.pending()
        if ready + unresolved < n and not self.book.tasks_left():
            self.waiting = self.book.wanted = None  # get_batch raises: can never be complete

    def drain(self) -> None:
        """No more failures or version moves: every task ends delivered or dropped."""
        self.config.fault_rate = 0.0
        for _ in range(100_000):
            self.launch()
            if self.inflight:
                self.result()
            elif self.awaiting:
                self.policy_call()
            elif self.calls:
                self.policy_answer()
            elif self.waiting is None and self.book.groups:
                self.waiting = self.book.wanted = 1
            elif self.waiting is not None:
                self.try_hand_over()
            elif self.book.tasks_left():  # a trainer that asks for more
                self.waiting = self.book.wanted = 1
            elif not self.book.tasks_left():
                break
            if self.waiting is not None:
                self.try_hand_over()
            self.check()
        else:
            raise AssertionError(f"the schedule never drained: {self.book.pending()}")
        assert not self.book.groups and not self.book.active and not self.book.tasks
        assert set(self.delivered) | self.dropped == self.submitted

    # --------------------------------------------------------------- checks

    def check(self) -> None:
        book, c = self.book, self.config
        book.check()  # both ledger identities
        # no live trajectory past the bound, ever
        for group in book.groups.values():
            for traj in group.live():
                assert not self.lag.stale(traj.oldest_version), (
                    f"group {group.group_id} keeps a stale trajectory: {traj.versions} "
                    f"at version {self.lag.version}"
                )
        # every handed-over group within the bound, of the right size, finished
        for group in self.handed:
            if c.max_lag is not None:
                assert group.lag <= c.max_lag, f"group {group.group_id} lag {group.lag}"
                for traj in group.trajectories:
                    assert group.version - min(traj.versions, default=group.version) <= c.max_lag
            kept = len(group.trajectories)
            least = c.group_size if c.min_survivors is None else c.min_survivors
            assert least <= kept <= c.group_size, f"group {group.group_id} keeps {kept}"
            assert len({t.index for t in group.trajectories}) == kept
            assert all(t.status in FINISHED for t in group.trajectories)
        self.handed.clear()
        # no task lost or handed over twice
        for gid, group in book.groups.items():
            if group.task.seed is not None:
                self.tasks_of.setdefault(gid, group.task.seed)
        gone = [gid for gid in self.tasks_of if gid not in book.groups]
        for gid in gone:
            seed = self.tasks_of.pop(gid)
            if seed not in self.delivered:
                self.dropped.add(seed)
        assert len(self.delivered) == len(set(self.delivered)), "a task handed over twice"
        assert len(self.dropped) == sum(book.ledger.groups_dropped.values())
        assert len(self.delivered) == book.ledger.delivered
        queued = {t.seed for t in book.tasks}
        pending = {g.task.seed for g in book.groups.values()}
        outcomes = [set(self.delivered), self.dropped, queued, pending]
        assert sum(len(s) for s in outcomes) == len(self.submitted), "a task lost"
        assert set().union(*outcomes) == self.submitted, "a task lost"
        # envs: each free or running one attempt, the running ones counted in flight
        free = [env for envs in book.free.values() for env in envs]
        assert len(free) == len(set(free))
        for env, traj in enumerate(book.on_env):
            assert (traj is None) == (env in free), f"env {env}: {traj} and free"
            assert (env in self.inflight) == (env in book.busy), f"env {env} busy"
        running = {id(t) for t in book.on_env if t is not None and t.status is Status.RUNNING}
        assert running == book.active


def lag_rule_schedule(seed: int, batches: int) -> dict[str, int]:
    """A LagRule under ``on_stale="wait"`` and a trainer whose version rises by
    ``rise`` per batch (in single steps or one jump, after any start) and whose
    batches take ``groups_per_batch`` groups or more: groups
    start when the rule admits them (acting at once), complete in random order,
    and batches take the groups the rule chooses. Every
    group that started once the rule had seen two hand-overs (and so the rise)
    is handed over within the bound."""
    rng = random.Random(seed)
    max_lag, n = rng.randint(0, 3), rng.randint(1, 5)
    rise, jumps = rng.choice([0, 1, 1, 2, 3, 5]), rng.random() < 0.5
    rule = LagRule(max_lag=max_lag, on_stale="wait", groups_per_batch=n)
    rule.set_version(rng.choice([0, 7, 1000]))
    groups: dict[int, list] = {}  # id -> [oldest version, complete, admitted after learning]
    next_id, handed, bumps_left, wanted = 0, 0, 0, None
    for _ in range(batches * 50):
        event = rng.random()
        if event < 0.4 and rule.admits(len(groups), wanted):
            groups[next_id] = [rule.version, False, handed >= 2]
            next_id += 1
        elif event < 0.8 and groups:
            gid = rng.choice(list(groups))
            groups[gid][1] = True
        elif bumps_left:
            step = bumps_left if jumps else 1
            rule.set_version(rule.version + step)
            bumps_left -= step
        elif wanted is None:
            wanted = rng.choice([n, n, n, n + 1, n + 3])  # a smaller batch leaves groups behind
        else:
            complete = [(g, v) for g, (v, done, _) in groups.items() if done]
            running = [v for v, done, _ in groups.values() if not done]
            chosen = rule.choose(complete, running, wanted)
            if chosen is None:
                continue
            for g in chosen:
                if groups[g][2]:
                    lag = rule.version - groups[g][0]
                    assert lag <= max_lag, (
                        f"seed {seed}: group {g} handed with lag {lag} > {max_lag} "
                        f"(rise {rise}, n {n}, wanted {wanted})"
                    )
            for g in chosen:
                del groups[g]
            rule.handed_over()
            handed += 1
            wanted, bumps_left = None, rise
    return {"handed": handed, "pending": len(groups)}
