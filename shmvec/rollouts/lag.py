"""The lag bound as a rule on versions and hand-over order: which trajectories
are stale, which groups a batch takes, and whether a new group may start; a
pure object (no threads, no envs, no clock), driven under the rollouts' lock.

The bound: a group is handed over only if ``version at hand-over - oldest
action version <= max_lag`` for every kept trajectory. Staleness is a fact of
versions alone (:meth:`LagRule.stale`); the rollouts check it whenever the
version moves, an action is recorded, and again for every group they hand
over, so the bound holds whatever the trainer does with versions.

Under ``on_stale="wait"`` the rule also keeps trajectories from going stale
in the first place, from the hand-over order rather than from the version's
value: a new group joins the back of the line of pending groups, so it is
taken by the batch ``pending // groups_per_batch`` batches after the next
one; it may start if the versions those hand-overs are expected to add keep
it within ``max_lag``. The rise per batch is learnt from the hand-overs (the
version's rise between the last two, at least 1), so a trainer that resumes at
version 1000, counts two updates per batch or counts samples is admitted as
exactly as one that adds 1 after each batch. A batch takes the complete
groups closest to the bound, and waits while the groups it would leave behind
could not all be taken in time by the batches after it but would if older
running groups finished first. A trajectory that goes stale all the same (a
version jump the rule could not foresee, a batch smaller than
``groups_per_batch``) runs again.
"""

from __future__ import annotations

from dataclasses import dataclass

STALE_POLICIES = ("wait", "drop", "rerun")


@dataclass
class LagRule:
    """Versions, hand-overs and the lag bound (see the module).

    Attributes:
        max_lag: the bound; None: no bound.
        on_stale: ``"wait"``, ``"drop"`` or ``"rerun"``.
        groups_per_batch: the usual ``n`` of ``get_batch(n)`` (``"wait"``
            admits groups by the batches that will take them).
        version: the policy version now.
        handed_at: the version at the last hand-over (None before the first).
        rise: the version's rise between the last two hand-overs (at least 1;
            1 until two have happened).
    """

    max_lag: int | None = None
    on_stale: str = "wait"
    groups_per_batch: int | None = None
    version: int = 0
    handed_at: int | None = None
    rise: int = 1

    def __post_init__(self) -> None:
        if self.max_lag is not None and (
            not isinstance(self.max_lag, int) or isinstance(self.max_lag, bool) or self.max_lag < 0
        ):
            raise ValueError(f"max_lag must be None or an int >= 0, got {self.max_lag!r}")
        if self.on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {STALE_POLICIES}, got {self.on_stale!r}")
        if self.groups_per_batch is not None and (
            not isinstance(self.groups_per_batch, int) or self.groups_per_batch < 1
        ):
            raise ValueError(f"groups_per_batch must be an int >= 1, got {self.groups_per_batch!r}")

    @property
    def waits(self) -> bool:
        """Whether admission keeps the bound (``on_stale="wait"`` with a bound)."""
        return self.max_lag is not None and self.on_stale == "wait"

    @property
    def retries_stale(self) -> bool:
        """Whether a stale trajectory runs again (``"wait"`` and ``"rerun"``)."""
        return self.on_stale != "drop"

    def set_version(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < self.version:
            raise ValueError(
                f"version must be an int >= the current {self.version}, got {version!r}"
            )
        self.version = version

    def handed_over(self) -> None:
        """A batch was handed over at the current version."""
        if self.handed_at is not None:
            self.rise = max(1, self.version - self.handed_at)
        self.handed_at = self.version

    def lag(self, oldest: int | None) -> int:
        """How far an action of version ``oldest`` is behind now (0 for None)."""
        return 0 if oldest is None else self.version - oldest

    def stale(self, oldest: int | None) -> bool:
        """Whether a trajectory whose oldest action has this version is past the bound."""
        return self.max_lag is not None and self.lag(oldest) > self.max_lag

    def choose(
        self, complete: list[tuple[int, int | None]], running: list[int | None], n: int
    ) -> list[int] | None:
        """The batch to hand over now, or None to wait.

        ``complete``: (key, oldest version) of the complete groups in order of
        completion; ``running``: the oldest versions of the other pending
        groups. The batch takes the ``n`` complete groups closest to the
        bound. Under ``"wait"`` it waits while the groups left behind could
        not all be handed over in time by later batches (of
        ``groups_per_batch``, one rise apart) but would if older running
        groups completed first; when no batch can keep every group in time,
        it does not wait (those that fall behind run again).
        """
        if len(complete) < n:
            return None
        ranked = sorted(complete, key=lambda item: self._age(item[1]))
        if not self.waits or self._fits([o for _, o in ranked[n:]] + running):
            return [key for key, _ in ranked[:n]]
        everything = sorted([o for _, o in complete] + running, key=self._age)
        if self._fits(everything[n:]):
            return None  # older groups are running: wait for them
        return [key for key, _ in ranked[:n]]

    def _age(self, oldest: int | None) -> int:
        return self.version if oldest is None else oldest

    def _fits(self, left: list[int | None]) -> bool:
        """Whether groups of these oldest versions, left after the batch handed
        over now, can each be handed over in time by the batches after it."""
        assert self.max_lag is not None
        per_batch = self.groups_per_batch or 1
        slack = sorted((self._age(o) + self.max_lag - self.version) // self.rise for o in left)
        # the i-th most pressed group (0-based) needs a batch among the first `slack`
        return all(i < batches * per_batch for i, batches in enumerate(slack))

    def admits(self, pending: int, wanted: int | None = None) -> bool:
        """Whether a new group may start now, behind ``pending`` groups in the
        hand-over order; ``wanted``: the ``n`` of a ``get_batch`` that waits now
        (it hands over at this version), None when none waits."""
        if not self.waits:
            return True
        assert self.max_lag is not None
        per_batch = self.groups_per_batch or wanted or 1
        if wanted is not None:
            if pending < wanted:
                return True  # the waiting batch needs it, and takes it at this version
            later, to_come = 1 + (pending - wanted) // per_batch, 0
        else:
            later, to_come = pending // per_batch, self._rise_to_come()
        return to_come + later * self.rise <= self.max_lag

    def _rise_to_come(self) -> int:
        """The rise expected before the next hand-over: none before the first,
        else what is left of one batch's rise."""
        if self.handed_at is None:
            return 0
        return max(self.rise - (self.version - self.handed_at), 0)
