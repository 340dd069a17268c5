"""The lag bound's price without a machine in the way: a discrete-event simulation
that drives the rollout layer's own book and lag rule (shmvec.rollouts.book)
with simulated envs and a simulated trainer, so that the groups/s of each
max_lag reflect the rule alone (no CPU contention, no policy cost, no loop).

The envs are the benchmark's ``tool`` workload in shape: each trajectory takes
1-8 turns (uniform), each step waits a lognormal time (median 20 ms, sigma 1),
each policy answer comes ``--policy-ms`` after its row; the trainer takes
``num_envs / group_size`` groups per batch and adds 1 to the version after each.

    python dev/lag_price.py --seconds 120 --seed 0
"""

from __future__ import annotations

import argparse
import heapq
import math
import random

from shmvec.rollouts.book import Book
from shmvec.rollouts.groups import GroupPolicy
from shmvec.rollouts.lag import LagRule
from shmvec.rollouts.records import Task


def simulate(max_lag, seconds, seed, num_envs=256, group_size=8, policy_ms=10.0):
    rng = random.Random(seed)
    n = num_envs // group_size
    lag = LagRule(max_lag=max_lag, on_stale="wait", groups_per_batch=n)
    book = Book(GroupPolicy(group_size, max_retries=0), lag, [None] * num_envs)
    book.source = (Task(seed=i) for i in range(10**9))
    turns: dict[int, int] = {}  # id(traj) -> turns left
    events: list[tuple[float, int, int, str, object]] = []  # (time, order, env, kind, traj)
    order = 0
    now, groups, busy_env_s, last = 0.0, 0, 0.0, 0.0
    book.wanted = n  # the trainer always waits in get_batch

    def push(t, env, kind, traj):
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, env, kind, traj))

    while now < seconds:
        for env, traj in book.launch(now):
            turns[id(traj)] = rng.randint(1, 8)
            push(now + 0.001, env, "result", traj)
        if not events:
            break
        t, _, env, kind, traj = heapq.heappop(events)
        busy_env_s += (t - last) * (num_envs - len(book.free[None]))
        now, last = t, t
        if kind == "result":
            got = book.returned(env)
            awaits = got is not None
            if got is not None and not got.observations:
                book.reset_done(got, 0, {})
            elif got is not None:
                turns[id(got)] -= 1
                awaits = book.step_done(got, 0, 0.0, turns[id(got)] == 0, False, {}, now)
            if awaits:
                push(now + policy_ms / 1000, env, "answer", (got, lag.version))
        else:
            got, version = traj
            if book.answered(got, 0, None, version, now):
                push(now + 0.02 * math.exp(rng.gauss(0.0, 1.0)), env, "result", got)
        while book.can_hand_over(n, now):
            groups += len(book.hand_over(n, now))
            book.set_version(lag.version + 1, now)
    return {
        "max_lag": max_lag,
        "groups_per_s": groups / now,
        "env_busy_share": busy_env_s / (now * num_envs),
        "stale": book.ledger.dropped.get("stale", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-ms", type=float, default=10.0)
    args = parser.parse_args()
    lags = (None, 1, 2)
    rows = [simulate(lag, args.seconds, args.seed, policy_ms=args.policy_ms) for lag in lags]
    base = rows[0]["groups_per_s"]
    for row in rows:
        print(
            f"max_lag={row['max_lag']}: {row['groups_per_s']:.1f} groups/s "
            f"({row['groups_per_s'] / base:.2f}x no bound), envs busy "
            f"{row['env_busy_share']:.0%}, stale {row['stale']}"
        )


if __name__ == "__main__":
    main()
