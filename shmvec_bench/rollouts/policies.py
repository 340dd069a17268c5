"""The policies every backend calls: a batch of observations in, one action per row out.

- ``latency`` (P2): a latency model of one GPU decode batch. A call on ``rows``
  observations sleeps ``a + b * rows + c * longest_row`` seconds, where each row's output
  length in tokens is drawn lognormal (median ``TOKENS_MEDIAN``, sigma ``TOKENS_SIGMA``)
  from the policy's own seeded generator: ``a = 5 ms`` (the fixed cost of a decode
  launch and sampling), ``b = 0.05 ms`` a row (prefill and per-sequence overhead),
  ``c = 0.02 ms`` a token of the longest row (the decode steps the batch waits for).
  Sleeping frees the core as a process blocked on a GPU does.
- ``gru`` (P1): a random-init tiny torch model (byte embedding + GRU, hidden 128) that
  reads each observation's last ``GRU_CONTEXT`` bytes and generates up to
  ``GRU_NEW_BYTES`` bytes per row, greedily, in one batch, on one thread
  (``torch.set_num_threads(1)``). Needs torch; it is skipped where torch is missing.

``Batcher`` serves a policy to callers that ask row by row: a thread that runs it on
every request pending whenever it is free, as an inference server's continuous
batching does.

Both choose each row's action from the workload's vocabulary (the model's bytes, or
the seeded generator, pick the entry) so that every action parses. Each call is timed
(``PolicyClock``): the benchmark's policy idle share is the share of the rollout's wall
time outside these calls.

Example:
    >>> policy = make_policy("latency", ("a", "b"), seed=0)
    >>> len(policy(["obs 1", "obs 2", "obs 3"]))
    3
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

#: P2's latency model, seconds: a + b * rows + c * longest row (tokens).
LATENCY_A_S = 5e-3
LATENCY_B_S = 0.05e-3
LATENCY_C_S = 0.02e-3
#: P2's output lengths in tokens: lognormal, this median and sigma, capped.
TOKENS_MEDIAN = 100
TOKENS_SIGMA = 0.5
TOKENS_MAX = 1024
#: P1: bytes of the observation it reads, bytes it generates, its hidden size.
GRU_CONTEXT = 64
GRU_NEW_BYTES = 16
GRU_HIDDEN = 128

POLICIES = ("latency", "gru", "server")


class PolicyClock:
    """The policy's busy time: the sum and count of its calls (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.calls = 0
        self.rows = 0

    def add(self, seconds: float, rows: int) -> None:
        with self._lock:
            self.busy_s += seconds
            self.calls += 1
            self.rows += rows

    def snapshot(self) -> tuple[float, int, int]:
        with self._lock:
            return self.busy_s, self.calls, self.rows


class LatencyPolicy:
    """P2: sleeps as a decode batch would take (see the module docstring)."""

    name = "latency"

    def __init__(self, actions: Sequence[str], seed: int = 0) -> None:
        self.actions = tuple(actions)
        self.rng = np.random.default_rng([seed, 2])
        self.clock = PolicyClock()
        self._lock = threading.Lock()  # one GPU: one decode batch at a time

    def __call__(self, observations: Sequence[str]) -> list[str]:
        rows = len(observations)
        with self._lock:
            start = time.perf_counter()
            tokens = np.minimum(
                TOKENS_MEDIAN * np.exp(TOKENS_SIGMA * self.rng.standard_normal(rows)), TOKENS_MAX
            )
            picks = self.rng.integers(0, len(self.actions), rows)
            wait = LATENCY_A_S + LATENCY_B_S * rows + LATENCY_C_S * float(tokens.max(initial=0))
            time.sleep(max(0.0, wait - (time.perf_counter() - start)))
            self.clock.add(time.perf_counter() - start, rows)
        return [self.actions[i] for i in picks]


class GRUPolicy:
    """P1: a random-init byte GRU that really runs (see the module docstring)."""

    name = "gru"

    def __init__(self, actions: Sequence[str], seed: int = 0) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(256, 32)
        self.gru = torch.nn.GRU(32, GRU_HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(GRU_HIDDEN, 256)
        for module in (self.embed, self.gru, self.head):
            for p in module.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.actions = tuple(actions)
        self.clock = PolicyClock()
        self._lock = threading.Lock()

    def __call__(self, observations: Sequence[str]) -> list[str]:
        torch = self.torch
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            context = np.zeros((len(observations), GRU_CONTEXT), dtype=np.int64)
            for i, text in enumerate(observations):
                data = text.encode()[-GRU_CONTEXT:]
                context[i, GRU_CONTEXT - len(data) :] = np.frombuffer(data, dtype=np.uint8)
            out, hidden = self.gru(self.embed(torch.from_numpy(context)))
            token = self.head(out[:, -1]).argmax(-1)
            generated = [token]
            for _ in range(GRU_NEW_BYTES - 1):
                out, hidden = self.gru(self.embed(token[:, None]), hidden)
                token = self.head(out[:, -1]).argmax(-1)
                generated.append(token)
            codes = torch.stack(generated, 1).sum(1).numpy()
            self.clock.add(time.perf_counter() - start, len(observations))
        return [self.actions[int(c) % len(self.actions)] for c in codes]


class Stopped(Exception):
    """The runner is closing: an env loop's policy request is refused."""


class Batcher:
    """A thread that runs the policy on every request pending when it is free."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self._cond = threading.Condition()
        self._pending: list[tuple[str, Future]] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, observation: str) -> Future:
        """The future of ``observation``'s action."""
        future: Future = Future()
        with self._cond:
            if self._stop:
                raise Stopped("the batcher is closed")
            self._pending.append((observation, future))
            self._cond.notify()
        return future

    def ask(self, observation: str) -> str:
        return self.submit(observation).result()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                # A caller may have cancelled its future (a rollout closing); the others
                # are running from here on and can no longer be cancelled.
                batch = [(o, f) for o, f in self._pending if f.set_running_or_notify_cancel()]
                self._pending = []
                if self._stop:
                    for _, future in batch:
                        future.set_exception(Stopped("the batcher is closed"))
                    return
            if not batch:
                continue
            try:
                actions = self.policy([obs for obs, _ in batch])
            except BaseException as exc:  # every caller hears of it
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), action in zip(batch, actions):
                future.set_result(action)

    def close(self) -> None:
        """Refuses new requests, fails those pending and waits for the policy call running."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.thread.join()


def make_policy(name: str, actions: Sequence[str], seed: int = 0, server=None):
    """A new policy by name (``latency``, ``gru``, or ``server``: a run's side of the server
    ``server``, a ``shmvec_bench.rollouts.server.ServerConfig``) choosing among ``actions``."""
    if name == "latency":
        return LatencyPolicy(actions, seed)
    if name == "gru":
        return GRUPolicy(actions, seed)
    if name == "server":
        if server is None:
            raise ValueError("the server policy needs a server (a ServerConfig)")
        from shmvec_bench.rollouts.server import ServerRun

        return ServerRun(server, actions)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")


def policy_available(name: str) -> bool:
    """Whether ``name`` can run here (``gru`` needs torch; ``server`` openai and
    transformers)."""
    import importlib.util

    needs = {"gru": ("torch",), "server": ("openai", "transformers")}.get(name, ())
    return all(importlib.util.find_spec(module) is not None for module in needs)
