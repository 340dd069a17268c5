"""Rollouts against a running OpenAI-compatible server with ServerPolicy: groups/s, requests/s,
request latency, the client's CPU per request, and what interruption across versions does.

    python dev/server_rollouts.py --base-url http://127.0.0.1:8000/v1 --envs 256 --seconds 20 \\
        --interrupt off on --repeats 2

FrozenLake as text, 3 turns a trajectory, groups of 8, a version bump after every batch of 4
groups. The client's CPU is this process's (the rollout loop and the policy's event loop; the
envs step in worker processes), divided by the requests made. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

from transformers import AutoTokenizer

from shmvec.rollouts import Rollouts, Task
from shmvec.rollouts.server import Sampling, ServerPolicy
from shmvec.testing.tiny_llm import tiny_llm
from shmvec.text_envs import FrozenLakeText


def messages(row):
    if not row.trajectory.actions:
        return [
            {"role": "system", "content": "Play FrozenLake: answer left, down, right or up."},
            {"role": "user", "content": row.observation},
        ]
    return [{"role": "user", "content": row.observation}]


def run(args: argparse.Namespace, tokenizer, interrupt: bool) -> dict:
    policy = ServerPolicy(
        args.base_url,
        args.model,
        tokenizer,
        messages,
        sampling=Sampling(max_tokens=args.max_tokens),
        max_in_flight=args.envs,
        interrupt=interrupt,
    )
    lake = functools.partial(FrozenLakeText, max_episode_steps=3, is_slippery=False)
    tasks = (Task(seed=s) for s in itertools.count())
    with Rollouts.from_env_fns(
        [lake] * args.envs, policy, env_concurrency=args.envs, group_size=8, tasks=tasks
    ) as rollouts:
        rollouts.get_batch(4, timeout=600)  # warm up: connections, the server's caches
        start_stats, cpu0, t0 = policy.stats(), time.process_time(), time.monotonic()
        groups = 0
        while time.monotonic() - t0 < args.seconds:
            groups += len(rollouts.get_batch(4, timeout=600))
            rollouts.set_version(rollouts.version + 1)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        stats = policy.stats()
    requests = stats["requests"] - start_stats["requests"]
    return {
        "envs": args.envs,
        "interrupt": interrupt,
        "groups_per_s": groups / wall,
        "requests_per_s": requests / wall,
        "latency_p50_s": stats["latency_p50_s"],
        "latency_p99_s": stats["latency_p99_s"],
        "client_cpu_ms_per_request": 1e3 * cpu / max(requests, 1),
        "interrupted": stats["interrupted"] - start_stats["interrupted"],
        "faults": stats["faults"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--envs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interrupt", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llm()))
    for _ in range(args.repeats):
        for mode in args.interrupt:
            print(json.dumps(run(args, tokenizer, mode == "on")), flush=True)


if __name__ == "__main__":
    main()
