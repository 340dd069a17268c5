"""The Ray actors behind RayVectorEnv: each ``EnvActor`` runs a node-local ShmVectorEnv
over a block of envs and steps it as one batch; ``ActorGroup`` places, starts, calls and
restarts them.

Methods may be called from one thread at a time (the driver's).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.vector.vector_env import AutoresetMode
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from shmvec.batching import batch_infos
from shmvec.errors import WorkerDiedError, add_note
from shmvec.vector_env import ShmVectorEnv

#: Ray's error for an actor that is restarting (Ray >= 2.30; older Rays wait instead).
_UNAVAILABLE = getattr(ray.exceptions, "ActorUnavailableError", ())

logger = logging.getLogger("shmvec")

#: How long the constructor waits for the placement group and the actors' envs.
STARTUP_TIMEOUT_S = 120.0
#: How long a restarted actor may take to answer again, and how often it is asked.
RESTART_TIMEOUT_S = 60.0
RESTART_POLL_S = 0.1
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

    def reset(self, seeds: list | None, options: Any, reset_mask: np.ndarray | None) -> tuple:
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


class ActorGroup:
    """The Ray actors of one RayVectorEnv: placement, start-up, calls attributed
    to their actor, deaths and restarts.

    Args:
        env_fns: every env's callable; actor ``k`` gets ``blocks[k]`` of them.
        blocks: each actor's env ids.
        autoreset_mode: the actors' ShmVectorEnvs' autoreset mode.
        vector_kwargs: keyword arguments of each actor's ShmVectorEnv.
        options: ``ActorClass.options(...)`` of every actor.
        on_actor_death: ``"raise"`` or ``"restart"``.
        placement_strategy, node_ids: where the actors go (RayVectorEnv's args).
    """

    def __init__(
        self,
        env_fns: list,
        blocks: list[range],
        autoreset_mode: AutoresetMode,
        vector_kwargs: dict[str, Any],
        options: dict[str, Any],
        on_actor_death: str,
        placement_strategy: str | None,
        node_ids: Sequence[str] | None,
    ) -> None:
        self.blocks = blocks
        self.on_actor_death = on_actor_death
        self.restarts = [0] * len(blocks)
        self.stale: list = []  # refs of a call whose wait timed out
        self.placement_group = None
        self.actors: list = []
        try:
            bundle = {"CPU": options["num_cpus"], **options.get("resources", {})}
            strategies = self.schedule(placement_strategy, node_ids, bundle)
            for k, rows in enumerate(blocks):
                actor = RemoteEnvActor.options(scheduling_strategy=strategies[k], **options)
                block = env_fns[rows.start : rows.stop]
                self.actors.append(actor.remote(k, rows, block, autoreset_mode, vector_kwargs))
            self.described = self.started()
        except BaseException:
            self.release()
            raise

    def schedule(self, strategy: str | None, node_ids, bundle: dict[str, float]) -> list:
        """One Ray scheduling strategy per actor; ``bundle``: the resources of one."""
        if node_ids is not None:
            return [NodeAffinitySchedulingStrategy(node, soft=False) for node in node_ids]
        if strategy is None:
            return ["DEFAULT"] * len(self.blocks)
        bundles = [bundle] * len(self.blocks)
        self.placement_group = group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([group.ready()], timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the placement group ({len(self.blocks)} bundles of {bundles[0]}, {strategy}) "
                f"could not be placed within {STARTUP_TIMEOUT_S:.0f} s; cluster resources: "
                f"{ray.cluster_resources()}"
            )
        return [
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=k)
            for k in range(len(self.blocks))
        ]

    def started(self) -> list[dict[str, Any]]:
        """Waits for every actor's envs; their descriptions, after checking the spaces."""
        described = self.gather(
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
                self.blocks[k].start, self.blocks[k].stop - 1,
            )  # fmt: skip
        return [described[k] for k in range(len(self.blocks))]

    def gather(
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
            self.stale = list(refs.values())
            raise multiprocessing.TimeoutError(
                f"The call has timed out after {timeout} second(s). Not finished: "
                + ", ".join(f"actor {k} (envs {self.describe_rows(k)})" for k in late)
            ) from None
        except Exception:  # noqa: BLE001 - attributed to its actor below
            pass
        results = {}
        for k, ref in refs.items():
            try:
                results[k] = self.get(k, ref)
            except (RayActorError, ActorDiedError) as exc:
                if recover is None or self.on_actor_death != "restart":
                    raise self.died(k, exc) from exc
                results[k] = recover(k, exc)
        return results

    def get(self, k: int, ref) -> Any:
        """``ray.get(ref)``; an env's own exception gets a note naming the actor."""
        try:
            return ray.get(ref)
        except (RayActorError, ActorDiedError):
            raise
        except Exception as exc:
            add_note(exc, f"in shmvec Ray actor {k} (envs {self.describe_rows(k)})")
            raise

    def describe_rows(self, k: int) -> str:
        rows = self.blocks[k]
        return f"{rows.start}..{rows.stop - 1}"

    def died(self, k: int, exc: BaseException) -> ActorDiedError:
        if isinstance(exc, ActorDiedError):
            return ActorDiedError(k, self.blocks[k], exc.cause)
        cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if self.on_actor_death == "restart":
            cause += f" (restarted {self.restarts[k]} time(s) before)"
        error = ActorDiedError(k, self.blocks[k], f"{type(exc).__name__}: {cause}")
        logger.error("%s", error)
        return error

    def restart(self, k: int, exc: BaseException) -> None:
        """Actor ``k`` died under the restart policy; Ray restarts it, or, if a worker
        inside it died, it is killed for Ray to restart."""
        logger.error(
            "shmvec Ray actor %d (envs %s) died (%s): restarting it",
            k, self.describe_rows(k), type(exc).__name__,
        )  # fmt: skip
        if isinstance(exc, ActorDiedError):  # the actor lives, its ShmVectorEnv does not
            ray.kill(self.actors[k], no_restart=False)

    def call_restarted(self, k: int, method: str, *args: Any) -> Any:
        """Calls ``method`` of actor ``k`` once Ray has restarted it. A call can land
        while Ray still reconnects to the new actor (``ActorUnavailableError``): it is
        retried for up to ``RESTART_TIMEOUT_S``; any other failure is an ActorDiedError."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                return self.get(k, getattr(self.actors[k], method).remote(*args))
            except (RayActorError, ActorDiedError) as exc:
                if not isinstance(exc, _UNAVAILABLE) or time.monotonic() > deadline:
                    raise self.died(k, exc) from exc
                time.sleep(RESTART_POLL_S)

    def release(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone, or Ray shut down
                ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None
