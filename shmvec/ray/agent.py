"""NodeAgent: the Ray actor that runs one node's envs of a ClusterVectorEnv, a
node-local ``ShmVectorEnv`` in async mode whose results it sends as each env
finishes, coalesced for at most ``coalesce_s``, with failures already reported as
result infos (``env_error``, ``worker_restarted``), as a local ShmVectorEnv gives them.

Data flow: the driver connects to the agent's channel (``channel.py``; its address is
in ``describe()``). The reader thread queues each ``Reset``/``Step`` that arrives; the
pump thread applies the queued commands between its waits (within ``coalesce_s``) and
sends the rows that are in as ``Rows`` (a failed command as ``AgentFailure``). The
driver's outstanding ``serve`` call ends only when the agent closes: if the actor or
its node dies, Ray fails it, and the driver knows.

Who may call what: any Ray thread may call any method; the ShmVectorEnv is used
under ``_env_lock`` only, by one thread at a time; the channel is read by the reader
thread and written by the pump.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Listener
from typing import Any

import gymnasium as gym
import ray
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.ray.channel import AgentFailure, Channel, Reset, Rows, accept
from shmvec.row_infos import infos_by_row
from shmvec.vector_env import ShmVectorEnv

#: The infos key (with its ``_node_lost`` mask) of the rows of envs whose node agent was lost.
NODE_LOST = "node_lost"
#: How long ``ready`` waits, once a row is in, for its batch to fill: the longest a
#: result waits on its node for other results to travel with it. Each Ray call costs
#: ~0.5-1 ms (Ray's microbenchmarks), so a row alone per call would cost more than this.
COALESCE_S = 0.002
#: Ray threads of one agent: ``serve``, and ``call``/``describe``/``close``/``stats``.
AGENT_CONCURRENCY = 4
#: How long the pump's ``ready`` waits for a row before it looks at the closed flag.
PUMP_WAIT_S = 0.5


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
        authkey: bytes = b"",
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
        self._closed = threading.Event()  # close() was called: serve() returns
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        self._conn: Channel | None = None
        threading.Thread(target=self._accept, name="shmvec-agent-accept", daemon=True).start()
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
            "address": self._listener.address,
        }

    def serve(self) -> None:
        """Returns once the agent is closed: the driver keeps this call outstanding,
        and Ray fails it when the actor or its node dies."""
        self._closed.wait()

    # ---------------------------------------------------------------- channel

    def _accept(self) -> None:
        """Takes the driver's connection; then reads its commands (this thread) and
        starts the pump."""
        conn = accept(self._listener, self._closed)
        if conn is None:
            return  # closed before the driver connected
        self._conn = conn
        threading.Thread(target=self._pump, name="shmvec-agent-pump", daemon=True).start()
        while not self._closed.is_set():
            try:
                messages = conn.receive()
            except (EOFError, OSError):
                break  # the driver closed the channel
            for message in messages:
                if isinstance(message, Reset):
                    self._queue(("reset", message.seeds, message.options, message.env_ids))
                else:
                    self._queue(("step", message.actions, message.env_ids))
        self._closed.set()
        self._queue(None)  # wakes the pump

    def _pump(self) -> None:
        """Sends each batch of rows as it is in, until the agent closes."""
        conn = self._conn
        assert conn is not None
        while not self._closed.is_set():
            try:
                rows = self.ready(PUMP_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - the driver raises it
                out: Rows | AgentFailure | None = AgentFailure(exc)
            else:
                out = None if rows is None else Rows(*rows)
            if out is not None:
                try:
                    conn.send(out)
                except OSError:
                    return

    # --------------------------------------------------------------- commands

    def _queue(self, command: tuple | None) -> None:
        """Queues a command for the pump (None: only wakes it)."""
        with self._queued:
            if command is not None:
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
        more): ``((obs, rewards, terminations, truncations, {"env_id": ids}), row_infos)``
        with ``ids`` the agent's local ids and ``row_infos`` each row's info as its env
        returned it (None when no row has one); None if none came in ``timeout_s``."""
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
            infos = result[4]
            row_infos = self._row_infos(infos, len(result[1]))
            # The driver batches the infos again from the rows: only the ids travel batched.
            return (*result[:4], {"env_id": infos["env_id"]}), row_infos

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
        """Closes the envs and the channel (the driver then ends the actor)."""
        self._closed.set()
        self._queue(None)
        with self._env_lock:
            if self.envs is not None:
                self.envs.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._conn is not None:
            self._conn.close()


RemoteNodeAgent = ray.remote(NodeAgent)  # options(max_concurrency=AGENT_CONCURRENCY)
