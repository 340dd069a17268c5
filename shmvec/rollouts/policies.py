"""The two kinds of policy the rollout loop drives, each in a thread of its own.

A *batched* policy is a callable in the trainer's process (a torch model, a
local generator): whenever it is free, it is called with every row that has
come to await an action since its last call began, as an inference server's
continuous batching does, while the loop goes on receiving and recording. A
*per-row* policy is a coroutine function (a call to an inference service such
as a vLLM or SGLang server): the loop issues one call per row as soon as the
row is ready, up to ``concurrency`` calls at once, on an event loop in a
thread of its own, and sends each answer as it comes; no row waits for another.

Both runners take rows with ``submit``, hand back :class:`RowAnswer` s with
``take`` (the loop sends them), and count the time the policy was running.
:func:`action_problem` says which answers the env may not receive: the loop
fails their trajectories as ``invalid_action`` instead of sending them.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from shmvec.rollouts.records import (
    EndTrajectory,
    PolicyBatch,
    PolicyError,
    PolicyFailure,
    PolicyOutput,
    PolicyRow,
    RowOutput,
)
from shmvec.rollouts.rows import join_batches, rows_of

#: How long closing a per-row policy's runner waits for its cancelled calls to unwind.
UNWIND_S = 5.0


class AsyncPolicy:
    """A per-row policy: ``await fn(row)`` for each :class:`PolicyRow`, returning
    an action or a :class:`RowOutput` (action and extra). ``fn`` may raise
    :class:`PolicyFailure` to fail the row's trajectory (the loop goes on) or
    :class:`EndTrajectory` to end it as finished without acting.

    Args:
        fn: a coroutine function.
        concurrency: at most this many calls in flight (an inference server's
            useful batch); the other ready rows wait their turn in order.
    """

    def __init__(self, fn: Callable[[PolicyRow], Awaitable[Any]], concurrency: int = 64) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"AsyncPolicy needs a coroutine function (async def), got {fn!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        self.fn, self.concurrency = fn, concurrency

    def set_version(self, version: int) -> None:
        """Called on the policy's event loop when the rollouts' version changes, before any
        call that is stamped with ``version`` starts (a subclass may interrupt calls)."""

    async def aclose(self) -> None:
        """Called on the policy's event loop once its calls are cancelled, when the rollouts
        close (a subclass closes its clients)."""


@dataclass
class RowAnswer:
    """One row's answer (or the error of the call that was to answer it),
    handed back to the rollout loop."""

    key: Any  # the loop's handle on the row (its attempt)
    output: Any = None
    error: BaseException | None = None
    started_s: float = 0.0
    ended_s: float = 0.0
    failure: str | None = None  # a PolicyFailure's message: the trajectory fails, the loop goes on
    end: str | None = None  # an EndTrajectory's message: the trajectory ends as finished


class BusyClock:
    """Seconds during which at least one policy call ran (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self._busy_s = 0.0

    def start(self) -> None:
        with self._lock:
            if not self._running:
                self._since = time.monotonic()
            self._running += 1

    def stop(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self._busy_s += time.monotonic() - self._since

    def busy_s(self) -> float:
        with self._lock:
            running = time.monotonic() - self._since if self._running else 0.0
            return self._busy_s + running


class PolicyRunner:
    """What both runners share: answers handed back, and the busy clock."""

    #: Whether each row is answered on its own (the loop then hands rows over as
    #: they come, not by full batches).
    per_row = False

    def __init__(self, version: Callable[[], int], on_answer: Callable[[], None]) -> None:
        self.version, self.on_answer = version, on_answer
        self.answers: deque[RowAnswer] = deque()
        self.outstanding = 0  # rows submitted, not yet taken
        self.calls = 0
        self.clock = BusyClock()

    def submit(self, rows: list[PolicyRow], observations: Any) -> None:
        """Hands over rows that await an action (``observations``: theirs, batched)."""
        raise NotImplementedError

    def set_version(self, version: int) -> None:
        """The rollouts' version changed (``version()`` already gives it)."""

    def close(self) -> None:
        raise NotImplementedError

    def take(self) -> list[RowAnswer]:
        """The answers that have come in since the last ``take``."""
        taken = []
        while self.answers:
            taken.append(self.answers.popleft())
        self.outstanding -= len(taken)
        return taken


class AsyncPolicyRunner(PolicyRunner):
    """Runs an :class:`AsyncPolicy` on an event loop in its own thread.

    ``submit`` may be called from the rollout loop's thread; each call's row is
    stamped with the policy version at its start, as the event loop has it (or
    with the version its ``RowOutput`` names):
    ``set_version`` hands a new version to the loop (and to the policy's
    ``set_version``) ahead of every call submitted after it, so that a call and
    the row it answers agree on their version. ``on_answer`` is called (from
    the event loop's thread) after each answer, to wake the rollout loop. The
    policy is busy while at least one call runs.
    """

    per_row = True

    def __init__(
        self, policy: AsyncPolicy, version: Callable[[], int], on_answer: Callable[[], None]
    ) -> None:
        super().__init__(version, on_answer)
        self.policy = policy
        self.loop_version = version()
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self.thread = threading.Thread(target=self._serve, name="shmvec-policy", daemon=True)
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.limit = asyncio.Semaphore(self.policy.concurrency)
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()

    def submit(self, rows: list[PolicyRow], observations: Any) -> None:
        """Issues one call per row (``observations``, their batch, is not used), all
        started by one wake-up of the event loop."""
        self.outstanding += len(rows)
        self.loop.call_soon_threadsafe(self._start, rows)

    def _start(self, rows: list[PolicyRow]) -> None:
        for row in rows:
            task = self.loop.create_task(self._call(row))
            self._tasks.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self._tasks.discard)

    def set_version(self, version: int) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._new_version, version)

    def _new_version(self, version: int) -> None:
        self.loop_version = version
        self.policy.set_version(version)

    async def _call(self, row: PolicyRow) -> None:
        async with self.limit:
            self.clock.start()
            answer = RowAnswer((row.trajectory, self.loop_version), started_s=time.monotonic())
            try:
                answer.output = await self.policy.fn(row)
            except PolicyFailure as failure:
                answer.failure = _reason(failure)
            except EndTrajectory as end:
                answer.end = _reason(end)
            except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
                answer.error = PolicyError(
                    f"the policy raised {error!r} for the row of env {row.env_id}"
                )
                answer.error.__cause__ = error
            else:
                if split_row_output(answer.output)[0] is None:
                    answer.error = PolicyError(
                        f"the policy answered None for the row of env {row.env_id}"
                    )
                version = getattr(answer.output, "version", None)
                if isinstance(answer.output, RowOutput) and version is not None:
                    if not isinstance(version, int) or isinstance(version, bool):
                        answer.error = PolicyError(
                            f"the policy answered version {version!r} for the row of env "
                            f"{row.env_id}: RowOutput.version is an int or None"
                        )
                    else:
                        answer.key = (row.trajectory, version)
            answer.ended_s = time.monotonic()
            self.clock.stop()
        self.calls += 1
        self.answers.append(answer)
        self.on_answer()

    def close(self) -> None:
        """Cancels the calls still in flight and stops the event loop; closing again does
        nothing."""
        if self.loop.is_closed():
            return

        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            loop = self.loop
            # As asyncio.run ends: the cancelled calls unwind (their cleanup may take
            # several turns of the loop), so that none is destroyed while pending, and
            # async generators left open are closed on this loop, not by the collector.
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=UNWIND_S))
            loop.run_until_complete(self.policy.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


class BatchedPolicyRunner(PolicyRunner):
    """Calls a batched policy in a thread of its own, on every row submitted
    since its last call began; ``take`` returns the answers of finished calls.
    A row whose action is an :class:`EndTrajectory` (in a list of actions) ends
    its trajectory as finished; one whose action is a :class:`PolicyFailure`
    fails it as ``policy_error``.

    Each call's rows are stamped with the policy version at the call's start
    (``version()``); ``on_answer`` is called after each call, to wake the loop.
    """

    def __init__(
        self,
        policy: Callable[[PolicyBatch], Any],
        version: Callable[[], int],
        on_answer: Callable[[], None],
    ) -> None:
        super().__init__(version, on_answer)
        self.policy = policy
        self._cond = threading.Condition()
        self._pending: list[tuple[list[PolicyRow], Any]] = []
        self._stopping = False
        self.thread = threading.Thread(target=self._serve, name="shmvec-policy", daemon=True)
        self.thread.start()

    def submit(self, rows: list[PolicyRow], observations: Any) -> None:
        """Queues ``rows`` (``observations``: theirs, batched, owned by the
        runner from now on) for the next call."""
        self.outstanding += len(rows)
        with self._cond:
            self._pending.append((rows, observations))
            self._cond.notify()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                parts, self._pending = self._pending, []
            rows = [row for part, _ in parts for row in part]
            version = self.version()
            self.clock.start()
            started = time.monotonic()
            outputs, error = self._call(rows, [observations for _, observations in parts])
            ended = time.monotonic()
            self.clock.stop()
            self.calls += 1
            for row, output in zip(rows, outputs):
                answer = RowAnswer((row.trajectory, version), output, error, started, ended)
                if output is not None and isinstance(output.action, EndTrajectory):
                    answer.output, answer.end = None, _reason(output.action)
                elif output is not None and isinstance(output.action, PolicyFailure):
                    answer.output, answer.failure = None, _reason(output.action)
                self.answers.append(answer)
            self.on_answer()

    def _call(
        self, rows: list[PolicyRow], observations: list[Any]
    ) -> tuple[list[Any], BaseException | None]:
        """The policy on ``rows`` (``observations``: their batches, in order): one
        ``RowOutput`` per row, or Nones and the error naming the rows."""
        env_ids = [row.env_id for row in rows]
        try:
            batch = PolicyBatch(
                join_batches(observations),
                [row.trajectory for row in rows],
                np.array(env_ids, dtype=np.int64),
            )
            actions, extras = split_batch_output(self.policy(batch), len(batch), env_ids)
            per_row = rows_of(actions)
        except PolicyError as error:
            return [None] * len(rows), error
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            wrapped = PolicyError(f"the policy raised {error!r} for the rows of envs {env_ids}")
            wrapped.__cause__ = error
            return [None] * len(rows), wrapped
        return [RowOutput(a, e) for a, e in zip(per_row, extras)], None

    def close(self) -> None:
        """Stops the thread once the call in progress, if any, returns."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.thread.join(timeout=5)


def _reason(error: Exception) -> str:
    """A ``PolicyFailure``'s or ``EndTrajectory``'s message (its type's name if it has none)."""
    return str(error) or type(error).__name__


def split_batch_output(output: Any, rows: int, env_ids: list[int]) -> tuple[Any, list[Any]]:
    """A batched policy's answer as (actions, extras), checked for its length."""
    actions, extras = (
        (output.actions, output.extras)
        if isinstance(output, PolicyOutput)
        else (
            output,
            None,
        )
    )
    if not isinstance(actions, dict):
        try:
            count = len(actions)
        except TypeError:
            raise PolicyError(
                f"the policy returned {type(actions).__name__}, not one action per row for the "
                f"{rows} rows of envs {env_ids}"
            ) from None
        if count != rows:
            raise PolicyError(
                f"the policy returned {count} actions for {rows} rows (envs {env_ids})"
            )
    if extras is None:
        extras = [None] * rows
    elif len(extras) != rows:
        raise PolicyError(
            f"the policy returned {len(extras)} extras for {rows} rows (envs {env_ids})"
        )
    return actions, list(extras)


def action_problem(space: gym.Space, action: Any) -> str | None:
    """None if the env of action space ``space`` may receive ``action``; else why not, naming
    the action and the space (the reason of its trajectory's ``invalid_action``).

    The value checked is the one the env receives: the loop writes each action into the
    space's dtype before sending it (a float64 Box action as float32, an int tensor as int64).
    """
    try:
        if _holds(space, action) or _holds(space, _as_received(space, action)):
            return None
        detail = _problem(space, action)
    except Exception as error:  # noqa: BLE001 - what cannot be written as the space's value
        detail = f"{type(error).__name__}: {error}"
    return f"action {action!r:.200} is outside the env's action space {space!r:.200}" + (
        f": {detail}" if detail else ""
    )


#: Spaces of one array of a fixed dtype, whose actions the loop writes with numpy's cast.
ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _as_received(space: gym.Space, action: Any) -> Any:
    """``action`` as the loop writes it into the space's dtype: with the same-kind cast of
    ``np.stack(..., out=...)`` (TypeError where it refuses), a direct cast for an array space
    and each part of a Dict or Tuple (``concatenate`` of one row costs 10-30x more), and
    gymnasium's own for any other space."""
    if isinstance(space, ARRAY_SPACES):
        value = np.asarray(action)
        if value.dtype == space.dtype:
            return value
        return value.astype(space.dtype, casting="same_kind")
    if isinstance(space, spaces.Dict):
        return {key: _as_received(part, action[key]) for key, part in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        if len(action) != len(space.spaces):
            raise ValueError(f"{len(action)} parts for the {len(space.spaces)} of the space")
        return tuple(_as_received(part, value) for part, value in zip(space.spaces, action))
    out: Any = create_empty_array(space, 1)
    return next(iter(iterate(batch_space(space, 1), concatenate(space, [action], out))))


def _holds(space: gym.Space, value: Any) -> bool:
    if type(space) is spaces.Text:  # Text.contains looks each character up through a property
        return (
            isinstance(value, str)
            and space.min_length <= len(value) <= space.max_length
            and space.character_set.issuperset(value)
        )
    if isinstance(space, spaces.Box):
        # Its shape only, as the vector env checks it: a value past the bounds is the env's
        # to clip (as gymnasium's vector envs hand it over), not the policy's failure.
        return isinstance(value, np.ndarray) and value.shape == space.shape
    return bool(space.contains(value))


def _problem(space: gym.Space, value: Any) -> str:
    """What keeps ``value`` out of ``space``, where it is more than its not being in it: a
    text's length and characters, an array's shape ("" otherwise)."""
    if isinstance(space, ARRAY_SPACES) and np.shape(value) != space.shape:
        return f"shape {np.shape(value)}, not {space.shape}"
    if not isinstance(space, spaces.Text) or not isinstance(value, str):
        return ""
    problems = []
    if len(value) < space.min_length:
        problems.append(f"{len(value)} characters, under min_length={space.min_length}")
    if len(value) > space.max_length:
        problems.append(f"{len(value)} characters, over max_length={space.max_length}")
    outside = sorted(set(value) - set(space.character_set))
    if outside:
        problems.append(f"characters outside its charset: {''.join(outside)!r}")
    return "; ".join(problems)


def split_row_output(output: Any) -> tuple[Any, Any]:
    """A per-row policy's answer as (action, extra)."""
    if isinstance(output, RowOutput):
        return output.action, output.extra
    return output, None
