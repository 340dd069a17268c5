"""GroupState and Ledger alone: what a group does with each outcome."""

from __future__ import annotations

import pytest

from shmvec.rollouts.groups import GroupPolicy, GroupState, Ledger
from shmvec.rollouts.records import Status, Task


def group(**policy) -> GroupState:
    return GroupState(0, Task(seed=1), GroupPolicy(**policy), now=0.0)


def finish(state: GroupState, index: int, now: float = 1.0):
    traj = state.current[index]
    traj.status = Status.TERMINATED
    return state.finish(traj, now)


def test_a_group_completes_when_all_finish():
    state = group(group_size=3)
    assert len(state.current) == 3
    assert not finish(state, 0).resolved and not finish(state, 2).resolved
    decision = finish(state, 1)
    assert decision.resolved and state.complete and not decision.cancel
    out = state.to_group(version=4)
    assert [t.index for t in out.trajectories] == [0, 1, 2] and out.failed == []


def test_a_failure_is_retried_from_the_same_task_up_to_max_retries():
    state = group(group_size=2, max_retries=1)
    first = state.current[0]
    decision = state.fail(first, Status.ENV_ERROR, retry=True, now=1.0)
    (again,) = decision.launch
    assert again.task is first.task and again.index == 0 and again.attempt == 1
    assert again.retried_after == [Status.ENV_ERROR] and state.current[0] is again
    decision = state.fail(again, Status.WORKER_DIED, retry=True, now=2.0)
    assert decision.resolved and state.dropped is Status.WORKER_DIED  # what lost the trajectory
    assert decision.cancel == [(state.current[1], Status.GROUP_DROPPED)]


def test_a_lost_node_is_retried_without_spending_max_retries():
    """``node_lost`` is the infrastructure's failure: retried however often it comes, and
    the task's own failures still get their ``max_retries``."""
    state = group(group_size=1, max_retries=1)
    traj = state.current[0]
    for _ in range(4):
        (traj,) = state.fail(traj, Status.NODE_LOST, retry=True, now=1.0).launch
    assert traj.attempt == 4 and traj.retried_after == [Status.NODE_LOST] * 4
    (traj,) = state.fail(traj, Status.ENV_ERROR, retry=True, now=2.0).launch  # its one retry
    decision = state.fail(traj, Status.ENV_ERROR, retry=True, now=3.0)
    assert not decision.launch and decision.resolved and state.dropped is Status.ENV_ERROR


def test_a_stale_failure_under_drop_is_not_retried():
    state = group(group_size=2, max_retries=5)
    decision = state.fail(state.current[1], Status.STALE, retry=False, now=1.0)
    assert not decision.launch and decision.resolved and state.dropped is Status.STALE


@pytest.mark.parametrize("cancelled", [Status.REDUNDANT, Status.GROUP_DROPPED])
def test_a_cancelled_attempt_is_never_retried(cancelled):
    state = group(group_size=2, max_retries=5, min_survivors=1)
    decision = state.fail(state.current[0], cancelled, retry=True, now=1.0)
    assert not decision.launch and not decision.resolved


def test_survivors_keep_the_group_once_nothing_runs():
    state = group(group_size=3, max_retries=0, min_survivors=2)
    assert not state.fail(state.current[0], Status.ENV_ERROR, retry=True, now=1.0).resolved
    assert not finish(state, 1).resolved  # one survivor, one still running
    decision = finish(state, 2)
    assert decision.resolved and state.complete
    out = state.to_group(version=0)
    assert [t.index for t in out.trajectories] == [1, 2] and len(out.failed) == 1


def test_too_few_survivors_drop_the_group():
    state = group(group_size=3, max_retries=0, min_survivors=2)
    state.fail(state.current[0], Status.ENV_ERROR, retry=True, now=1.0)
    decision = state.fail(state.current[1], Status.DEADLINE, retry=True, now=2.0)
    assert not decision.resolved  # the third may still finish: 1 < 2 survivors, though
    decision = finish(state, 2)
    assert decision.resolved and state.dropped is Status.ENV_ERROR


def test_redundancy_keeps_the_first_to_finish_and_cancels_the_rest():
    state = group(group_size=2, redundancy=2, max_retries=0)
    assert len(state.current) == 4
    state.fail(state.current[3], Status.ENV_ERROR, retry=True, now=0.5)  # a spare lost
    finish(state, 2)
    decision = finish(state, 0)
    assert decision.resolved and state.complete
    assert decision.cancel == [(state.current[1], Status.REDUNDANT)]
    out = state.to_group(version=0)
    assert [t.index for t in out.trajectories] == [0, 2]


def test_redundancy_absorbs_losses_up_to_its_size():
    state = group(group_size=2, redundancy=1, max_retries=0)
    state.fail(state.current[0], Status.ENV_ERROR, retry=True, now=0.5)
    decision = state.fail(state.current[1], Status.ENV_ERROR, retry=True, now=0.6)
    assert decision.resolved and state.dropped is Status.ENV_ERROR


def test_the_oldest_version_is_that_of_the_kept_attempts():
    state = group(group_size=2, max_retries=1)
    state.current[0].versions = [3, 4]
    (again,) = state.fail(state.current[0], Status.ENV_ERROR, retry=True, now=1.0).launch
    again.versions = [6]
    state.current[1].versions = [5, 6]
    assert state.oldest_version() == 5


def test_policy_arguments_are_checked():
    for kwargs, match in [
        ({"group_size": 0}, "group_size"),
        ({"group_size": 2, "max_retries": -1}, "max_retries"),
        ({"group_size": 2, "redundancy": -1}, "redundancy"),
        ({"group_size": 2, "min_survivors": 3}, "min_survivors"),
        ({"group_size": 2, "min_survivors": 0}, "min_survivors"),
    ]:
        with pytest.raises(ValueError, match=match):
            GroupPolicy(**kwargs)


def test_the_ledger_notices_a_lost_attempt_or_group():
    ledger = Ledger()
    state = group(group_size=2)
    for traj in state.current:
        ledger.launch(traj)
    ledger.end(Status.TERMINATED)
    ledger.submitted = 1
    ledger.check(in_flight=1, pending_groups=1)
    with pytest.raises(AssertionError, match="launched 2 != completed 1"):
        ledger.check(in_flight=0, pending_groups=1)
    with pytest.raises(AssertionError, match="groups submitted 1"):
        ledger.check(in_flight=1, pending_groups=0)
