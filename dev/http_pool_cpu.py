"""The client's CPU per request through ``openai.AsyncOpenAI`` clients: one client whose pool
holds a connection per request in flight, against ``ServerPolicy``'s shards of
``SHARD_CONNECTIONS`` (``shmvec.rollouts.server_client.ClientShards``), alternated.

A local aiohttp server (a process of its own, on ``--server-cpu``) answers every
``POST /v1/completions`` with the same 16-token completion after ``--delay`` seconds, so that
``--concurrency`` requests stay in flight; the clients run on ``--client-cpu`` and post an
800-id prompt through ``post_completions`` as ``ServerPolicy`` does. Prints requests/s and the
client process's CPU time per request over each window::

    python dev/http_pool_cpu.py --concurrency 1000 --delay 1.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

SERVER = """
import asyncio, sys
from aiohttp import web
body = sys.argv[3]
async def handle(request):
    await request.read()
    await asyncio.sleep(float(sys.argv[2]))
    return web.Response(text=body, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/completions", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

REPLY = {
    "id": "cmpl",
    "object": "text_completion",
    "created": 0,
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "text": "abcdefghijklmnop",
            "finish_reason": "length",
            "token_ids": list(range(10, 26)),
            "logprobs": {
                "tokens": list("abcdefghijklmnop"),
                "token_logprobs": [-1.5] * 16,
                "top_logprobs": None,
                "text_offset": list(range(16)),
            },
        }
    ],
    "usage": {"prompt_tokens": 800, "completion_tokens": 16, "total_tokens": 816},
}


async def window(base_url: str, shards: bool, concurrency: int, seconds: float) -> tuple:
    from shmvec.rollouts.server import Retry
    from shmvec.rollouts.server_client import ClientShards, post_completions

    connections = concurrency + 8
    most = None if shards else connections  # the default shards, or one client for all
    pool = ClientShards(base_url, "EMPTY", connections, Retry(), most)
    body = {"model": "tiny", "prompt": list(range(800)), "max_tokens": 16, "logprobs": 0}
    done = 0
    stop = time.monotonic() + seconds + 3.0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            with pool.client() as client:
                await post_completions(client, body)
            done += 1

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(3.0)  # connections made, every worker in flight
    t0, cpu0, n0 = time.monotonic(), time.process_time(), done
    await asyncio.sleep(seconds)
    t1, cpu1, n1 = time.monotonic(), time.process_time(), done
    await asyncio.gather(*tasks)
    await pool.aclose()
    return (n1 - n0) / (t1 - t0), 1000 * (cpu1 - cpu0) / max(1, n1 - n0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--delay", type=float, default=1.5, help="the server's answer time (s)")
    parser.add_argument("--seconds", type=float, default=12.0, help="timed window per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    args = parser.parse_args()
    from shmvec.testing.vllm_server import free_port

    port = free_port()
    os.sched_setaffinity(0, {args.server_cpu})
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), str(args.delay), json.dumps(REPLY)]
    )
    os.sched_setaffinity(0, {args.client_cpu})
    try:
        time.sleep(3.0)
        for r in range(args.rounds):
            for shards in (False, True):
                rate, cpu = asyncio.run(
                    window(f"http://127.0.0.1:{port}/v1", shards, args.concurrency, args.seconds)
                )
                label = "shards of 32" if shards else "one pool"
                print(f"round {r} {label:13s} {rate:7.1f} requests/s {cpu:6.3f} ms CPU/request")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
