"""The HTTP side of :class:`~shmvec.rollouts.server.ServerPolicy`: one ``openai`` async client
sized for thousands of requests, completions asked for with token-id prompts and read back as
ids and log-probabilities, every failure classified as retryable or not, and a cap on the
requests in flight that may adapt to the server's answers.

Everything here runs on one event loop (the policy's); nothing blocks it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import random
import time
from collections import deque
from collections.abc import Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

#: Words by which servers (vLLM, SGLang, llama.cpp) say that a prompt and its completion do not
#: fit the model's context in a 400 reply.
_CONTEXT_WORDS = (
    "context length",
    "context_length",
    "maximum context",
    "max_model_len",
    "too long",
)


@dataclass(frozen=True)
class Sampling:
    """How each completion is sampled.

    Attributes:
        max_tokens: the most tokens a turn's completion may have (less where the model's
            context has less room left).
        temperature, top_p, seed: as the completions API takes them.
        extra: other fields of the request body (``top_k``, ``min_p``, ``stop``,
            ``stop_token_ids``...), sent as they are. Those that would break token in, token
            out are refused here, naming the field: ``n`` or ``best_of`` above 1,
            ``use_beam_search``, ``echo``, ``suffix``, ``truncate_prompt_tokens``,
            ``prompt_embeds``, ``stream_options``, ``spaces_between_special_tokens=False``,
            and the fields the policy sets itself. Stop fields (``stop``, ``stop_token_ids``,
            ``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``,
            ``skip_special_tokens``) shape the action's text as vLLM shapes its text
            (:class:`~shmvec.rollouts.tokens.StopRule`).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        check_extra(self.extra)


def _strings(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)


def _ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )


#: Request fields the policy sets itself, and why.
_POLICY_FIELDS = {
    "model": "ServerPolicy's model",
    "prompt": "token ids built turn by turn",
    "max_tokens": "Sampling.max_tokens",
    "temperature": "Sampling.temperature",
    "top_p": "Sampling.top_p",
    "seed": "Sampling.seed",
    "logprobs": "one log-probability per id",
    "stream": "interrupt=True streams",
    "return_token_ids": "the ids are what the trajectory keeps",
    "stream_options": "usage chunks carry no token",
    "prompt_embeds": "the prompt is token ids",
}
#: Fields of ``Sampling.extra`` with the values that keep token in, token out working.
_FIELD_RULES: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "one completion per request (a group samples the rest)"),
    "best_of": (lambda v: v in (None, 1), "the reply must be the completion sampled"),
    "use_beam_search": (lambda v: not v, "beam scores are not sampling log-probabilities"),
    "echo": (lambda v: not v, "the reply's ids must be the completion's alone"),
    "suffix": (lambda v: v is None, "a completion follows its token-id prompt, nothing after"),
    "truncate_prompt_tokens": (
        lambda v: v is None,
        "the server would cut the prompt, and the ids kept would not be what the model saw",
    ),
    "spaces_between_special_tokens": (
        lambda v: v is True,
        "the action's text is the ids decoded by the tokenizer, with its own spacing",
    ),
    "stop": (lambda v: v is None or _strings(v), "a non-empty string or a list of them"),
    "stop_token_ids": (lambda v: v is None or _ints(v), "a list of token ids"),
    "min_tokens": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "an int >= 0",
    ),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "a bool"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
}
#: Fields that constrain a whole completion (guided decoding): a request continued after an
#: interruption would start the constraint again, so ``interrupt=True`` refuses them.
CONSTRAINED_FIELDS = frozenset(
    {
        "response_format", "structured_outputs", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "regex", "json_schema", "ebnf",
    }
)  # fmt: skip


def check_extra(extra: Mapping[str, Any]) -> None:
    """Raises ValueError, naming the field, for a field of ``Sampling.extra`` that would break
    token in, token out (see ``Sampling``)."""
    if not isinstance(extra, Mapping):
        raise ValueError(f"Sampling.extra must be a mapping of request fields, got {extra!r}")
    for name, value in extra.items():
        if name in _POLICY_FIELDS:
            raise ValueError(
                f"Sampling.extra[{name!r}]: the policy sets {name!r} itself "
                f"({_POLICY_FIELDS[name]})"
            )
        rule = _FIELD_RULES.get(name)
        if rule is not None and not rule[0](value):
            raise ValueError(f"Sampling.extra[{name!r}]={value!r} is refused: {rule[1]}")


@dataclass(frozen=True)
class Retry:
    """How failed requests are tried again, and how long one may take.

    Attributes:
        attempts: requests per turn that may fail before the trajectory fails as
            ``policy_error`` (its tokens so far are kept between attempts); a request that
            failed because the server could not be reached at all does not count (the
            policy's ``outage_timeout``).
        backoff_s, max_backoff_s: the wait before attempt ``k + 1`` is drawn from
            ``[0, min(max_backoff_s, backoff_s * 2**k)]`` ("full jitter"), or is the server's
            ``Retry-After`` when it sends one (capped the same way).
        timeout_s: a request fails as ``timeout`` after this long without a byte (a streamed
            one: between two chunks).
        connect_timeout_s: a connection not made in this time fails as ``connect``.
    """

    attempts: int = 8
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("backoff_s", "max_backoff_s", "timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def delay(self, failures: int, retry_after: float | None, rng: random.Random) -> float:
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff_s)
        return rng.uniform(0.0, cap)


class ServerFault(Exception):
    """A request that failed; ``kind`` names what happened, ``retry`` whether trying again may
    help, ``overload`` whether the server said it has too much to do (429, 503, a timeout).

    Kinds: at the connection, ``connect`` (refused, or not made in time), ``reset`` (closed or
    reset before the reply), ``dropped`` (a reply or stream cut short), ``timeout`` (no byte for
    ``Retry.timeout_s``); in the reply, ``bad_reply`` (not JSON, not UTF-8),
    ``empty_reply`` (no choice, no token), ``no_logprobs``, ``aborted`` (the server aborted the
    request), ``rate_limited`` (429), ``server_error`` (5xx, 408, 409, an error event in a
    stream), ``context_length`` (a 400 for a prompt that does not fit)."""

    def __init__(
        self,
        kind: str,
        detail: str,
        retry: bool,
        retry_after: float | None = None,
        overload: bool = False,
    ):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.retry, self.retry_after = kind, retry, retry_after
        self.overload = overload


class ServerSetupError(RuntimeError):
    """The server cannot serve this policy at all (not OpenAI-compatible, another model, another
    tokenizer, a request it refuses): raised to the trainer, never retried."""


@dataclass
class Piece:
    """Tokens a reply (or one chunk of a streamed reply) brought."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str | None = None


def parse_choice(reply: Any) -> Piece:
    """The first choice of a completions reply (or chunk), as ``post_completions`` gives it
    (the JSON as parsed), as a :class:`Piece`.

    Raises:
        ServerFault: the reply has no choice, no token ids or no log-probabilities.
    """
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise ServerFault("empty_reply", f"a reply without choices: {reply!r:.200}", retry=True)
    choice = choices[0]
    ids = choice.get("token_ids")
    finish = choice.get("finish_reason")
    logprobs = choice.get("logprobs")
    if ids is None:
        if finish is not None and logprobs is None:
            ids = []  # a stream's closing chunk may carry no token
        else:
            raise ServerFault(
                "empty_reply",
                "a reply without token_ids (the server must accept return_token_ids)",
                retry=True,
            )
    token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if ids and token_logprobs is None:
        raise ServerFault("no_logprobs", "a reply whose logprobs are null", retry=True)
    token_logprobs = list(token_logprobs or [])
    if len(token_logprobs) != len(ids) or any(p is None for p in token_logprobs):
        raise ServerFault(
            "no_logprobs",
            f"{len(ids)} token ids but log-probabilities {token_logprobs!r:.120}",
            retry=True,
        )
    return Piece(
        [int(i) for i in ids], [float(p) for p in token_logprobs], finish, choice.get("text")
    )


def classify(error: BaseException) -> ServerFault:
    """A failed request's exception as a :class:`ServerFault`, by what happened: an HTTP
    status by its code, a transport failure by the exceptions that caused it (``openai``'s
    aiohttp transport raises a refused or reset connection as a timeout, so its name says
    little).

    Raises:
        ServerSetupError: the server refused the request for a reason no retry cures.
        the error itself: an exception that is no server's failure (a bug to see).
    """
    import openai

    if isinstance(error, ServerFault):
        return error
    if isinstance(error, openai.APIStatusError):
        status, message = error.status_code, str(error)
        retry_after = _retry_after(error)
        if status == 429:
            return ServerFault(
                "rate_limited", message, retry=True, retry_after=retry_after, overload=True
            )
        if status >= 500 or status in (408, 409):
            return ServerFault(
                "server_error",
                message,
                retry=True,
                retry_after=retry_after,
                overload=status == 503,
            )
        if status == 400 and any(w in message.lower() for w in _CONTEXT_WORDS):
            return ServerFault("context_length", message, retry=False)
        if status == 404:
            raise ServerSetupError(
                f"the server answered 404 ({message}): it does not serve this model, or is not "
                "an OpenAI-compatible server with /v1/completions"
            ) from error
        raise ServerSetupError(f"the server refused the request: {message}") from error
    chain = _causes(error)
    for types, kind, what in _transport_rules():
        if any(isinstance(e, types) for e in chain):
            return ServerFault(
                kind, f"{what} ({chain[-1]!r:.200})", retry=True, overload=kind == "timeout"
            )
    if isinstance(error, openai.APIError):  # an error event in a stream
        return ServerFault("server_error", str(error), retry=True)
    raise error


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions that caused it, outermost first (as a traceback shows
    them)."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return chain


@functools.cache
def _transport_rules() -> tuple[tuple[tuple[type[BaseException], ...], str, str], ...]:
    """``(exception types, kind, what happened)``, first match wins: a failure is what its
    most specific cause says (a connect timeout is a failure to connect, a refusal raised
    as a timeout is a refusal)."""
    import openai

    http = importlib.import_module(type(openai.DEFAULT_CONNECTION_LIMITS).__module__.split(".")[0])
    try:
        aiohttp: Any = importlib.import_module("aiohttp")
    except ImportError:  # the client then runs over httpx's own transport
        aiohttp = None

    def aio(*names: str) -> tuple[type[BaseException], ...]:
        return tuple(getattr(aiohttp, n) for n in names if hasattr(aiohttp, n))

    return (
        ((json.JSONDecodeError, UnicodeDecodeError, http.DecodingError), "bad_reply",
         "a reply that is not JSON"),
        ((*aio("ConnectionTimeoutError", "ClientConnectorError"), ConnectionRefusedError,
          http.ConnectError), "connect", "no connection to the server"),
        ((*aio("ServerDisconnectedError"), ConnectionResetError, ConnectionAbortedError,
          BrokenPipeError, http.WriteError), "reset",
         "the connection was closed before the reply"),
        ((*aio("ClientPayloadError"), http.ReadError, http.RemoteProtocolError,
          http.StreamError), "dropped", "the reply was cut short"),
        ((TimeoutError, asyncio.TimeoutError, *aio("ServerTimeoutError"), http.TimeoutException,
          openai.APITimeoutError), "timeout", "no answer in time"),
        ((openai.APIConnectionError, http.TransportError, OSError), "connect",
         "no connection to the server"),
    )  # fmt: skip


def _retry_after(error: Any) -> float | None:
    try:
        value = error.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, ValueError):
        return None


#: Seconds an idle connection is kept for reuse. Below the servers' own keep-alive (uvicorn's,
#: under vLLM and SGLang: 5 s), so that the client never sends a request on a connection the
#: server is closing: aiohttp learns of a close only when its event loop reads it, which under
#: load comes late, and the request then fails as "Server disconnected". At the default 5 s,
#: beside vLLM-CPU on the same 2 vCPUs with 256 envs, 448 requests failed so in 3 runs of 45 s,
#: none in 3 runs at 2 s (2-vCPU VM, 2026-11-28).
KEEPALIVE_S = 2.0


def make_client(base_url: str, api_key: str, connections: int, retry: Retry) -> Any:
    """An ``openai.AsyncOpenAI`` whose connection pool holds ``connections`` connections (the
    default holds 100 kept alive, which thousands of requests queue behind), with no retry of
    its own (the policy retries) and ``retry``'s timeouts, over ``openai``'s aiohttp transport
    (``openai[aiohttp]``): beside vLLM-CPU with 256 envs, 2.56-2.57 ms of the client's CPU per
    request against 3.14-3.17 ms over httpx's own (``dev/turn_trace.py``, 2 alternated rounds;
    2-vCPU VM, 2026-11-27). Its errors come as httpx's."""
    import openai

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=connections,
        max_keepalive_connections=connections,
        keepalive_expiry=KEEPALIVE_S,
    )
    timeout = openai.Timeout(retry.timeout_s, connect=retry.connect_timeout_s)
    http = openai.DefaultAioHttpClient(limits=limits, timeout=timeout)
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout, http_client=http
    )


#: Connections of one HTTP client at most. The pool under ``openai``'s client (httpcore) looks
#: at each of its connections whenever a request starts or ends, so that its CPU per request
#: grows with its size: 1,000 requests in flight cost 2.55-2.60 ms of CPU each through one
#: pool of 1,008 connections and 0.94-0.95 ms through 32 pools of 32 (``dev/http_pool_cpu.py``:
#: a local server answering in 1.5 s, 12 s windows alternated; 2-vCPU VM, 2026-11-27; over
#: httpx's transport, before the aiohttp one).
SHARD_CONNECTIONS = 32


class ClientShards:
    """``openai.AsyncOpenAI`` clients (``make_client``) that hold ``connections`` connections
    between them, ``most`` (default ``SHARD_CONNECTIONS``) at most each; a request takes the
    client with the fewest requests in flight, so that none waits for a connection while
    another client has one free."""

    def __init__(
        self, base_url: str, api_key: str, connections: int, retry: Retry, most: int | None = None
    ) -> None:
        shards = -(-connections // (most or SHARD_CONNECTIONS))
        per = -(-connections // shards)
        self.clients = [make_client(base_url, api_key, per, retry) for _ in range(shards)]
        self.in_flight = [0] * shards

    @contextmanager
    def client(self):  # -> Iterator[openai.AsyncOpenAI]
        """The least busy client, counted busy until the block ends."""
        i = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        self.in_flight[i] += 1
        try:
            yield self.clients[i]
        finally:
            self.in_flight[i] -= 1

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()


def post_completions(client: Any, body: dict[str, Any]) -> Any:
    """``POST /completions`` with ``body`` as it is, through ``client`` (``openai.OpenAI`` or
    ``AsyncOpenAI``; awaitable for the latter): the reply's JSON as parsed (a dict), or with
    ``body["stream"]`` a stream of them; the client's errors as it raises them.

    ``client.completions.create`` would first walk every value of the body against the API's
    types, element by element: ~7.7 ms for a prompt of 1,000 token ids on a 2-vCPU VM, most
    of a client's CPU per request; the body here is plain JSON already. Nor is the reply
    built into ``Completion`` models: 35 µs per streamed chunk and 42 µs per 40-token reply
    (with its 600 prompt ids) on the same VM, where ``parse_choice`` reads the few fields it
    needs."""
    import openai

    stream_cls = (openai.AsyncStream if isinstance(client, openai.AsyncOpenAI) else openai.Stream)[
        object
    ]
    return client.post(
        "/completions",
        body=body,
        cast_to=object,
        stream=bool(body.get("stream")),
        stream_cls=stream_cls,
    )


class InFlightLimit:
    """At most ``limit`` requests at once; waiters are served in order.

    With ``adaptive``, the limit follows the server (additive increase, multiplicative
    decrease): it halves, at most once per ``cooldown_s``, on an overload signal (429, 503,
    a timeout, a request slower than ``target_latency_s``), and grows by one after ``limit``
    requests in a row that were answered in time, never outside ``[minimum, maximum]``.
    """

    def __init__(
        self,
        maximum: int,
        *,
        adaptive: bool = False,
        minimum: int = 1,
        target_latency_s: float | None = None,
        cooldown_s: float = 1.0,
    ) -> None:
        if not isinstance(maximum, int) or maximum < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {maximum!r}")
        if not isinstance(minimum, int) or not 1 <= minimum <= maximum:
            raise ValueError(f"min_in_flight must be an int in 1..{maximum}, got {minimum!r}")
        self.maximum, self.minimum, self.adaptive = maximum, minimum, adaptive
        self.target_latency_s, self.cooldown_s = target_latency_s, cooldown_s
        self.limit = maximum if not adaptive else max(minimum, min(maximum, 64))
        self.in_flight = 0
        self.peak = 0  # the most requests that were in flight at once
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._good = 0
        self._cut_s = 0.0

    @asynccontextmanager
    async def slot(self):  # -> AsyncIterator[None]
        await self._acquire()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._wake()

    async def _acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.in_flight -= 1  # granted, then cancelled: hand the slot on
                self._wake()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                waiter.set_result(None)

    def answered(self, latency_s: float) -> None:
        """A request was answered after ``latency_s``."""
        if not self.adaptive:
            return
        if self.target_latency_s is not None and latency_s > self.target_latency_s:
            self.overloaded()
            return
        self._good += 1
        if self._good >= self.limit and self.limit < self.maximum:
            self.limit, self._good = self.limit + 1, 0
            self._wake()

    def overloaded(self) -> None:
        """The server said it is overloaded (429, 503, a timeout)."""
        if not self.adaptive:
            return
        now = time.monotonic()
        self._good = 0
        if now - self._cut_s >= self.cooldown_s:
            self.limit, self._cut_s = max(self.minimum, self.limit // 2), now


#: Fault kinds that may mean the server cannot be reached at all; a probe tells
#: (:class:`~shmvec.rollouts.server_outages.Outages`).
UNREACHABLE = frozenset({"connect", "reset", "dropped"})
