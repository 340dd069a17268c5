"""An env whose step calls a local HTTP service, run through shmvec.ShmVectorEnv.

    python examples/tool_env.py --num-envs 16 --latency-ms 5 --seconds 3

Agent-training envs (tool calls, code sandboxes, web pages, remote simulators)
spend most of a step waiting for a service. Here the "tool" is an HTTP server
on 127.0.0.1 (a child process, an ephemeral port, stopped at the end) that
answers each call after ``--latency-ms``. ``ShmVectorEnv(env_fns,
env_concurrency=num_envs)`` says that the envs wait: each worker steps all of its
envs at once, in threads (``stats()["worker_env_threads"]``), so a few processes
serve many waiting envs. The example prints steps/s and the memory of all
processes against gymnasium's AsyncVectorEnv (a process per env).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gymnasium as gym
import numpy as np
from gymnasium import spaces

import shmvec


class ToolHandler(BaseHTTPRequestHandler):
    """POST /tool {"state": [...], "tool": k} -> {"state": [...], "reward": r}."""

    protocol_version = "HTTP/1.1"  # keep-alive: one connection per env
    disable_nagle_algorithm = True  # else headers, then body: a 40 ms delayed ACK
    latency_s = 0.005

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.latency_s)  # the tool's work: a sandbox run, a page fetch...
        state = [(x * 31 + request["tool"] + i) % 97 for i, x in enumerate(request["state"])]
        body = json.dumps({"state": state, "reward": float(state[0] % 2)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass  # quiet


def serve(port_pipe, latency_s: float) -> None:
    """The tool service (in a child process): loopback only, any free port."""
    ToolHandler.latency_s = latency_s
    ThreadingHTTPServer.request_queue_size = 1024  # every env connects at once
    server = ThreadingHTTPServer(("127.0.0.1", 0), ToolHandler)
    server.daemon_threads = True
    port_pipe.send(server.server_address[1])
    server.serve_forever()


class ToolEnv(gym.Env):
    """Each step is one call of the tool service; 32 calls make an episode."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.observation_space = spaces.Box(0, 96, (4,), np.float32)
        self.action_space = spaces.Discrete(4)
        self.connection: http.client.HTTPConnection | None = None  # made in the worker

    def _call(self, state: list[int], tool: int) -> dict:
        if self.connection is None:
            self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.connection.connect()
            self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = json.dumps({"state": state, "tool": int(tool)}).encode()
        self.connection.request("POST", "/tool", body, {"Content-Type": "application/json"})
        return json.loads(self.connection.getresponse().read())

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = self.np_random.integers(0, 97, 4).tolist()
        self.t = 0
        return np.array(self.state, np.float32), {}

    def step(self, action):
        answer = self._call(self.state, action)
        self.state, self.t = answer["state"], self.t + 1
        return np.array(self.state, np.float32), answer["reward"], False, self.t >= 32, {}

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()


def memory_mib() -> float:
    """RSS of this process and its descendants, but not the tool service's."""
    total, todo = 0, [os.getpid()]
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    while todo:
        pid = todo.pop()
        todo.extend(p for p in children.get(pid, []) if p != SERVICE_PID)
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


SERVICE_PID = -1


def run(name: str, envs, seconds: float) -> float:
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    for _ in range(5):
        envs.step(actions)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        envs.step(actions)
        steps += envs.num_envs
    steps_per_s = steps / (time.perf_counter() - started)
    extra = ""
    if isinstance(envs, shmvec.ShmVectorEnv):
        extra = f", env threads per worker {envs.stats()['worker_env_threads']}"
    print(f"{name:28s} {steps_per_s:8,.0f} steps/s, RSS {memory_mib():6.0f} MiB{extra}")
    envs.close()
    return steps_per_s


def main() -> None:
    global SERVICE_PID
    parser = argparse.ArgumentParser(
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--num-envs", type=int, default=16, metavar="N",
        help="envs, each with its own connection to the service (default: 16)",
    )  # fmt: skip
    parser.add_argument(
        "--latency-ms", type=float, default=5.0, metavar="MS",
        help="how long the service takes to answer each call (default: 5)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=3.0, metavar="S",
        help="timed window for each vector env (default: 3)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.num_envs < 1 or args.latency_ms <= 0 or args.seconds <= 0:
        parser.error("--num-envs must be >= 1, --latency-ms and --seconds > 0")

    receive, send = multiprocessing.Pipe(duplex=False)
    service = multiprocessing.Process(
        target=serve, args=(send, args.latency_ms / 1000), daemon=True
    )
    service.start()
    SERVICE_PID = service.pid
    try:
        if not receive.poll(30):
            raise RuntimeError("the tool service did not start")
        port = receive.recv()
        env_fns = [lambda: ToolEnv(port)] * args.num_envs
        print(f"{args.num_envs} envs, each step one HTTP call of {args.latency_ms:g} ms "
              f"(ideal {args.num_envs / args.latency_ms * 1000:,.0f} steps/s)")  # fmt: skip
        envs = shmvec.ShmVectorEnv(env_fns, env_concurrency=args.num_envs)
        ours = run("shmvec.ShmVectorEnv", envs, args.seconds)
        theirs = run("gymnasium AsyncVectorEnv", gym.vector.AsyncVectorEnv(env_fns), args.seconds)
        print(f"shmvec / AsyncVectorEnv: {ours / theirs:.2f}x")
    finally:
        service.kill()
        service.join()


if __name__ == "__main__":
    main()
