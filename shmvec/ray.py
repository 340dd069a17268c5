"""RayVectorEnv: shmvec beyond one machine, one node-local ShmVectorEnv per Ray actor.

Data flow::

    RayVectorEnv (driver) ── actions[block k] ──► actor k (any node of the cluster)
                                                   ShmVectorEnv over envs first_k .. last_k
                                                   (shared memory between its workers)
                          ◄── (obs, rewards, terminations, truncations, infos) of block k
                              numpy arrays through Ray's object store, never per-env pickles

Each actor owns a contiguous block of envs and steps it as one batch; the driver
concatenates the blocks in env order (``step``), or hands back the first actor
batches that are ready (``recv``, async mode). Everything gymnasium defines (seeds,
options, ``reset_mask``, autoreset modes, info merging with ``_key`` masks) is done by
the actors' ShmVectorEnvs and by gymnasium's own ``VectorEnv._add_info`` here, so the
results equal ``SyncVectorEnv``'s with the same seeds and actions.

Example:
    >>> import gymnasium as gym
    >>> import ray
    >>> from shmvec.ray import RayVectorEnv
    >>> _ = ray.init(num_cpus=2, include_dashboard=False)  # doctest: +SKIP
    >>> envs = RayVectorEnv("CartPole-v1", num_actors=2, envs_per_actor=4)  # doctest: +SKIP
    >>> obs, infos = envs.reset(seed=0)  # doctest: +SKIP
    >>> obs.shape  # doctest: +SKIP
    (8, 4)
    >>> envs.close()  # doctest: +SKIP

Results are always fresh, writable arrays: each actor's batch arrives read-only
(large ones are zero-copy views of the object store) and is concatenated into new
arrays, one copy, as ``copy=True`` in gymnasium.

Methods of ``RayVectorEnv`` may be called from one thread at a time (the driver's).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space
from gymnasium.vector.vector_env import ArrayType, AutoresetMode, VectorEnv

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shmvec.ray needs Ray: pip install 'shmvec[ray]' (or pip install 'ray>=2.9')"
    ) from exc

from shmvec.batching import (
    batch_infos,
    check_env_ids,
    check_reset_mask,
    expand_options,
    expand_seeds,
    recv_whole_batch,
    rows_with_info,
    split_blocks,
    take_reset_mask,
    unbatch_info,
)
from shmvec.errors import WorkerDiedError, add_note
from shmvec.vector_env import ShmVectorEnv

__all__ = ["ActorDiedError", "RayVectorEnv"]

#: Ray's error for an actor that is restarting (Ray >= 2.30; older Rays wait instead).
_UNAVAILABLE = getattr(ray.exceptions, "ActorUnavailableError", ())

logger = logging.getLogger("shmvec")

#: How long the constructor waits for the placement group and the actors' envs.
STARTUP_TIMEOUT_S = 120.0
#: How long a restarted actor may take to answer again, and how often it is asked.
RESTART_TIMEOUT_S = 60.0
RESTART_POLL_S = 0.1
#: How long close() gives the actors to close their envs before killing them.
CLOSE_GRACE_S = 5.0
#: ``infos`` key set (with its ``_actor_restarted`` mask) on the rows of a restarted actor.
ACTOR_RESTARTED = "actor_restarted"


class ActorDiedError(WorkerDiedError):
    """A Ray actor of a RayVectorEnv died, or a worker process inside it did.

    A ``shmvec.WorkerDiedError``, so one ``except`` covers both vector envs.

    Attributes:
        worker: the actor's index.
        env_ids: the envs it owned (global ids).
        exitcode: always None (Ray does not report one).
        cause: what Ray, or the actor's ShmVectorEnv, said.
    """

    def __init__(self, actor: int, env_ids: range, cause: str) -> None:
        RuntimeError.__init__(
            self,
            f"shmvec Ray actor {actor} (envs {env_ids.start}..{env_ids.stop - 1}) died: {cause}",
        )
        self.worker = actor
        self.env_ids = env_ids
        self.exitcode = None
        self.cause = cause

    def __reduce__(self):  # it crosses process boundaries as a Ray task error
        return type(self), (self.worker, self.env_ids, self.cause)


class EnvActor:
    """The body of one Ray actor: a node-local ShmVectorEnv over one block of envs.

    Ray runs one method at a time (the actor's default concurrency of 1), so the
    ring views that ``copy=False`` returns are serialized into the object store
    before the next call can overwrite them.

    An actor that Ray restarted (``max_restarts``) knows it: until its envs are
    reset, ``step`` resets them instead and reports them truncated, with
    ``infos["actor_restarted"]``, so a restart is never mistaken for a step.
    """

    def __init__(
        self,
        index: int,
        env_ids: range,
        env_fns: list[Callable[[], gym.Env]],
        autoreset_mode: AutoresetMode,
        vector_kwargs: dict[str, Any],
    ) -> None:
        self.index = index
        self.env_ids = env_ids
        self.envs = ShmVectorEnv(env_fns, autoreset_mode=autoreset_mode, **vector_kwargs)
        with warnings.catch_warnings():  # Ray's own use of a deprecated property
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def describe(self) -> dict[str, Any]:
        """Spaces, metadata and where the actor runs."""
        context = ray.get_runtime_context()
        return {
            "single_observation_space": self.envs.single_observation_space,
            "single_action_space": self.envs.single_action_space,
            "metadata": self.envs.metadata,
            "render_mode": self.envs.render_mode,
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
        }

    def reset(self, seeds: list, options: Any, reset_mask: np.ndarray | None) -> tuple:
        """``ShmVectorEnv.reset`` of the block: ``(obs, infos)``."""
        self.restarted = False
        return self._guard(self.envs.reset, seed=seeds, options=options, reset_mask=reset_mask)

    def step(self, actions: Any) -> tuple:
        """``ShmVectorEnv.step`` of the block (``recover()`` after a restart)."""
        if self.restarted:
            return self.recover()
        return self._guard(self.envs.step, actions)

    def recover(self) -> tuple:
        """After a restart: resets the envs and reports them truncated, as a step batch."""
        obs, infos = self.reset(None, None, None)
        n = len(self.env_ids)
        infos = batch_infos([(row, [{ACTOR_RESTARTED: True}]) for row in range(n)], n, infos)
        return obs, np.zeros(n), np.zeros(n, dtype=bool), np.ones(n, dtype=bool), infos

    def call(self, name: str, args: tuple, kwargs: dict) -> tuple:
        return self._guard(self.envs.call, name, *args, **kwargs)

    def set_attr(self, name: str, values: list) -> None:
        self._guard(self.envs.set_attr, name, values)

    def stats(self) -> dict[str, Any]:
        return self.envs.stats()

    def close(self) -> None:
        """Closes the envs and ends the actor (Ray does not restart it)."""
        self.envs.close()
        ray.actor.exit_actor()

    def _guard(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Runs ``method``; a dead worker of the block becomes a (picklable) ActorDiedError."""
        try:
            return method(*args, **kwargs)
        except WorkerDiedError as exc:
            raise ActorDiedError(self.index, self.env_ids, str(exc)) from None


RemoteEnvActor = ray.remote(EnvActor)


class RayVectorEnv(VectorEnv):
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
            It must be a multiple of the (then equal) block size.
        group_size: envs ``g*k .. g*k+g-1`` form group ``k`` across actors, as in
            ``ShmVectorEnv``: ``reset(seed=s)`` gives them all seed ``s + k``, and list
            seeds/options may have one entry per group.
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
            {"env_node": 1}}`` to schedule only on nodes started with that custom
            resource (``ray start --resources='{"env_node": 8}'``; the placement
            group's bundles ask for it too), or ``{"runtime_env": ...}``.
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
        env_fns = _env_fns(env_fns, num_actors, envs_per_actor, env_kwargs or {})
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
        self.on_actor_death = on_actor_death
        self.actor_env_ids = split_blocks(self.num_envs, num_actors)
        self.batch_size = self.num_envs if batch_size is None else int(batch_size)
        self._batch_actors = self._check_batch_size()
        self.actor_restarts = [0] * num_actors
        self._state = AsyncState.DEFAULT
        self._refs: dict[int, Any] = {}  # sync mode: actor -> its pending call
        self._reset_args: dict[int, tuple] = {}
        self._pending: dict[Any, tuple[int, str]] = {}  # async mode: ref -> (actor, kind)
        self._stale: list = []  # refs of a call whose wait timed out
        self._sync_reset_pending = False
        self._last_env_ids: np.ndarray | None = None
        self._was_reset = False
        self._stats_steps = 0
        self._stats_episodes = 0
        self._stats_started = time.perf_counter()
        self.placement_group = None
        self.actors: list = []

        vector_kwargs = {
            "copy": False,
            "num_workers": 0 if num_cpus_per_actor <= 1 else int(num_cpus_per_actor),
            **(vector_kwargs or {}),
        }
        options: dict[str, Any] = {"num_cpus": num_cpus_per_actor, **(actor_options or {})}
        if on_actor_death == "restart":
            options.update(max_restarts=max_restarts, max_task_retries=0)
        try:
            bundle = {"CPU": num_cpus_per_actor, **options.get("resources", {})}
            strategies = self._schedule(placement_strategy, node_ids, bundle)
            for k, rows in enumerate(self.actor_env_ids):
                actor = RemoteEnvActor.options(scheduling_strategy=strategies[k], **options)
                block = env_fns[rows.start : rows.stop]
                self.actors.append(actor.remote(k, rows, block, self.autoreset_mode, vector_kwargs))
            described = self._started()
        except BaseException:
            self._release()
            raise
        first = described[0]
        self.single_observation_space = first["single_observation_space"]
        self.single_action_space = first["single_action_space"]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {**first["metadata"], "autoreset_mode": self.autoreset_mode}
        self.render_mode = first["render_mode"]
        #: The Ray node id of each actor, as at construction.
        self.actor_node_ids = [d["node_id"] for d in described]
        self._actor_obs: list[Any] = [None] * num_actors  # each actor's last obs
        self.closed = False

    # ------------------------------------------------------------------ setup

    def _check_batch_size(self) -> int:
        """The number of actor batches one ``recv()`` returns."""
        if self.batch_size == self.num_envs:
            return self.num_actors
        if not 1 <= self.batch_size <= self.num_envs:
            raise ValueError(
                f"batch_size must be between 1 and num_envs={self.num_envs}, got {self.batch_size}"
            )
        sizes = {len(rows) for rows in self.actor_env_ids}
        block = len(self.actor_env_ids[0])
        if len(sizes) != 1 or self.batch_size % block:
            raise ValueError(
                f"batch_size < num_envs needs equal actor blocks and a multiple of them: "
                f"blocks of {sorted(sizes)} envs, batch_size={self.batch_size}"
            )
        return self.batch_size // block

    def _schedule(self, strategy: str | None, node_ids, bundle: dict[str, float]) -> list:
        """One Ray scheduling strategy per actor; ``bundle``: the resources of one."""
        if node_ids is not None:
            return [NodeAffinitySchedulingStrategy(node, soft=False) for node in node_ids]
        if strategy is None:
            return ["DEFAULT"] * self.num_actors
        bundles = [bundle] * self.num_actors
        self.placement_group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the placement group ({self.num_actors} bundles of {bundles[0]}, {strategy}) "
                f"could not be placed within {STARTUP_TIMEOUT_S:.0f} s; cluster resources: "
                f"{ray.cluster_resources()}"
            )
        return [
            PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=k)
            for k in range(self.num_actors)
        ]

    def _started(self) -> list[dict[str, Any]]:
        """Waits for every actor's envs; their descriptions, after checking the spaces."""
        described = self._gather(
            {k: a.describe.remote() for k, a in enumerate(self.actors)}, STARTUP_TIMEOUT_S
        )
        first = described[0]
        for k, other in described.items():
            for name in ("single_observation_space", "single_action_space"):
                if other[name] != first[name]:
                    raise ValueError(
                        f"actor {k} has {name} {other[name]}, actor 0 has {first[name]}; "
                        "every env must share both spaces"
                    )
            logger.info(
                "Ray actor %d on node %s runs envs %d..%d", k, other["node_id"],
                self.actor_env_ids[k].start, self.actor_env_ids[k].stop - 1,
            )  # fmt: skip
        return [described[k] for k in range(self.num_actors)]

    @property
    def is_async(self) -> bool:
        """True when ``batch_size < num_envs``."""
        return self.batch_size < self.num_envs

    # ------------------------------------------------------------------ reset

    def reset_async(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        reset_mask: np.ndarray | None = None,
    ) -> None:
        """Sends a reset to every actor whose block has an env to reset.

        ``seed``: an int (env ``i`` gets ``seed + i``), a list with one seed per env,
        or None. ``options``: a dict for every env or a list with one per env. The
        mask is ``options["reset_mask"]`` as in gymnasium, or ``reset_mask``.
        """
        self._assert_idle("reset_async")
        if self.is_async:
            raise RuntimeError(
                "with batch_size < num_envs, reset with async_reset() and read with recv()"
            )
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
        infos = self._merge_infos([(k, results[k][1]) for k in sorted(results)], self.num_envs)
        return self._join_obs(self._actor_obs), infos

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        reset_mask: np.ndarray | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the envs; see ``gymnasium.vector.VectorEnv.reset`` and ``reset_async``.

        In async mode this is ``async_reset`` then ``recv``: it returns the first
        ``batch_size`` envs to finish resetting.
        """
        if self.is_async:
            if reset_mask is not None:
                raise ValueError("reset_mask needs batch_size == num_envs")
            self.async_reset(seed=seed, options=options)
            obs, _, _, _, infos = self.recv()
            return obs, infos
        self.reset_async(seed=seed, options=options, reset_mask=reset_mask)
        return self.reset_wait()

    # ------------------------------------------------------------------- step

    def step_async(self, actions: ArrayType) -> None:
        """Sends each actor the actions of its block."""
        self._assert_idle("step_async")
        if self.is_async:
            raise RuntimeError(
                "with batch_size < num_envs, step with send(actions, env_ids) and recv()"
            )
        _check_rows(self.single_action_space, actions, self.num_envs)
        self._refs = {
            k: actor.step.remote(_take_rows(self.single_action_space, actions, rows))
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

    def async_reset(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        env_ids: Any = None,
    ) -> None:
        """Resets envs without waiting; ``recv()`` returns the results.

        ``seed`` and ``options`` are expanded over all envs as in ``reset``. In async
        mode ``env_ids`` (default: all) must name whole actor blocks whose actors are
        idle: the actor is the unit that steps and resets.
        """
        self._assert_is_running()
        if not self.is_async:
            if env_ids is not None:
                raise ValueError("env_ids in async_reset needs batch_size < num_envs")
            self.reset_async(seed=seed, options=options)
            self._sync_reset_pending = True
            return
        seeds, per_actor = self._expand_seeds(seed), self._split_options(options)
        ids = np.arange(self.num_envs) if env_ids is None else env_ids
        for k in self._idle_actors(ids, "async_reset"):
            rows = self.actor_env_ids[k]
            args = (seeds[rows.start : rows.stop], per_actor[k], None)
            self._pending[self.actors[k].reset.remote(*args)] = (k, "reset")
        self._was_reset = True

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` and returns at once.

        ``env_ids`` defaults to those of the last ``recv()`` and must name whole actor
        blocks, in any order, whose actors are idle. In sync mode they must name every
        env.
        """
        self._assert_is_running()
        if not self.is_async and env_ids is None:
            self.step_async(actions)
            return
        if env_ids is None:
            if self._last_env_ids is None:
                raise ValueError("send() needs env_ids: no recv() has returned any yet")
            env_ids = self._last_env_ids
        ids = check_env_ids(env_ids, self.num_envs)
        _check_rows(self.single_action_space, actions, len(ids))
        if not self.is_async:
            if sorted(ids.tolist()) != list(range(self.num_envs)):
                raise ValueError(
                    "with batch_size == num_envs, send() steps every env: env_ids must name "
                    f"each of the {self.num_envs} envs once, got {ids.tolist()}"
                )
            self.step_async(_take_rows(self.single_action_space, actions, np.argsort(ids)))
            return
        if not self._was_reset:
            raise RuntimeError("send() before async_reset(): reset the envs first")
        position = np.empty(self.num_envs, dtype=np.int64)
        position[ids] = np.arange(len(ids))
        for k in self._idle_actors(ids, "send"):
            rows = self.actor_env_ids[k]
            block_actions = _take_rows(self.single_action_space, actions, position[rows])
            self._pending[self.actors[k].step.remote(block_actions)] = (k, "step")

    def recv(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict]:
        """The first ``batch_size`` results to be ready, whole actor batches:
        ``(obs, rewards, terminations, truncations, infos)`` with ``infos["env_id"]``.
        """
        self._assert_is_running()
        if not self.is_async:
            return self._recv_sync(timeout)
        need = self._batch_actors
        if len(self._pending) < need:
            running = sum(len(self.actor_env_ids[k]) for k, _ in self._pending.values())
            raise RuntimeError(
                f"recv() waits for batch_size={self.batch_size} results but only {running} "
                "envs are running: send() actions first"
            )
        ready, _ = ray.wait(list(self._pending), num_returns=need, timeout=timeout)
        if len(ready) < need:
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
            batches, actors, self.batch_size
        )
        env_ids = np.concatenate([np.arange(*self._span(k)) for k in actors])
        infos["env_id"] = env_ids
        self._last_env_ids = env_ids
        return obs, rewards, terminations, truncations, infos

    def _async_result(self, k: int, kind: str, ref) -> tuple:
        """Actor ``k``'s batch from ``ref`` (of a ``"reset"`` or a ``"step"``)."""
        try:
            result = self._get(k, ref)
        except (RayActorError, ActorDiedError) as exc:
            if self.on_actor_death != "restart":
                raise self._died(k, exc) from exc
            return self._recover(k, exc)
        if kind == "reset":
            obs, infos = result
            n = len(self.actor_env_ids[k])
            return obs, np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), infos
        return result

    def _recv_sync(self, timeout: float | None) -> tuple[Any, Any, Any, Any, dict]:
        pending, self._sync_reset_pending = self._sync_reset_pending, False
        return recv_whole_batch(self, pending, timeout)

    def _idle_actors(self, env_ids: Any, name: str) -> list[int]:
        """The actors whose whole blocks ``env_ids`` names; each must be idle."""
        ids = check_env_ids(env_ids, self.num_envs)
        named = np.zeros(self.num_envs, dtype=bool)
        named[ids] = True
        busy = {k for k, _ in self._pending.values()}
        actors = []
        for k, rows in enumerate(self.actor_env_ids):
            block = named[rows.start : rows.stop]
            if not block.any():
                continue
            if not block.all():
                raise ValueError(
                    f"{name}() steps whole actor blocks: actor {k} owns envs "
                    f"{rows.start}..{rows.stop - 1}, env_ids names only "
                    f"{(np.flatnonzero(block) + rows.start).tolist()}"
                )
            if k in busy:
                raise ValueError(
                    f"envs {rows.start}..{rows.stop - 1} (actor {k}) are not awaiting an "
                    "action: their previous call is still running (recv() its result first)"
                )
            actors.append(k)
        return actors

    # ------------------------------------------------------------- call & co

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` (or reads it, if not callable) in every env; one result each."""
        self._assert_idle("call")
        results = self._gather({k: a.call.remote(name, args, kwargs) for k, a in self._each()})
        return tuple(r for k in range(self.num_actors) for r in results[k])

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every env (callables are called, as in gymnasium)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env: one value each, or the same value for all."""
        self._assert_idle("set_attr")
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for {self.num_envs} environments."
            )
        self._gather(
            {
                k: a.set_attr.remote(name, list(values[slice(*self._span(k))]))
                for k, a in self._each()
            }
        )

    def render(self) -> tuple[Any, ...] | None:
        """Each env's ``render()``."""
        return self.call("render")

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
            actor_stats = self._gather({k: a.stats.remote() for k, a in self._each()})
            stats["actors"] = [actor_stats[k] for k in range(self.num_actors)]
        return stats

    # ------------------------------------------------------------------ close

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the actors' envs (``timeout`` s, default 5), then kills the actors and
        removes the placement group."""
        pending = [*self._refs.values(), *self._pending, *self._stale]
        grace = CLOSE_GRACE_S if timeout is None else timeout
        if not terminate:
            closing = [a.close.remote() for a in self.actors]
            ray.wait(pending + closing, num_returns=len(pending) + len(closing), timeout=grace)
        self._refs, self._pending, self._stale = {}, {}, []
        self._state = AsyncState.DEFAULT
        self._release()

    def _release(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone, or Ray shut down
                pass
        self.actors = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
            self.placement_group = None

    def __enter__(self) -> RayVectorEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and ray.is_initialized():
            self.close(terminate=True)

    # ---------------------------------------------------------------- helpers

    def _each(self):
        return enumerate(self.actors)

    def _span(self, k: int) -> tuple[int, int]:
        return self.actor_env_ids[k].start, self.actor_env_ids[k].stop

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _assert_idle(self, name: str) -> None:
        self._assert_is_running()
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{name}` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        if self._stale:  # late results of a timed-out wait: drop them
            ray.wait(self._stale, num_returns=len(self._stale))
            self._stale = []

    def _assert_waiting(self, state: AsyncState, name: str, sender: str) -> None:
        self._assert_is_running()
        if self._state != state:
            raise NoAsyncCallError(
                f"Calling `{name}` without any prior call to `{sender}`.", state.value
            )

    def _expand_seeds(self, seed: int | list[int | None] | None) -> list:
        return expand_seeds(seed, self.num_envs, self.group_size)

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
            return self._gather(refs, timeout, recover)
        finally:
            self._state = AsyncState.DEFAULT

    def _gather(
        self,
        refs: dict[int, Any],
        timeout: float | None = None,
        recover: Callable[[int, BaseException], Any] | None = None,
    ) -> dict[int, Any]:
        """``ray.get`` of one call per actor; a failure is attributed to its actor.

        ``recover(k, error)`` gives actor ``k``'s result after its death, under the
        restart policy; without it a death is an ``ActorDiedError``.
        """
        try:
            return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout)))
        except GetTimeoutError:
            done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
            late = [k for k, ref in refs.items() if ref not in set(done)]
            self._stale = list(refs.values())
            raise multiprocessing.TimeoutError(
                f"The call has timed out after {timeout} second(s). Not finished: "
                + ", ".join(f"actor {k} (envs {self._describe_rows(k)})" for k in late)
            ) from None
        except Exception:  # noqa: BLE001 - attributed to its actor below
            pass
        results = {}
        for k, ref in refs.items():
            try:
                results[k] = self._get(k, ref)
            except (RayActorError, ActorDiedError) as exc:
                if recover is None or self.on_actor_death != "restart":
                    raise self._died(k, exc) from exc
                results[k] = recover(k, exc)
        return results

    def _get(self, k: int, ref) -> Any:
        """``ray.get(ref)``; an env's own exception gets a note naming the actor."""
        try:
            return ray.get(ref)
        except (RayActorError, ActorDiedError):
            raise
        except Exception as exc:
            add_note(exc, f"in shmvec Ray actor {k} (envs {self._describe_rows(k)})")
            raise

    def _describe_rows(self, k: int) -> str:
        rows = self.actor_env_ids[k]
        return f"{rows.start}..{rows.stop - 1}"

    def _died(self, k: int, exc: BaseException) -> ActorDiedError:
        if isinstance(exc, ActorDiedError):
            return ActorDiedError(k, self.actor_env_ids[k], exc.cause)
        cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if self.on_actor_death == "restart":
            cause += f" (restarted {self.actor_restarts[k]} time(s) before)"
        error = ActorDiedError(k, self.actor_env_ids[k], f"{type(exc).__name__}: {cause}")
        logger.error("%s", error)
        return error

    def _restart(self, k: int, exc: BaseException) -> None:
        """Actor ``k`` died under the restart policy; Ray restarts it, or, if a worker
        inside it died, it is killed for Ray to restart."""
        logger.error(
            "shmvec Ray actor %d (envs %s) died (%s): restarting it",
            k, self._describe_rows(k), type(exc).__name__,
        )  # fmt: skip
        if isinstance(exc, ActorDiedError):  # the actor lives, its ShmVectorEnv does not
            ray.kill(self.actors[k], no_restart=False)

    def _redo_reset(self, k: int, exc: BaseException) -> tuple:
        """A reset after actor ``k`` died: the same reset on the restarted actor."""
        self._restart(k, exc)
        return self._call_restarted(k, "reset", *self._reset_args[k])

    def _recover(self, k: int, exc: BaseException) -> tuple:
        """A step after actor ``k`` died: its envs, new, report truncated."""
        self._restart(k, exc)
        return self._call_restarted(k, "recover")

    def _call_restarted(self, k: int, method: str, *args: Any) -> Any:
        """Calls ``method`` of actor ``k`` once Ray has restarted it. A call can land
        while Ray still reconnects to the new actor (``ActorUnavailableError``): it is
        retried for up to ``RESTART_TIMEOUT_S``; any other failure is an ActorDiedError."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                return self._get(k, getattr(self.actors[k], method).remote(*args))
            except (RayActorError, ActorDiedError) as exc:
                if not isinstance(exc, _UNAVAILABLE) or time.monotonic() > deadline:
                    raise self._died(k, exc) from exc
                time.sleep(RESTART_POLL_S)

    def _join(self, batches: list[tuple], actors: list[int], rows: int) -> tuple:
        """Actor batches, in the order given, as one batch of ``rows`` rows."""
        obs = self._join_obs([b[0] for b in batches])
        rewards, terminations, truncations = (
            np.concatenate([b[i] for b in batches]) for i in (1, 2, 3)
        )
        infos = self._merge_infos([(k, b[4]) for k, b in zip(actors, batches)], rows, by_env=False)
        for k, batch in zip(actors, batches):
            self.actor_restarts[k] += ACTOR_RESTARTED in batch[4]
        self._stats_steps += len(rewards)
        self._stats_episodes += int(np.count_nonzero(terminations | truncations))
        return obs, rewards, terminations, truncations, infos

    def _join_obs(self, batches: list) -> Any:
        return _concatenate_batches(self.single_observation_space, batches)

    def _merge_infos(
        self, parts: list[tuple[int, dict]], rows: int, by_env: bool = True
    ) -> dict[str, Any]:
        """Merges the actors' batched infos with ``VectorEnv._add_info``.

        ``parts`` are ``(actor, infos)``; an actor's rows land at its env ids
        (``by_env``) or one after another in the order given.
        """
        items = []
        offset = 0
        for k, block in parts:
            first = self.actor_env_ids[k].start if by_env else offset
            offset += len(self.actor_env_ids[k])
            items += [(first + row, [info]) for row, [info] in _items(block)]
        return batch_infos(items, rows)


def _env_fns(
    env_fns: Sequence[Callable[[], gym.Env]] | str,
    num_actors: int,
    envs_per_actor: int | None,
    env_kwargs: dict[str, Any],
) -> list[Callable[[], gym.Env]]:
    if not isinstance(num_actors, int) or num_actors < 1:
        raise ValueError(f"num_actors must be a positive int, got {num_actors!r}")
    if isinstance(env_fns, str):
        per_actor = 1 if envs_per_actor is None else envs_per_actor
        return [functools.partial(gym.make, env_fns, **env_kwargs)] * (num_actors * per_actor)
    env_fns = list(env_fns)
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] is not callable: {fn!r}")
    if len(env_fns) < num_actors:
        raise ValueError(f"{len(env_fns)} env_fns cannot fill {num_actors} actors")
    if envs_per_actor is not None and envs_per_actor * num_actors != len(env_fns):
        raise ValueError(
            f"envs_per_actor={envs_per_actor} x num_actors={num_actors} != {len(env_fns)} env_fns"
        )
    return env_fns


_FIXED_SIZE = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _leaf_batches(space: gym.Space, batch: Any, path: str = "actions"):
    """Yields ``(path, leaf batch)`` for every leaf of a batch of ``space``."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            yield from _leaf_batches(sub, batch[key], f"{path}[{key!r}]")
    elif isinstance(space, spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            yield from _leaf_batches(sub, batch[i], f"{path}[{i}]")
    else:
        yield path, batch


def _check_rows(space: gym.Space, batch: Any, rows: int) -> None:
    """A ValueError unless every leaf of ``batch`` has ``rows`` rows."""
    for path, leaf in _leaf_batches(space, batch):
        if isinstance(leaf, np.ndarray):
            size = leaf.shape[0] if leaf.ndim else None
        else:
            size = len(leaf) if isinstance(leaf, (list, tuple)) else None
        if size != rows:
            raise ValueError(f"{path} has {size} rows, expected {rows} (one per env)")


def _take_rows(space: gym.Space, batch: Any, rows: slice | np.ndarray | range) -> Any:
    """Rows ``rows`` of a batch of ``space`` (arrays, or per-env sequences at leaves)."""
    if isinstance(rows, range):
        rows = slice(rows.start, rows.stop)
    if isinstance(space, spaces.Dict):
        return {key: _take_rows(sub, batch[key], rows) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_take_rows(sub, batch[i], rows) for i, sub in enumerate(space.spaces))
    if isinstance(batch, np.ndarray):
        return batch[rows]
    return [batch[i] for i in np.arange(len(batch))[rows]]


def _concatenate_batches(space: gym.Space, batches: list) -> Any:
    """One batch from consecutive batches of ``space``: gymnasium's ``concatenate``,
    for batches instead of single values (fresh arrays at fixed-size leaves, tuples
    of per-env values elsewhere, as gymnasium batches them)."""
    if isinstance(space, spaces.Dict):
        return {
            key: _concatenate_batches(sub, [b[key] for b in batches])
            for key, sub in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        return tuple(
            _concatenate_batches(sub, [b[i] for b in batches]) for i, sub in enumerate(space.spaces)
        )
    if isinstance(space, _FIXED_SIZE):
        return np.concatenate(batches)
    return tuple(value for batch in batches for value in batch)


def _items(infos: dict) -> list[tuple[int, list[dict]]]:
    """A batched info dict as per-row dicts ``[(row, [info])]`` for ``batch_infos``."""
    return [(row, [unbatch_info(infos, row)]) for row in rows_with_info(infos)]
