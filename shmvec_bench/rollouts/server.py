"""``--policy server``: every runner samples its actions from one real OpenAI-compatible
inference server (vLLM), token ids in and token ids out, as agent trainers do.

All runners send the same requests: each turn one ``/v1/completions`` request whose prompt
is token ids (the opening messages rendered by the chat template on the first turn; after
that the previous prompt and completion ids plus the template's delta for the new
observation, :func:`shmvec.rollouts.tokens.turn_prompt`), ``max_tokens`` tokens at
temperature 1, with the completion's ids and log-probabilities returned. The completion's
text picks the action among the workload's (its CRC-32 modulo their number), so that every
action parses whatever a random model writes. Every runner posts the same JSON body through
the ``openai`` client (:func:`shmvec.rollouts.server_client.post_completions`;
``client.completions.create`` would spend ~7.7 ms of CPU per 1,000-id prompt checking it).
How they send them is each runner's own:

- ``shmvec``: :class:`shmvec.rollouts.server.ServerPolicy`, per row as rows become ready,
  on the rollout layer's event loop (``interrupt`` on or off);
- ``skyrl-asyncio``: one ``await`` on ``openai.AsyncOpenAI`` per turn in each trajectory's
  coroutine (SkyRL's and rLLM's agent loops);
- ``roll-threads``: one blocking ``openai.OpenAI`` call per turn in each env's thread
  (ROLL's env managers).

Each runner's client pool holds a connection per env (the clients' default of 100 queues
thousands of requests behind it), over httpx. ``ServerPolicy`` retries as its ``Retry``
says; the asyncio runner's ``openai.AsyncOpenAI`` and ROLL's threads' shared ``openai.OpenAI``
retry as the clients do by default (a failed request asked twice more), and a request that
still fails ends their run, as an exception in SkyRL's gather or ROLL's env thread does.
``ServerMonitor`` reads what the server did in the timed window from its own counters.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmvec.rollouts.server import Retry, Sampling, ServerPolicy
from shmvec.rollouts.server_client import parse_choice, post_completions
from shmvec.rollouts.tokens import ChatTokens, TurnTokens, turn_prompt
from shmvec_bench.rss import cpu_s

#: Tokens a turn's completion may have.
MAX_TOKENS = 16
#: The system message of a trajectory's first turn.
SYSTEM = "You are playing a game. Answer with your move in \\boxed{}."


class Stopped(Exception):
    """The run is closing: a trajectory's next request is refused."""


@dataclass(frozen=True)
class ServerConfig:
    """The server every runner calls, and what each request asks of it."""

    base_url: str
    model: str
    tokenizer: Any
    max_tokens: int = MAX_TOKENS
    #: pids of the server's processes, left out of the client's CPU (when the benchmark
    #: started the server itself: it is then a child of this process).
    server_pids: Sequence[int] = ()

    @property
    def root(self) -> str:
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url


def opening(observation: str) -> list[dict[str, str]]:
    """A trajectory's first messages."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": observation}]


def follow_up(observation: str) -> list[dict[str, str]]:
    """The message a later observation adds."""
    return [{"role": "user", "content": observation}]


def pick(text: str, actions: Sequence[str]) -> str:
    """The workload's action that a completion's text picks."""
    return actions[zlib.crc32(text.encode("utf-8", "replace")) % len(actions)]


@dataclass
class RequestLog:
    """Requests a runner made and their latencies (thread-safe)."""

    requests: int = 0
    latencies: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self.latencies.append(seconds)


@dataclass(frozen=True)
class ServerReading:
    """The server's cumulative counters at one moment."""

    at: float
    #: vLLM's sums over finished requests, seconds: time in its running batches
    #: (``vllm:request_inference_time_seconds``) and in its queue (``..._queue_time_...``).
    inference_s: float
    queue_s: float
    #: CPU seconds of the model executor (vLLM's ``VLLM::Worker`` processes) and of every
    #: server process; NaN where the server's processes are not known.
    executor_cpu_s: float
    server_cpu_s: float


class ServerMonitor:
    """What the server did in a window, from its own counters: ``/metrics``'s request-time
    sums (by Little's law, their growth over the window is the mean number of requests it
    ran and queued), and the CPU time of its processes where known (the model executor's
    share of the window is the server's busy share: it runs a forward pass or sleeps)."""

    def __init__(self, root: str, pids: Sequence[int] = ()) -> None:
        self.url, self.pids = f"{root}/metrics", tuple(pids)
        self._start: ServerReading | None = None

    def read(self) -> ServerReading:
        with urllib.request.urlopen(self.url, timeout=10) as reply:
            sums = parse_sums(reply.read().decode())
        executor = server = float("nan")
        if self.pids:
            cpus = {pid: (process_name(pid), cpu_s(pid)) for pid in self.pids}
            server = sum(cpu for _, cpu in cpus.values())
            executor = sum(cpu for name, cpu in cpus.values() if name.startswith(EXECUTOR))
        return ServerReading(time.monotonic(), sums["inference"], sums["queue"], executor, server)

    def window(self) -> None:
        """The window starts now."""
        self._start = self.read()

    def summary(self) -> dict[str, float]:
        """The window's busy share, mean requests running and queued, and server cores."""
        if self._start is None:
            raise RuntimeError("window() was not called")
        a, b = self._start, self.read()
        wall = b.at - a.at
        return {
            "busy_share": (b.executor_cpu_s - a.executor_cpu_s) / wall,
            "running": (b.inference_s - a.inference_s) / wall,
            "queued": (b.queue_s - a.queue_s) / wall,
            "server_cores": (b.server_cpu_s - a.server_cpu_s) / wall,
        }


#: The name vLLM gives its model executor processes.
EXECUTOR = "VLLM::Worker"
#: vLLM's request-time histograms whose sums the monitor reads.
SUMS = {
    "vllm:request_inference_time_seconds_sum": "inference",
    "vllm:request_queue_time_seconds_sum": "queue",
}


def parse_sums(text: str) -> dict[str, float]:
    """vLLM's request inference and queue time sums in its Prometheus text (over engines)."""
    found = dict.fromkeys(SUMS.values(), 0.0)
    seen = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SUMS:
            found[SUMS[name]] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    if len(seen) < len(SUMS):
        missing = sorted(set(SUMS) - seen)
        raise KeyError(f"the server's /metrics lacks vLLM's request time sums {missing}")
    return found


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class ServerRun:
    """One run's side of the server: its clients, its requests, the monitor.

    ``make_policy("server", ...)`` gives each run a fresh one; ``close()`` refuses every
    later request (a trajectory still running stops at its next turn) and closes the clients.
    """

    name = "server"

    def __init__(self, config: ServerConfig, actions: Sequence[str]) -> None:
        self.config, self.actions = config, tuple(actions)
        self.chat = ChatTokens(config.tokenizer)
        self.log = RequestLog()
        self.monitor = ServerMonitor(config.root, config.server_pids)
        self.closed = threading.Event()
        self.layer: ServerPolicy | None = None
        self._sync: Any = None
        self._sync_lock = threading.Lock()

    # ------------------------------------------------------------ shmvec

    def layer_policy(self, concurrency: int, interrupt: bool) -> ServerPolicy:
        """The rollout layer's policy: ``ServerPolicy`` with as many requests in flight as envs."""

        def messages(row) -> list[dict[str, str]]:
            first = not row.trajectory.actions
            return (opening if first else follow_up)(row.observation)

        self.layer = ServerPolicy(
            self.config.base_url,
            self.config.model,
            self.config.tokenizer,
            messages,
            sampling=Sampling(max_tokens=self.config.max_tokens),
            retry=Retry(),
            max_in_flight=concurrency,
            interrupt=interrupt,
            action=lambda text: pick(text, self.actions),
        )
        return self.layer

    # ------------------------------------------------------------ the other runners

    def conversation(self) -> Conversation:
        """A new trajectory's turns."""
        return Conversation(self)

    def body(self, prompt: list[int]) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": self.config.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "stream": False,
            "return_token_ids": True,
        }

    def sync_client(self, connections: int) -> Any:
        """One ``openai.OpenAI`` every thread shares, its pool ``connections`` wide."""
        with self._sync_lock:
            if self._sync is None:
                self._sync = _client(self.config, connections, asynchronous=False)
            return self._sync

    def async_client(self, connections: int) -> Any:
        """A new ``openai.AsyncOpenAI`` (bound to the running event loop)."""
        return _client(self.config, connections, asynchronous=True)

    # ------------------------------------------------------------ figures

    def window(self) -> None:
        """The timed window starts now."""
        self.monitor.window()
        self._requests0 = self.requests()

    def requests(self) -> int:
        if self.layer is not None:
            return int(self.layer.stats()["requests"])
        return self.log.requests

    def policy_failures(self) -> dict[str, int]:
        """Trajectories ``ServerPolicy`` failed, by kind, over the run (none for the other
        runners, whose first failed request ends their run)."""
        return dict(self.layer.stats()["failed"]) if self.layer is not None else {}

    def figures(self) -> dict[str, Any]:
        """Requests since the window started, latency percentiles over the run, the server's
        busy share and batch over the window, interruptions."""
        server = self.monitor.summary()
        if self.layer is not None:
            stats = self.layer.stats()
            p50, p99 = stats["latency_p50_s"], stats["latency_p99_s"]
            interrupted = stats["interrupted"]
            kept = stats.get("tokens_interrupted", 0)
            kinds = dict(stats["faults"])
        else:
            with self.log._lock:
                latencies = list(self.log.latencies)
            p50 = float(np.percentile(latencies, 50)) if latencies else float("nan")
            p99 = float(np.percentile(latencies, 99)) if latencies else float("nan")
            interrupted = kept = 0
            kinds = {}
        return {
            "requests": self.requests() - self._requests0,
            "latency_p50_s": p50,
            "latency_p99_s": p99,
            **server,
            "interrupted": interrupted,
            "tokens_interrupted": kept,
            "faults": kinds,
        }

    def close(self) -> None:
        self.closed.set()
        with self._sync_lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()


def _client(config: ServerConfig, connections: int, asynchronous: bool) -> Any:
    """``openai.AsyncOpenAI`` or ``openai.OpenAI`` as they come (over httpx, a failed request
    retried twice; rLLM's client), ``connections`` wide, ``ServerPolicy``'s timeouts."""
    import openai

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=connections + 8, max_keepalive_connections=connections + 8
    )
    timeout = openai.Timeout(Retry().timeout_s, connect=Retry().connect_timeout_s)
    if asynchronous:
        return openai.AsyncOpenAI(
            base_url=config.base_url, api_key="EMPTY", timeout=timeout,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout),
        )  # fmt: skip
    return openai.OpenAI(
        base_url=config.base_url, api_key="EMPTY", timeout=timeout,
        http_client=openai.DefaultHttpxClient(limits=limits, timeout=timeout),
    )  # fmt: skip


class Conversation:
    """One trajectory's turns for the runners that call the server themselves: each turn's
    prompt built from ids as ``ServerPolicy`` builds it, the reply's ids kept."""

    def __init__(self, server_run: ServerRun) -> None:
        self.server_run = server_run
        self.turns: list[TurnTokens] = []

    def _prompt(self, observation: str) -> tuple[list[int], int, list[dict[str, str]]]:
        if self.server_run.closed.is_set():
            raise Stopped("the run is closing")
        messages = (follow_up if self.turns else opening)(observation)
        prompt, env_start = turn_prompt(self.server_run.chat, self.turns, messages)
        return prompt, env_start, messages

    def _keep(self, prompt, env_start, messages, reply, started: float) -> str:
        self.server_run.log.add(time.monotonic() - started)
        piece = parse_choice(reply)
        self.turns.append(
            TurnTokens(
                prompt,
                piece.ids,
                piece.logprobs,
                [0] * len(piece.ids),
                env_start,
                messages,
                piece.finish_reason or "",
            )  # fmt: skip
        )
        return pick(self.server_run.chat.reply_text(piece.ids), self.server_run.actions)

    def ask(self, observation: str, connections: int) -> str:
        """The next action, from a blocking request."""
        prompt, env_start, messages = self._prompt(observation)
        client = self.server_run.sync_client(connections)
        started = time.monotonic()
        reply = post_completions(client, self.server_run.body(prompt))
        return self._keep(prompt, env_start, messages, reply, started)

    async def aask(self, client: Any, observation: str) -> str:
        """The next action, awaited."""
        prompt, env_start, messages = self._prompt(observation)
        started = time.monotonic()
        reply = await post_completions(client, self.server_run.body(prompt))
        return self._keep(prompt, env_start, messages, reply, started)
