"""``shmvec-bench rollouts --policy server``'s shmvec row with ``ServerPolicy``'s HTTP clients in
shards of ``SHARD_CONNECTIONS`` against one client for every connection, alternated, one
vLLM-CPU server (the tiny model) on CPU 0 and the rollouts on CPU 1::

    python dev/server_shards_ab.py --num-envs 256 --seconds 45 --rounds 2

Prints each run's groups/s, requests/s, the client's CPU per request and the server's busy
share (``shmvec_bench.rollouts.runner.measure``).
"""

from __future__ import annotations

import argparse
import os

import shmvec.rollouts.server_client as server_client
from shmvec.testing.tiny_llm import tiny_llm
from shmvec.testing.vllm_server import VLLMServer
from shmvec_bench.rollouts.runner import measure
from shmvec_bench.rollouts.server import ServerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = tiny_llm()
    server = VLLMServer(str(model), max_model_len=2048, cpus={0})
    server.start()
    try:
        server.wait_ready()
        os.sched_setaffinity(0, {1})
        config = ServerConfig(
            server.base_url, "tiny", AutoTokenizer.from_pretrained(str(model)), 16,
            server_pids=tuple(server.pids()),
        )  # fmt: skip
        shards = server_client.SHARD_CONNECTIONS
        for r in range(args.rounds):
            for label, most in (("shards of 32", shards), ("one client", 1 << 30)):
                server_client.SHARD_CONNECTIONS = most
                m = measure(
                    "tool", "shmvec", "server", num_envs=args.num_envs, group_size=8,
                    seconds=args.seconds, timeout=400, max_lag=None, server=config, seed=r,
                )  # fmt: skip
                print(
                    f"round {r} {label:12s} {m.outcome}: {m.groups_per_s:.2f} groups/s, "
                    f"{m.requests_per_s:.1f} requests/s, client CPU "
                    f"{m.client_cpu_ms_per_request:.2f} ms/request, server busy "
                    f"{m.server_busy_share:.0%}",
                    flush=True,
                )
        server_client.SHARD_CONNECTIONS = shards
    finally:
        server.stop()


if __name__ == "__main__":
    main()
