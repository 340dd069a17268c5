"""ClusterVectorEnv: one async-mode vector env over node agents, with global env ids.

Agent slot ``k`` (``members.Members``; a ``NodeAgent`` per node or group of CPUs) holds
the contiguous envs ``blocks[k]``. ``send``/``async_reset`` route each env's command to
its agent over the agent's channel (``channel.py``: a direct TCP connection set up through
Ray), and each agent sends each env's row back on it as soon as it is in, so ``recv``
returns rows from whichever node as they arrive; the driver waits on one socket and one
Ray reference per slot, so its work grows with the results, not with the envs. The envs
of a slot without a live agent (lost, drained, not started yet) take no new work
(``lost_env_ids``): each command to them is answered by a row with ``infos["node_lost"]``,
and so is each command in flight when their agent was lost. A lost agent is started
again where Ray can place it; its envs come back, fresh.

Methods may be called from one thread at a time (the driver's), but ``drain``.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.batching import (
    ARRAY_SPACES,
    Options,
    Seeds,
    batch_infos,
    check_env_ids,
    check_rows,
    send_env_ids,
    split_blocks,
    take_rows,
)
from shmvec.ray.agent import COALESCE_S
from shmvec.ray.blocks import actor_env_fns, take_spaces
from shmvec.ray.channel import Reset, Step
from shmvec.ray.env_states import EnvStates, ReadyRows
from shmvec.ray.members import Event, Members, SlotState
from shmvec.ray.sync_face import StepAPI, SyncFace
from shmvec.row_infos import RowInfos

__all__ = ["ClusterVectorEnv"]

logger = logging.getLogger("shmvec")

#: How long the constructor waits for its first ``min_agents`` agents (``startup_timeout_s``).
STARTUP_TIMEOUT_S = 120.0
#: How long ``close()`` gives the agents to close their envs before killing them.
CLOSE_GRACE_S = 5.0
#: How long a drained agent's envs may go on with what they run (``drain``'s default).
DRAIN_TIMEOUT_S = 60.0
#: How many times a lost agent is started again (``agent_restarts``'s default).
AGENT_RESTARTS = 3


class ClusterVectorEnv(StepAPI):
    """A vector env whose envs run on node agents over a Ray cluster (``ray.init`` first).

    Env ``i`` lives on one agent's contiguous block; ``async_reset(seed=s)`` gives it
    seed ``s + i`` (``group_size`` as in ``ShmVectorEnv``) whichever node runs it, so
    each env's trajectory equals a local ``ShmVectorEnv``'s for the same seeds and
    actions; with ``batch_size == num_envs``, ``reset``/``step`` give ``SyncVectorEnv``'s
    results. Failures come back as rows, as ``Rollouts`` and ``AwaitableEnvs`` need them:
    ``on_env_error="reset"``, ``on_worker_death="restart"`` inside each agent, and
    ``infos["node_lost"]`` for the envs of a lost agent. ``num_envs`` never changes: nodes
    join by starting agents that Ray could not place before (``min_agents``) and leave by
    being lost or drained (``drain``); meanwhile their envs are in ``lost_env_ids``.

    Args:
        env_fns: zero-argument callables, one per env; or a registered env id, made
            ``num_agents * envs_per_agent`` times with ``gym.make(id, **env_kwargs)``.
        num_agents: node agents; the envs are split into contiguous blocks, one each
            (at least two envs per agent).
        envs_per_agent: with an env id, the block size (default 2).
        num_cpus_per_agent: Ray CPUs each agent reserves; its ShmVectorEnv runs
            ``max(1, int(num_cpus_per_agent))`` worker processes (``vector_kwargs``
            overrides).
        batch_size: the rows one ``recv`` returns at most (default: a sixteenth of the
            envs, at least 1); must be below ``num_envs``.
        env_concurrency: the envs a worker steps at once (``ShmVectorEnv``'s), passed
            to every agent: ``envs_per_agent`` for envs that wait on tools, 1 for
            envs that compute.
        autoreset_mode: an ``AutoresetMode`` or its string value.
        group_size: envs ``g*k .. g*k+g-1`` share seed ``s + k``.
        env_tags: one tag per env (as ``make_mix``'s), or None.
        node_ids: pin agent ``k`` to node ``node_ids[k]`` (``NodeAffinitySchedulingStrategy``,
            hard; a restarted agent prefers it and goes elsewhere when it is gone);
            default: Ray's ``"SPREAD"`` scheduling.
        min_agents: the agents the constructor waits for (default: all). The others
            start when Ray places them (a node joins the cluster) and their envs then
            join the pool.
        agent_restarts: how many times each lost agent is started again; 0: its envs
            leave the pool for good.
        startup_timeout_s: how long the constructor waits for ``min_agents`` agents.
        agent_options: extra ``ActorClass.options(...)`` (``resources``, ``runtime_env``).
        vector_kwargs: keyword arguments of each agent's ShmVectorEnv.
        env_kwargs: keyword arguments of ``gym.make`` when ``env_fns`` is an env id.
        coalesce_s: how long an agent waits, once a row is in, for more to send with it.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | str,
        num_agents: int = 1,
        *,
        envs_per_agent: int | None = None,
        num_cpus_per_agent: float = 1.0,
        batch_size: int | None = None,
        env_concurrency: int | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        group_size: int = 1,
        env_tags: Sequence[str | None] | None = None,
        node_ids: Sequence[str] | None = None,
        min_agents: int | None = None,
        agent_restarts: int = AGENT_RESTARTS,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        agent_options: dict[str, Any] | None = None,
        vector_kwargs: dict[str, Any] | None = None,
        env_kwargs: dict[str, Any] | None = None,
        coalesce_s: float = COALESCE_S,
    ) -> None:
        self.closed = True  # until the agents are up; close() is then a no-op
        if not ray.is_initialized():
            raise RuntimeError("ClusterVectorEnv needs Ray: call ray.init(...) first")
        if isinstance(env_fns, str) and envs_per_agent is None:
            envs_per_agent = 2
        fns = actor_env_fns(env_fns, num_agents, envs_per_agent, env_kwargs or {})
        self.num_envs = len(fns)
        self.blocks = split_blocks(self.num_envs, num_agents)
        self.batch_size = max(1, self.num_envs // 16) if batch_size is None else int(batch_size)
        min_agents = num_agents if min_agents is None else int(min_agents)
        _check_layout(self, node_ids, min_agents, group_size, env_tags)
        self.env_tags = None if env_tags is None else list(env_tags)
        self.group_size = group_size
        self.is_async = self.batch_size < self.num_envs  # else: the step API (sync_face.py)
        self.num_agents = num_agents
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        # Failures come back as rows (the agents' ShmVectorEnvs reset a failed env and
        # restart a dead worker; a lost agent's envs get ``node_lost`` rows).
        self.on_env_error, self.on_worker_death = "reset", "restart"
        self._state = AsyncState.DEFAULT
        self._sync_reset_pending = False
        self.agent_of = np.repeat(np.arange(num_agents), [len(b) for b in self.blocks])
        self.local_of = np.concatenate([np.arange(len(b)) for b in self.blocks])
        self._envs = EnvStates(self.num_envs)
        self._last_env_ids: np.ndarray | None = None
        #: Why each agent was last lost (agent index -> message).
        self.lost_agents: dict[int, str] = {}
        #: The envs that take no new work (their agent was lost or drained, or is starting).
        self.lost_env_ids: frozenset[int] = frozenset(range(self.num_envs))
        self._row_infos: RowInfos | None = None
        self._drains: deque[tuple[int, float]] = deque()  # (agent, deadline): drain() asked
        self._results = 0
        self._started = time.perf_counter()

        vector_kwargs = {
            "num_workers": max(1, int(num_cpus_per_agent)),
            **({} if env_concurrency is None else {"env_concurrency": env_concurrency}),
            **(vector_kwargs or {}),
        }
        options = {"num_cpus": num_cpus_per_agent, **(agent_options or {})}
        self._members = Members(
            fns, self.blocks, (self.autoreset_mode, vector_kwargs, coalesce_s), options,
            None if node_ids is None else list(node_ids), agent_restarts,
        )  # fmt: skip
        try:
            self._start_up(min_agents, startup_timeout_s)
        except BaseException:
            self._members.shut(None)
            raise
        self.closed = False

    def _start_up(self, min_agents: int, timeout_s: float) -> None:
        """Waits for ``min_agents`` agents' envs (RuntimeErrors name an agent that fails)."""
        deadline = time.monotonic() + timeout_s
        members = self._members
        while len(members.in_state(SlotState.LIVE)) < min_agents:
            vacant = members.in_state(SlotState.VACANT)
            if self.num_agents - len(vacant) < min_agents:
                raise RuntimeError(
                    f"fewer than {min_agents} node agents can start: "
                    + "; ".join(self.lost_agents[k] for k in vacant)
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{min_agents} node agents did not start within {timeout_s:g} s "
                    f"(agents {members.in_state(SlotState.STARTING)} wait for a node); cluster "
                    f"resources: {ray.cluster_resources()}"
                )
            for event in self._members.wait(left):
                if event.kind == "failed":
                    raise RuntimeError(event.value)
                self._handle(event)

    @property
    def agents(self) -> list[Any]:
        """Each agent's Ray actor handle (None where it has none now)."""
        return self._members.actors()

    @property
    def agent_node_ids(self) -> list[str]:
        """The Ray node id of each agent ("" while it starts, or where it has none)."""
        return [slot.node_id for slot in self._members.slots]

    @property
    def agent_states(self) -> list[str]:
        """The state of each agent (starting, live, draining, closing or vacant)."""
        return [self._members.state(k).value for k in range(self.num_agents)]

    @property
    def exhausted(self) -> bool:
        """Whether every agent is vacant for good (lost past its restarts, or drained)."""
        return all(self._members.state(k) is SlotState.VACANT for k in range(self.num_agents))

    # --------------------------------------------------------------- commands

    def _async_reset(self, seed: Seeds, options: Options, env_ids: Any) -> None:
        """Resets envs ``env_ids`` (default: all); each must be idle."""
        ids = np.arange(self.num_envs) if env_ids is None else check_env_ids(env_ids, self.num_envs)
        seeds = self._expand_seeds(seed)
        per_env = None
        if options is not None and not isinstance(options, dict):
            per_env = self._expand_options(options)
        for k, local, _ in self._route(ids, reset=True):
            global_ids = local + self.blocks[k].start
            opts = options if per_env is None else [per_env[e] for e in global_ids.tolist()]
            self._members.send(k, Reset([seeds[e] for e in global_ids.tolist()], opts, local))

    def _send(self, actions: Any, env_ids: Any) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` (default: the last ``recv``'s)."""
        ids = send_env_ids(env_ids, self._last_env_ids, self.num_envs)
        check_rows(self.single_action_space, actions, len(ids))
        _check_action_shape(self.single_action_space, actions)
        never = self._envs.never_reset(ids)
        if len(never):
            raise RuntimeError(
                f"send() before async_reset(): envs {never.tolist()} were never reset"
            )
        position = np.empty(self.num_envs, dtype=np.int64)
        position[ids] = np.arange(len(ids))
        space = self.single_action_space
        for k, local, fresh in self._route(ids, reset=False):
            if len(local):
                rows = take_rows(space, actions, position[local + self.blocks[k].start])
                self._members.send(k, Step(rows, local))
            if len(fresh):  # the step after a node_lost row: the env's reset, as autoreset does
                self._members.send(k, Reset([None] * len(fresh), None, fresh))

    def _route(self, ids: np.ndarray, reset: bool) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Checks that ``ids`` await a command and marks them in flight; answers with a
        ``node_lost`` row each env whose agent cannot take the command (none live, a
        step to an env whose agent was lost since its reset, a new episode on a drained
        agent); returns the others' ``(agent, local ids, local ids to reset instead)``."""
        self._envs.start(ids)
        routes = []
        agents = self.agent_of[ids]
        autoreset = self.autoreset_mode is not AutoresetMode.DISABLED
        for k in np.unique(agents).tolist():
            mine, state = ids[agents == k], self._members.state(k)
            refused = self._envs.refused(mine, reset, state, autoreset)
            if refused.any():
                self._envs.lost_rows(mine[refused], self._members.slots[k].reason)
            restarts = ~refused & self._envs.restarts(mine, state, autoreset and not reset)
            go, fresh = mine[~refused & ~restarts], mine[restarts]
            self._envs.routed(go, reset)
            self._envs.routed(fresh, reset=True)
            if len(go) or len(fresh):
                routes.append((k, self.local_of[go], self.local_of[fresh]))
        return routes

    # ------------------------------------------------------------------- recv

    def _recv(
        self, timeout: float | None, partial: bool, take_ready: bool
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Up to ``batch_size`` rows, in the order they arrived from any agent."""
        rows = self._envs.rows
        assert rows is not None
        need = self.batch_size
        running = int(self._envs.in_flight.sum())
        if running < need:
            if not (partial and running):
                raise RuntimeError(
                    f"recv() waits for batch_size={need} results but only {running} envs are "
                    "running: send() actions first"
                )
            need = running
        deadline = None if timeout is None else time.monotonic() + timeout
        while rows.count < need:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._poll(left, need - rows.count)
        if not rows.count or (rows.count < need and not take_ready):
            raise multiprocessing.TimeoutError(
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{rows.count} of {need} results are in"
            )
        return self._take(need)

    def update_agents(self, timeout: float = 0.0) -> None:
        """Takes in what the agents did (rows, starts, losses, drains) within ``timeout``
        s, for a caller with nothing in flight (``AwaitableEnvs``, ``Rollouts`` call it)."""
        self._assert_is_running()
        self._poll(timeout)

    def _poll(self, timeout: float | None, rows: int = 1) -> None:
        """Waits up to ``timeout`` for ``rows`` rows or any agent's call; takes in what
        came by then."""
        self._check_drains()
        for event in self._members.wait(timeout, rows):
            self._handle(event)

    def _handle(self, event: Event) -> None:
        k, members = event.agent, self._members
        if event.kind == "rows":  # per message: no slot changed, lost_env_ids stays
            if members.state(k) in (SlotState.LIVE, SlotState.DRAINING):
                batch, row_infos = event.value
                ids = batch[4].pop("env_id") + self.blocks[k].start  # leaves infos empty
                self._envs.rows_in(batch, ids, row_infos)
            return
        if event.kind == "started":
            self._join(k, event.value)
        elif event.kind == "lost":
            self._lose(k, event.value)
            members.lost(k, event.value)
        elif event.kind == "failed":
            logger.error("%s", event.value)
            self.lost_agents[k] = event.value
            members.vacate(k, event.value)
        else:  # closed
            members.closed(k)
        self._refresh_lost()

    def _join(self, k: int, described: dict[str, Any]) -> None:
        """Agent ``k`` started: its envs join the pool (each to be reset first)."""
        if self._envs.rows is None:  # the first agent: the env's spaces
            take_spaces(self, described)
            self._envs.rows = ReadyRows(self.single_observation_space)
            self._sync = SyncFace(self.single_observation_space, self.num_envs)
        for name in ("single_observation_space", "single_action_space"):
            if described[name] != getattr(self, name):
                raise ValueError(
                    f"node agent {k} has {name} {described[name]}, the others "
                    f"{getattr(self, name)}; every env must share both spaces"
                )
        self._envs.was_reset[self.blocks[k].start : self.blocks[k].stop] = False
        self._members.started(k, described)

    def _take(self, need: int) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        (obs, rewards, terminations, truncations, _), env_ids, rows = self._envs.take(need)
        items = [] if rows is None else [(i, [info]) for i, info in enumerate(rows) if info]
        infos = batch_infos(items, len(env_ids))
        self._row_infos = RowInfos(infos, items)
        infos["env_id"] = env_ids
        self._last_env_ids = env_ids
        self._results += len(env_ids)
        return obs, rewards, terminations, truncations, infos

    def row_infos(self) -> RowInfos | None:
        """The last ``recv``'s infos row by row, as each env returned them (``RowInfos``;
        Python scalars stay Python scalars): ``AwaitableEnvs`` and ``Rollouts`` read them."""
        return self._row_infos

    # ------------------------------------------------------ lost and drained

    def _lose(self, k: int, reason: str) -> None:
        """Agent ``k`` died: its running envs get ``node_lost`` rows; all are stale."""
        self.lost_agents[k] = reason
        self._envs.lose(np.arange(self.blocks[k].start, self.blocks[k].stop), reason)

    def drain(
        self,
        agents: int | Iterable[int] | None = None,
        *,
        node_id: str | None = None,
        timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> list[int]:
        """Drains ``agents`` (or every agent on node ``node_id``): their envs take no new
        episode (they join ``lost_env_ids``); each running episode goes on until it ends,
        or until ``timeout_s``, when its env is answered with a ``node_lost`` row (the
        rollouts run it again elsewhere). Once its envs are idle each agent closes them
        and leaves; it is not started again. Returns the agents named.

        It may be called from any thread (a ``Rollouts``' or ``AwaitableEnvs``' loop
        owns the env meanwhile): the drain starts at the driver's next ``recv`` or
        ``update_agents``, within milliseconds while envs run."""
        self._assert_is_running()
        chosen = self._members.select(agents, node_id)
        self._drains.extend((k, time.monotonic() + timeout_s) for k in chosen)
        return chosen

    def _check_drains(self) -> None:
        """Starts the drains asked for; closes the drained agents whose envs are done."""
        while self._drains:
            self._members.drain(*self._drains.popleft())
            self._refresh_lost()
        for k in self._members.in_state(SlotState.DRAINING):
            slot = self._members.slots[k]
            ids = np.arange(slot.block.start, slot.block.stop)
            if self._envs.busy(ids) and time.monotonic() < slot.drain_deadline:
                continue
            self._envs.lose(ids, f"{slot.reason}: still running after its drain timeout")
            self._members.close(k)

    def _refresh_lost(self) -> None:
        lost = self._members.unavailable()
        self.lost_env_ids = self.lost_env_ids if lost == self.lost_env_ids else lost

    # ------------------------------------------------------------- call & co

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` (or reads it) in every env while none runs; one result each
        (None for the envs without a live agent)."""
        self._assert_is_running()
        self._envs.assert_idle("call")
        return tuple(self._members.call(name, args, kwargs))

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env of a live agent: one value each, or one for all."""
        self._assert_is_running()
        self._envs.assert_idle("set_attr")
        self._members.set_attr(name, list(self._attr_values(values)))

    def stats(self) -> dict[str, Any]:
        """Results returned and per second since construction; each agent's state, its
        restarts, and why the lost ones were lost."""
        elapsed = time.perf_counter() - self._started
        return {
            "results": self._results,
            "results_per_s": self._results / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "agent_states": self.agent_states,
            "agent_restarts": [slot.restarts for slot in self._members.slots],
            "lost_agents": dict(self.lost_agents),
        }

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the agents' envs (``timeout`` s, default 5), then kills the agents."""
        grace = None if terminate else CLOSE_GRACE_S if timeout is None else timeout
        self._members.shut(grace)

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and ray.is_initialized():
            self.close(terminate=True)


def _check_layout(
    envs: ClusterVectorEnv,
    node_ids: Sequence[str] | None,
    min_agents: int,
    group_size: int,
    env_tags: Sequence[str | None] | None,
) -> None:
    """ValueErrors for a layout the constructor cannot run."""
    n, agents = envs.num_envs, len(envs.blocks)
    if min(len(b) for b in envs.blocks) < 2:
        raise ValueError(
            f"ClusterVectorEnv needs at least 2 envs per agent (each agent's ShmVectorEnv "
            f"runs in async mode): {n} envs over {agents} agents"
        )
    if node_ids is not None and len(node_ids) != agents:
        raise ValueError(f"node_ids needs one node per agent ({agents}), got {node_ids}")
    if not 1 <= min_agents <= agents:
        raise ValueError(f"min_agents must be in [1, num_agents={agents}], got {min_agents}")
    if not 1 <= envs.batch_size <= n:
        raise ValueError(f"batch_size must be in [1, num_envs={n}], got {envs.batch_size}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size must divide num_envs={n}, got {group_size}")
    if env_tags is not None and len(env_tags) != n:
        raise ValueError(f"env_tags needs one tag per env ({n}), got {env_tags}")


def _check_action_shape(space: gym.Space, actions: Any) -> None:
    """A ValueError unless ``actions`` of an array ``space`` have rows of its shape."""
    if isinstance(space, ARRAY_SPACES):
        shape = np.shape(actions)[1:]
        if shape != space.shape:
            raise ValueError(
                f"actions have rows of shape {shape}, the action space {space} has {space.shape}"
            )
