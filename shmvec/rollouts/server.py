"""A per-row policy that samples each action from an OpenAI-compatible inference server (vLLM,
SGLang) with token ids in and token ids out.

Each row's turn is one ``/v1/completions`` request whose prompt is a list of token ids: the
first turn's is the opening messages rendered by the tokenizer's chat template; every later
turn's is the previous turn's prompt and completion ids followed by the ids of what the
template adds for the new messages (:mod:`shmvec.rollouts.tokens`). The reply's completion
ids and log-probabilities are kept as they came (``return_token_ids``, ``logprobs``), with the
policy version of every id, in a :class:`~shmvec.rollouts.tokens.TurnTokens` beside the text
action.

A request that fails (times out, a reset or cut reply, a reply that is not JSON, 429 or 5xx,
an empty reply or null log-probabilities) is asked again with backoff; past ``Retry.attempts``
the row's trajectory fails as ``policy_error`` and the group policy counts, retries or drops
it. A server that cannot be reached (it refuses or drops every connection: starting,
restarting) is the infrastructure's failure: the requests wait for it without spending a
retry, up to ``outage_timeout`` (:mod:`shmvec.rollouts.server_outages`).

With ``interrupt=True`` each request streams, and a new version cancels the requests
still in flight: the tokens received so far are kept (stamped with the version that made
them) and the completion goes on under the new version from the prompt plus those tokens.

Versions: a request is stamped with the policy's version when it is sent (once it has its
in-flight slot), and each id with its request's version; the action's version is the oldest
of its turn's ids' (``RowOutput.version``), what the lag bound counts.

Stop strings: the ids are the completion (the id that completed a stop string whole, as
vLLM returns it); the action's text is what vLLM's text is, those ids decoded and cut before
the stop string or stop token (:func:`~shmvec.rollouts.tokens.stop_completion`).
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmvec.rollouts.policies import AsyncPolicy
from shmvec.rollouts.records import EndTrajectory, PolicyFailure, PolicyRow, RowOutput
from shmvec.rollouts.server_client import (
    UNREACHABLE,
    ClientShards,
    InFlightLimit,
    Piece,
    Retry,
    Sampling,
    ServerFault,
    ServerSetupError,
    classify,
    parse_choice,
    post_completions,
)
from shmvec.rollouts.server_outages import CancelledAttempts, Outages, ServerUnreachable, answers
from shmvec.rollouts.server_requests import RequestBody, ServerCheck
from shmvec.rollouts.server_stats import ServerStats
from shmvec.rollouts.tokens import (
    ChatTokens,
    TurnTokens,
    context_full,
    stop_completion,
    turn_prompt,
)


@dataclass
class _Completion:
    """A turn's completion as it grows over attempts."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    answered: int = 0  # the version of the last request that finished
    text: str = ""  # the action's text (``stop_completion``)

    def add(self, piece: Piece, version: int) -> None:
        self.ids += piece.ids
        self.logprobs += piece.logprobs
        self.versions += [version] * len(piece.ids)
        self.finish_reason = piece.finish_reason or self.finish_reason


class ServerPolicy(AsyncPolicy):
    """Actions sampled from an OpenAI-compatible server, token ids in and out.

    Args:
        base_url: the server's API root, e.g. ``"http://127.0.0.1:8000/v1"``.
        model: the model name the server serves.
        tokenizer: the model's Hugging Face tokenizer (with its chat template).
        messages: ``messages(row) -> list of {"role", "content"}``: the chat messages the row's
            observation adds (on a trajectory's first turn, the opening messages: system,
            task, observation). The row has the trajectory (``row.trajectory.task``).
        sampling: how completions are sampled.
        retry: how failed requests are tried again.
        max_in_flight: requests in flight at most (the HTTP pool holds as many connections).
        adaptive: let the cap follow the server (see ``InFlightLimit``); ``max_in_flight`` is
            then its ceiling.
        target_latency_s: with ``adaptive``, a request slower than this counts as overload.
        interrupt: stream each request, and on a new version cancel those in flight and go on
            under the new version, keeping their tokens. Refuses guided decoding fields in
            ``sampling.extra`` (``CONSTRAINED_FIELDS``): a continued request would start the
            constraint again.
        count_drift: also render each later turn's chat as text and tokenize it, and count the
            turns whose ids would have differed (``stats()["drift_turns"]``).
        action: turns the completion's text into the env's action (default: the text).
        api_key: sent as the bearer token.
        context_length: the model's context; default: the server's ``max_model_len`` if it
            says, else unknown (the server's 400 then tells).
        on_context_full: what a later turn whose prompt no longer fits the context does:
            ``"fail"``: the trajectory fails as ``policy_error`` (its group policy retries or
            drops it); ``"end"``: it ends as finished, ``policy_ended``, with the turns it
            had (``EndTrajectory``; a trainer may keep or mask it). A first turn that does
            not fit fails either way.
        outage_timeout: seconds a server that cannot be reached is waited for (its requests
            paused, probed every second at most, no retry spent) before ``act`` raises
            ``ServerUnreachable`` naming it; None: forever.

    Raises (from ``act``, to the trainer): ``ServerSetupError`` for a server that is not
    OpenAI-compatible, a model it does not serve, a tokenizer that is not its own or a request
    it refuses; ``ServerUnreachable`` past ``outage_timeout``; ``ValueError`` for a
    ``messages`` that returns no messages.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        messages: Callable[[PolicyRow], list[dict[str, Any]]],
        *,
        sampling: Sampling | None = None,
        retry: Retry | None = None,
        max_in_flight: int = 256,
        adaptive: bool = False,
        target_latency_s: float | None = None,
        interrupt: bool = False,
        count_drift: bool = False,
        action: Callable[[str], Any] | None = None,
        api_key: str = "EMPTY",
        context_length: int | None = None,
        on_context_full: str = "fail",
        outage_timeout: float | None = 300.0,
    ) -> None:
        super().__init__(self.act, concurrency=1 << 30)  # requests are capped by max_in_flight
        if not callable(messages) or inspect.iscoroutinefunction(messages):
            raise TypeError(f"messages must be a plain function of a row, got {messages!r}")
        self.base_url, self.model = base_url.rstrip("/"), model
        self.chat = ChatTokens(tokenizer)
        self.messages, self.action = messages, action
        self.sampling, self.retry = sampling or Sampling(), retry or Retry()
        self.limit = InFlightLimit(
            max_in_flight, adaptive=adaptive, target_latency_s=target_latency_s
        )
        self.interrupt, self.count_drift = interrupt, count_drift
        self._body = RequestBody.of(model, self.sampling, self.chat.stop_ids, interrupt)
        if on_context_full not in ("fail", "end"):
            raise ValueError(f"on_context_full must be 'fail' or 'end', got {on_context_full!r}")
        self.api_key, self.context_length = api_key, context_length
        self.on_context_full = on_context_full
        self.version = 0
        self._clients: ClientShards | None = None
        self._server = ServerCheck(
            self.base_url, model, self.chat, len(tokenizer), self._body.stops
        )
        self._checked = False
        self._check_lock: asyncio.Lock | None = None
        self._streams: dict[asyncio.Task[Any], int] = {}  # streamed requests -> their version
        self._rng = random.Random()
        self._stats = ServerStats()  # read from the trainer's thread
        self.outages = Outages(self._probe, self.base_url, outage_timeout, self.retry.backoff_s)
        self._attempts = CancelledAttempts()

    # -------------------------------------------------------------- the hooks

    def set_version(self, version: int) -> None:
        """Requests sent from now on (those waiting for an in-flight slot included) are
        stamped ``version``; with ``interrupt``, those in flight under an older version are
        cancelled and go on under it. Call it on the
        policy's event loop (``Rollouts.set_version`` does)."""
        self.version = version
        if self.interrupt:
            for task, started in list(self._streams.items()):
                if started < version and not task.done():
                    # Once: a second cancel would land in the stream's own cleanup.
                    del self._streams[task]
                    task.cancel()

    async def aclose(self) -> None:
        """Closes the HTTP clients (their connections); calls in flight should be cancelled
        first."""
        if self._clients is not None:
            clients, self._clients = self._clients, None
            await clients.aclose()

    def stats(self) -> dict[str, Any]:
        """Requests, tokens and failures since construction (callable from any thread)."""
        return self._stats.snapshot(self._attempts, self.outages, self.limit)

    # -------------------------------------------------------------- one turn

    async def act(self, row: PolicyRow) -> RowOutput:
        """Samples the row's action; returns its text (or ``action(text)``) with its
        ``TurnTokens`` and its version (the oldest of its ids').

        The text is the completion's ids decoded and, where a stop token or stop string
        ended it, cut where vLLM cuts its text (before the stop string, or after it with
        ``include_stop_str_in_output``); the ids keep every token generated, the one that
        completed a stop string whole."""
        traj = row.trajectory
        turns = list(traj.extras)
        messages = self.messages(row)
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"messages(row) returned {messages!r} for env {row.env_id}: it must return the "
                "non-empty list of chat messages the observation adds"
            )
        prompt, env_start = turn_prompt(self.chat, turns, messages)
        drift = None
        if self.count_drift and turns:
            drift = self.chat.rerender(turns, messages) != prompt
            self._stats.count("compared_turns")
            self._stats.count("drift_turns", int(drift))
        with self._attempts.watch(traj):  # ends the call if the rollouts cancel the attempt
            await self._ensure_checked()
            completion = await self._complete(prompt, can_end=bool(turns))
        turn = TurnTokens(
            prompt_ids=prompt,
            completion_ids=completion.ids,
            logprobs=completion.logprobs,
            versions=completion.versions,
            env_start=env_start,
            messages=messages,
            finish_reason=completion.finish_reason or "",
            drift=drift,
        )
        text = completion.text
        self._stats.count("turns")
        version = min(completion.versions, default=completion.answered)
        return RowOutput(self.action(text) if self.action is not None else text, turn, version)

    async def _complete(self, prompt: list[int], can_end: bool) -> _Completion:
        """The prompt's completion, over as many requests as failures and interruptions take.

        Raises:
            PolicyFailure: past ``retry.attempts`` failed requests, or a prompt too long.
            EndTrajectory: a prompt too long, ``on_context_full="end"`` and ``can_end``.
        """
        full = context_full(prompt, self.context_length)
        if full is not None:
            raise self._context_full(full, can_end)
        budget = self.sampling.max_tokens
        if self.context_length is not None:
            budget = min(budget, self.context_length - len(prompt))
        out = _Completion()
        failures = 0
        while True:
            left = budget - len(out.ids)
            if out.finish_reason is not None or left < 1:
                break
            self._attempts.check()
            await self.outages.wait()
            received = len(out.ids)
            started = time.monotonic()
            try:
                async with self.limit.slot():
                    version = self.version  # stamped when sent: after waiting for its slot
                    self._stats.count("requests")
                    if self.interrupt:
                        finished = await self._streamed(prompt, out, left, version)
                    else:
                        out.add(await self._request(prompt + out.ids, left), version)
                        finished = True
                    if finished and not out.ids:
                        out.finish_reason = None
                        raise ServerFault("empty_reply", "a completion without a token", True)
            except Exception as error:  # noqa: BLE001 - classified: a fault or a setup error
                fault = classify(error)
                self._stats.fault(fault.kind)
                if fault.kind in UNREACHABLE and await self.outages.suspect():
                    continue  # the server's outage, not the request's: sent again after it
                failures += 1
                if fault.overload:
                    self.limit.overloaded()
                if not fault.retry or failures >= self.retry.attempts:
                    self._attempts.check()  # a cancelled attempt's last failure is not counted
                    message = f"{fault} (after {failures} failed request(s) of this turn)"
                    if fault.kind == "context_length":
                        raise self._context_full(message, can_end) from error
                    self._stats.fail(fault.kind)
                    raise PolicyFailure(message) from error
                await asyncio.sleep(self.retry.delay(failures, fault.retry_after, self._rng))
                continue
            latency = time.monotonic() - started
            self.limit.answered(latency)
            self._stats.latency(latency)
            if finished:
                out.answered = version
            else:
                self._stats.count("interrupted")
                self._stats.count("tokens_interrupted", len(out.ids) - received)
                if stop_completion(self.chat, out.ids, self._body.stops).stopped:
                    out.finish_reason = "stop"  # interrupted after its stop, before its end
        # Over several requests, a stop string across two of them is found here.
        stop = stop_completion(self.chat, out.ids, self._body.stops)
        if stop.kept < len(out.ids):
            del out.ids[stop.kept :], out.logprobs[stop.kept :], out.versions[stop.kept :]
        out.text = stop.text
        self._stats.count("tokens", len(out.ids))
        if out.finish_reason is None or stop.stopped:
            out.finish_reason = "stop" if stop.stopped else "length"
        return out

    def _context_full(self, message: str, can_end: bool) -> Exception:
        """What a prompt that does not fit the context raises (``on_context_full``)."""
        if can_end and self.on_context_full == "end":
            self._stats.end("context_length")
            return EndTrajectory(message)
        self._stats.fail("context_length")
        return PolicyFailure(message)

    async def _request(self, prompt: list[int], max_tokens: int) -> Piece:
        with self._http().client() as client:
            reply = await post_completions(client, self._body(prompt, max_tokens, False))
        piece = parse_choice(reply)
        if not piece.ids:
            raise ServerFault("empty_reply", "a reply with no token", retry=True)
        self._server.reply(piece)
        return piece

    async def _streamed(
        self, prompt: list[int], out: _Completion, max_tokens: int, version: int
    ) -> bool:
        """Streams a completion into ``out``; False if a new version interrupted it."""
        task = asyncio.ensure_future(self._stream(prompt + out.ids, out, max_tokens, version))
        self._streams[task] = version
        try:
            await asyncio.wait({task})
        finally:
            self._streams.pop(task, None)
            if not task.done():
                task.cancel()  # this call itself was cancelled (the rollouts close)
        if task.cancelled():
            return False
        task.result()  # raises the stream's failure, its tokens so far kept in ``out``
        return True

    async def _stream(self, prompt: list[int], out: _Completion, max_tokens: int, version: int):
        with self._http().client() as client:
            body = self._body(prompt, max_tokens, True, len(out.ids))
            stream = await post_completions(client, body)
            async with stream:
                try:
                    async for chunk in stream:
                        piece = parse_choice(chunk)
                        self._server.ids(piece.ids)
                        out.add(piece, version)
                        if piece.finish_reason == "abort":
                            out.finish_reason = None
                            raise ServerFault("aborted", "the server aborted the request", True)
                        if piece.finish_reason is not None:
                            return
                except Exception as error:  # noqa: BLE001 - a broken stream is a fault of its own
                    fault = classify(error)
                    if fault.kind in ("connect", "reset"):
                        raise ServerFault("dropped", f"the stream broke: {fault}", True) from error
                    raise fault from error
        raise ServerFault("dropped", "the stream ended before the completion finished", retry=True)

    # -------------------------------------------------------------- the server

    async def _probe(self) -> bool:
        with self._http().client() as client:
            return await answers(client, self.retry.connect_timeout_s)

    def _http(self) -> ClientShards:
        if self._clients is None:
            self._clients = ClientShards(
                self.base_url, self.api_key, self.limit.maximum + 8, self.retry
            )
        return self._clients

    async def _ensure_checked(self) -> None:
        """Checks the server once (the model is served, the tokenizer is its own); a server
        that does not answer yet is waited for like a failed request."""
        if self._checked:
            return
        if self._check_lock is None:
            self._check_lock = asyncio.Lock()
        failures = 0
        while not self._checked:
            await self.outages.wait()
            try:
                async with self._check_lock:
                    if not self._checked:
                        await self._check()
                        self._checked = True
            except Exception as error:  # noqa: BLE001 - classified
                fault = classify(error)
                self._stats.fault(fault.kind)
                if fault.kind in UNREACHABLE and await self.outages.suspect():
                    continue  # not up yet: waited for
                failures += 1
                if not fault.retry or failures >= self.retry.attempts:
                    self._stats.fail(fault.kind)
                    raise PolicyFailure(f"{fault} (while checking the server)") from error
                await asyncio.sleep(self.retry.delay(failures, fault.retry_after, self._rng))

    async def _check(self) -> None:
        with self._http().client() as client:
            length = await self._server.served(client)
            if self.context_length is None:
                self.context_length = length
            await self._server.tokenizer(client)


__all__ = [
    "Retry",
    "Sampling",
    "ServerFault",
    "ServerPolicy",
    "ServerSetupError",
    "ServerUnreachable",
]
