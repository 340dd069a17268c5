"""RayVectorEnv: a gymnasium VectorEnv over Ray actors, one node-local ShmVectorEnv per
actor, stepped in whole actor blocks.

Each actor owns a contiguous block of envs and steps it as one batch, which
travels as numpy arrays through Ray's object store; the driver concatenates the
blocks in env order (``step``) or hands back the first actor batches that are
ready (``recv``). Gymnasium's semantics are the actors' ShmVectorEnvs' and
``VectorEnv._add_info``'s here, so the results equal ``SyncVectorEnv``'s
(docs/guides/ray.md).

Results are fresh, writable arrays (one copy, as ``copy=True`` in gymnasium).
Methods of ``RayVectorEnv`` may be called from one thread at a time (the driver's).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.vector_env import ArrayType, AutoresetMode
from ray.exceptions import RayActorError

from shmvec.batching import (
    Options,
    Seeds,
    VectorEnvBase,
    check_env_ids,
    check_reset_mask,
    check_rows,
    expand_options,
    send_env_ids,
    split_blocks,
    take_reset_mask,
    take_rows,
)
from shmvec.ray.actors import ACTOR_RESTARTED, ActorDiedError, ActorGroup, EnvActor
from shmvec.ray.blocks import (
    actor_batches,
    actor_env_fns,
    concatenate_batches,
    idle_actors,
    merge_infos,
    take_spaces,
)

__all__ = ["ActorDiedError", "EnvActor", "RayVectorEnv"]

logger = logging.getLogger("shmvec")

#: How long close() gives the actors to close their envs before killing them.
CLOSE_GRACE_S = 5.0


class RayVectorEnv(VectorEnvBase):
    """A gymnasium VectorEnv whose envs live in Ray actors, a ShmVectorEnv in each.

    Env ``i`` belongs to one actor's contiguous block; ``reset(seed=s)`` gives it
    seed ``s + i`` whichever actor runs it, so the results equal ``SyncVectorEnv``'s
    for the same seeds and actions, in every autoreset mode.

    Ray must be initialized (``ray.init(...)``) before construction.

    Args:
        env_fns: zero-argument callables, each creating one env; or a registered env
            id, made ``num_actors * envs_per_actor`` times with ``gym.make(id,
            **env_kwargs)``. They are pickled (cloudpickle) to the actors.
        num_actors: Ray actors; envs are split into contiguous blocks, one each.
        envs_per_actor: with an env id, the block size (default 1); with env_fns, if
            given, must equal ``len(env_fns) / num_actors``.
        num_cpus_per_actor: Ray CPUs reserved per actor. The actor's ShmVectorEnv runs
            its envs in the actor process with 1 CPU (``num_workers=0``), else in
            ``int(num_cpus_per_actor)`` worker processes; ``vector_kwargs`` overrides.
        autoreset_mode: an ``AutoresetMode`` or its string value, shared by all actors.
        batch_size: with ``batch_size < num_envs``, the async mode: ``recv()`` returns
            the first ``batch_size // envs_per_actor`` actor batches that are ready.
            It must be a multiple of the (then equal) block size; ``send`` and
            ``async_reset`` then name whole blocks of idle actors, in any order.
        group_size: envs ``g*k .. g*k+g-1`` share seed ``s + k`` across actors, as in
            ``ShmVectorEnv``.
        on_actor_death: ``"raise"``: a dead actor is an ``ActorDiedError`` naming it and
            its envs. ``"restart"``: Ray restarts it (up to ``max_restarts`` times), its
            envs are created and reset again and report ``truncated`` with
            ``infos["actor_restarted"]`` (a dead worker inside the actor restarts the
            actor the same way).
        max_restarts: Ray's ``max_restarts`` per actor with ``on_actor_death="restart"``.
        placement_strategy: the placement group's strategy, ``"SPREAD"`` (default: over
            as many nodes as possible), ``"STRICT_SPREAD"``, ``"PACK"``,
            ``"STRICT_PACK"``; None for no placement group (Ray's default scheduling).
        node_ids: pin actor ``k`` to node ``node_ids[k]`` (hex ids, as in
            ``ray.nodes()``) with ``NodeAffinitySchedulingStrategy``; no placement group.
        actor_options: extra ``ActorClass.options(...)``, e.g. ``{"resources":
            {"env_node": 1}}`` (only nodes with that custom resource; the placement
            group's bundles ask for it too) or ``{"runtime_env": ...}``.
        vector_kwargs: keyword arguments of each actor's ``ShmVectorEnv``
            (``num_workers``, ``context``, ``spin_ns``...). Default ``copy=False``: the
            actor's results are copied into the object store anyway.
        env_kwargs: keyword arguments of ``gym.make`` when ``env_fns`` is an env id.

    Example:
        >>> envs = RayVectorEnv(  # doctest: +SKIP
        ...     "CartPole-v1", num_actors=4, envs_per_actor=16, num_cpus_per_actor=2,
        ...     batch_size=32,
        ... )
        >>> envs.async_reset(seed=0)  # doctest: +SKIP
        >>> obs, rewards, terminations, truncations, infos = envs.recv()  # doctest: +SKIP
        >>> envs.send(policy(obs), infos["env_id"])  # doctest: +SKIP
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]] | str,
        num_actors: int = 1,
        *,
        envs_per_actor: int | None = None,
        num_cpus_per_actor: float = 1.0,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        batch_size: int | None = None,
        group_size: int = 1,
        on_actor_death: str = "raise",
        max_restarts: int = 3,
        placement_strategy: str | None = "SPREAD",
        node_ids: Sequence[str] | None = None,
        actor_options: dict[str, Any] | None = None,
        vector_kwargs: dict[str, Any] | None = None,
        env_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.closed = True  # until the actors are up; close() is then a no-op
        if not ray.is_initialized():
            raise RuntimeError("RayVectorEnv needs Ray: call ray.init(...) first")
        env_fns = actor_env_fns(env_fns, num_actors, envs_per_actor, env_kwargs or {})
        if on_actor_death not in ("raise", "restart"):
            raise ValueError(f"on_actor_death must be 'raise' or 'restart', got {on_actor_death!r}")
        if node_ids is not None and len(node_ids) != num_actors:
            raise ValueError(f"node_ids needs one node per actor ({num_actors}), got {node_ids}")
        self.num_envs = len(env_fns)
        self.num_actors = num_actors
        if group_size < 1 or self.num_envs % group_size:
            raise ValueError(f"group_size must divide num_envs={self.num_envs}, got {group_size}")
        self.group_size = group_size
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.actor_env_ids = split_blocks(self.num_envs, num_actors)
        self.batch_size = self.num_envs if batch_size is None else int(batch_size)
        self.is_async = self.batch_size < self.num_envs
        self._batch_actors = actor_batches(self.batch_size, self.actor_env_ids)
        self._state = AsyncState.DEFAULT
        self._refs: dict[int, Any] = {}  # sync mode: actor -> its pending call
        self._reset_args: dict[int, tuple] = {}
        self._pending: dict[Any, tuple[int, str]] = {}  # async mode: ref -> (actor, kind)
        self._sync_reset_pending = False
        self._last_env_ids: np.ndarray | None = None
        self._was_reset = False
        self._stats_steps = 0
        self._stats_episodes = 0
        self._stats_started = time.perf_counter()

        vector_kwargs = {
            "copy": False,
            "num_workers": 0 if num_cpus_per_actor <= 1 else int(num_cpus_per_actor),
            **(vector_kwargs or {}),
        }
        #: What the actors' envs do when their step raises (``vector_kwargs``).
        self.on_env_error = vector_kwargs.get("on_env_error", "raise")
        options: dict[str, Any] = {"num_cpus": num_cpus_per_actor, **(actor_options or {})}
        if on_actor_death == "restart":
            options.update(max_restarts=max_restarts, max_task_retries=0)
        self._group = ActorGroup(
            env_fns, self.actor_env_ids, self.autoreset_mode, vector_kwargs, options,
            on_actor_death, placement_strategy, node_ids,
        )  # fmt: skip
        described = self._group.described
        take_spaces(self, described[0])
        #: The Ray node id of each actor, as at construction.
        self.actor_node_ids = [d["node_id"] for d in described]
        self._actor_obs: list[Any] = [None] * num_actors  # each actor's last obs
        self.closed = False

    @property
    def actors(self) -> list:
        """The Ray actor handles, one per block."""
        return self._group.actors

    @property
    def placement_group(self):
        """The actors' placement group, or None."""
        return self._group.placement_group

    @property
    def actor_restarts(self) -> list[int]:
        """How many times each actor was restarted."""
        return self._group.restarts

    # ------------------------------------------------------------------ reset

    def reset_async(self, seed: Seeds = None, options: Options = None, reset_mask=None) -> None:
        """Sends a reset to every actor whose block has an env to reset.

        ``seed``: an int (env ``i`` gets ``seed + i``), a list with one seed per env,
        or None. ``options``: a dict for every env or a list with one per env. The
        mask is ``options["reset_mask"]`` as in gymnasium, or ``reset_mask``.
        """
        self._assert_idle("reset_async")
        self._assert_sync("reset_async")
        options = dict(options) if isinstance(options, dict) else options
        reset_mask = take_reset_mask(options, reset_mask)
        if reset_mask is not None:
            reset_mask = check_reset_mask(reset_mask, self.num_envs)
        seeds, per_actor = self._expand_seeds(seed), self._split_options(options)
        self._reset_args = {}
        for k, rows in enumerate(self.actor_env_ids):
            mask = None if reset_mask is None else reset_mask[rows.start : rows.stop]
            if mask is None or mask.any():
                self._reset_args[k] = (seeds[rows.start : rows.stop], per_actor[k], mask)
        self._refs = {k: self.actors[k].reset.remote(*a) for k, a in self._reset_args.items()}
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Waits for the reset sent by ``reset_async``; returns ``(obs, infos)``."""
        self._assert_waiting(AsyncState.WAITING_RESET, "reset_wait", "reset_async")
        results = self._finish(timeout, self._redo_reset)
        for k, (obs, _) in results.items():
            self._actor_obs[k] = obs
        parts = [(k, results[k][1]) for k in sorted(results)]
        infos = merge_infos(parts, self.actor_env_ids, self.num_envs)
        return self._join_obs(self._actor_obs), infos

    # ------------------------------------------------------------------- step

    def step_async(self, actions: ArrayType) -> None:
        """Sends each actor the actions of its block."""
        self._assert_idle("step_async")
        self._assert_sync("step_async")
        check_rows(self.single_action_space, actions, self.num_envs)
        self._refs = {
            k: actor.step.remote(take_rows(self.single_action_space, actions, rows))
            for k, (actor, rows) in enumerate(zip(self.actors, self.actor_env_ids))
        }
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict]:
        """Waits for every actor's batch; returns them joined in env order."""
        self._assert_waiting(AsyncState.WAITING_STEP, "step_wait", "step_async")
        results = self._finish(timeout, self._recover)
        batches = [results[k] for k in range(self.num_actors)]
        for k, batch in enumerate(batches):
            self._actor_obs[k] = batch[0]
        return self._join(batches, list(range(self.num_actors)), self.num_envs)

    def step(self, actions: ArrayType) -> tuple[Any, Any, Any, Any, dict]:
        """Steps every env; see ``gymnasium.vector.VectorEnv.step``."""
        self.step_async(actions)
        return self.step_wait()

    # ------------------------------------------------------------------ async

    def _async_reset(self, seed: Seeds, options: Options, env_ids: Any) -> None:
        """``env_ids`` (default: all) must name whole blocks of idle actors."""
        seeds, per_actor = self._expand_seeds(seed), self._split_options(options)
        ids = np.arange(self.num_envs) if env_ids is None else check_env_ids(env_ids, self.num_envs)
        for k in idle_actors(ids, self.actor_env_ids, self._busy(), "async_reset"):
            rows = self.actor_env_ids[k]
            args = (seeds[rows.start : rows.stop], per_actor[k], None)
            self._pending[self.actors[k].reset.remote(*args)] = (k, "reset")
        self._was_reset = True

    def _send(self, actions: Any, env_ids: Any) -> None:
        """``env_ids`` must name whole actor blocks, in any order, whose actors are idle."""
        ids = send_env_ids(env_ids, self._last_env_ids, self.num_envs)
        check_rows(self.single_action_space, actions, len(ids))
        if not self._was_reset:
            raise RuntimeError("send() before async_reset(): reset the envs first")
        position = np.empty(self.num_envs, dtype=np.int64)
        position[ids] = np.arange(len(ids))
        for k in idle_actors(ids, self.actor_env_ids, self._busy(), "send"):
            rows = self.actor_env_ids[k]
            block_actions = take_rows(self.single_action_space, actions, position[rows])
            self._pending[self.actors[k].step.remote(block_actions)] = (k, "step")

    def _recv(
        self, timeout: float | None, partial: bool, take_ready: bool
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """The first ``batch_size`` results to be ready, whole actor batches; with
        ``partial``, while fewer actors run, the batches of all of them; with
        ``take_ready``, past ``timeout``, the batches that are ready."""
        need = self._batch_actors
        if len(self._pending) < need:
            running = sum(len(self.actor_env_ids[k]) for k, _ in self._pending.values())
            if not (partial and self._pending):
                raise RuntimeError(
                    f"recv() waits for batch_size={self.batch_size} results but only {running} "
                    "envs are running: send() actions first"
                )
            need = len(self._pending)
        ready, _ = ray.wait(list(self._pending), num_returns=need, timeout=timeout)
        if len(ready) < need and not (take_ready and ready):
            raise multiprocessing.TimeoutError(
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{len(ready)} of {need} actor batches are ready"
            )
        actors, batches = [], []
        for ref in ready:
            k, kind = self._pending.pop(ref)
            actors.append(k)
            batches.append(self._async_result(k, kind, ref))
        obs, rewards, terminations, truncations, infos = self._join(
            batches, actors, sum(len(self.actor_env_ids[k]) for k in actors)
        )
        env_ids = np.concatenate([np.arange(*self._span(k)) for k in actors])
        infos["env_id"] = env_ids
        self._last_env_ids = env_ids
        return obs, rewards, terminations, truncations, infos

    def _async_result(self, k: int, kind: str, ref) -> tuple:
        """Actor ``k``'s batch from ``ref`` (of a ``"reset"`` or a ``"step"``)."""
        try:
            result = self._group.get(k, ref)
        except (RayActorError, ActorDiedError) as exc:
            if self.on_actor_death != "restart":
                raise self._group.died(k, exc) from exc
            return self._recover(k, exc)
        if kind == "reset":
            obs, infos = result
            n = len(self.actor_env_ids[k])
            return obs, np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), infos
        return result

    # ------------------------------------------------------------- call & co

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` (or reads it, if not callable) in every env; one result each."""
        self._assert_idle("call")
        calls = {k: a.call.remote(name, args, kwargs) for k, a in self._each()}
        results = self._group.gather(calls)
        return tuple(r for k in range(self.num_actors) for r in results[k])

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env: one value each, or the same value for all."""
        self._assert_idle("set_attr")
        values = self._attr_values(values)
        self._group.gather(
            {
                k: a.set_attr.remote(name, list(values[slice(*self._span(k))]))
                for k, a in self._each()
            }
        )

    def stats(self) -> dict[str, Any]:
        """Steps, steps/s and episodes since construction, restarts per actor, and each
        actor's own ``ShmVectorEnv.stats()`` (when no call is pending)."""
        elapsed = time.perf_counter() - self._stats_started
        stats: dict[str, Any] = {
            "steps": self._stats_steps,
            "steps_per_s": self._stats_steps / elapsed if elapsed > 0 else 0.0,
            "episodes": self._stats_episodes,
            "elapsed_s": elapsed,
            "actor_restarts": list(self.actor_restarts),
        }
        if self._state == AsyncState.DEFAULT and not self._pending:
            actor_stats = self._group.gather({k: a.stats.remote() for k, a in self._each()})
            stats["actors"] = [actor_stats[k] for k in range(self.num_actors)]
        return stats

    # ------------------------------------------------------------------ close

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the actors' envs (``timeout`` s, default 5), then kills the actors and
        removes the placement group."""
        pending = [*self._refs.values(), *self._pending, *self._group.stale]
        grace = CLOSE_GRACE_S if timeout is None else timeout
        if not terminate:
            closing = [a.close.remote() for a in self.actors]
            ray.wait(pending + closing, num_returns=len(pending) + len(closing), timeout=grace)
        self._refs, self._pending, self._group.stale = {}, {}, []
        self._state = AsyncState.DEFAULT
        self._group.release()

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and ray.is_initialized():
            self.close(terminate=True)

    # ---------------------------------------------------------------- helpers

    def _each(self):
        return enumerate(self.actors)

    @property
    def on_actor_death(self) -> str:
        """``"raise"`` or ``"restart"``, as constructed (the actor group's)."""
        return self._group.on_actor_death

    def _busy(self) -> set[int]:
        return {k for k, _ in self._pending.values()}

    def _span(self, k: int) -> tuple[int, int]:
        return self.actor_env_ids[k].start, self.actor_env_ids[k].stop

    def _assert_idle(self, name: str, end: str = ".") -> None:
        self._assert_is_running()
        super()._assert_idle(name, end)
        if self._group.stale:  # late results of a timed-out wait: drop them
            ray.wait(self._group.stale, num_returns=len(self._group.stale))
            self._group.stale = []

    def _split_options(self, options: Any) -> list:
        """Each actor's options: the same dict, or its slice of the per-env list."""
        if options is None or isinstance(options, dict):
            return [options] * self.num_actors
        per_env = expand_options(options, self.num_envs, self.group_size)
        return [per_env[slice(*self._span(k))] for k in range(self.num_actors)]

    def _finish(self, timeout: float | None, recover: Callable[[int, BaseException], Any]) -> dict:
        """Ends the pending sync-mode call: each actor's result, by actor."""
        refs, self._refs = self._refs, {}
        try:
            return self._group.gather(refs, timeout, recover)
        finally:
            self._state = AsyncState.DEFAULT

    def _redo_reset(self, k: int, exc: BaseException) -> tuple:
        """A reset after actor ``k`` died: the same reset on the restarted actor."""
        self._group.restart(k, exc)
        return self._group.call_restarted(k, "reset", *self._reset_args[k])

    def _recover(self, k: int, exc: BaseException) -> tuple:
        """A step after actor ``k`` died: its envs, new, report truncated."""
        self._group.restart(k, exc)
        return self._group.call_restarted(k, "recover")

    def _join(self, batches: list[tuple], actors: list[int], rows: int) -> tuple:
        """Actor batches, in the order given, as one batch of ``rows`` rows."""
        obs = self._join_obs([b[0] for b in batches])
        rewards, terminations, truncations = (
            np.concatenate([b[i] for b in batches]) for i in (1, 2, 3)
        )
        parts = [(k, b[4]) for k, b in zip(actors, batches)]
        infos = merge_infos(parts, self.actor_env_ids, rows, by_env=False)
        for k, batch in zip(actors, batches):
            self.actor_restarts[k] += ACTOR_RESTARTED in batch[4]
        self._stats_steps += len(rewards)
        self._stats_episodes += int(np.count_nonzero(terminations | truncations))
        return obs, rewards, terminations, truncations, infos

    def _join_obs(self, batches: list) -> Any:
        return concatenate_batches(self.single_observation_space, batches)
