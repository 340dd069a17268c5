"""An OpenAI-compatible server that answers every completion in a fixed time, whatever the
load: the runners of ``shmvec-bench rollouts --policy server`` then meet their own limits
(client CPU, the latency between a reply and the next request), not the server's::

    taskset -c 0 python dev/fake_llm_server.py --port 47123 --token-delay 0.05 &
    taskset -c 1 shmvec-bench rollouts --policy server \\
        --server-url http://127.0.0.1:47123/v1 --workloads tool --num-envs 256

It is the test suite's fake server (tests/llm_servers.py: token-id prompts,
``return_token_ids``, log-probabilities, ``/v1/models``, ``/tokenize``, ``/metrics``) serving
the tiny model's tokenizer, each reply ``--token-delay`` seconds per token (16 tokens: 0.8 s
at 0.05), keeping only its last requests. Stop it with SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

#: Requests the server keeps (for streamed requests' "first time" check), trimmed by half.
KEPT = 1000


class Recent(list):
    """The last requests only: a long benchmark would otherwise keep every prompt."""

    def append(self, item) -> None:  # type: ignore[no-untyped-def]
        super().append(item)
        if len(self) > KEPT:
            del self[: KEPT // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=47123)
    parser.add_argument("--token-delay", type=float, default=0.05, help="seconds per token")
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()
    from llm_servers import FakeServer
    from transformers import AutoTokenizer

    from shmvec.testing.tiny_llm import tiny_llm

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llm()))
    server = FakeServer(
        tokenizer,
        port=args.port,
        token_delay_s=args.token_delay,
        max_model_len=args.max_model_len,
    )
    server.seen = Recent()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with server:
        print(f"serving on {server.base_url}", flush=True)
        try:
            done.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
