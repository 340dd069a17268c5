"""The turn loop that the lock-step runners share: reset every env to its group's
task, then turn after turn ask the policy for the unfinished rows and step them,
until every trajectory has ended. Env ``i`` runs member ``i % group_size`` of
group ``i // group_size``; one call of ``rollout`` is one batch. ``Lockstep`` is
such a runner, given how to reset and step its envs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shmvec_bench.rollouts.records import GroupRecord, RunContext, TrajRecord, now

#: ``step(env_ids, actions) -> [(obs, reward, terminated, truncated)]`` for those envs.
StepFn = Callable[[list[int], list[str]], Sequence[tuple[str, float, bool, bool]]]


def rollout(
    ctx: RunContext,
    reset: Callable[[list[int]], Sequence[str]],
    step: StepFn,
    *,
    generate_for_finished: bool = False,
    step_finished: bool = False,
) -> tuple[list[GroupRecord], int]:
    """One lock-step rollout of every env; returns its groups and the env steps made.

    ``generate_for_finished``: the policy is called on every row each turn, finished
    ones included (verl-agent masks finished envs rather than removing them).
    ``step_finished``: finished envs are stepped too (their results ignored).
    """
    n, g = ctx.num_envs, ctx.group_size
    tasks = [ctx.stream.take() for _ in range(n // g)]
    seeds = [tasks[i // g][1] for i in range(n)]
    started = now()
    obs = list(reset(seeds))
    steps = [0] * n
    rewards = [0.0] * n
    ended: list[TrajRecord | None] = [None] * n
    env_steps = 0
    while True:
        active = [i for i in range(n) if ended[i] is None]
        if not active:
            break
        asked = list(range(n)) if generate_for_finished else active
        answers = ctx.policy([obs[i] for i in asked])
        action_of = dict(zip(asked, answers))
        stepped = list(range(n)) if step_finished else active
        fallback = answers[0]
        results = step(stepped, [action_of.get(i, fallback) for i in stepped])
        env_steps += len(stepped)
        t = now()
        for i, (o, r, term, trunc) in zip(stepped, results):
            if ended[i] is not None:
                continue
            obs[i] = o
            steps[i] += 1
            rewards[i] += r
            if term or trunc:
                task, seed = tasks[i // g]
                status = "done" if term else "truncated"
                ended[i] = TrajRecord(task, seed, i % g, started, t, steps[i], rewards[i], status)
    groups = [
        GroupRecord(task, seed, [ended[k * g + m] for m in range(g)])  # type: ignore[misc]
        for k, (task, seed) in enumerate(tasks)
    ]
    return groups, env_steps


class Lockstep:
    """A lock-step runner: one ``rollout`` of its envs a batch, through ``_reset(seeds)``
    and ``_step(env_ids, actions)``; ``ROLLOUT`` holds ``rollout``'s options."""

    ROLLOUT: dict[str, bool] = {}

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.env_steps = 0

    def _reset(self, seeds: list[int]) -> Sequence[str]:
        raise NotImplementedError

    def _step(self, ids: list[int], actions: list[str]) -> Sequence[tuple[str, float, bool, bool]]:
        raise NotImplementedError

    def get_batch(self) -> list[GroupRecord]:
        groups, steps = rollout(self.ctx, self._reset, self._step, **self.ROLLOUT)
        self.env_steps += steps
        return groups

    def env_pids(self) -> list[int]:
        return []

    def stats(self) -> None:
        return None
