"""EnvStates and ReadyRows alone (shmvec.ray.env_states): which command a cluster's env
takes in each state of its agent, and the rows in the order they came."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

pytest.importorskip("ray")

from shmvec.ray.env_states import EnvStates, ReadyRows  # noqa: E402
from shmvec.ray.members import SlotState  # noqa: E402

SPACE = spaces.Box(-1.0, 1.0, (2,), np.float64)


def states(n: int = 4) -> EnvStates:
    envs = EnvStates(n)
    envs.rows = ReadyRows(SPACE)
    return envs


def batch(ids, done=False):
    n = len(ids)
    obs = np.arange(2 * n, dtype=np.float64).reshape(n, 2)
    return (obs, np.ones(n), np.full(n, done), np.zeros(n, bool), {})


def test_a_live_agent_takes_resets_and_steps_of_envs_that_were_not_lost():
    envs, ids = states(), np.array([0, 1])
    assert not envs.refused(ids, reset=True, state=SlotState.LIVE, autoreset=True).any()
    envs.routed(ids, reset=True)
    assert not envs.refused(ids, reset=False, state=SlotState.LIVE, autoreset=True).any()
    for state in (SlotState.STARTING, SlotState.CLOSING, SlotState.VACANT):
        assert envs.refused(ids, reset=True, state=state, autoreset=True).all()


def test_a_lost_env_takes_a_reset_only_and_its_running_command_gets_a_lost_row():
    envs, ids = states(), np.array([0, 1, 2])
    envs.routed(ids, reset=True)
    envs.start(np.array([0, 1]))  # 0 and 1 run a command, 2 awaits one
    envs.lose(ids, "agent 0 was lost")
    assert envs.rows is not None and envs.rows.count == 2  # the running ones' rows
    (_, _, _, truncations, _), got, infos = envs.take(2)
    assert got.tolist() == [0, 1] and truncations.all()
    assert infos == [{"node_lost": "agent 0 was lost"}] * 2
    # Stale: a step is refused until a node_lost row told the env so (2 had none yet);
    # then, under an autoreset mode, the step is the env's reset.
    refused = envs.refused(ids, reset=False, state=SlotState.LIVE, autoreset=True)
    assert refused.tolist() == [False, False, True]
    assert envs.restarts(ids, SlotState.LIVE, autoreset=True).tolist() == [True, True, False]
    assert envs.refused(ids, reset=False, state=SlotState.LIVE, autoreset=False).all()
    assert not envs.restarts(ids, SlotState.STARTING, autoreset=True).any()
    assert not envs.refused(ids, reset=True, state=SlotState.LIVE, autoreset=True).any()
    envs.start(np.array([2]))
    with pytest.raises(ValueError, match=r"envs \[2\] are not awaiting"):
        envs.start(np.array([1, 2]))


def test_a_draining_agent_lets_open_episodes_end_and_takes_no_new_one():
    envs, ids = states(), np.array([0, 1])
    envs.routed(ids, reset=True)
    envs.start(ids)
    envs.rows_in(batch(ids, done=False)[:4] + ({},), ids, None)  # both still in an episode
    envs.take(2)
    assert not envs.refused(ids, reset=False, state=SlotState.DRAINING, autoreset=True).any()
    assert envs.busy(ids)
    envs.start(ids)
    done = batch(ids, done=True)
    envs.rows_in(done, ids, [{"x": 1}, {}])
    _, got, infos = envs.take(2)
    assert infos == [{"x": 1}, {}] and not envs.busy(ids)
    assert envs.refused(
        ids, reset=False, state=SlotState.DRAINING, autoreset=True
    ).all()  # a new episode
    assert envs.refused(ids, reset=True, state=SlotState.DRAINING, autoreset=True).all()


def test_ready_rows_come_out_in_arrival_order_cut_at_any_row():
    rows = ReadyRows(SPACE)
    rows.add(batch([0, 1, 2]), np.array([0, 1, 2]), [{"a": 0}, {}, {"a": 2}])
    rows.add(batch([5]), np.array([5]), None)
    first, ids, infos = rows.take(2)
    assert ids.tolist() == [0, 1] and infos == [{"a": 0}, {}]
    assert first[0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    second, ids, infos = rows.take(5)
    assert ids.tolist() == [2, 5] and infos == [{"a": 2}, {}] and rows.count == 0
    assert second[0].tolist() == [[4.0, 5.0], [0.0, 1.0]]
