"""Soak test of the rollout layer under faults: text envs that wait on a "tool",
fail, hang and lose their worker, and a trainer loop that must see none of it.

    python dev/rollout_soak.py --trajectories 10000 --out soak.json

Workload: ``--envs`` text envs whose every step waits a lognormal time (median
``--median-ms``, sigma 1) drawn from a generator of the env's own (seeded from
its reset seed and reset count, never from the trajectory's), raises with
probability ``--fault``, sleeps an hour with probability ``--hang`` (ended by
the vector env's ``step_deadline``); from a thread of its own, one worker is
SIGKILLed every ``--kill-every`` seconds, two at the same instant every
``--kill-two-every`` and every worker at once every ``--kill-all-every``. The
trainer takes ``--groups-per-batch`` groups per ``get_batch`` in async mode
with ``max_lag``, bumping the version each time, until ``--trajectories`` are
handed over and ``--seconds`` have passed.

The OOM killer's kind of fault, several workers at once, for two and a half minutes:

    python dev/rollout_soak.py --trajectories 0 --seconds 150 --envs 64 --workers 4 \\
        --kill-every 0 --kill-two-every 4 --kill-all-every 30 --out soak.json

Checks, each printed as PASS or FAIL: the trainer loop saw no exception; every
worker killed was restarted (``stats()["worker_restarts"]``) and the
trajectories they ran counted as ``worker_died``; no task
lost (each is handed over, dropped with a reason, or still pending) and none
handed over twice; every failure counted by reason (the ledger's identity is
checked inside every ``get_batch``); every trajectory handed over within
``max_lag`` of its oldest action's version; ``--replay`` sampled trajectories
(retried ones first) replay bit for bit in an env without waits or faults.
Exit status 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import sys
import threading
import time

import gymnasium as gym
import numpy as np

import shmvec
from shmvec.rollouts import Rollouts, Task, replay

WORDS = ("look", "take", "open", "north", "south", "use", "wait", "ask")


class ToolTextEnv(gym.Env):
    """A text game: each turn shows a number; the reward is how well the chosen
    word's index matches it. The game's draws come from ``np_random`` only; the
    tool's latency and faults from a generator of their own."""

    def __init__(self, median_s=0.0, fault=0.0, hang=0.0, hang_s=3600.0, max_turns=8):
        self.observation_space = shmvec.UnboundedText()
        self.action_space = shmvec.UnboundedText()
        self.median_s, self.fault, self.hang, self.hang_s = median_s, fault, hang, hang_s
        self.max_turns = max_turns
        self.resets = 0
        self.tool = random.Random(0)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        self.tool = random.Random(f"{seed}/{self.resets}/{os.getpid()}")
        self.turn, self.length = 0, int(self.np_random.integers(2, self.max_turns + 1))
        self.target = int(self.np_random.integers(len(WORDS)))
        return f"turn 0 of {self.length}: target {self.target}", {}

    def step(self, action):
        if self.median_s:
            time.sleep(self.median_s * float(np.exp(self.tool.gauss(0.0, 1.0))))
        if self.hang and self.tool.random() < self.hang:
            time.sleep(self.hang_s)
        if self.fault and self.tool.random() < self.fault:
            raise RuntimeError("the tool call failed")
        self.turn += 1
        chosen = WORDS.index(action) if action in WORDS else -1
        reward = float(chosen == self.target) + float(self.np_random.normal()) * 0.01
        self.target = int(self.np_random.integers(len(WORDS)))
        obs = f"turn {self.turn} of {self.length}: target {self.target}"
        return obs, reward, self.turn >= self.length, False, {}


def policy(batch):
    return tuple(random.choice(WORDS) for _ in range(len(batch)))


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Killer:
    """SIGKILLs workers from its own thread, as the kernel's OOM killer would:
    one random worker every ``one_s`` seconds, two at the same instant (one
    tight loop of ``os.kill``) every ``two_s``, every worker at once every
    ``all_s`` (0: never). Counts each process it killed while it ran."""

    def __init__(self, envs, one_s: float, two_s: float, all_s: float) -> None:
        self.envs, self.stop = envs, threading.Event()
        self.every = {"one": one_s, "two": two_s, "all": all_s}
        self.rounds = dict.fromkeys(self.every, 0)
        self.killed: set[int] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        chooser = random.Random(1)
        start = time.monotonic()
        due = {kind: start + s for kind, s in self.every.items() if s}
        while due:
            kind = min(due, key=due.get)
            if self.stop.wait(max(due[kind] - time.monotonic(), 0.0)):
                return
            due[kind] += self.every[kind]
            pids = [w.pid for w in list(self.envs._pool.workers)]
            if kind != "all":
                pids = chooser.sample(pids, min(len(pids), 1 if kind == "one" else 2))
            pids = [pid for pid in pids if pid not in self.killed and _alive(pid)]
            for pid in pids:  # one tight loop: the same instant
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed.add(pid)
            self.rounds[kind] += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=10_000)
    parser.add_argument("--envs", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-batch", type=int, default=4)
    parser.add_argument("--median-ms", type=float, default=20.0)
    parser.add_argument("--fault", type=float, default=0.01)
    parser.add_argument("--hang", type=float, default=0.002)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="run at least this long, whatever --trajectories says",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=10.0,
        help="kill one random worker this often (0: never)",
    )
    parser.add_argument(
        "--kill-two-every",
        type=float,
        default=0.0,
        help="kill two workers at the same instant this often (0: never)",
    )
    parser.add_argument(
        "--kill-all-every",
        type=float,
        default=0.0,
        help="kill every worker at once this often (0: never)",
    )
    parser.add_argument("--max-lag", type=int, default=1)
    parser.add_argument("--on-stale", default="wait")
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--replay", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    env_fn = functools.partial(
        ToolTextEnv, median_s=args.median_ms / 1e3, fault=args.fault, hang=args.hang
    )
    envs = shmvec.ShmVectorEnv(
        [env_fn] * args.envs,
        num_workers=args.workers,
        batch_size=max(1, args.envs // 8),
        env_concurrency=args.envs,
        on_env_error="reset",
        on_worker_death="restart",
        **(
            {"step_deadline": args.deadline, "env_timeout": args.deadline * 5}
            if args.deadline
            else {}
        ),
    )
    n, g = args.groups_per_batch, args.group_size
    groups_wanted = args.trajectories // g
    tasks = (Task(seed=s) for s in range(10**9))
    rollouts = Rollouts(envs, policy, group_size=g, tasks=tasks, max_lag=args.max_lag,
                        on_stale=args.on_stale, groups_per_batch=n,
                        max_retries=args.max_retries)  # fmt: skip
    killer = Killer(envs, args.kill_every, args.kill_two_every, args.kill_all_every)
    killer.thread.start()
    handed, seen_seeds, lag_violations, trainer_errors = [], set(), 0, []
    duplicates = 0
    started = time.monotonic()
    try:
        while len(handed) < groups_wanted or time.monotonic() - started < args.seconds:
            try:
                batch = rollouts.get_batch(n, timeout=600)
            except Exception as error:  # noqa: BLE001 - a check: the trainer must see none
                trainer_errors.append(repr(error))
                break
            for group in batch:
                duplicates += group.task.seed in seen_seeds
                seen_seeds.add(group.task.seed)
                for traj in group.trajectories:
                    oldest = min(traj.versions, default=group.version)
                    lag_violations += group.version - oldest > args.max_lag
            handed += batch
            rollouts.set_version(rollouts.version + 1)
            if len(handed) % (10 * n) == 0:
                print(
                    f"{len(handed) * g}/{args.trajectories} trajectories, "
                    f"{time.monotonic() - started:.0f} s, {len(killer.killed)} workers killed",
                    file=sys.stderr,
                )
    finally:
        killer.stop.set()
        killer.thread.join()
        wall = time.monotonic() - started
        stats = rollouts.stats()
        engine_stats = envs.stats()
        rollouts.close()
        envs.close(terminate=True)
    print(file=sys.stderr)
    trajectories = [t for group in handed for t in group.trajectories]
    retried = [t for t in trajectories if t.attempt > 0]
    rest = [t for t in trajectories if t.attempt == 0]
    random.Random(2).shuffle(rest)
    sample = (retried[: args.replay // 2] + rest)[: args.replay]
    clean = functools.partial(ToolTextEnv)
    replay_failures = []
    for traj in sample:
        try:
            replay(traj, clean)
        except AssertionError as error:
            replay_failures.append(str(error))
    pending = stats["groups_pending"]
    accounted = (
        stats["groups_delivered"] + sum(stats["groups_dropped"].values()) + pending
        == stats["groups_submitted"]
    )
    kills = len(killer.killed)
    checks = {
        "trainer saw no exception": not trainer_errors,
        f"every worker killed ({kills}) was restarted": engine_stats["worker_restarts"] == kills,
        "the trajectories they ran were counted as worker_died": kills == 0
        or stats["dropped"].get("worker_died", 0) > 0,
        "no task lost (handed over + dropped + pending == submitted)": accounted,
        "no task handed over twice": duplicates == 0,
        "attempts: launched == completed + dropped + in flight": stats["launched"]
        == stats["completed"] + sum(stats["dropped"].values()) + stats["in_flight"],
        f"every trajectory within max_lag={args.max_lag}": lag_violations == 0,
        f"{len(sample)} sampled trajectories ({len(retried[: args.replay // 2])} retried) "
        "replay bit for bit": not replay_failures
        and len(sample) >= min(args.replay, len(trajectories)),
    }
    result = {
        "args": vars(args),
        "wall_s": wall,
        "trajectories_handed_over": len(trajectories),
        "retried_handed_over": len(retried),
        "workers_killed": kills,
        "kill_rounds": killer.rounds,
        "worker_restarts": engine_stats["worker_restarts"],
        "stats": stats,
        "checks": checks,
        "errors": trainer_errors,
        "replay_failures": replay_failures[:5],
    }
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    print(
        f"{len(trajectories)} trajectories in {wall:.1f} s; {kills} workers killed "
        f"(rounds: {killer.rounds}), {engine_stats['worker_restarts']} restarted; "
        f"dropped attempts {stats['dropped']}; groups dropped {stats['groups_dropped']}; "
        f"retries {stats['retries']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
