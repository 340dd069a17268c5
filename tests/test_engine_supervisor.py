"""Supervisor: deaths noticed while waiting, env_timeout kills, restarts.

Worker processes are stand-ins with an ``exitcode``, so a death is a state the
test sets, not an event it waits for.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
from gymnasium import spaces
from helpers import open_pool

import shmvec.engine.pool
import shmvec.engine.supervisor
from shmvec.engine.pool import WorkerPool
from shmvec.engine.stats import Stats
from shmvec.engine.supervisor import MAX_UNREADY_DEATHS, Supervisor
from shmvec.errors import WorkerDiedError


class ProcessStandIn:
    """A worker process that the test kills (``exitcode``); its ``sentinel``
    turns readable once it is killed, as a process's does when it exits."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self.sentinel, self._alive = os.pipe()

    def kill(self) -> None:
        self.exitcode = -9
        self.exit_unseen()

    def exit_unseen(self) -> None:
        """Exits with its status taken by another waiter: ``exitcode`` stays None."""
        os.close(self._alive)

    def join(self, timeout: float | None = None) -> None:
        pass


class WireStandIn:
    """Records what the supervisor asks of the wire, in order."""

    def __init__(self, log: list, stuck: list[int] = ()) -> None:
        self.log = log
        self.stuck = list(stuck)

    def stuck_workers(self, round_started: float, env_timeout: float) -> list[int]:
        self.log.append(("stuck_workers", env_timeout))
        return self.stuck

    def busy_workers(self, dead) -> list[int]:
        return []

    def recovery(self, dead, read) -> dict:
        self.log.append(("recovery", set(dead), set(read)))
        return {index: ("plan for", index) for index in dead}

    def resend(self, index: int) -> None:
        self.log.append(("resend", index))

    def restarted(self, index: int) -> None:
        self.log.append(("restarted", index))


class DecoderStandIn:
    def __init__(self, num_workers: int) -> None:
        self.schemas = [{f"key{i}": i} for i in range(num_workers)]


def _pool(num_envs: int = 6, num_workers: int = 3) -> WorkerPool:
    """A pool with its segment open and stand-ins for its worker processes."""
    pool = open_pool(num_envs, num_workers, num_envs, spaces.Discrete(3))
    pool.workers = [ProcessStandIn(1000 + i) for i in range(num_workers)]
    return pool


def _supervisor(pool, wire, env_timeout=None, restart=False) -> Supervisor:
    return Supervisor(pool, DecoderStandIn(pool.num_workers), Stats(), wire, env_timeout, restart)


def test_a_death_during_a_wait_names_the_worker_and_its_envs():
    pool = _pool()
    supervisor = _supervisor(pool, WireStandIn([]))
    pool.workers[1].exitcode = -9
    with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid 1001, envs 2\.\.3\) killed by") as e:
        supervisor.wait_for(lambda budget_ns: False, None, lambda: "unused")
    assert (e.value.worker, e.value.env_ids, e.value.exitcode) == (1, range(2, 4), -9)


def test_a_death_whose_status_another_waiter_took_is_a_death(monkeypatch):
    """A worker reaped elsewhere (its ``exitcode`` stays None, its sentinel is
    readable) is dead to every check: the dead workers include it, and a
    wait raises its death."""
    monkeypatch.setattr(shmvec.engine.pool, "REAPED_ELSEWHERE_S", 0.0)
    pool = _pool()
    supervisor = _supervisor(pool, WireStandIn([]))
    supervisor.wait_for(lambda budget_ns: True, None, lambda: "unused")  # all alive
    assert pool.dead_workers() == set()
    pool.workers[2].exit_unseen()
    assert pool.dead_workers() == {2} and pool.workers[2].exitcode is None
    with pytest.raises(WorkerDiedError, match=r"worker 2 \(pid 1002, envs 4\.\.5\) exited") as e:
        supervisor.wait_for(lambda budget_ns: False, None, lambda: "unused")
    assert (e.value.worker, e.value.exitcode) == (2, None)


def test_a_wait_ends_when_ready_and_times_out_with_why():
    pool = _pool()
    supervisor = _supervisor(pool, WireStandIn([]))
    calls = []
    supervisor.wait_for(lambda budget_ns: calls.append(budget_ns) or True, 5.0, str)
    assert len(calls) == 1 and 0 < calls[0] <= 5e9
    with pytest.raises(multiprocessing.TimeoutError, match="still waiting for worker 2"):
        supervisor.wait_for(lambda budget_ns: False, 0.0, lambda: "still waiting for worker 2")


def test_env_timeout_kills_the_stuck_workers_the_wire_names_but_spares_some():
    pool = _pool()
    pool.current_env[:] = [2, 0, 6]  # 1 + the env each is in
    pool.workers[2].exitcode = 1  # already gone: nothing to kill
    log: list = []
    supervisor = _supervisor(pool, WireStandIn(log, stuck=[0, 1, 2]), env_timeout=0.5)
    supervisor.kill_stuck_workers(0.0, spared={1})
    assert log == [("stuck_workers", 0.5)]
    assert [p.exitcode for p in pool.workers] == [-9, None, 1]
    with pytest.raises(WorkerDiedError) as e:
        pool.check_alive(0)
    assert "stuck in env 1 for more than env_timeout=0.5 s" in "".join(e.value.__notes__)


def test_no_env_timeout_asks_nothing_and_kills_nothing():
    pool = _pool()
    log: list = []
    _supervisor(pool, WireStandIn(log, stuck=[0])).kill_stuck_workers(0.0)
    assert log == [] and pool.workers[0].exitcode is None


def _replacing(pool, log: list, dies: dict[int, int] | None = None) -> dict:
    """Has ``pool.replace`` and ``pool.expect_ready`` log what they are asked;
    worker i's next ``dies[i]`` replacements die before they are ready."""
    replaced: dict = {}
    dies = dict(dies or {})

    def replace(index, **changes):
        log.append(("replace", index))
        replaced[index] = changes
        pool.workers[index] = ProcessStandIn(2000 + index)

    def expect_ready(index, who):
        log.append(("ready", index))
        if dies.get(index, 0):
            dies[index] -= 1
            pool.workers[index].exitcode = -9
            pool.check_alive(index)
        return {"ready": pool.workers[index].pid}

    pool.replace, pool.expect_ready = replace, expect_ready
    pool.drain = lambda index: None
    return replaced


def test_replace_dead_restores_what_the_wire_says_in_order():
    pool = _pool()
    log: list = []
    replaced = _replacing(pool, log)
    supervisor = _supervisor(pool, WireStandIn(log), restart=True)
    pool.workers[2].exitcode = -9
    messages = supervisor.replace_dead(2, {(0, 1)})
    assert log == [
        ("recovery", {2}, {(0, 1)}),
        ("replace", 2),
        ("resend", 2),
        ("ready", 2),
        ("restarted", 2),
    ]
    assert replaced[2] == {
        "generation": pool.barrier.generation,
        "recover": ("plan for", 2),
        "info_schema": {"key2": 2},  # the dead worker's info columns, kept
    }
    assert messages == {2: {"ready": 2002}}
    assert supervisor.stats.restarts == 1


def test_every_worker_dead_by_then_is_replaced_together():
    pool = _pool()
    log: list = []
    _replacing(pool, log)
    supervisor = _supervisor(pool, WireStandIn(log), restart=True)
    for process in pool.workers:
        process.exitcode = -9
    messages = supervisor.replace_dead(1)
    assert log[0] == ("recovery", {0, 1, 2}, set())  # one plan for all three
    assert sorted(messages) == [0, 1, 2] and supervisor.stats.restarts == 3
    assert [p.exitcode for p in pool.workers] == [None] * 3


def test_a_replacement_that_dies_before_it_is_ready_is_replaced_again():
    pool = _pool()
    log: list = []
    _replacing(pool, log, dies={0: 2})
    supervisor = _supervisor(pool, WireStandIn(log), restart=True)
    pool.workers[0].exitcode = pool.workers[1].exitcode = -9
    messages = supervisor.replace_dead(0)
    recoveries = [entry for entry in log if entry[0] == "recovery"]
    assert recoveries == [("recovery", {0, 1}, set()), ("recovery", {0}, set()),
                          ("recovery", {0}, set())]  # fmt: skip
    assert sorted(messages) == [0, 1]
    assert supervisor.stats.restarts == 4  # each death: two, then two of the replacements
    assert ("restarted", 1) in log and log[-1] == ("restarted", 0)


def test_a_worker_whose_replacements_keep_dying_unready_is_an_error():
    pool = _pool()
    log: list = []
    _replacing(pool, log, dies={1: MAX_UNREADY_DEATHS})
    supervisor = _supervisor(pool, WireStandIn(log), restart=True)
    pool.workers[1].exitcode = -9
    with pytest.raises(WorkerDiedError, match=r"worker 1 ") as error:
        supervisor.replace_dead(1)
    note = "\n".join(error.value.__notes__)
    assert f"its last {MAX_UNREADY_DEATHS} replacements died before they were ready" in note
    assert [e for e in log if e[0] == "replace"] == [("replace", 1)] * MAX_UNREADY_DEATHS


def test_the_others_are_ready_before_a_given_up_worker_is_raised(monkeypatch):
    """Worker 0's replacement dies unready once too often while worker 2's starts:
    worker 2's ready message is read (none is left on its pipe to be taken for
    a reply later) before the error is raised."""
    monkeypatch.setattr(shmvec.engine.supervisor, "MAX_UNREADY_DEATHS", 1)
    pool = _pool()
    log: list = []
    _replacing(pool, log, dies={0: 1})
    supervisor = _supervisor(pool, WireStandIn(log), restart=True)
    pool.workers[0].exitcode = pool.workers[2].exitcode = -9
    with pytest.raises(WorkerDiedError, match=r"worker 0 "):
        supervisor.replace_dead(2)
    assert log[-2:] == [("ready", 2), ("restarted", 2)]
