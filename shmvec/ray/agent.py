"""NodeAgent: the Ray actor that runs one node's envs of a ClusterVectorEnv, a
node-local ``ShmVectorEnv`` in async mode whose results it serves as each env
finishes, coalesced for at most ``coalesce_s``, with failures already reported as
result infos (``env_error``, ``worker_restarted``), as a local ShmVectorEnv gives them.

Data flow: ``send``/``async_reset`` queue a command and return at once; the thread
in ``ready`` applies the queued commands between its waits (within ``coalesce_s``)
and returns the rows that are in. Ray runs the agent as a threaded actor, so a
command never waits for a ``ready`` call to end; the driver keeps one ``ready``
call outstanding per agent, so rows never wait for the driver to ask.

Who may call what: any Ray thread may call any method; the ShmVectorEnv is used
under ``_env_lock`` only, by one thread at a time.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.batching import infos_by_row
from shmvec.vector_env import ShmVectorEnv

#: The infos key (with its ``_node_lost`` mask) of the rows of envs whose node agent was lost.
NODE_LOST = "node_lost"
#: How long ``ready`` waits, once a row is in, for its batch to fill: the longest a
#: result waits on its node for other results to travel with it. Each Ray call costs
#: ~0.5-1 ms (Ray's microbenchmarks), so a row alone per call would cost more than this.
COALESCE_S = 0.002
#: Ray threads of one agent: one ``ready``, commands, and ``call``/``describe``/``close``.
AGENT_CONCURRENCY = 4


class NodeAgent:
    """The body of one node agent: a node-local ShmVectorEnv over a block of envs.

    Args:
        index: the agent's index in its ClusterVectorEnv (named in errors).
        env_fns: the block's env callables (at least two: the ShmVectorEnv runs in
            async mode, ``batch_size < num_envs``).
        autoreset_mode: the ShmVectorEnv's autoreset mode.
        vector_kwargs: keyword arguments of the ShmVectorEnv (``num_workers``,
            ``env_concurrency``...); ``on_env_error="reset"`` and
            ``on_worker_death="restart"`` are always set.
        coalesce_s: how long ``ready`` waits for more rows once one is in.

    A failure to create the envs does not fail the actor: ``describe`` raises it,
    naming the node, so that the driver's error says where it happened.
    """

    def __init__(
        self,
        index: int,
        env_fns: list[Callable[[], gym.Env]],
        autoreset_mode: AutoresetMode,
        vector_kwargs: dict[str, Any],
        coalesce_s: float = COALESCE_S,
    ) -> None:
        self.index = index
        self.node_id = ray.get_runtime_context().get_node_id()
        self.coalesce_s = coalesce_s
        self.num_envs = len(env_fns)
        self.in_flight = 0
        self._env_lock = threading.Lock()  # the ShmVectorEnv, one thread at a time
        self._commands: deque[tuple] = deque()  # guarded by _queued
        self._queued = threading.Condition()
        self._error: BaseException | None = None  # a command that failed, raised by ready()
        self.start_error: str | None = None
        self.envs: ShmVectorEnv | None = None
        try:
            self.envs = ShmVectorEnv(
                env_fns,
                autoreset_mode=autoreset_mode,
                **{
                    "batch_size": max(1, self.num_envs - 1),
                    **vector_kwargs,
                    "on_env_error": "reset",
                    "on_worker_death": "restart",
                },
            )
        except Exception as exc:  # noqa: BLE001 - raised by describe(), with the node
            self.start_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.start_traceback = traceback.format_exc()

    def describe(self) -> dict[str, Any]:
        """Spaces, metadata and where the agent runs; its envs' start-up error, if any."""
        if self.envs is None:
            raise RuntimeError(
                f"node agent {self.index} on node {self.node_id} could not create its envs: "
                f"{self.start_error}\n{self.start_traceback}"
            )
        return {
            "single_observation_space": self.envs.single_observation_space,
            "single_action_space": self.envs.single_action_space,
            "metadata": self.envs.metadata,
            "render_mode": self.envs.render_mode,
            "node_id": self.node_id,
            "pid": os.getpid(),
        }

    # --------------------------------------------------------------- commands

    def async_reset(self, seeds: list, options: Any, local_ids: np.ndarray) -> None:
        """Queues a reset of envs ``local_ids``: ``seeds[i]`` (and ``options[i]``, or
        ``options`` for all) for env ``local_ids[i]``."""
        self._queue(("reset", seeds, options, local_ids))

    def send(self, actions: Any, local_ids: np.ndarray) -> None:
        """Queues ``actions[i]`` for env ``local_ids[i]``."""
        self._queue(("step", actions, local_ids))

    def _queue(self, command: tuple) -> None:
        with self._queued:
            self._commands.append(command)
            self._queued.notify()

    def _apply(self, commands: list[tuple]) -> None:
        """Starts the queued commands (under ``_env_lock``)."""
        envs = self.envs
        assert envs is not None
        for kind, *args in commands:
            try:
                if kind == "reset":
                    seeds, options, ids = args
                    full_seeds: list = [None] * self.num_envs
                    for i, env in enumerate(ids.tolist()):
                        full_seeds[env] = seeds[i]
                    if isinstance(options, list):
                        full: list = [None] * self.num_envs
                        for i, env in enumerate(ids.tolist()):
                            full[env] = options[i]
                        options = full
                    envs.async_reset(seed=full_seeds, options=options, env_ids=ids)
                else:
                    actions, ids = args
                    envs.send(actions, ids)
            except Exception as exc:  # noqa: BLE001 - raised by the next ready()
                self._error = self._error or exc
                continue
            self.in_flight += len(ids)

    # ------------------------------------------------------------------ ready

    def ready(self, timeout_s: float) -> tuple | None:
        """The rows that are in, as soon as one is (and up to ``coalesce_s`` for
        more): ``((obs, rewards, terminations, truncations, infos), row_infos)`` with
        ``infos["env_id"]`` the agent's local ids and ``row_infos`` each row's info as
        its env returned it (None when no row has one); None if none came in
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._queued:
                if not self._commands and not self.in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._queued.wait(left)
                commands = list(self._commands)
                self._commands.clear()
            with self._env_lock:
                if self.envs is None or self.envs.closed:
                    return None  # closing: the driver kills the agent next
                self._apply(commands)
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                if not self.in_flight:
                    continue
                try:
                    result = self.envs.recv(timeout=self.coalesce_s, partial=True, take_ready=True)
                except (multiprocessing.TimeoutError, TimeoutError):
                    if time.monotonic() >= deadline:
                        return None
                    continue
            self.in_flight -= len(result[1])
            return result, self._row_infos(result[4], len(result[1]))

    def _row_infos(self, infos: dict, rows: int) -> list[dict] | None:
        """Each row's info as its env returned it (Python scalars stay Python scalars)."""
        if not infos.keys() - {"env_id"}:
            return None
        assert self.envs is not None
        by_row = infos_by_row(self.envs, infos)
        return [by_row.info(i, skip=frozenset({"env_id"})) for i in range(rows)]

    # ------------------------------------------------------------- call & co

    def call(self, name: str, args: tuple, kwargs: dict) -> tuple:
        with self._env_lock:
            return self.envs.call(name, *args, **kwargs)  # type: ignore[union-attr]

    def set_attr(self, name: str, values: list) -> None:
        with self._env_lock:
            self.envs.set_attr(name, values)  # type: ignore[union-attr]

    def stats(self) -> dict[str, Any]:
        with self._env_lock:
            return self.envs.stats() if self.envs is not None else {}

    def close(self) -> None:
        """Closes the envs (the driver then ends the actor)."""
        with self._env_lock:
            if self.envs is not None:
                self.envs.close()


RemoteNodeAgent = ray.remote(NodeAgent)  # options(max_concurrency=AGENT_CONCURRENCY)
