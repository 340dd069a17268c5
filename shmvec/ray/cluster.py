"""ClusterVectorEnv: one async-mode vector env over node agents, with global env ids.

Agent ``k`` (a ``NodeAgent``, one per node or group of CPUs) holds the contiguous
envs ``blocks[k]``. ``send``/``async_reset`` route each env's command to its agent;
the driver keeps one ``ready`` call outstanding per agent and ``ray.wait``s on
those (at most one reference per agent: the driver's work grows with the results,
not with the envs), so ``recv`` returns each env's row as soon as its agent sent
it, from whichever node. A lost agent (its node removed, its process killed) is an
outcome: each of its envs with a command in flight gets a row with
``infos["node_lost"]``, and its envs take no more work (``lost_env_ids``).

Methods may be called from one thread at a time (the driver's).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space, create_empty_array
from gymnasium.vector.vector_env import AutoresetMode
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmvec.batching import (
    ARRAY_SPACES,
    Options,
    Seeds,
    VectorEnvBase,
    batch_infos,
    check_env_ids,
    check_rows,
    send_env_ids,
    split_blocks,
    take_rows,
)
from shmvec.errors import add_note
from shmvec.ray.agent import AGENT_CONCURRENCY, COALESCE_S, NODE_LOST, RemoteNodeAgent
from shmvec.ray.blocks import StepBatch, actor_env_fns, join_step_batches, select_step_rows

__all__ = ["ClusterVectorEnv"]

logger = logging.getLogger("shmvec")

#: How long one ``ready`` call waits for a row before it returns empty: an idle agent's
#: heartbeat, so that a lost agent is noticed within this plus Ray's death detection
#: even while none of its envs runs. One empty call a second per idle agent costs nothing.
READY_TIMEOUT_S = 1.0
#: How long the constructor waits for the agents' envs.
STARTUP_TIMEOUT_S = 120.0
#: How long ``close()`` gives the agents to close their envs before killing them.
CLOSE_GRACE_S = 5.0


def started_agents(agents: list, blocks: list[range]) -> list[dict[str, Any]]:
    """Waits for every agent's envs; their descriptions, after checking the spaces. An
    agent that could not create its envs is a RuntimeError naming it and its node."""
    refs = [agent.describe.remote() for agent in agents]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STARTUP_TIMEOUT_S)
    if len(ready) < len(refs):
        late = [k for k, ref in enumerate(refs) if ref not in set(ready)]
        raise RuntimeError(
            f"node agents {late} did not start within {STARTUP_TIMEOUT_S:.0f} s; cluster "
            f"resources: {ray.cluster_resources()}"
        )
    described = []
    for k, ref in enumerate(refs):
        try:
            described.append(ray.get(ref))
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            lines = [line for line in str(cause).strip().splitlines() if line.strip()] or [""]
            said = lines[0] if lines[0] == lines[-1] else f"{lines[0]} ... {lines[-1]}"
            rows = f"{blocks[k].start}..{blocks[k].stop - 1}"
            raise RuntimeError(f"node agent {k} (envs {rows}) failed to start: {said}") from exc
    for k, other in enumerate(described):
        for name in ("single_observation_space", "single_action_space"):
            if other[name] != described[0][name]:
                raise ValueError(
                    f"node agent {k} has {name} {other[name]}, agent 0 has "
                    f"{described[0][name]}; every env must share both spaces"
                )
        logger.info("node agent %d on node %s runs envs %s", k, other["node_id"], blocks[k])
    return described


class ReadyRows:
    """The rows the agents sent that ``recv`` has not returned yet, in arrival order."""

    def __init__(self, space: gym.Space) -> None:
        self.space = space
        self.batches: deque[tuple[StepBatch, np.ndarray]] = deque()  # (batch, global env ids)
        self.count = 0

    def add(self, batch: StepBatch, env_ids: np.ndarray) -> None:
        self.batches.append((batch, env_ids))
        self.count += len(env_ids)

    def take(self, need: int) -> tuple[StepBatch, np.ndarray]:
        """The first ``need`` rows (fewer if fewer are in) and their env ids."""
        batches, id_parts, taken = [], [], 0
        while self.batches and taken < need:
            batch, ids = self.batches.popleft()
            if taken + len(ids) > need:
                cut, rows = need - taken, np.arange(len(ids))
                rest = select_step_rows(self.space, batch, rows[cut:])
                self.batches.appendleft((rest, ids[cut:]))
                batch, ids = select_step_rows(self.space, batch, rows[:cut]), ids[:cut]
            batches.append(batch)
            id_parts.append(ids)
            taken += len(ids)
        self.count -= taken
        return join_step_batches(self.space, batches), np.concatenate(id_parts)


class ClusterVectorEnv(VectorEnvBase):
    """An async-mode vector env whose envs run on node agents over a Ray cluster.

    Env ``i`` lives on one agent's contiguous block; ``async_reset(seed=s)`` gives it
    seed ``s + i`` (``group_size`` as in ``ShmVectorEnv``) whichever node runs it, so
    each env's trajectory equals the one a local ``ShmVectorEnv`` gives for the same
    seeds and actions. Failures come back as rows, as ``Rollouts`` and
    ``AwaitableEnvs`` need them: ``on_env_error="reset"``, ``on_worker_death="restart"``
    inside each agent, and ``infos["node_lost"]`` for the envs of a lost agent.

    Ray must be initialized (``ray.init(...)``) before construction.

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
            hard); default: Ray's ``"SPREAD"`` scheduling.
        agent_options: extra ``ActorClass.options(...)`` (``resources``, ``runtime_env``).
        vector_kwargs: keyword arguments of each agent's ShmVectorEnv.
        env_kwargs: keyword arguments of ``gym.make`` when ``env_fns`` is an env id.
        ready_timeout_s: how long an agent's ``ready`` call waits before it returns
            empty (the heartbeat of an idle agent).
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
        agent_options: dict[str, Any] | None = None,
        vector_kwargs: dict[str, Any] | None = None,
        env_kwargs: dict[str, Any] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
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
        if min(len(b) for b in self.blocks) < 2:
            raise ValueError(
                f"ClusterVectorEnv needs at least 2 envs per agent (each agent's ShmVectorEnv "
                f"runs in async mode): {self.num_envs} envs over {num_agents} agents"
            )
        if node_ids is not None and len(node_ids) != num_agents:
            raise ValueError(f"node_ids needs one node per agent ({num_agents}), got {node_ids}")
        self.batch_size = max(1, self.num_envs // 16) if batch_size is None else int(batch_size)
        if not 1 <= self.batch_size < self.num_envs:
            raise ValueError(
                f"ClusterVectorEnv runs in async mode: batch_size must be in [1, num_envs="
                f"{self.num_envs}), got {batch_size}"
            )
        if group_size < 1 or self.num_envs % group_size:
            raise ValueError(f"group_size must divide num_envs={self.num_envs}, got {group_size}")
        if env_tags is not None and len(env_tags) != self.num_envs:
            raise ValueError(f"env_tags needs one tag per env ({self.num_envs}), got {env_tags}")
        self.env_tags = None if env_tags is None else list(env_tags)
        self.group_size = group_size
        self.is_async = True
        self.num_agents = num_agents
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        # Failures come back as rows (the agents' ShmVectorEnvs reset a failed env and
        # restart a dead worker; a lost agent's envs get ``node_lost`` rows).
        self.on_env_error, self.on_worker_death = "reset", "restart"
        self.ready_timeout_s = float(ready_timeout_s)
        self._state = AsyncState.DEFAULT
        self._sync_reset_pending = False
        self.agent_of = np.repeat(np.arange(num_agents), [len(b) for b in self.blocks])
        self.local_of = np.concatenate([np.arange(len(b)) for b in self.blocks])
        self._in_flight = np.zeros(self.num_envs, dtype=bool)  # command sent, row not returned
        self._answered = np.zeros(self.num_envs, dtype=bool)  # its row is buffered
        self._was_reset = np.zeros(self.num_envs, dtype=bool)
        self._owed = np.zeros(self.num_envs, dtype=bool)  # lost while awaiting a command
        self._ready: dict[Any, int] = {}  # the outstanding ready call of each live agent
        self._last_env_ids: np.ndarray | None = None
        #: Why each lost agent was lost (agent index -> message).
        self.lost_agents: dict[int, str] = {}
        #: The envs whose agent was lost, which take no more work.
        self.lost_env_ids: frozenset[int] = frozenset()
        self._results = 0
        self._started = time.perf_counter()

        vector_kwargs = {
            "num_workers": max(1, int(num_cpus_per_agent)),
            **({} if env_concurrency is None else {"env_concurrency": env_concurrency}),
            **(vector_kwargs or {}),
        }
        options: dict[str, Any] = {
            "num_cpus": num_cpus_per_agent,
            "max_concurrency": AGENT_CONCURRENCY,  # a command never waits for ready()
            **(agent_options or {}),
        }
        self.agents: list = []
        try:
            for k, rows in enumerate(self.blocks):
                strategy: Any = (
                    "SPREAD"
                    if node_ids is None
                    else NodeAffinitySchedulingStrategy(node_ids[k], soft=False)
                )
                actor = RemoteNodeAgent.options(scheduling_strategy=strategy, **options)
                block = fns[rows.start : rows.stop]
                args = (k, block, self.autoreset_mode, vector_kwargs, coalesce_s)
                self.agents.append(actor.remote(*args))
            described = started_agents(self.agents, self.blocks)
        except BaseException:
            self._kill_agents()
            raise
        first = described[0]
        self.single_observation_space = first["single_observation_space"]
        self.single_action_space = first["single_action_space"]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {**first["metadata"], "autoreset_mode": self.autoreset_mode}
        self.render_mode = first["render_mode"]
        #: The Ray node id of each agent, as at construction.
        self.agent_node_ids: list[str] = [d["node_id"] for d in described]
        self._rows = ReadyRows(self.single_observation_space)
        self.closed = False
        for k in range(num_agents):
            self._ask(k)

    # --------------------------------------------------------------- commands

    def _async_reset(self, seed: Seeds, options: Options, env_ids: Any) -> None:
        """Resets envs ``env_ids`` (default: all); each must be idle."""
        ids = np.arange(self.num_envs) if env_ids is None else check_env_ids(env_ids, self.num_envs)
        seeds = self._expand_seeds(seed)
        per_env = None
        if options is not None and not isinstance(options, dict):
            per_env = self._expand_options(options)
        for k, local in self._route(ids, "async_reset"):
            global_ids = local + self.blocks[k].start
            opts = options if per_env is None else [per_env[e] for e in global_ids.tolist()]
            self.agents[k].async_reset.remote([seeds[e] for e in global_ids.tolist()], opts, local)
        self._was_reset[ids] = True

    def _send(self, actions: Any, env_ids: Any) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` (default: the last ``recv``'s)."""
        ids = send_env_ids(env_ids, self._last_env_ids, self.num_envs)
        check_rows(self.single_action_space, actions, len(ids))
        self._check_action_shape(actions)
        if not self._was_reset[ids].all():
            never = ids[~self._was_reset[ids]].tolist()
            raise RuntimeError(f"send() before async_reset(): envs {never} were never reset")
        position = np.empty(self.num_envs, dtype=np.int64)
        position[ids] = np.arange(len(ids))
        for k, local in self._route(ids, "send"):
            rows = position[local + self.blocks[k].start]
            self.agents[k].send.remote(take_rows(self.single_action_space, actions, rows), local)

    def _route(self, ids: np.ndarray, name: str) -> list[tuple[int, np.ndarray]]:
        """Checks that ``ids`` await a command; answers the lost ones that are owed a
        row (``node_lost``); returns the others' ``(agent, local ids)``, and marks all
        of them in flight."""
        busy = ids[self._in_flight[ids]]
        if len(busy):
            raise ValueError(
                f"envs {busy.tolist()} are not awaiting a command: their previous one is still "
                "running (recv() its result first)"
            )
        lost = ids[np.isin(ids, list(self.lost_env_ids))] if self.lost_env_ids else ids[:0]
        gone = lost[~self._owed[lost]]
        if len(gone):
            k = int(self.agent_of[gone[0]])
            raise ValueError(
                f"{name}() for envs {gone.tolist()} of a lost node: {self.lost_agents[k]}; "
                "they take no more work (see lost_env_ids)"
            )
        self._in_flight[ids] = True
        if len(lost):
            self._owed[lost] = False
            self._lost_rows(lost)
        live = ids[~np.isin(ids, lost)] if len(lost) else ids
        agents = self.agent_of[live]
        return [(k, self.local_of[live[agents == k]]) for k in np.unique(agents).tolist()]

    def _check_action_shape(self, actions: Any) -> None:
        space = self.single_action_space
        if isinstance(space, ARRAY_SPACES):
            shape = np.shape(actions)[1:]
            if shape != space.shape:
                raise ValueError(
                    f"actions have rows of shape {shape}, the action space {space} has "
                    f"{space.shape}"
                )

    # ------------------------------------------------------------------- recv

    def _recv(
        self, timeout: float | None, partial: bool, take_ready: bool
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Up to ``batch_size`` rows, in the order they arrived from any agent."""
        need = self.batch_size
        running = int(self._in_flight.sum())
        if running < need:
            if not (partial and running):
                raise RuntimeError(
                    f"recv() waits for batch_size={need} results but only {running} envs are "
                    "running: send() actions first"
                )
            need = running
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._rows.count < need:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._poll(left)
        if not self._rows.count or (self._rows.count < need and not take_ready):
            raise multiprocessing.TimeoutError(
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{self._rows.count} of {need} results are in"
            )
        return self._take(need)

    def _poll(self, timeout: float | None) -> None:
        """Waits up to ``timeout`` for any agent's ``ready`` call; buffers the rows of
        every call that is done, and asks each of those agents again."""
        refs = list(self._ready)
        done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in done:
            k = self._ready.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as exc:
                self._lose(k, exc)
                continue
            except Exception as exc:
                add_note(exc, f"in shmvec node agent {k} (envs {self._describe_rows(k)})")
                raise
            self._ask(k)
            if result is not None:
                infos = result[4]
                local = infos.pop("env_id")
                global_ids = local + self.blocks[k].start
                self._answered[global_ids] = True
                self._rows.add(result, global_ids)

    def _take(self, need: int) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        (obs, rewards, terminations, truncations, infos), env_ids = self._rows.take(need)
        self._in_flight[env_ids] = False
        self._answered[env_ids] = False
        infos["env_id"] = env_ids
        self._last_env_ids = env_ids
        self._results += len(env_ids)
        return obs, rewards, terminations, truncations, infos

    # ------------------------------------------------------------- lost nodes

    def _ask(self, k: int) -> None:
        self._ready[self.agents[k].ready.remote(self.ready_timeout_s)] = k

    def _lose(self, k: int, exc: BaseException) -> None:
        """Agent ``k`` died: its envs leave the pool; those with a command in flight
        get their ``node_lost`` rows now, those awaiting one with their next command."""
        rows = self.blocks[k]
        message = (
            f"node agent {k} (envs {self._describe_rows(k)}) on node {self.agent_node_ids[k]} "
            f"was lost: {_cause(exc)}"
        )
        logger.error("%s", message)
        self.lost_agents[k] = message
        ids = np.arange(rows.start, rows.stop)
        self.lost_env_ids = self.lost_env_ids | frozenset(ids.tolist())
        running = ids[self._in_flight[ids] & ~self._answered[ids]]
        self._owed[ids[~self._in_flight[ids] & self._was_reset[ids]]] = True
        if len(running):
            self._lost_rows(running)
        with contextlib.suppress(Exception):
            ray.kill(self.agents[k])

    def _lost_rows(self, ids: np.ndarray) -> None:
        """Buffers a ``node_lost`` row (truncated, zero observation) for each env of ``ids``."""
        n = len(ids)
        k = int(self.agent_of[ids[0]])
        obs = create_empty_array(self.single_observation_space, n, fn=np.zeros)
        infos = batch_infos([(i, [{NODE_LOST: self.lost_agents[k]}]) for i in range(n)], n)
        batch = (obs, np.zeros(n), np.zeros(n, dtype=bool), np.ones(n, dtype=bool), infos)
        self._answered[ids] = True
        self._rows.add(batch, ids)

    # ------------------------------------------------------------- call & co

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` (or reads it) in every env while none runs; one result each
        (None for the envs of a lost agent)."""
        self._assert_is_running()
        self._assert_no_envs_running("call")
        refs = {k: a.call.remote(name, args, kwargs) for k, a in self._live_agents()}
        out: list[Any] = []
        for k, rows in enumerate(self.blocks):
            out += list(ray.get(refs[k])) if k in refs else [None] * len(rows)
        return tuple(out)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env of a live agent: one value each, or one for all."""
        self._assert_is_running()
        self._assert_no_envs_running("set_attr")
        values = self._attr_values(values)
        ray.get(
            [
                a.set_attr.remote(name, list(values[self.blocks[k].start : self.blocks[k].stop]))
                for k, a in self._live_agents()
            ]
        )

    def stats(self) -> dict[str, Any]:
        """Results returned and per second since construction, and the lost agents."""
        elapsed = time.perf_counter() - self._started
        return {
            "results": self._results,
            "results_per_s": self._results / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "lost_agents": dict(self.lost_agents),
        }

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the agents' envs (``timeout`` s, default 5), then kills the agents."""
        if not terminate:
            closing = [a.close.remote() for _, a in self._live_agents()]
            grace = CLOSE_GRACE_S if timeout is None else timeout
            ray.wait(closing, num_returns=len(closing), timeout=grace)
        self._ready = {}
        self._kill_agents()

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and ray.is_initialized():
            self.close(terminate=True)

    # ---------------------------------------------------------------- helpers

    def _live_agents(self) -> list[tuple[int, Any]]:
        return [(k, a) for k, a in enumerate(self.agents) if k not in self.lost_agents]

    def _assert_no_envs_running(self, name: str) -> None:
        if self._in_flight.any():
            running = np.flatnonzero(self._in_flight).tolist()
            raise RuntimeError(f"{name}() while envs {running} run: recv() their results first")

    def _describe_rows(self, k: int) -> str:
        return f"{self.blocks[k].start}..{self.blocks[k].stop - 1}"

    def _kill_agents(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):  # already gone, or Ray shut down
                ray.kill(agent)
        self.agents = []


def _cause(exc: BaseException) -> str:
    """The last line of a Ray error, or of the error inside it."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".strip()
