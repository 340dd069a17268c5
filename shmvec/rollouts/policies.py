"""The two kinds of policy the rollout loop drives.

A *batched* policy is a callable in the trainer's process (a torch model, a
local generator): the loop calls it with every row that awaits an action in
the batch it received, and sends the answers. A *per-row* policy is a
coroutine function (a call to an inference service such as a vLLM or SGLang
server): the loop issues one call per row as soon as the row is ready, up to
``concurrency`` calls at once, on an event loop in a thread of its own, and
sends each answer as it comes; no row waits for another.
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

from shmvec.rollouts.records import PolicyError, PolicyOutput, PolicyRow, RowOutput


class AsyncPolicy:
    """A per-row policy: ``await fn(row)`` for each :class:`PolicyRow`, returning
    an action or a :class:`RowOutput` (action and extra).

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


@dataclass
class RowAnswer:
    """One per-row call's outcome, handed back to the rollout loop."""

    key: Any  # the loop's handle on the row (its attempt)
    output: Any = None
    error: BaseException | None = None
    started_s: float = 0.0
    ended_s: float = 0.0


class AsyncPolicyRunner:
    """Runs an :class:`AsyncPolicy` on an event loop in its own thread.

    ``submit`` may be called from the rollout loop's thread; ``take`` returns
    the answers that have come in; ``on_answer`` is called (from the event
    loop's thread) after each answer, to wake the rollout loop.
    """

    def __init__(self, policy: AsyncPolicy, on_answer: Callable[[], None]) -> None:
        self.policy, self.on_answer = policy, on_answer
        self.answers: deque[RowAnswer] = deque()
        self.outstanding = 0  # submitted, not yet taken
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="shmvec-policy", daemon=True)
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.limit = asyncio.Semaphore(self.policy.concurrency)
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()

    def submit(self, key: Any, row: PolicyRow) -> None:
        self.outstanding += 1
        asyncio.run_coroutine_threadsafe(self._call(key, row), self.loop)

    async def _call(self, key: Any, row: PolicyRow) -> None:
        async with self.limit:
            answer = RowAnswer(key, started_s=time.monotonic())
            try:
                answer.output = await self.policy.fn(row)
            except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
                answer.error = error
            answer.ended_s = time.monotonic()
        self.answers.append(answer)
        self.on_answer()

    def take(self) -> list[RowAnswer]:
        taken = []
        while self.answers:
            taken.append(self.answers.popleft())
        self.outstanding -= len(taken)
        return taken

    def close(self) -> None:
        """Cancels the calls still in flight and stops the event loop."""

        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            # let the cancelled calls unwind, so that none is destroyed while pending
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()


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


def split_row_output(output: Any) -> tuple[Any, Any]:
    """A per-row policy's answer as (action, extra)."""
    if isinstance(output, RowOutput):
        return output.action, output.extra
    return output, None
