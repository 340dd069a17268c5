"""The node agents of one ClusterVectorEnv as slots: each slot holds one block of env ids
and, at any time, at most one agent, its channel (``channel.py``: commands and rows) and
one outstanding Ray call of it (``describe`` while it starts, ``serve`` while it runs,
``close`` while it closes), so the driver waits on one socket and one reference per slot.

A slot is ``starting`` (its actor is created, or waits for Ray to find it a node: a node
that joins the cluster gets it), ``live``, ``draining`` (no new work; it closes once its
envs are idle), ``closing`` or ``vacant`` (lost or drained, and not re-created). A slot
whose agent dies is started again, up to ``restarts`` times, wherever Ray can place it.
``Members.wait`` turns the rows that came in and the calls that ended into events for the
vector env. A dead agent's process closes its channel (seen at once); a lost node fails
its ``serve`` call (seen within ``RAY_CHECK_S`` of Ray's notice).

Methods may be called from one thread at a time (the driver's).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client
from typing import Any

import gymnasium as gym
import ray
from gymnasium.vector.vector_env import AutoresetMode
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmvec._core import FrameReader
from shmvec.errors import add_note
from shmvec.ray.agent import AGENT_CONCURRENCY, RemoteNodeAgent
from shmvec.ray.channel import AgentFailure, Channel, Rows, decode

__all__ = ["Event", "Members", "SlotState"]

logger = logging.getLogger("shmvec")

#: How often the driver looks at the agents' Ray calls while rows come in on their channels
#: (a started agent, a lost node): one ``ray.wait`` of ~50-100 us every 50 ms.
RAY_CHECK_S = 0.05


class SlotState(enum.Enum):
    STARTING = "starting"
    LIVE = "live"
    DRAINING = "draining"
    CLOSING = "closing"
    VACANT = "vacant"


@dataclass
class Slot:
    block: range
    strategy: Any  # the scheduling strategy of its first agent
    state: SlotState = SlotState.STARTING
    actor: Any = None
    conn: Channel | None = None  # its channel, while live or draining
    ref: Any = None  # describe (starting), serve (live, draining) or close (closing)
    node_id: str = ""
    restarts: int = 0
    #: Why its envs take no work now (starting, lost, drained), for their ``node_lost`` rows.
    reason: str = ""
    drain_deadline: float = 0.0  # time.monotonic() when its running episodes are cut


@dataclass
class Event:
    """What the agents said: ``kind`` is ``"rows"`` (``value``: ``(batch, row_infos)``
    from the channel), ``"started"`` (``value``: the agent's description),
    ``"lost"`` (the agent died; ``value``: why), ``"failed"`` (it could not create its
    envs; ``value``: why) or ``"closed"``."""

    kind: str
    agent: int
    value: Any = None


class Members:
    """The slots of one ClusterVectorEnv and their agents' calls.

    Args:
        env_fns: every env's callable; slot ``k`` runs ``env_fns[blocks[k]]``.
        blocks: each slot's env ids.
        agent_args: ``(autoreset_mode, vector_kwargs, coalesce_s)`` of every agent.
        options: the agents' ``ActorClass.options`` (``num_cpus``...).
        node_ids: pin slot ``k``'s first agent to ``node_ids[k]`` (its restarts
            prefer that node and go elsewhere when it is gone); None: ``"SPREAD"``.
        restarts: how many times a slot's agent is started again after it died.
    """

    def __init__(
        self,
        env_fns: list[Callable[[], gym.Env]],
        blocks: list[range],
        agent_args: tuple[AutoresetMode, dict[str, Any], float],
        options: dict[str, Any],
        node_ids: list[str] | None,
        restarts: int,
    ) -> None:
        self.env_fns, self.agent_args = env_fns, agent_args
        self.options = {"max_concurrency": AGENT_CONCURRENCY, **options}
        self.restarts = restarts
        self.authkey = secrets.token_bytes(32)  # the channels' HMAC key
        self._next_check = 0.0
        self._reader = FrameReader()  # reads each live slot's channel, as slot k
        pins = [None] * len(blocks) if node_ids is None else node_ids
        self.slots = [
            Slot(block, "SPREAD" if pin is None else NodeAffinitySchedulingStrategy(pin, False))
            for block, pin in zip(blocks, pins)
        ]
        self._calls: dict[Any, int] = {}  # outstanding reference -> slot
        for k in range(len(blocks)):
            self._create(k)

    # ------------------------------------------------------------ the slots

    def state(self, k: int) -> SlotState:
        return self.slots[k].state

    def in_state(self, state: SlotState) -> list[int]:
        return [k for k, slot in enumerate(self.slots) if slot.state is state]

    def unavailable(self) -> frozenset[int]:
        """The env ids of the slots that are not live (they take no new work)."""
        return frozenset(
            e for slot in self.slots if slot.state is not SlotState.LIVE for e in slot.block
        )

    def actors(self) -> list[Any]:
        """Each slot's agent (None where it has none)."""
        return [slot.actor for slot in self.slots]

    def live(self) -> list[tuple[int, Any]]:
        """``(slot, agent)`` of the slots whose agent runs envs (live or draining)."""
        running = (SlotState.LIVE, SlotState.DRAINING)
        return [(k, s.actor) for k, s in enumerate(self.slots) if s.state in running]

    def describe_rows(self, k: int) -> str:
        block = self.slots[k].block
        return f"{block.start}..{block.stop - 1}"

    def name(self, k: int) -> str:
        slot = self.slots[k]
        where = f" on node {slot.node_id}" if slot.node_id else ""
        return f"node agent {k} (envs {self.describe_rows(k)}){where}"

    # ---------------------------------------------------------------- calls

    def _create(self, k: int) -> None:
        slot = self.slots[k]
        strategy = slot.strategy
        if slot.restarts and isinstance(strategy, NodeAffinitySchedulingStrategy):
            strategy = NodeAffinitySchedulingStrategy(strategy.node_id, soft=True)
        actor = RemoteNodeAgent.options(scheduling_strategy=strategy, **self.options)
        fns = self.env_fns[slot.block.start : slot.block.stop]
        slot.actor = actor.remote(k, fns, *self.agent_args, self.authkey)
        slot.state, slot.node_id = SlotState.STARTING, ""
        slot.reason = f"{self.name(k)} is starting"
        self._call(k, slot.actor.describe.remote())

    def _call(self, k: int, ref: Any) -> None:
        self.slots[k].ref = ref
        self._calls[ref] = k

    def send(self, k: int, message: Any) -> None:
        """Sends a command to slot ``k``'s agent; a dead channel is seen by ``wait``."""
        conn = self.slots[k].conn
        assert conn is not None
        with contextlib.suppress(OSError):
            conn.send(message)

    def wait(self, timeout: float | None, rows: int = 1) -> list[Event]:
        """Waits up to ``timeout`` (at most ``RAY_CHECK_S`` while agents run) for ``rows``
        rows from the channels (or any other message, or a channel's end) or any Ray
        call's end; the events of what came by then."""
        if not any(slot.conn is not None for slot in self.slots):
            return self._ray_events(timeout)
        now = time.monotonic()
        events = []
        if now >= self._next_check:
            self._next_check = now + RAY_CHECK_S
            events = self._ray_events(0)
        limit = self._next_check - now if timeout is None else min(timeout, self._next_check - now)
        wait_ns = 0 if events else max(0, int(limit * 1e9))
        frames, ended = self._reader.wait(max(1, rows), wait_ns)
        for k, kind, payload in frames:
            message = decode(kind, payload)
            if isinstance(message, AgentFailure):
                add_note(message.error, f"in shmvec {self.name(k)}")
                raise message.error
            assert isinstance(message, Rows)
            events.append(Event("rows", k, (message.batch, message.row_infos)))
        for k in ended:
            reason = f"{self.name(k)} was lost: its channel closed (the agent's process ended)"
            events.append(Event("lost", k, reason))
        return events

    def _ray_events(self, timeout: float | None) -> list[Event]:
        refs = list(self._calls)
        if not refs:
            return []
        done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        return [self._ended(self._calls.pop(ref), ref) for ref in done]

    def _ended(self, k: int, ref: Any) -> Event:
        slot = self.slots[k]
        slot.ref = None
        try:
            value = ray.get(ref)
        except RayActorError as exc:
            return Event("lost", k, f"{self.name(k)} was lost: {cause_of(exc)}")
        except Exception as exc:
            if slot.state is SlotState.STARTING:
                return Event("failed", k, f"{self.name(k)} failed to start: {first_line(exc)}")
            if slot.state is SlotState.CLOSING:
                return Event("closed", k)
            add_note(exc, f"in shmvec {self.name(k)}")
            raise
        if slot.state is SlotState.STARTING:
            return Event("started", k, value)
        if slot.state is SlotState.CLOSING:
            return Event("closed", k)
        return Event("lost", k, f"{self.name(k)} was lost: it closed its channel")

    # -------------------------------------------------------------- changes

    def started(self, k: int, description: dict[str, Any]) -> bool:
        """Slot ``k``'s agent is up: connects to its channel; False if it cannot."""
        slot = self.slots[k]
        slot.node_id = description["node_id"]
        try:
            slot.conn = Channel(Client(description["address"], authkey=self.authkey))
            self._reader.add(slot.conn.fileno(), k)
        except (OSError, EOFError) as exc:
            self.lost(k, f"{self.name(k)} was lost: its channel did not open ({exc!r})")
            return False
        slot.state, slot.reason = SlotState.LIVE, ""
        logger.info("%s runs envs %s", self.name(k), slot.block)
        self._call(k, slot.actor.serve.remote())
        return True

    def lost(self, k: int, reason: str) -> bool:
        """Slot ``k``'s agent died; True if it is started again (not after a drain)."""
        slot = self.slots[k]
        drained = slot.state in (SlotState.DRAINING, SlotState.CLOSING)
        self.vacate(k, reason)
        if not drained and slot.restarts < self.restarts:
            slot.restarts += 1
            logger.error("%s; starting it again (%d of %d)", reason, slot.restarts, self.restarts)
            self._create(k)
            slot.reason = f"{reason}; it is starting again"
            return True
        logger.error("%s; its envs leave the pool", reason)
        return False

    def vacate(self, k: int, reason: str) -> None:
        """Slot ``k`` has no agent any more (lost, or it could not create its envs)."""
        slot = self.slots[k]
        self._forget(k)
        self._hang_up(k)
        with contextlib.suppress(Exception):
            ray.kill(slot.actor)
        slot.actor, slot.reason, slot.state = None, reason, SlotState.VACANT

    def select(self, agents: Any, node_id: str | None) -> list[int]:
        """The slots that ``agents`` (an index or several) or ``node_id`` name."""
        if node_id is not None:
            chosen = [k for k, slot in enumerate(self.slots) if slot.node_id == node_id]
            if not chosen:
                nodes = [slot.node_id for slot in self.slots]
                raise ValueError(f"no agent runs on node {node_id} (agents' nodes: {nodes})")
            return chosen
        chosen = [agents] if isinstance(agents, int) else list(agents or ())
        for k in chosen:
            if not 0 <= k < len(self.slots):
                raise ValueError(f"agent {k} does not exist (num_agents={len(self.slots)})")
        return chosen

    def drain(self, k: int, deadline: float) -> None:
        """Slot ``k`` takes no new work, if it is live; it closes once its envs are idle."""
        slot = self.slots[k]
        if slot.state is SlotState.LIVE:
            slot.state, slot.reason = SlotState.DRAINING, f"{self.name(k)} was drained"
            slot.drain_deadline = deadline

    def close(self, k: int) -> None:
        """Closes a drained slot's envs; its agent is killed when they are closed."""
        slot = self.slots[k]
        self._forget(k)
        self._hang_up(k)  # rows it still sends are not wanted: their envs were answered
        slot.state = SlotState.CLOSING
        self._call(k, slot.actor.close.remote())

    def closed(self, k: int) -> None:
        slot = self.slots[k]
        with contextlib.suppress(Exception):
            ray.kill(slot.actor)
        slot.actor, slot.state = None, SlotState.VACANT

    def _hang_up(self, k: int) -> None:
        slot = self.slots[k]
        if slot.conn is not None:
            self._reader.remove(k)  # with its rows not taken yet
            slot.conn.close()
            slot.conn = None

    def _forget(self, k: int) -> None:
        slot = self.slots[k]
        if slot.ref is not None:
            self._calls.pop(slot.ref, None)
            slot.ref = None

    def call(self, name: str, args: tuple, kwargs: dict) -> list[Any]:
        """``name`` called (or read) in every env of a live agent; None for the others."""
        refs = {k: actor.call.remote(name, args, kwargs) for k, actor in self.live()}
        out: list[Any] = []
        for k, slot in enumerate(self.slots):
            out += list(ray.get(refs[k])) if k in refs else [None] * len(slot.block)
        return out

    def set_attr(self, name: str, values: list[Any]) -> None:
        """Sets ``name`` to ``values[i]`` in each env ``i`` of a live agent."""
        blocks = [self.slots[k].block for k, _ in self.live()]
        calls = [
            actor.set_attr.remote(name, values[block.start : block.stop])
            for (_, actor), block in zip(self.live(), blocks)
        ]
        ray.get(calls)

    def shut(self, grace_s: float | None) -> None:
        """Closes every agent's envs (``grace_s`` s, None: none) and kills every agent."""
        self._calls.clear()
        if grace_s is not None:
            closing = [actor.close.remote() for _, actor in self.live()]
            ray.wait(closing, num_returns=len(closing), timeout=grace_s)
        for k, slot in enumerate(self.slots):
            self._hang_up(k)
            with contextlib.suppress(Exception):  # already gone, or Ray shut down
                if slot.actor is not None:
                    ray.kill(slot.actor)
            slot.actor, slot.state, slot.ref = None, SlotState.VACANT, None
        self._reader.close()


def first_line(exc: BaseException) -> str:
    """The first and last lines of an error raised inside an agent."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line for line in str(cause).strip().splitlines() if line.strip()] or [""]
    return lines[0] if lines[0] == lines[-1] else f"{lines[0]} ... {lines[-1]}"


def cause_of(exc: BaseException) -> str:
    """The last line of a Ray error, or of the error inside it."""
    cause = getattr(exc, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".strip()
