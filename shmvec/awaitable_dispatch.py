"""The dispatcher of awaitable envs: one thread that owns an async vector env's
``async_reset``/``send``/``recv`` on behalf of every coroutine of one event loop.

Data flow: the event loop's thread queues ``(env, command)`` pairs (``submit``); each turn
the dispatcher takes every queued command, starts the resets with one ``async_reset`` and
the steps with one ``send``, then takes the results that are in
(``recv(take_ready=True, partial=True)``) and hands their rows, cut into one ``Result``
each, to the event loop with a single ``call_soon_threadsafe``. No result waits for
another env: ``recv`` blocks at most ``POLL_S`` for its batch to fill, and returns the rows
that are in by then, so a result reaches its coroutine within ``POLL_S`` of arriving and a
command is sent within ``POLL_S`` of its ``submit``, whatever the other envs are doing.
While nothing runs the thread sleeps on a condition that ``submit`` signals; over a
vector env whose envs leave and come back (``lost_env_ids``, ``update_agents``: a
``ClusterVectorEnv``) it takes in the agents' news every ``IDLE_UPDATE_S`` meanwhile; it
tells the loop whenever ``lost_env_ids`` changed.

Who may call what: ``submit`` and ``stop`` from the event loop's thread;
everything else runs in the dispatcher's thread.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from shmvec.errors import (
    EnvDeadlineError,
    EnvFailure,
    EnvNodeLostError,
    EnvStepError,
    EnvWorkerDiedError,
)
from shmvec.rollouts.rows import rows_of
from shmvec.row_infos import infos_by_row

#: Infos with which the vector env reports that an env lost its state, and the failure
#: each one is (the same as the rollout layer's).
FAILURE_INFOS = {
    "env_error": "env_error",
    "worker_restarted": "worker_died",
    "actor_restarted": "worker_died",
    "node_lost": "node_lost",
    "step_deadline": "deadline",
}
FAILURES: dict[str, type[EnvFailure]] = {
    "env_error": EnvStepError,
    "worker_died": EnvWorkerDiedError,
    "node_lost": EnvNodeLostError,
    "deadline": EnvDeadlineError,
}
#: Infos that are the layer's, not the env's: no coroutine's ``info`` carries them.
_OWN_KEYS = frozenset({"env_id", *FAILURE_INFOS, *(f"_{k}" for k in FAILURE_INFOS)})
#: How long the dispatcher sleeps with nothing to do before it looks at its stop flag
#: (``submit`` and ``stop`` wake it at once).
IDLE_S = 1.0
#: The longest a ``recv`` waits for its batch to fill while envs run: the bound on how
#: long a result waits for its coroutine, and a command to be sent. A ``recv`` that times
#: out with no result in costs ~0.14 ms of CPU with 1,000 envs running (2-vCPU VM): polling
#: while every running env is in a long call costs ~6% of a core (docs/design/heuristics.md,
#: "Awaitable envs' recv polls").
POLL_S = 0.002
#: How often an idle dispatcher takes in a cluster's news (an agent started, was lost or
#: drained): the delay before a returning env reaches a waiting coroutine.
IDLE_UPDATE_S = 0.1


@dataclass
class Result:
    """One env's row of a received batch. ``failure``: ``(what, detail)`` when the
    vector env reported that the env lost its state (``FAILURE_INFOS``)."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    failure: tuple[str, str] | None = None


class Dispatcher:
    """Sends the coroutines' commands and receives their results, in a thread of its own.

    Args:
        envs: the vector env (async mode, checked by ``check_async_envs``).
        loop: the event loop that ``deliver`` and ``stopped`` run on.
        deliver: called on the loop with each batch's ``[(env, Result)]``.
        stopped: called on the loop with the exception that stopped the thread.
        changed: called on the loop after the vector env's ``lost_env_ids`` changed.
    """

    def __init__(
        self,
        envs: Any,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[tuple[int, Result]]], None],
        stopped: Callable[[BaseException], None],
        changed: Callable[[], None] | None = None,
    ) -> None:
        self.envs, self.loop = envs, loop
        self.deliver, self.stopped, self.changed = deliver, stopped, changed
        self._lost = getattr(envs, "lost_env_ids", None)
        self._updates = hasattr(envs, "update_agents")  # its envs may leave and come back
        self.num_envs = envs.num_envs
        self.space = envs.single_action_space
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: list[tuple[int, tuple]] = []
        self._idle = False  # the thread sleeps on _wake
        self._stopping = False
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="shmvec-awaitable", daemon=True)
        self._thread.start()

    def submit(self, env: int, command: tuple) -> None:
        """Queues ``("reset", seed, options)`` or ``("step", action)`` for ``env``."""
        with self._lock:
            self._queue.append((env, command))
            if self._idle:
                self._wake.notify()

    def stop(self) -> None:
        """Stops the thread after its current ``recv`` (``POLL_S``); waits for it."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # ----------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as error:  # noqa: BLE001 - handed to the loop's coroutines
            try:
                self.loop.call_soon_threadsafe(self.stopped, error)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting

    def _turn(self) -> bool:
        with self._lock:
            if self._stopping:
                return False
            idle = not self._queue and not self._in_flight
            if idle:
                self._idle = True
                self._wake.wait(IDLE_UPDATE_S if self._updates else IDLE_S)
                self._idle = False
            else:
                queue, self._queue = self._queue, []
        if idle:
            if self._updates:
                self.envs.update_agents()
                self._note_changes()
            return True
        resets = [(env, cmd) for env, cmd in queue if cmd[0] == "reset"]
        steps = [(env, cmd[1]) for env, cmd in queue if cmd[0] == "step"]
        if resets:
            self._start(resets)
        if steps:
            self._send(steps)
        self._receive()
        self._note_changes()
        return True

    def _note_changes(self) -> None:
        lost = getattr(self.envs, "lost_env_ids", None)
        if lost is not self._lost:
            self._lost = lost
            if self.changed is not None:
                self.loop.call_soon_threadsafe(self.changed)

    def _start(self, resets: list[tuple[int, tuple]]) -> None:
        seeds: list[int | None] = [None] * self.num_envs
        options: list[dict[str, Any] | None] = [None] * self.num_envs
        for env, (_, seed, opts) in resets:
            seeds[env], options[env] = seed, opts
        ids = np.array([env for env, _ in resets], dtype=np.int64)
        self.envs.async_reset(seed=seeds, options=options, env_ids=ids)
        self._in_flight += len(resets)

    def _send(self, steps: list[tuple[int, Any]]) -> None:
        out: Any = create_empty_array(self.space, len(steps))
        actions = concatenate(self.space, [action for _, action in steps], out)
        self.envs.send(actions, np.array([env for env, _ in steps], dtype=np.int64))
        self._in_flight += len(steps)

    def _receive(self) -> None:
        try:
            obs, rewards, terminations, truncations, infos = self.envs.recv(
                timeout=POLL_S, partial=True, take_ready=True
            )
        except (multiprocessing.TimeoutError, TimeoutError):
            return
        env_ids = infos["env_id"].tolist()
        self._in_flight -= len(env_ids)
        failures = [
            (infos[f"_{key}"], infos[key], what)
            for key, what in FAILURE_INFOS.items()
            if f"_{key}" in infos
        ]
        # Each row's info as its env returned it (Python scalars stay Python scalars).
        by_row = infos_by_row(self.envs, infos) if infos.keys() - _OWN_KEYS else None
        rewards, terminations, truncations = (
            rewards.tolist(), terminations.tolist(), truncations.tolist()
        )  # fmt: skip
        results = []
        for i, (env, row_obs) in enumerate(zip(env_ids, rows_of(obs))):
            failure = next(
                ((what, str(values[i])) for mask, values, what in failures if mask[i]), None
            )
            info = by_row.info(i, _OWN_KEYS) if by_row is not None else {}
            results.append(
                (
                    env,
                    Result(
                        row_obs, float(rewards[i]), bool(terminations[i]),
                        bool(truncations[i]), info, failure,
                    ),
                )
            )  # fmt: skip
        self.loop.call_soon_threadsafe(self.deliver, results)
