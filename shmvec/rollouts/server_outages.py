"""What :class:`~shmvec.rollouts.server.ServerPolicy` does about failures that are not a
trajectory's: a server that cannot be reached (refused, reset, every connection dropped)
pauses the requests until a probe finds it answering again, so that its outage costs no
trajectory a retry (:class:`Outages`); and the calls of attempts that the rollouts cancelled
(their group completed or was dropped) stop, their requests with them
(:class:`CancelledAttempts`).

Everything here runs on the policy's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from shmvec.rollouts.records import PolicyFailure, Status, Trajectory
from shmvec.rollouts.server_client import UNREACHABLE, classify

#: Seconds between probes of a server that cannot be reached, at most: a server that is back
#: is found within about this long, and a refused probe costs it nothing.
PROBE_EVERY_S = 1.0


class ServerUnreachable(RuntimeError):
    """The server has not answered for longer than the policy's ``outage_timeout``: raised
    to the trainer (the loop stops), naming the server."""


class Outages:
    """Whether the server can be reached, and the outages it had.

    A request that failed at the connection level (``UNREACHABLE``) calls :meth:`suspect`: one
    probe (``probe() -> bool``: does the server answer?), shared by the requests that fail
    meanwhile, tells. If the server answers, the fault was the request's own. If not, an outage
    begins: :meth:`wait` holds every request until a probe, repeated every ``backoff_s``
    doubling up to ``PROBE_EVERY_S``, gets an answer; past ``timeout_s`` of outage (None: never)
    it raises :class:`ServerUnreachable`. Runs on the policy's event loop; ``count`` and
    ``seconds()`` may be read from any thread.
    """

    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        url: str,
        timeout_s: float | None,
        backoff_s: float,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"outage_timeout must be > 0 or None, got {timeout_s!r}")
        self.probe, self.url, self.timeout_s = probe, url, timeout_s
        self.backoff_s = min(backoff_s, PROBE_EVERY_S)
        self.count = 0  # outages begun
        self.since: float | None = None  # when the outage under way began
        self._ended_s = 0.0  # seconds of the outages that ended
        self._up = asyncio.Event()
        self._probing: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def seconds(self) -> float:
        """Seconds the server could not be reached, the outage under way included."""
        since = self.since
        return self._ended_s + (time.monotonic() - since if since is not None else 0.0)

    async def suspect(self) -> bool:
        """After a connection-level fault: whether the server is down (probed once for all the
        requests that ask meanwhile)."""
        if self.since is None:
            if self._probing is None:
                self._probing = asyncio.ensure_future(self._first_probe())
            await asyncio.shield(self._probing)
        return self.since is not None

    async def wait(self) -> None:
        """Returns at once while the server is up; during an outage, when it ends.

        Raises:
            ServerUnreachable: the outage has lasted ``timeout_s``.
        """
        since, up = self.since, self._up
        if since is None:
            return
        if self.timeout_s is None:
            await up.wait()
            return
        try:
            await asyncio.wait_for(up.wait(), max(0.0, since + self.timeout_s - time.monotonic()))
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            if up.is_set():
                return
            raise ServerUnreachable(
                f"the server at {self.url} has not answered for "
                f"{time.monotonic() - since:.0f} s (outage_timeout={self.timeout_s} s): it "
                "refuses or drops every connection"
            ) from None

    async def _first_probe(self) -> None:
        try:
            if not await self.probe() and self.since is None:
                self.since, self._up = time.monotonic(), asyncio.Event()
                self.count += 1
                self._watcher = asyncio.ensure_future(self._until_up())
        finally:
            self._probing = None

    async def _until_up(self) -> None:
        delay = self.backoff_s
        while True:
            await asyncio.sleep(delay)
            try:
                if await self.probe():
                    break
            except Exception:  # noqa: BLE001 - no server's failure: the requests will show it
                break
            delay = min(2 * delay, PROBE_EVERY_S)
        since, self.since = self.since, None
        self._ended_s += time.monotonic() - (since or 0.0)
        self._up.set()


async def answers(client: Any, connect_timeout_s: float) -> bool:
    """Whether the server behind ``client`` (an ``openai.AsyncOpenAI``) answers ``GET /models``
    within ``PROBE_TIMEOUT_S`` with anything but a 5xx."""
    import openai

    timeout = openai.Timeout(PROBE_TIMEOUT_S, connect=min(connect_timeout_s, PROBE_TIMEOUT_S))
    try:
        await client.get("/models", cast_to=object, options={"timeout": timeout})
    except openai.APIStatusError as error:
        return error.status_code < 500
    except Exception as error:  # noqa: BLE001 - classified
        return classify(error).kind not in (*UNREACHABLE, "timeout")  # (not JSON: an answer)
    return True


#: Seconds a probe waits for the server's answer: a server whose event loop cannot answer a
#: listing of its models in this long is as good as down for the requests.
PROBE_TIMEOUT_S = 10.0
#: Seconds between looks at the attempts in flight: a cancelled attempt's request is closed
#: within about this long of its group settling, for at most 0.7 ms of CPU a look at 1,000
#: calls in flight (0.14% of a core; 2-vCPU VM beside a vLLM-CPU server starting, 2026-12-02).
SWEEP_S = 0.5


class CancelledAttempts:
    """The attempts whose calls are in flight, by task. A sweep every ``SWEEP_S`` cancels the
    call of each attempt the rollouts no longer run (its status is no longer ``RUNNING``: its
    group completed or was dropped), and :meth:`check` stops one before each request, so that
    no request or retry is spent on it; such a call ends with a :class:`PolicyFailure` that
    the rollouts discard (the attempt is over) and that counts in ``abandoned``, not as a
    failed turn."""

    def __init__(self) -> None:
        self.abandoned = 0
        self._calls: dict[asyncio.Task[Any], Trajectory] = {}
        self._cancelled: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    @contextmanager
    def watch(self, traj: Trajectory) -> Iterator[None]:
        """The block is the current task's call for ``traj``."""
        task = asyncio.current_task()
        assert task is not None, "watch() runs in a task"
        self._calls[task] = traj
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._cancelled:
                raise  # cancelled by someone else (the rollouts close)
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11 counts cancels
            if uncancel is not None:
                uncancel()
            raise self._abandon() from None
        finally:
            del self._calls[task]
            self._cancelled.discard(task)

    def check(self) -> None:
        """Raises the abandoned call's ``PolicyFailure`` if the current task's attempt is over."""
        traj = self._calls.get(asyncio.current_task())  # type: ignore[arg-type]
        if traj is not None and traj.status is not Status.RUNNING:
            raise self._abandon()

    def _abandon(self) -> PolicyFailure:
        self.abandoned += 1
        return PolicyFailure("cancelled: the attempt's group completed or was dropped")

    async def _sweep(self) -> None:
        try:
            while self._calls:
                await asyncio.sleep(SWEEP_S)
                for task, traj in list(self._calls.items()):
                    if traj.status is not Status.RUNNING and task not in self._cancelled:
                        self._cancelled.add(task)
                        task.cancel()
        finally:
            self._sweeper = None
