"""Awaitable envs: ``await env.reset(...)`` and ``await env.step(action)`` on envs leased
from an async vector env, for code that runs one coroutine per trajectory.

Data flow: a coroutine leases a free env (``async with pool.env(tag=...) as env``; it
waits, first come first served, while none of that tag is free). Each ``await
env.step(action)`` hands one command to the dispatcher (shmvec/awaitable_dispatch.py),
one thread that owns the vector env's public async API (``async_reset``, ``send``,
``recv``): it sends the commands queued since its last turn as one batch, receives the
results and hands each row to its env's future on the event loop, one wake-up a batch.
A failure that the vector env reports as a result (``on_env_error="reset"``,
``on_worker_death="restart"``, ``step_deadline``) raises a typed ``EnvFailure`` in the
coroutine whose env it hit, and in no other; the env is usable after ``await
env.reset()``. Leaving the block releases the env, also on cancellation: an env whose
command is still running is handed on once its result has arrived (and is dropped).

Each leased env records its episode (``env.trajectory``, a ``shmvec.rollouts.Trajectory``)
so that ``env.replay(env_fn)`` can step it again alone, bit for bit.

Who may call what: everything from the event loop's thread that first leased an env.

Example:
    >>> import asyncio
    >>> import gymnasium as gym
    >>> import shmvec
    >>> envs = shmvec.ShmVectorEnv(
    ...     [lambda: gym.make("CartPole-v1")] * 4, num_workers=2, batch_size=2,
    ...     on_env_error="reset", on_worker_death="restart",
    ... )
    >>> async def episode(pool, seed):
    ...     async with pool.env() as env:
    ...         obs, info = await env.reset(seed=seed)
    ...         total, done = 0.0, False
    ...         while not done:
    ...             obs, reward, terminated, truncated, info = await env.step(0)
    ...             total, done = total + reward, terminated or truncated
    ...         return total
    >>> async def main():
    ...     async with shmvec.AwaitableEnvs(envs) as pool:
    ...         return await asyncio.gather(*(episode(pool, s) for s in range(8)))
    >>> len(asyncio.run(main()))
    8
    >>> envs.close()
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from gymnasium.error import ResetNeeded
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.awaitable_dispatch import FAILURES, Dispatcher, Result
from shmvec.errors import LeaseError
from shmvec.rollouts.records import Status, Task, Trajectory
from shmvec.rollouts.replay import ReplayReport, replay

__all__ = ["AwaitableEnv", "AwaitableEnvs"]

#: The leases (their serial numbers) that the running coroutine holds: a child task
#: created inside an ``async with`` block inherits them, any other coroutine has not.
_HELD: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "shmvec_held_envs", default=frozenset()
)
_serials = itertools.count()


class AwaitableEnvs:
    """Leases envs of an async vector env to coroutines, one at a time each.

    Args:
        envs: a ``ShmVectorEnv`` (or ``make_mix``'s) in async mode
            (``batch_size < num_envs``), with ``on_env_error="reset"`` and
            ``on_worker_death="restart"``, so that failures come back as results;
            autoreset mode ``NEXT_STEP`` or ``DISABLED``. The pool owns its async API
            while it runs.
        record: whether leased envs record their episodes (``env.trajectory``) by
            default; ``pool.env(record=...)`` decides per lease.
        close_envs: whether ``close()`` closes the vector env too.

    Use it from one event loop: ``async with AwaitableEnvs(envs) as pool`` (or call
    ``close()``), then ``async with pool.env(tag=...) as env`` in each coroutine.
    """

    def __init__(self, envs: Any, *, record: bool = True, close_envs: bool = False) -> None:
        check_async_envs(envs)
        self.envs = envs
        self.num_envs = envs.num_envs
        self.record = record
        self.env_tags: list[str | None] = list(
            getattr(envs, "env_tags", None) or [None] * self.num_envs
        )
        self.tags = frozenset(t for t in self.env_tags if t is not None)
        self.observation_space = envs.single_observation_space
        self.action_space = envs.single_action_space
        self._free: dict[str | None, deque[int]] = {}
        for env, tag in enumerate(self.env_tags):
            self._free.setdefault(tag, deque()).append(env)
        self._waiters: deque[tuple[str | None, asyncio.Future]] = deque()
        self._handles: list[AwaitableEnv | None] = [None] * self.num_envs
        self._draining: set[int] = set()  # released with a command in flight
        self._parked: set[int] = set()  # free, but in the vector env's lost_env_ids
        self._dispatcher: Dispatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.close_envs = close_envs

    @classmethod
    def from_env_fns(
        cls,
        env_fns: list[Callable[[], Any]],
        *,
        env_concurrency: int,
        batch_size: int | None = None,
        record: bool = True,
        **vector_kwargs: Any,
    ) -> AwaitableEnvs:
        """A ``ShmVectorEnv`` set up for leasing, and the pool over it (``close()``
        closes both). ``env_concurrency`` as in ``Rollouts.from_env_fns``: every env
        of a block (``len(env_fns)``) for envs that wait on tools, ``1`` for envs that
        compute. ``batch_size`` defaults to a sixteenth of the envs (rows reach their
        coroutines sooner than with larger batches)."""
        from shmvec.vector_env import client_vector_env

        envs = client_vector_env(env_fns, env_concurrency, batch_size, vector_kwargs)
        try:
            return cls(envs, record=record, close_envs=True)
        except BaseException:
            envs.close(terminate=True)
            raise

    # ------------------------------------------------------------------ leases

    def env(
        self, tag: str | None = None, *, record: bool | None = None
    ) -> AbstractAsyncContextManager[AwaitableEnv]:
        """``async with pool.env(tag=...) as env``: a free env (of ``tag``: one of
        ``make_mix``'s names; None: any), waiting until one is free. The env is
        released when the block ends, however it ends. ``record``: whether the env
        records its episodes (default: the pool's)."""
        if tag is not None and tag not in self.tags:
            known = sorted(self.tags)
            raise ValueError(
                f"no env has tag {tag!r}; the envs' tags are {known}"
                if known
                else f"no env has tag {tag!r}: these envs have no tags (make_mix names them)"
            )
        return _Lease(self, tag, self.record if record is None else record)

    async def _acquire(self, tag: str | None) -> int:
        self._bind()
        env = self._take_free(tag)
        if env is not None:
            return env
        if getattr(self.envs, "exhausted", False):
            raise self._exhausted()
        waiter = self._loop_or_raise().create_future()
        self._waiters.append((tag, waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._free_env(waiter.result())  # granted as the cancellation came
            else:
                self._waiters.remove((tag, waiter))
            raise

    def _take_free(self, tag: str | None) -> int | None:
        """A free env of ``tag`` (None: any) that no earlier waiter could take."""
        wanted = {w for w, _ in self._waiters}
        if None in wanted:
            return None  # it takes any env first (and none is free while it waits)
        lost = getattr(self.envs, "lost_env_ids", ())
        for kind in [tag] if tag is not None else list(self._free):
            free = self._free.get(kind)
            while free and kind not in wanted:
                env = free.popleft()
                if env not in lost:
                    return env
                self._parked.add(env)
        return None

    def _free_env(self, env: int) -> None:
        """Gives ``env`` to the first waiter that takes its tag, or back to the free list;
        an env that takes no new work (``ClusterVectorEnv.lost_env_ids``: its node
        agent is lost, drained or starting) waits aside until it is back."""
        self._handles[env] = None
        if env in getattr(self.envs, "lost_env_ids", ()):
            self._parked.add(env)
            return
        tag = self.env_tags[env]
        for i, (wanted, waiter) in enumerate(self._waiters):
            if wanted is None or wanted == tag:
                del self._waiters[i]
                waiter.set_result(env)
                return
        self._free[tag].append(env)

    def _release(self, handle: AwaitableEnv) -> None:
        handle.released = True
        if handle.pending is not None and not handle.pending.done():
            handle.pending.cancel()
        if handle.in_flight:
            self._draining.add(handle.env_id)  # freed when its result arrives
            return
        self._free_env(handle.env_id)

    # -------------------------------------------------------------- dispatcher

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("this AwaitableEnvs is closed")
        if self._error is not None:
            raise RuntimeError(f"the env dispatcher stopped: {self._error!r}") from self._error
        if self._loop is None:
            self._loop = loop
            self._dispatcher = Dispatcher(
                self.envs, loop, self._deliver, self._stopped, self._envs_changed
            )
        elif self._loop is not loop:
            raise RuntimeError(
                "this AwaitableEnvs serves the event loop that first leased an env; "
                "make one pool per event loop"
            )

    def _loop_or_raise(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def _command(self, handle: AwaitableEnv, command: tuple) -> asyncio.Future:
        # The lease bound the pool to this loop (_bind); only what changed since matters.
        if self._closed or self._error is not None:
            self._bind()  # raises the reason
        assert self._dispatcher is not None and self._loop is not None
        future = self._loop.create_future()
        handle.pending, handle.in_flight = future, True
        self._dispatcher.submit(handle.env_id, command)
        return future

    def _deliver(self, results: list[tuple[int, Result]]) -> None:
        """The dispatcher's rows, on the event loop: each to its env's future."""
        for env, result in results:
            handle = self._handles[env]
            if env in self._draining:
                self._draining.discard(env)
                self._free_env(env)
                continue
            if handle is None:
                continue
            handle.in_flight = False
            if handle.pending is not None and not handle.pending.done():
                handle.pending.set_result(result)
            else:  # its coroutine was cancelled while waiting: the episode is unknown
                handle.needs_reset = True

    def _envs_changed(self) -> None:
        """The vector env's ``lost_env_ids`` changed: the envs back in the pool are free
        again; if no env can ever take work, the coroutines waiting for one get a
        RuntimeError."""
        lost = getattr(self.envs, "lost_env_ids", ())
        for env in sorted(self._parked.difference(lost)):
            self._parked.discard(env)
            self._free_env(env)
        if getattr(self.envs, "exhausted", False):
            for _, waiter in self._waiters:
                if not waiter.done():
                    waiter.set_exception(self._exhausted())
            self._waiters.clear()

    def _exhausted(self) -> RuntimeError:
        return RuntimeError(
            "no env can take work: every node agent was lost or drained "
            f"({getattr(self.envs, 'lost_agents', {})})"
        )

    def _stopped(self, error: BaseException) -> None:
        """The dispatcher died: every waiting coroutine gets the error."""
        self._error = error
        for handle in self._handles:
            if handle is not None and handle.pending is not None and not handle.pending.done():
                handle.pending.set_exception(RuntimeError(f"the env dispatcher stopped: {error!r}"))

    # --------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Stops the dispatcher (within a few tens of milliseconds); closes the vector
        env too with ``close_envs`` (as ``from_env_fns`` sets it). Coroutines still
        awaiting an env get a ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.stop()
        for _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(RuntimeError("the AwaitableEnvs was closed"))
        self._waiters.clear()
        if self.close_envs and not self.envs.closed:
            self.envs.close(terminate=True)

    async def __aenter__(self) -> AwaitableEnvs:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def __enter__(self) -> AwaitableEnvs:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _Lease:
    """``pool.env(...)``'s async context manager: leases on entry, releases on exit."""

    def __init__(self, pool: AwaitableEnvs, tag: str | None, record: bool) -> None:
        self.pool, self.tag, self.record = pool, tag, record
        self.handle: AwaitableEnv | None = None

    async def __aenter__(self) -> AwaitableEnv:
        if self.handle is not None:
            raise LeaseError("this pool.env() lease was entered already; call pool.env() again")
        env = await self.pool._acquire(self.tag)
        handle = AwaitableEnv(self.pool, env, self.record)
        self.pool._handles[env] = self.handle = handle
        _HELD.set(_HELD.get() | {handle.serial})
        return handle

    async def __aexit__(self, *exc_info: Any) -> None:
        handle = self.handle
        assert handle is not None
        _HELD.set(_HELD.get() - {handle.serial})
        if not handle.released:
            self.pool._release(handle)


class AwaitableEnv:
    """One env leased to a coroutine: ``await reset(...)`` and ``await step(action)``
    return that env's own values, as a single gymnasium env's do.

    Attributes:
        env_id: its index in the vector env.
        tag: its tag, or None.
        trajectory: the episode recorded since the last ``reset`` (``None`` before
            it, or when the lease does not record): seed, options, observations,
            actions, rewards, and how it ended (``status``, ``reason``).
    """

    def __init__(self, pool: AwaitableEnvs, env_id: int, record: bool) -> None:
        self.pool, self.env_id, self.record = pool, env_id, record
        self.tag = pool.env_tags[env_id]
        self.observation_space = pool.observation_space
        self.action_space = pool.action_space
        self.serial = next(_serials)
        self.pending: asyncio.Future | None = None
        self.in_flight = False
        self.released = False
        self.needs_reset = True
        self.trajectory: Trajectory | None = None

    def __repr__(self) -> str:
        tag = "" if self.tag is None else f", tag={self.tag!r}"
        return f"<AwaitableEnv env_id={self.env_id}{tag}{', released' if self.released else ''}>"

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the env (``seed``, ``options`` as gymnasium's); returns ``(obs, info)``."""
        self._check_call("reset")
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"env {self.env_id}: seed must be an int or None, got {seed!r}")
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"env {self.env_id}: options must be a dict or None, got {options!r}")
        if self.record:
            self.trajectory = Trajectory(
                Task(seed, options, self.tag), group_id=-1, index=0, attempt=0,
                env_id=self.env_id, env_tag=self.tag,
            )  # fmt: skip
        else:
            self.trajectory = None
        result = await self._call(("reset", seed, options), "reset")
        self.needs_reset = False
        if self.trajectory is not None:
            self.trajectory.observations.append(result.obs)
            self.trajectory.reset_info = result.info
        return result.obs, result.info

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Steps the env; returns ``(obs, reward, terminated, truncated, info)``.

        Raises an ``EnvFailure`` (``EnvStepError``, ``EnvDeadlineError``,
        ``EnvWorkerDiedError``, ``EnvNodeLostError``) when the step failed; ``ResetNeeded`` when the
        episode ended (or failed, or was never started in this lease)."""
        self._check_call("step")
        if self.needs_reset:
            raise ResetNeeded(
                f"env {self.env_id}: await env.reset(...) first (after leasing, and after an "
                "episode ends or fails)"
            )
        if not self.action_space.contains(action):
            raise ValueError(
                f"env {self.env_id}: action {action!r} is not in the action space "
                f"{self.action_space}"
            )
        traj = self.trajectory
        if traj is not None:
            traj.actions.append(action)
        result = await self._call(("step", action), "step")
        if traj is not None:
            traj.observations.append(result.obs)
            traj.rewards.append(result.reward)
            traj.infos.append(result.info)
        if result.terminated or result.truncated:
            self.needs_reset = True
            if traj is not None:
                traj.status = Status.TERMINATED if result.terminated else Status.TRUNCATED
        return result.obs, result.reward, result.terminated, result.truncated, result.info

    def replay(self, env_fn: Callable[[], Any]) -> ReplayReport:
        """Steps ``env_fn()`` alone through the recorded episode (seed, options,
        actions) and compares every observation and reward bit for bit
        (``shmvec.rollouts.replay``): raises ``ReplayMismatch`` at the first
        difference."""
        if self.trajectory is None:
            raise ValueError(
                f"env {self.env_id} has recorded no episode: reset it first, with "
                "pool.env(record=True) (the default)"
            )
        return replay(self.trajectory, env_fn)

    def _check_call(self, call: str) -> None:
        if self.released:
            raise LeaseError(
                f"{call}() on env {self.env_id}, released when its `async with pool.env()` "
                "block ended: lease an env again"
            )
        if self.serial not in _HELD.get():
            raise LeaseError(
                f"{call}() on env {self.env_id} from a coroutine that does not hold it: only "
                "the coroutine inside its `async with pool.env()` block (and tasks it starts "
                "there) may use it"
            )
        if self.in_flight:
            raise LeaseError(
                f"{call}() on env {self.env_id} while its previous call is still running: "
                "await each call before the next"
            )

    async def _call(self, command: tuple, call: str) -> Result:
        future = self.pool._command(self, command)
        try:
            result: Result = await future
        except asyncio.CancelledError:
            self.needs_reset = True  # the command runs on; its result will be dropped
            raise
        finally:
            if self.pending is future:
                self.pending = None
        # A reset after its worker's restart ran as asked, on the new env: no failure.
        lost = result.failure is not None and not (
            call == "reset" and result.failure[0] == "worker_died"
        )
        if lost:
            assert result.failure is not None
            what, detail = result.failure
            self.needs_reset = True
            if self.trajectory is not None:
                self.trajectory.status, self.trajectory.reason = Status(what), detail
                if call == "step":
                    self.trajectory.actions.pop()  # the step did not happen
            raise FAILURES[what](self.env_id, self.tag, call, detail)
        return result


def check_async_envs(envs: Any) -> None:
    """Raises ValueError unless ``envs`` can serve leases (async mode, failures as results)."""
    if not getattr(envs, "is_async", False):
        raise ValueError(
            "AwaitableEnvs needs a vector env in async mode (batch_size < num_envs), so that "
            f"each env steps on its own; got batch_size={getattr(envs, 'batch_size', None)} "
            f"of num_envs={getattr(envs, 'num_envs', None)}"
        )
    if getattr(envs, "on_env_error", "reset") != "reset":
        raise ValueError(
            "AwaitableEnvs raises an env's error in its own coroutine only: make the vector "
            "env with on_env_error='reset'"
        )
    if getattr(envs, "on_worker_death", "restart") != "restart":
        raise ValueError(
            "AwaitableEnvs raises a dead worker in its envs' coroutines only: make the vector "
            "env with on_worker_death='restart'"
        )
    mode = getattr(envs, "autoreset_mode", AutoresetMode.NEXT_STEP)
    if AutoresetMode(mode) is AutoresetMode.SAME_STEP:
        raise ValueError(
            "AwaitableEnvs returns each step's own observation: use autoreset_mode NEXT_STEP "
            "or DISABLED, not SAME_STEP"
        )
